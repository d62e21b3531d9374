"""Writable-mount quotas are kept by file, not by name: no sequence of file operations can
make a mount hold, or publish, more than ``quota_bytes`` in more than ``quota_files`` files.

The class: byte accounting that follows names could be credited twice for the same bytes.
A file still open was unlinked (or replaced by a rename), which credited its size back, and
then truncated through its descriptor, which credited it again; a guest repeating that
published 48 times its quota. Quotas now count each inode (as a filesystem does) while a
name links to it or a descriptor holds it open, and publishing measures what the staging
tree actually holds, so a backend whose guest writes the tree itself (the microVM's) is
held to the same quotas.

Every check here measures the disk, never wasibox's own counters: :func:`held` walks the
staging tree and adds the files this process still holds open under it (``/proc/self/fd``),
counting each inode once. The random sequences run against ``FileSession`` directly, with a
real staging tree on the real filesystem, so they can be many; ``test_mount_state_machine``
runs the same vocabulary through the guest.
"""

from __future__ import annotations

import os
import stat
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

import wasibox
from wasibox._control import RunControl
from wasibox._result import Outcome
from wasibox.backends.base import Backend, Job
from wasibox.capabilities.files.mount import STAGING_DIR
from wasibox.capabilities.files.session import (
    F_APPEND,
    F_CREATE,
    F_EXCL,
    F_READ,
    F_TRUNC,
    F_WRITE,
    FilesError,
    FileSession,
)

pytestmark = pytest.mark.guest

QUOTA = 1_000
LIMITS = wasibox.Limits(fuel=10_000_000_000, timeout_s=60)


def held(root: Path) -> tuple[int, int]:
    """(bytes, files and directories) under ``root``, each inode counted once: everything
    linked below it, and every file below it this process still holds open (unlinked or
    not), as a filesystem counts them. ``root`` itself is not counted."""
    inodes: dict[int, int] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(top, name))
            inodes[st.st_ino] = st.st_size if stat.S_ISREG(st.st_mode) else 0
    prefix = str(root) + "/"
    for fd in os.listdir("/proc/self/fd"):
        link = f"/proc/self/fd/{fd}"
        try:
            if not os.readlink(link).startswith(prefix):
                continue
            st = os.stat(link)  # the open file itself, even once it has no name
        except OSError:
            continue  # the descriptor os.listdir itself used, closed by now
        inodes[st.st_ino] = st.st_size if stat.S_ISREG(st.st_mode) else 0
    return sum(inodes.values()), len(inodes)


def staging_tree(out: Path) -> Path:
    """The one live run's staging tree under the writable mount ``out``."""
    (tree,) = (out / STAGING_DIR).glob("run-*/tree")
    return tree


def published(out: Path) -> tuple[int, int]:
    """What the host directory holds after a run, outside the staging directory."""
    total = count = 0
    for top, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if d != STAGING_DIR]
        count += len(dirs) + len(files)
        total += sum(os.lstat(os.path.join(top, name)).st_size for name in files)
    return total, count


@pytest.fixture()
def out(tmp_path: Path) -> Path:
    directory = tmp_path / "out"
    directory.mkdir()
    return directory


WRITE_ALL = """
def write_all(fd, total):
    # Write until the quota refuses more: return the bytes that went in.
    done = 0
    while done < total:
        try:
            done += os.write(fd, b"x" * min(total - done, 4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            break
    return done
"""


def guest(out: Path, code: str, *args: Any, quota_files: int = 10_000,
          quota_bytes: int = QUOTA) -> tuple[Any, list[tuple[int, int]]]:
    """Run ``main(*args)`` (with ``write_all``) in a guest with ``out`` mounted writable at
    /out; return its value and what the staging held each time it called ``host.measure()``."""
    measured: list[tuple[int, int]] = []

    def measure() -> None:
        measured.append(held(staging_tree(out)))

    mount = wasibox.Mount(out, "/out", writable=True, quota_bytes=quota_bytes,
                          quota_files=quota_files)
    with wasibox.Sandbox(LIMITS, mounts=[mount], functions={"measure": measure}) as sb:
        r = sb.run("import errno, os, host\n" + WRITE_ALL + textwrap.dedent(code),
                   entry="main", args=args)
    assert r.ok, (r.error, r.stderr)
    return r.value, measured


