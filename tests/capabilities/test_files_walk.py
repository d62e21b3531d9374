"""The one confinement walker (``wasibox/capabilities/files/walk.py``), on real directories:
it never leaves its root, whatever components it is handed and whatever is planted on the
way, and it tells the caller why it stopped."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasibox.capabilities.files.walk import DIR_FLAGS, Blocked, walk


def plant(top: Path) -> Path:
    """A root holding a directory, a file, a FIFO and links out of it, beside a directory
    outside it that holds a secret; returns the root."""
    outside = top / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    root = top / "root"
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "file").write_text("data")
    os.mkfifo(root / "fifo")
    (root / "out").symlink_to(outside)
    (root / "dir" / "up").symlink_to("../..")
    (root / "dangling").symlink_to(top / "nowhere")
    return root


@pytest.fixture
def root(tmp_path: Path) -> Iterator[int]:
    fd = os.open(plant(tmp_path), DIR_FLAGS)
    yield fd
    os.close(fd)


def where(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def stopped(root_fd: int, parts: list[str], *, create: bool = False,
            hidden: str | None = None) -> Blocked:
    with pytest.raises(Blocked) as info:
        os.close(walk(root_fd, parts, create=create, hidden=hidden))
    return info.value


def test_walks_to_a_directory_below_the_root(root: int, tmp_path: Path) -> None:
    assert where(walk(root, [])) == str(tmp_path / "root")
    assert where(walk(root, ["dir", "sub"])) == str(tmp_path / "root" / "dir" / "sub")


@pytest.mark.parametrize("parts", [["out"], ["dir", "up"], ["dangling"]])
def test_a_link_stops_the_walk_and_says_so(root: int, parts: list[str]) -> None:
    blocked = stopped(root, parts)
    assert blocked.part == parts[-1] and blocked.is_link is True
    assert blocked.error.errno in (errno.ELOOP, errno.ENOTDIR)


@pytest.mark.parametrize("part", ["file", "fifo"])
def test_a_component_that_is_not_a_directory_stops_the_walk(root: int, part: str) -> None:
    blocked = stopped(root, [part, "x"], create=True)
    assert blocked.part == part and blocked.is_link is False
    assert blocked.error.errno == errno.ENOTDIR


@pytest.mark.parametrize("part", ["", ".", "..", "a/b", "/", "a\x00"])
def test_a_component_that_is_not_one_name_is_refused(root: int, part: str) -> None:
    blocked = stopped(root, ["dir", part], create=True)
    assert blocked.part == part and blocked.error.errno == errno.EINVAL


def test_a_hidden_component_is_missing_and_never_made(root: int, tmp_path: Path) -> None:
    (tmp_path / "root" / "dir" / ".hidden").mkdir()
    blocked = stopped(root, ["dir", ".hidden"], hidden=".hidden")
    assert isinstance(blocked.error, FileNotFoundError)
    assert stopped(root, ["new", ".staging"], create=True, hidden=".staging").part == ".staging"
    assert not (tmp_path / "root" / "new" / ".staging").exists()


def test_create_makes_missing_directories_but_never_through_a_link(
        root: int, tmp_path: Path) -> None:
    assert where(walk(root, ["a", "b"], create=True)) == str(tmp_path / "root" / "a" / "b")
    assert stopped(root, ["out", "made"], create=True).is_link is True
    assert stopped(root, ["missing"]).error.errno == errno.ENOENT
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["secret"]


#: Components a caller might hand the walker, among them every way out of the root.
PARTS = ["dir", "sub", "up", "out", "file", "fifo", "dangling", "new", "..", ".", "", "a/b",
         "/", "x\x00"]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(PARTS), max_size=6), create=st.booleans())
def test_no_walk_leaves_the_root(parts: list[str], create: bool) -> None:
    with tempfile.TemporaryDirectory() as top:
        root = plant(Path(top))
        before = sorted(os.listdir(top))
        root_fd = os.open(root, DIR_FLAGS)
        try:
            fd = walk(root_fd, parts, create=create)
        except Blocked:
            pass
        else:
            reached = Path(where(fd))
            assert reached == root or root in reached.parents
        finally:
            os.close(root_fd)
        assert sorted(os.listdir(top)) == before
        assert sorted(os.listdir(Path(top) / "outside")) == ["secret"]
