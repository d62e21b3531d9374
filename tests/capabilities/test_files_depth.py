"""A writable mount's directory depth cap (``MAX_DEPTH``): trees as deep as CPython's own
tests build (50 levels below a directory) are made, listed, renamed, removed and published,
and one level past the cap is ``ENAMETOOLONG`` for the guest and "nested too deep" for a
tree planted in the staging directly (by C code through a preopen, or a microVM)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
from tests.capabilities.test_files import assert_healthy, call, sandbox, tree  # noqa: F401
from tests.conftest import open_fds
from wasibox.capabilities.files.mount import MAX_DEPTH
from wasibox.capabilities.files.session import FilesError, FileSession

#: Depths around the cap: the deepest that is allowed and a few on either side.
AROUND_THE_CAP = st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3)


def chain(depth: int) -> list[str]:
    return ["d"] * depth


@pytest.mark.guest
def test_a_guest_makes_lists_renames_removes_and_publishes_a_deep_tree(
        tree: dict[str, Path]) -> None:  # noqa: F811
    # test_shutil's and test_pathlib's *_above_recursion_limit tests nest 50 directories
    # below a test directory, which sits in the current directory: 52 levels, and more.
    levels = 55
    with sandbox(tree) as sb:
        fds = open_fds()
        value = call(sb, f"""
            import os, pathlib, shutil, sys
            def main():
                path = os.path.join("/out/deep", *["d"] * {levels - 1})
                os.makedirs(path)
                with open(path + "/leaf.txt", "w") as f:
                    f.write("leaf")
                walked = sum(1 for _ in os.walk("/out/deep"))
                found = [str(p) for p in pathlib.Path("/out/deep").rglob("*.txt")]
                os.rename(path, os.path.dirname(path) + "/e")
                shutil.copytree("/out/deep", "/out/copy")
                limit = sys.getrecursionlimit()
                sys.setrecursionlimit(40)  # as test_rmtree_above_recursion_limit does
                try:
                    shutil.rmtree("/out/copy")
                finally:
                    sys.setrecursionlimit(limit)
                return [walked, found, os.listdir("/out")]
        """)
        assert value == [levels, ["/out/deep/" + "d/" * (levels - 1) + "leaf.txt"], ["deep"]]
        moved = tree["out"].joinpath("deep", *chain(levels - 2), "e")
        assert (moved / "leaf.txt").read_text() == "leaf"
        assert not (tree["out"] / "copy").exists()
        # The next run removes the whole published tree again, and that is published too.
        assert call(sb, """
            import os, shutil
            def main():
                shutil.rmtree("/out/deep")
                return os.listdir("/out")
        """) == []
        assert sorted(p.name for p in tree["out"].iterdir()) == [".wasibox-staging"]
        assert_healthy(sb, tree, fds)


@pytest.mark.guest
def test_one_level_past_the_cap_is_enametoolong(tree: dict[str, Path]) -> None:  # noqa: F811
    depths = range(MAX_DEPTH - 2, MAX_DEPTH + 3)
    with sandbox(tree) as sb:
        fds = open_fds()
        value = call(sb, f"""
            import os
            def main():
                made, files = {{}}, {{}}
                for depth in {list(depths)}:
                    top = "/out/n" + str(depth)  # depth 1
                    path = top + "/d" * (depth - 1)
                    made[depth] = attempt(lambda: os.makedirs(path))
                    files[depth] = attempt(lambda: open(path + "/f", "w").close())
                # {MAX_DEPTH} levels, moved one level down.
                moved = attempt(lambda: os.rename("/out/n{MAX_DEPTH}",
                                                  "/out/n{MAX_DEPTH - 1}/n"))
                return [made, files, moved]
        """)
        made, files, moved = value
        for depth in depths:
            assert made[depth] == ("ok" if depth <= MAX_DEPTH else "ENAMETOOLONG")
            # A file is a level too: only a directory above the deepest holds one.
            assert files[depth] == ("ok" if depth < MAX_DEPTH else "ENAMETOOLONG"
                                    if depth == MAX_DEPTH else "ENOENT")
        assert moved == "ENAMETOOLONG"
        for depth in depths:  # makedirs made what it could; all of it is published
            top = tree["out"] / f"n{depth}"
            assert top.joinpath(*chain(min(depth, MAX_DEPTH) - 1)).is_dir()
            assert not top.joinpath(*chain(MAX_DEPTH)).exists()
        assert_healthy(sb, tree, fds)


@settings(max_examples=30, deadline=None)
@given(depth=AROUND_THE_CAP)
def test_a_planted_tree_is_published_to_the_cap_and_refused_past_it(depth: int) -> None:
    with tempfile.TemporaryDirectory() as host:
        with FileSession([wasibox.Mount(host, "/out", writable=True)], 8) as session:
            bottom = session.trees["/out"].joinpath(*chain(depth))
            bottom.mkdir(parents=True)
            (bottom.parent / "f.txt").write_text("deep")
            records, refused = session.publish()
        published = Path(host).joinpath(*chain(min(depth, MAX_DEPTH)))
        assert published.is_dir()
        assert not Path(host).joinpath(*chain(MAX_DEPTH + 1)).exists()
        if depth <= MAX_DEPTH:
            assert refused == []
            assert [r.path for r in records] == ["/out/" + "d/" * (depth - 1) + "f.txt"]
        else:
            assert [(r.path, r.reason) for r in refused] == [
                ("/out/" + "/".join(chain(MAX_DEPTH + 1)), "nested too deep")]
            assert records == ([] if depth > MAX_DEPTH + 1 else
                               [wasibox.FileRecord(path="/out/" + "d/" * MAX_DEPTH + "f.txt",
                                                   size=4, sha256=records[0].sha256)])


@settings(max_examples=40, deadline=None)
@given(height=st.integers(0, MAX_DEPTH - 1), target=st.integers(2, MAX_DEPTH + 1))
def test_a_rename_deeper_than_the_cap_is_refused(height: int, target: int) -> None:
    """A directory with ``height`` levels below it, moved to depth ``target``."""
    with tempfile.TemporaryDirectory() as host:
        with FileSession([wasibox.Mount(host, "/out", writable=True)], 8) as session:
            source = "/out/s"
            session.mkdir(source, 0o755)
            for level in range(1, height + 1):
                session.mkdir(source + "/d" * level, 0o755)
            parent = "/out" + "/t" * (target - 1)
            for level in range(1, target):
                session.mkdir("/out" + "/t" * level, 0o755)
            outcome: Any = "ok"
            try:
                session.rename(source, parent + "/s")
            except FilesError as error:
                outcome = error.code
            session.publish()
        deep_enough = target + height <= MAX_DEPTH
        assert outcome == ("ok" if deep_enough else "nametoolong")
        moved = Path(host).joinpath(*["t"] * (target - 1), "s", *chain(height))
        assert moved.is_dir() == deep_enough
        assert Path(host, "s").joinpath(*chain(height)).is_dir() != deep_enough


def test_a_host_tree_deeper_than_the_cap_is_shown_to_it_and_left_alone() -> None:
    with tempfile.TemporaryDirectory() as host:
        beyond = Path(host).joinpath(*chain(MAX_DEPTH + 2))
        beyond.mkdir(parents=True)
        (beyond / "kept.txt").write_text("kept")
        with FileSession([wasibox.Mount(host, "/out", writable=True)], 8) as session:
            staged = session.trees["/out"]
            assert staged.joinpath(*chain(MAX_DEPTH)).is_dir()
            assert not staged.joinpath(*chain(MAX_DEPTH + 1)).exists()
            session.rmdir("/out/" + "/".join(chain(MAX_DEPTH)))  # empty in the guest's view
            records, refused = session.publish()
        assert (records, refused) == ([], [])
        # The host's directory was not empty: publishing leaves it, and what it holds.
        assert (beyond / "kept.txt").read_text() == "kept"
