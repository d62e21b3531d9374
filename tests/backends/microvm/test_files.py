"""The microVM's mount copy, host side: what is sent in, and hostile accounts coming back.

No VM here: the frames a guest agent would send are written by hand (the honest ones as the
agent writes them, the hostile ones as a guest that owns the VM's kernel could), and applied
to a real ``FileSession`` on real directories. The end-to-end runs are in
``tests/backends/microvm/test_mounts.py`` and ``test_session.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.backends.microvm.host_tree import host_view
from wasibox import Mount, UsageError
from wasibox.backends.microvm.files import FRAME_DATA, CopyIn, CopyOut, QuotaExceeded
from wasibox.capabilities.files.mount import MAX_DEPTH, STAGING_DIR
from wasibox.capabilities.files.session import FileSession

MEMORY = 256 * 2**20


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    return make_tree(tmp_path)


def make_tree(tmp_path: Path) -> dict[str, Path]:
    data, out, outside = tmp_path / "data", tmp_path / "out", tmp_path / "outside"
    for directory in (data / "sub", out / "keep", outside):
        directory.mkdir(parents=True)
    (data / "in.csv").write_text("a,b\n1,2\n")
    (data / "sub" / "big.bin").write_bytes(os.urandom(FRAME_DATA + 100))
    (data / "link").symlink_to("/etc/passwd")
    os.mkfifo(data / "fifo")
    (data / os.fsdecode(b"bad\xffname")).write_text("invisible")
    (out / "same.txt").write_text("same")
    (out / "change.txt").write_text("old")
    (out / "gone.txt").write_text("bye")
    (out / "keep" / "inner.txt").write_text("inner")
    (out / "hostlink").symlink_to(outside)
    (outside / "secret.txt").write_text("secret")
    return {"data": data, "out": out, "outside": outside}


def session(tree: dict[str, Path], **options: Any) -> FileSession:
    return FileSession([Mount(tree["data"], "/data"),
                        Mount(tree["out"], "/out", writable=True, **options),
                        Mount.scratch("/scratch")], 64)


def entries_sent(copy_in: CopyIn) -> dict[int, list[list[Any]]]:
    sent: dict[int, list[list[Any]]] = {}
    for frame in copy_in.frames():
        assert frame["kind"] == "files"
        sent.setdefault(frame["mount"], []).extend(frame["entries"])
    return sent


def files(frame_entries: list[list[Any]], index: int = 1) -> dict[str, Any]:
    return {"kind": "files", "mount": index, "entries": frame_entries}


def test_the_copy_in_is_the_wasm_guests_view(tree: dict[str, Path]) -> None:
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        specs = copy_in.specs()
        sent = entries_sent(copy_in)
    assert [spec["path"] for spec in specs] == ["/data", "/out", "/scratch"]
    assert [spec["collect"] for spec in specs] == [False, True, False]
    data = {entry[1]: entry for entry in sent[0]}
    # Read-only: the link as a link (its target as bytes), the FIFO as a placeholder; the
    # name that is not UTF-8 is not sent, as the wasm guest cannot see it either.
    assert set(data) == {"in.csv", "link", "fifo", "sub", "sub/big.bin"}
    assert data["link"] == ["l", "link", b"/etc/passwd"]
    assert data["fifo"] == ["o", "fifo"]
    assert data["in.csv"][4] == b"a,b\n1,2\n" and data["in.csv"][5] is True
    big = b"".join(entry[4] for entry in sent[0] if entry[1] == "sub/big.bin")
    assert big == (tree["data"] / "sub" / "big.bin").read_bytes()
    assert [entry[5] for entry in sent[0] if entry[1] == "sub/big.bin"] == [False, True]
    # Writable: the staging tree, which holds no links; the scratch mount sends nothing.
    assert {entry[1] for entry in sent[1]} == {"same.txt", "change.txt", "gone.txt", "keep",
                                                "keep/inner.txt"}
    assert 2 not in sent
    assert specs[1]["cap_bytes"] == 64 * 2**20 and specs[1]["cap_files"] == 10_000


def test_mounts_larger_than_a_quarter_of_the_vm_are_refused_before_it_starts(
        tree: dict[str, Path]) -> None:
    with session(tree) as files_session, pytest.raises(UsageError, match="quarter"):
        CopyIn(files_session, 4 * FRAME_DATA)


def honest_copy_out(copy_in: CopyIn) -> list[list[Any]]:
    """What the agent reports after a job that changed, added, deleted and kept files."""
    return [["d", "keep"], ["k", "keep/inner.txt"], ["k", "same.txt"],
            ["f", "change.txt", 0o644, b"ne", False], ["f", "change.txt", 0o644, b"w", True],
            ["d", "made"], ["f", "made/new.txt", 0o600, b"hello", True],
            ["x", "evil", "symbolic link"]]


def test_an_honest_copy_out_is_published_by_the_staging_code(tree: dict[str, Path]) -> None:
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        copy_out.apply(files(honest_copy_out(copy_in)))
        copy_out.finish()
        assert host_view(tree["out"])["change.txt"] == "old"  # nothing before publishing
        records, refused = files_session.publish()
    assert host_view(tree["out"]) == {
        "change.txt": "new", "hostlink": "-> " + str(tree["outside"]), "keep": "/",
        "keep/inner.txt": "inner", "made": "/", "made/new.txt": "hello", "same.txt": "same"}
    assert sorted(record.path for record in records) == ["/out/change.txt",
                                                         "/out/made/new.txt"]
    assert [(item.path, item.reason) for item in refused] == [("/out/evil", "symbolic link")]
    assert host_view(tree["outside"]) == {"secret.txt": "secret"}


def test_a_copy_out_that_is_not_finished_publishes_nothing(tree: dict[str, Path]) -> None:
    before = host_view(tree["out"])
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        copy_out.apply(files([["f", "change.txt", 0o644, b"half", False]]))
        copy_out.close()  # the run was killed here: the session is closed, not published
    assert host_view(tree["out"]) == before
    assert sorted(os.listdir(tree["out"] / STAGING_DIR)) in (["README.txt"],
                                                              ["README.txt", "setup.lock"])


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "/etc/passwd", "a//b", "./a",
                                  "a/../../b", "", "a\x00b", "x" * 256,
                                  "/".join("d" * (MAX_DEPTH + 2))])
def test_a_hostile_name_breaks_the_protocol_and_touches_nothing(
        tree: dict[str, Path], path: str) -> None:
    before = host_view(tree["out"]), host_view(tree["outside"])
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        with pytest.raises(ValueError):
            copy_out.apply(files([["f", path, 0o644, b"pwned", True]]))
        copy_out.close()
    assert (host_view(tree["out"]), host_view(tree["outside"])) == before


@pytest.mark.parametrize("depth", range(MAX_DEPTH - 1, MAX_DEPTH + 3))
def test_a_copy_out_as_deep_as_the_cap_is_published_and_deeper_breaks_the_protocol(
        tree: dict[str, Path], depth: int) -> None:
    """A directory ``depth`` levels deep, holding a file, as the agent would report it (it
    reports a deeper directory as refused, never as made)."""
    chain = ["e"] * depth
    entries: list[list[Any]] = [["d", "/".join(chain[:level])] for level in range(1, depth + 1)]
    entries.append(["f", "/".join([*chain, "f.txt"]), 0o644, b"deep", True])
    before = host_view(tree["out"])
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        if depth > MAX_DEPTH:
            with pytest.raises(ValueError, match="nested"):
                copy_out.apply(files(entries))
            copy_out.close()
        else:
            copy_out.apply(files(honest_copy_out(copy_in)[:3] + entries))
            copy_out.finish()
            records, refused = files_session.publish()
    if depth > MAX_DEPTH:
        assert host_view(tree["out"]) == before
        return
    assert (tree["out"].joinpath(*chain) / "f.txt").read_text() == "deep"
    assert [record.path for record in records] == ["/out/" + "/".join([*chain, "f.txt"])]
    assert refused == []


def test_writes_through_a_host_symlink_are_refused_at_publishing(tree: dict[str, Path]) -> None:
    # ``hostlink`` is a symlink in the host directory to a directory outside the mount.
    # It is not staged, so the guest can make a directory of that name; publishing it
    # meets the link and refuses, instead of following it.
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        copy_out.apply(files([["d", "hostlink"],
                              ["f", "hostlink/secret.txt", 0o644, b"pwned", True],
                              ["d", "keep"], ["k", "keep/inner.txt"], ["k", "same.txt"],
                              ["k", "change.txt"], ["k", "gone.txt"]]))
        copy_out.finish()
        records, refused = files_session.publish()
    assert records == []
    assert {item.path for item in refused} == {"/out/hostlink", "/out/hostlink/secret.txt"}
    assert host_view(tree["outside"]) == {"secret.txt": "secret"}
    assert os.path.islink(tree["out"] / "hostlink")


def test_the_staging_directory_is_a_reserved_name(tree: dict[str, Path]) -> None:
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        copy_out.apply(files([["d", STAGING_DIR],
                              ["f", f"{STAGING_DIR}/publish.lock", 0o644, b"x", True],
                              *[["k", name] for name in ("same.txt", "change.txt",
                                                         "gone.txt")],
                              ["d", "keep"], ["k", "keep/inner.txt"]]))
        copy_out.finish()
        records, refused = files_session.publish()
    assert records == []
    assert [(item.path, item.reason) for item in refused] == [
        (f"/out/{STAGING_DIR}", "reserved name")]


@pytest.mark.parametrize("entries", [
    [["f", "big", 0o644, b"x" * 600, True]],
    [["f", "a", 0o644, b"x" * 300, True], ["f", "b", 0o644, b"x" * 300, True]],
    [["d", f"d{i}"] for i in range(5)],
    [["q", "bytes", 10**9, 1000]],
    # Refusals are entries too: a guest naming endless ones must not grow the host's list.
    [["x", f"fifo{i}", "a FIFO"] for i in range(5)],
    [["f", "a", 0o644, b"x", True], ["d", "b"], *[["x", f"p{i}"] for i in range(3)]],
])
def test_over_the_quota_fails_the_run(tree: dict[str, Path],
                                      entries: list[list[Any]]) -> None:
    (tree["out"] / "keep" / "inner.txt").unlink()
    for name in ("same.txt", "change.txt", "gone.txt"):
        (tree["out"] / name).unlink()
    with session(tree, quota_bytes=500, quota_files=4) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        with pytest.raises(QuotaExceeded):
            copy_out.apply(files(entries))
        copy_out.close()


@pytest.mark.parametrize("frame", [
    {"kind": "files", "mount": 0, "entries": []},  # the read-only mount
    {"kind": "files", "mount": 2, "entries": []},  # the scratch mount
    {"kind": "files", "mount": "1", "entries": []},
    {"kind": "files", "mount": 1, "entries": "no"},
    files([["f", "a", 0o644, "text, not bytes", True]]),
    files([["f", "a", 0o644, b"x", False], ["f", "b", 0o644, b"y", True]]),
    files([["d", "same.txt"], ["d", "same.txt"]]),
    files([["z", "a"]]),
    files([[]]),
])
def test_malformed_frames_break_the_protocol(tree: dict[str, Path],
                                             frame: dict[str, Any]) -> None:
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        with pytest.raises(ValueError):
            copy_out.apply(frame)
        copy_out.close()


def test_a_file_left_half_sent_breaks_the_protocol_at_the_end(tree: dict[str, Path]) -> None:
    with session(tree) as files_session:
        copy_in = CopyIn(files_session, MEMORY)
        entries_sent(copy_in)
        copy_out = CopyOut(files_session, copy_in)
        copy_out.apply(files([["f", "a", 0o644, b"x", False]]))
        with pytest.raises(ValueError):
            copy_out.finish()
        copy_out.close()


#: What a session's writable mount may hold after a call: files (by path) and their text.
_STATES = st.dictionaries(st.sampled_from(["a.txt", "same.txt", "keep/inner.txt", "d/c.txt",
                                           "d/e/f.txt", "g.txt"]),
                          st.sampled_from(["same", "inner", "one", "two", ""]), max_size=6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_STATES, st.booleans()), min_size=1, max_size=4))
def test_a_sessions_accounts_leave_the_staging_as_the_last_one_says(
        accounts: list[tuple[dict[str, str], bool]]) -> None:
    """A microVM session's agent reports its writable mounts after every call, sending only
    what changed since its last report; whatever came before, the staging (and what is then
    published, with its refusals once each) is the state the last account describes."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = make_tree(Path(scratch))
        with session(tree) as files_session:
            copy_in = CopyIn(files_session, MEMORY)
            entries_sent(copy_in)
            held = {"same.txt": "same", "change.txt": "old", "gone.txt": "bye",
                    "keep/inner.txt": "inner"}
            refused: list[Any] = []
            for state, link in accounts:
                entries: list[list[Any]] = []
                directories = sorted({"/".join(path.split("/")[:depth]) for path in state
                                      for depth in range(1, path.count("/") + 1)})
                entries += [["d", directory] for directory in directories]
                for path, text in sorted(state.items()):
                    entries.append(["k", path] if held.get(path) == text else
                                   ["f", path, 0o644, text.encode(), True])
                if link:
                    entries.append(["x", "link", "symbolic link"])
                copy_out = CopyOut(files_session, copy_in)
                copy_out.apply(files(entries))
                copy_out.finish()
                copy_out.close()
                files_session.withdraw(refused)  # as the session does after each account
                refused, held = copy_out.refused, dict(state)
                expected = {**state, **dict.fromkeys(directories, "/")}
                assert host_view(files_session.trees["/out"]) == expected
            records, refusals = files_session.publish()
        assert host_view(tree["out"]) == {**expected, "hostlink": "-> " + str(tree["outside"])}
        assert [(item.path, item.reason) for item in refusals] == (
            [("/out/link", "symbolic link")] if accounts[-1][1] else [])
        assert {record.path for record in records} <= {"/out/" + path for path in state}