REMOVALS = {
    "unlink": "os.unlink(path)",
    "replace": "os.close(os.open(path + '.new', os.O_WRONLY | os.O_CREAT)); "
               "os.replace(path + '.new', path)",
    "rename_over": "os.close(os.open(path + '.new', os.O_WRONLY | os.O_CREAT)); "
                   "os.rename(path + '.new', path)",
    "rename_away": "os.rename(path, path + '.moved')",
    "rename_its_directory": "os.rename(os.path.dirname(path), os.path.dirname(path) + '.moved')",
}


@pytest.mark.parametrize("removal", sorted(REMOVALS))
def test_removing_then_truncating_an_open_file_frees_its_bytes_once(out: Path,
                                                                    removal: str) -> None:
    # The recipe, 48 times over, with each way a name can leave an open file.
    value, measured = guest(out, f"""
        def main():
            written = []
            for i in range(48):
                os.mkdir(f"/out/d{{i}}")
                path = f"/out/d{{i}}/f"
                fd = os.open(path, os.O_RDWR | os.O_CREAT)
                written.append(write_all(fd, {QUOTA}))
                {REMOVALS[removal]}
                host.measure()
                os.ftruncate(fd, 0)
                host.measure()
                os.close(fd)
            final = os.open("/out/final", os.O_WRONLY | os.O_CREAT)
            written.append(write_all(final, 100 * {QUOTA}))
            host.measure()
            return written
    """)
    # Every file could take the whole quota (the one before it was emptied), and the last
    # one too: never more.
    assert value == [QUOTA] * 49
    assert all(used <= QUOTA for used, _ in measured), max(measured)
    assert published(out)[0] == QUOTA


