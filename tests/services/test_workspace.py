"""The MCP server's workspaces (``wasibox.services.workspace``): the file tools' paths stay
inside the workspace whatever a model sends, and idle workspaces are deleted on time. Host
logic only: no guest runs here."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import wait_for
from wasibox._errors import UsageError
from wasibox.capabilities.files.mount import STAGING_DIR
from wasibox.services.workspace import WorkspaceStore, read_text, workspace_parts, write_text


@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "/etc/passwd", "/workspace/../x",
                                  "", "a\x00b", ".wasibox-staging/run", "a\\..\\x"])
def test_confine_refuses_paths_outside(tmp_path: Path, path: str) -> None:
    with pytest.raises(UsageError):
        workspace_parts(path)
    with pytest.raises(UsageError):
        write_text(tmp_path, path, "x")
    assert list(tmp_path.iterdir()) == []


def test_confine_refuses_symlinks_on_the_way_and_at_the_end(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "dir-link").symlink_to(outside)
    (workspace / "file-link").symlink_to(outside / "secret")
    for path in ("dir-link/secret", "file-link", "/workspace/dir-link/new"):
        with pytest.raises(UsageError, match="symbolic link"):
            read_text(workspace, path)
        with pytest.raises(UsageError, match="symbolic link"):
            write_text(workspace, path, "overwritten")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "secret"
    assert write_text(workspace, "/workspace/a/b.txt", "x") == "wrote 1 bytes to /workspace/a/b.txt"
    assert (workspace / "a" / "b.txt").read_text() == "x"
    assert read_text(workspace, "a/b.txt") == "x"


def test_confine_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    for action in (lambda: read_text(tmp_path, "pipe"), lambda: write_text(tmp_path, "pipe", "x")):
        with pytest.raises(UsageError, match="not a regular file|cannot open"):
            action()


#: Path components a model might send, among them ways out of the workspace: "..", the
#: staging directory, a link ("l") planted to a directory outside, and bytes a path forbids.
PATH_PARTS = ["a", "b", ".", "..", "l", "", STAGING_DIR, "a\x00", "\u00e9", "a\\b"]


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(PATH_PARTS), max_size=6), absolute=st.booleans())
def test_file_tools_never_reach_outside_the_workspace(parts: list[str], absolute: bool) -> None:
    path = ("/workspace/" if absolute else "") + "/".join(parts)
    with tempfile.TemporaryDirectory() as top:
        outside = Path(top, "outside")
        outside.mkdir()
        (outside / "a").write_text("secret")
        workspace = Path(top, "workspace")
        workspace.mkdir()
        (workspace / "l").symlink_to(outside)
        try:
            write_text(workspace, path, "x")
        except UsageError:
            written = False
        else:
            written = True
            assert read_text(workspace, path) == "x"
        if not written:
            with pytest.raises(UsageError):
                read_text(workspace, path)
        assert sorted(os.listdir(top)) == ["outside", "workspace"]
        assert [p.name for p in outside.iterdir()] == ["a"]
        assert (outside / "a").read_text() == "secret"


def test_workspaces_are_deleted_when_idle_or_closed() -> None:
    store = WorkspaceStore(idle_timeout_s=0.2)
    try:
        first, renewed = store.acquire("one", hold=True)  # held: not idle while written
        (first / "f").write_text("x")
        store.release("one")
        assert not renewed
        second = store.get("two")
        # Nothing calls in: the store's own sweep deletes both once they are idle.
        assert wait_for(lambda: not first.exists() and not second.exists())
        third, renewed = store.acquire("one")
        assert renewed and third.exists() and third not in (first, second)
        assert store.acquire("one") == (third, False)
        store.drop("one")
        assert not third.exists()
    finally:
        store.close()
    assert not store.root.exists() and not store._sweeper.is_alive()
    store.close()  # idempotent