def test_an_unlinked_file_counts_until_its_last_descriptor_closes(out: Path) -> None:
    value, measured = guest(out, f"""
        def main():
            fd = os.open("/out/a", os.O_RDWR | os.O_CREAT)
            results = [write_all(fd, {QUOTA})]
            again = os.dup(fd)
            os.unlink("/out/a")
            other = os.open("/out/b", os.O_WRONLY | os.O_CREAT)
            results.append(write_all(other, 10))        # the unlinked file still holds it
            os.close(fd)
            host.measure()
            results.append(write_all(other, 10))        # its dup still holds it open
            os.ftruncate(again, {QUOTA} // 2)           # shrinking it frees the difference
            results.append(write_all(other, {QUOTA}))
            os.close(again)
            results.append(write_all(other, {QUOTA}))   # its last descriptor closed
            return results
    """)
    assert value == [QUOTA, 0, 0, QUOTA // 2, QUOTA // 2]
    assert measured == [(QUOTA, 2)]
    assert published(out) == (QUOTA, 1)


def test_an_unlinked_open_file_counts_against_the_file_quota(out: Path) -> None:
    value, _ = guest(out, """
        def main():
            held = os.open("/out/a", os.O_WRONLY | os.O_CREAT)
            os.unlink("/out/a")
            os.close(os.open("/out/b", os.O_WRONLY | os.O_CREAT))
            results = []
            try:
                os.mkdir("/out/c")
            except OSError as exc:
                results.append(errno.errorcode[exc.errno])
            os.close(held)
            os.mkdir("/out/c")
            return results + sorted(os.listdir("/out"))
    """, quota_files=2)
    assert value == ["EDQUOT", "b", "c"]


def test_truncating_through_a_descriptor_whose_name_was_replaced(out: Path) -> None:
    value, measured = guest(out, f"""
        def main():
            fd = os.open("/out/f", os.O_RDWR | os.O_CREAT)
            os.write(fd, b"f" * 100)
            with open("/out/g", "wb") as g:
                g.write(b"g" * 300)
            os.replace("/out/g", "/out/f")     # fd's file has no name now, but is open
            results = []
            try:
                os.ftruncate(fd, {QUOTA} - 299)  # 300 bytes are g's: one too many
            except OSError as exc:
                results.append(errno.errorcode[exc.errno])
            os.ftruncate(fd, {QUOTA} - 300)
            host.measure()
            results.append(os.fstat(fd).st_size)
            return results
    """)
    assert value == ["ENOSPC", QUOTA - 300]
    assert measured == [(QUOTA, 2)]
    assert (out / "f").read_bytes() == b"g" * 300


def test_a_file_shared_with_the_host_is_counted_once_and_copied_within_the_quota(
        out: Path, tmp_path: Path) -> None:
    # Staging links the host's files in (one inode, two names); changing one copies it.
    (out / "log.txt").write_bytes(b"l" * 600)
    before = (out / "log.txt").stat()
    value, measured = guest(out, f"""
        def main():
            reader = open("/out/log.txt", "rb")
            appender = os.open("/out/log.txt", os.O_WRONLY | os.O_APPEND)  # a private copy
            host.measure()
            appended = write_all(appender, {QUOTA})
            return [appended, len(reader.read())]   # the reader sees the copy's changes
    """)
    assert value == [QUOTA - 600, QUOTA]
    assert measured == [(600, 1)]
    after = (out / "log.txt").stat()
    assert after.st_size == QUOTA and after.st_ino != before.st_ino


@pytest.mark.parametrize(("quota_bytes", "expected"), [(1_100, "ENOSPC"), (1_200, "copied")])
def test_copying_a_file_with_a_second_name_in_the_mount_must_fit_the_quota(
        out: Path, quota_bytes: int, expected: str) -> None:
    (out / "a").write_bytes(b"a" * 600)
    os.link(out / "a", out / "b")  # one inode, two names: 600 bytes held
    value, measured = guest(out, """
        def main():
            try:
                os.close(os.open("/out/a", os.O_WRONLY))   # b still links the shared file
            except OSError as exc:
                return errno.errorcode[exc.errno]
            host.measure()
            return "copied"
    """, quota_bytes=quota_bytes)
    assert value == expected
    assert all(used <= quota_bytes for used, _ in measured)


# -- publishing measures what the staging tree holds ---------------------------------------------

class StagingWriter(Backend):
    """A test double for a backend whose guest writes the staging tree itself (as the
    microVM's copy-out does): it "runs" by writing ``files`` into each writable mount's
    tree, bypassing every quota check a run makes, and reports success."""

    name = "staging-writer"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def execute(self, job: Job, control: RunControl | None = None) -> Outcome:
        assert job.files is not None
        for tree in job.files.trees.values():
            for name, data in self.files.items():
                # A fresh file renamed into place, as the microVM's copy-out writes: never
                # through a staged link to the host's file.
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                (tree / f"{name}.new").write_bytes(data)
                os.replace(tree / f"{name}.new", tree / name)
        return Outcome(exit_code=0)


def writer_run(out: Path, backend: StagingWriter, **quotas: Any) -> wasibox.RunResult:
    mount = wasibox.Mount(out, "/out", writable=True, **quotas)
    with wasibox.Sandbox(backend=backend, mounts=[mount]) as sb:
        return sb.run("pass")


@pytest.mark.parametrize(("files", "quotas", "message"), [
    ({"big": b"x" * (QUOTA + 1)}, {"quota_bytes": QUOTA}, f"over its quota of {QUOTA}"),
    ({"a": b"x" * 600, "sub/b": b"y" * 600}, {"quota_bytes": QUOTA}, "1215 bytes"),
    ({f"f{i}": b"" for i in range(6)}, {"quota_files": 5}, "7 files and directories"),
    ({"d1/d2/d3/f": b"", "g": b""}, {"quota_files": 4}, "6 files and directories"),
])
def test_publishing_refuses_a_tree_over_its_quota(out: Path, files: dict[str, bytes],
                                                 quotas: dict[str, int], message: str) -> None:
    (out / "kept.txt").write_text("the host's own\n")  # 15 bytes, 1 file, counted too
    r = writer_run(out, StagingWriter(files), **quotas)
    assert not r.ok and r.exit_code == 1 and r.limit_exceeded is None
    assert r.error is not None and r.error.type == "OSError", r.error
    assert message in r.error.message and r.error.message.endswith("nothing was published")
    assert r.files == []
    assert sorted(p.name for p in out.iterdir()) == [STAGING_DIR, "kept.txt"]
    assert list((out / STAGING_DIR).glob("run-*")) == []


def test_publishing_counts_hard_links_the_host_staged_once(out: Path) -> None:
    (out / "a").write_bytes(b"a" * 600)
    os.link(out / "a", out / "b")
    r = writer_run(out, StagingWriter({"c": b"c" * 400}), quota_bytes=QUOTA)
    assert r.ok, r.error
    assert [f.path for f in r.files] == ["/out/c"]


def test_a_mount_already_over_its_quota_may_shrink_but_not_grow(out: Path) -> None:
    (out / "old").write_bytes(b"o" * 2 * QUOTA)
    shrunk = writer_run(out, StagingWriter({"old": b"o" * QUOTA}), quota_bytes=QUOTA)
    assert shrunk.ok, shrunk.error
    assert (out / "old").stat().st_size == QUOTA
    (out / "old").write_bytes(b"o" * 2 * QUOTA)
    grown = writer_run(out, StagingWriter({"new": b"n"}), quota_bytes=QUOTA)
    assert not grown.ok and grown.error is not None
    assert f"{2 * QUOTA + 1} bytes" in grown.error.message
    assert sorted(p.name for p in out.iterdir()) == [STAGING_DIR, "old"]


def test_within_the_quota_the_writer_publishes(out: Path) -> None:
    # The double is not refused for being a double: the same tree under the quota goes out.
    r = writer_run(out, StagingWriter({"a": b"x" * QUOTA}), quota_bytes=QUOTA)
    assert r.ok and [(f.path, f.size) for f in r.files] == [("/out/a", QUOTA)]


# -- any sequence, straight against the host side ----------------------------------------------

# Files are opened by the first names, directories made by the last: both can be renamed
# over and unlinked by any.
FILE_NAMES, DIR_NAMES = ("/w/a", "/w/b", "/w/d/a"), ("/w/d", "/w/e", "/w/d/a")
NAMES = tuple(sorted(set(FILE_NAMES + DIR_NAMES)))
SESSION_QUOTA_BYTES, SESSION_QUOTA_FILES = 64, 4
ACCESS = {"r": F_READ, "w": F_WRITE, "rw": F_READ | F_WRITE}
EXTRA_FLAGS = (F_APPEND, F_EXCL, F_TRUNC)

names = st.sampled_from(NAMES)
slots = st.integers(0, 2)
data = st.binary(min_size=1, max_size=SESSION_QUOTA_BYTES).map(lambda b: b.decode("latin-1"))
# Mostly creating and writable: files must exist and fill before a bypass can show.
opens = st.tuples(st.just("open"), st.sampled_from(FILE_NAMES),
                  st.sampled_from(["w", "rw", "rw", "r"]),
                  st.sets(st.sampled_from(EXTRA_FLAGS)).map(sorted),
                  st.sampled_from([F_CREATE] * 3 + [0]), slots)
writes = st.tuples(st.just("write"), slots, data)
session_ops = st.one_of(
    opens, opens, writes, writes,
    st.tuples(st.just("pwrite"), slots, data, st.integers(0, 80)),
    st.tuples(st.just("seek"), slots, st.integers(0, 80)),
    st.tuples(st.just("truncate"), slots, st.integers(0, 80)),
    st.tuples(st.just("dup"), slots, slots),
    st.tuples(st.just("close"), slots),
    *(st.tuples(st.just(kind), names, names) for kind in ("rename", "unlink")),
    *(st.tuples(st.just(kind), st.sampled_from(DIR_NAMES), names) for kind in ("mkdir", "rmdir")),
)
#: Every sequence starts with two files open (one to append), so descriptors are at hand.
START = [("open", "/w/a", "rw", [], F_CREATE, 0),
         ("open", "/w/b", "w", [F_APPEND], F_CREATE, 1)]


def _apply(session: FileSession, fds: dict[int, int], op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "open":
        _, path, access, extra, create, slot = op
        fds[slot] = session.open(path, ACCESS[access] | sum(extra) | create, 0o644)
        return
    if kind in ("rename", "unlink", "mkdir", "rmdir"):
        path, other = op[1], op[2]
        {"rename": lambda: session.rename(path, other), "unlink": lambda: session.unlink(path),
         "mkdir": lambda: session.mkdir(path, 0o755), "rmdir": lambda: session.rmdir(path),
         }[kind]()
        return
    # A descriptor operation works on one of the open descriptors (on none if none is open).
    slot = sorted(fds)[op[1] % len(fds)] if fds else None
    fd = -1 if slot is None else fds[slot]
    if kind == "write":
        session.write(fd, op[2])
    elif kind == "pwrite":
        session.pwrite(fd, op[2], op[3])
    elif kind == "seek":
        session.seek(fd, op[2], 0)
    elif kind == "truncate":
        session.truncate(fd, op[2])
    elif kind == "dup":
        fds[op[2]] = session.dup(fd)
    else:
        session.close_fd(fd)
        del fds[slot]


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("session")
    yield directory


@settings(max_examples=int(os.environ.get("WASIBOX_MOUNT_SOAK_EXAMPLES", 100)), deadline=None)
@given(ops=st.lists(session_ops, min_size=10, max_size=60), shared=st.binary(max_size=30))
def test_no_sequence_of_operations_holds_more_than_the_quota(host_dir: Path,
                                                              ops: list[tuple[Any, ...]],
                                                              shared: bytes) -> None:
    out = host_dir / "w"
    out.mkdir()
    try:
        (out / "a").write_bytes(shared)  # a file the staging links in from the host
        mount = wasibox.Mount(out, "/w", writable=True, quota_bytes=SESSION_QUOTA_BYTES,
                              quota_files=SESSION_QUOTA_FILES)
        session = FileSession([mount], open_files=8)
        tree = session.trees["/w"]
        fds: dict[int, int] = {}
        peak = (0, 0)
        with session:
            for op in START + ops:
                try:
                    _apply(session, fds, op)
                except FilesError:
                    pass
                used, files = held(tree)
                assert used <= SESSION_QUOTA_BYTES and files <= SESSION_QUOTA_FILES, (op, used,
                                                                                      files)
                peak = max(peak[0], used), max(peak[1], files)
            session.publish()
        # Steer the search towards sequences that fill the mount: where a bypass would show.
        target(peak[0], label="bytes held")
        target(peak[1], label="files held")
        assert published(out)[0] <= SESSION_QUOTA_BYTES
        assert published(out)[1] <= SESSION_QUOTA_FILES
    finally:
        _remove(out)


def _remove(top: Path) -> None:
    for directory, dirs, files in os.walk(top, topdown=False):
        for name in files:
            os.unlink(os.path.join(directory, name))
        for name in dirs:
            os.rmdir(os.path.join(directory, name))
    os.rmdir(top)
