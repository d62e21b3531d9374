"""A writable mount behaves as a real directory does, step by step, within its quotas.

A hypothesis state machine draws random sequences of file operations (``open`` in each
access mode with any of ``O_APPEND``, ``O_CREAT``, ``O_EXCL``, ``O_TRUNC``; ``write``,
``pwrite``, ``read``, ``lseek``, ``ftruncate``, ``truncate`` by path, ``rename``,
``os.replace``, ``unlink``, ``dup``, ``close``, ``mkdir``, ``rmdir`` and ``symlink``, whose
relative targets every other operation then follows or not as Linux does) over a few names,
on a mount that starts with files the staging shares with the host. Each operation runs at
once on a real host directory with real ``os`` calls: the reference. The whole sequence then
runs in one guest (one run per example; the guest reports each operation's result and the
mount's contents after it). After every step:

* the result (value or errno name) and the contents of every file and directory match the
  reference's; the one documented difference is the quotas, which the reference models:
  a write that would take the mount past ``quota_bytes`` writes what fits, then fails with
  ``ENOSPC`` (as ``ftruncate`` and ``truncate`` do), and a new file or directory past
  ``quota_files`` fails with ``EDQUOT``, each counted by inode as a filesystem counts
  them (an unlinked file still open still counts);
* what the staging holds on disk, measured by the host during the run (files linked in the
  tree plus those the host holds open), never exceeds the quotas and equals what the
  reference holds;
* the host directory itself is unchanged until the run ends;

and after the run, the host directory holds exactly the reference's final state but its
symbolic links, which publishing refuses.

``WASIBOX_MOUNT_SOAK_EXAMPLES`` raises the number of examples for a longer soak (the
default suite runs a few).

The focused tests below hold ``O_APPEND`` to POSIX: every write of an append descriptor
goes to the end of the file, whatever its position, and append descriptors interleave.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import wasibox
from tests.security.test_mount_quota import held, published, staging_tree
from wasibox.capabilities.files.mount import STAGING_DIR

pytestmark = pytest.mark.guest

NAMES = ("a", "b", "d", "d/a", "d/b", "l", "d/l")
#: What a link may hold: relative, so that the reference's links resolve as the guest's do
#: (``..`` from the mount's top is the guest's read-only root, the reference's parent).
TARGETS = ("a", "b", "d", "d/a", "missing", "l", "./d/b", "d/../a", "..", "../d/b")
#: The mount's starting content (None: a directory); staging links these to the host's.
INITIAL: dict[str, bytes | None] = {"a": b"initial a\n", "d": None, "d/b": b"xy"}
QUOTA_BYTES, QUOTA_FILES = 40, 4
SLOTS = 5
ACCESS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
EXTRA = {"append": os.O_APPEND, "creat": os.O_CREAT, "excl": os.O_EXCL, "trunc": os.O_TRUNC}
LIMITS = wasibox.Limits(fuel=20_000_000_000, timeout_s=120)

#: The guest half: runs the whole sequence, reporting after each step its result and the
#: mount's contents, and letting the host measure the staging.
GUEST = '''
import errno, os, stat, host

ACCESS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
EXTRA = {"append": os.O_APPEND, "creat": os.O_CREAT, "excl": os.O_EXCL, "trunc": os.O_TRUNC}


def contents(top="/out", prefix=""):
    found = {}
    for name in sorted(os.listdir(top)):
        path = top + "/" + name
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            found[prefix + name] = "->" + os.readlink(path)
        elif stat.S_ISDIR(mode):
            found[prefix + name] = None
            found.update(contents(path, prefix + name + "/"))
        else:
            with open(path, "rb") as f:
                found[prefix + name] = f.read()
    return found


def apply(op, fds):
    kind, args = op[0], op[1:]
    if kind == "open":
        name, access, extra, slot = args
        flags = ACCESS[access]
        for bit in extra:
            flags |= EXTRA[bit]
        fds[slot] = os.open("/out/" + name, flags, 0o644)
    elif kind == "dup":
        fds[args[1]] = os.dup(fds.get(args[0], -1))
    elif kind == "close":
        os.close(fds.pop(args[0], -1))
    elif kind == "write":
        return os.write(fds.get(args[0], -1), args[1])
    elif kind == "pwrite":
        return os.pwrite(fds.get(args[0], -1), args[1], args[2])
    elif kind == "read":
        return os.read(fds.get(args[0], -1), args[1])
    elif kind == "seek":
        return os.lseek(fds.get(args[0], -1), args[1], args[2])
    elif kind == "ftruncate":
        os.ftruncate(fds.get(args[0], -1), args[1])
    elif kind == "truncate":
        os.truncate("/out/" + args[0], args[1])
    elif kind in ("rename", "replace"):
        getattr(os, kind)("/out/" + args[0], "/out/" + args[1])
    elif kind == "symlink":
        os.symlink(args[0], "/out/" + args[1])
    else:
        getattr(os, kind)("/out/" + args[0])
    return None


def main(ops):
    fds, steps = {}, []
    for op in ops:
        try:
            result = ["ok", apply(op, fds)]
        except OSError as exc:
            result = ["err", errno.errorcode.get(exc.errno, str(exc.errno))]
        except Exception as exc:
            result = ["exception", type(exc).__name__]
        steps.append([result, contents()])
        host.measure()
    return steps
'''


def populate(root: Path) -> None:
    root.mkdir()
    for name, data in INITIAL.items():
        if data is None:
            (root / name).mkdir()
        else:
            (root / name).write_bytes(data)


def contents(root: Path) -> dict[str, bytes | str | None]:
    """What the guest's ``contents()`` reports, read from a host directory: a file's bytes,
    None for a directory, "->" and its target for a symbolic link."""
    found: dict[str, bytes | str | None] = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != STAGING_DIR]
        rel = os.path.relpath(top, root)
        for name in dirs + files:
            key = name if rel == "." else f"{rel}/{name}"
            path = os.path.join(top, name)
            found[key] = ("->" + os.readlink(path) if os.path.islink(path)
                          else None if name in dirs else Path(path).read_bytes())
    return dict(sorted(found.items()))


def final_target(path: Path) -> Path:
    """What ``open(path, O_CREAT)`` would create: ``path``, or what its final links name,
    each target taken relative to its link's directory and left unresolved (``..`` included)
    for the kernel to resolve. ``os.path.realpath`` would not do: it steps back over a missing
    directory's ``..`` lexically, where the kernel fails with ENOENT."""
    for _ in range(40):  # the kernel's own bound; a longer chain is ELOOP, which creates nothing
        if not path.is_symlink():
            break
        path = path.parent / os.readlink(path)
    return path


class MountMachine(RuleBasedStateMachine):
    """The reference: a real directory, real descriptors, and the quotas modelled."""

    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="wasibox-mount-machine-"))
        self.ref, self.out = self.base / "reference", self.base / "out"
        populate(self.ref)
        populate(self.out)
        self.fds: dict[int, int] = {}  # slot -> the reference's descriptor
        self.ops: list[list[Any]] = []
        #: Per step: the expected result, the reference's contents, and what it holds.
        self.expected: list[tuple[list[Any], dict[str, bytes | str | None],
                                  tuple[int, int]]] = []

    # -- the reference ---------------------------------------------------------------------
    def step(self, op: list[Any]) -> None:
        try:
            result: list[Any] = ["ok", self.apply(op)]
        except OSError as exc:
            result = ["err", errno.errorcode[exc.errno or 0]]
        self.ops.append(op)
        self.expected.append((result, contents(self.ref), held(self.ref)))

    def apply(self, op: list[Any]) -> Any:
        kind, args = op[0], op[1:]
        if kind == "open":
            name, access, extra, slot = args
            # O_CREAT makes what a final link names (unless O_EXCL, which fails on it).
            made = self.ref / name if "excl" in extra else final_target(self.ref / name)
            if "creat" in extra and self.creates(made):
                self.charge_file()
            flags = ACCESS[access] | os.O_CLOEXEC
            for bit in extra:
                flags |= EXTRA[bit]
            self.fds[slot] = os.open(self.ref / name, flags, 0o644)
        elif kind == "dup":
            self.fds[args[1]] = os.dup(self.fds[args[0]])
        elif kind == "close":
            os.close(self.fds.pop(args[0]))
        elif kind in ("write", "pwrite"):
            fd, data = self.fds[args[0]], args[1]
            offset = args[2] if kind == "pwrite" else None
            data = data[:self.fits(fd, len(data), offset)]
            return os.write(fd, data) if offset is None else os.pwrite(fd, data, offset)
        elif kind == "read":
            return os.read(self.fds[args[0]], args[1])
        elif kind == "seek":
            return os.lseek(self.fds[args[0]], args[1], args[2])
        elif kind == "ftruncate":
            fd, size = self.fds[args[0]], args[1]
            if self.writable(fd) and size > self.cap(os.fstat(fd).st_size):
                raise OSError(errno.ENOSPC, "over the byte quota")
            os.ftruncate(fd, size)
        elif kind == "truncate":
            path, size = self.ref / args[0], args[1]
            if self.is_file(path) and size > self.cap(path.stat().st_size):
                raise OSError(errno.ENOSPC, "over the byte quota")
            os.truncate(path, size)
        elif kind in ("rename", "replace"):
            getattr(os, kind)(self.ref / args[0], self.ref / args[1])
        elif kind == "mkdir":
            if self.creates(args[0]):
                self.charge_file()
            os.mkdir(self.ref / args[0])
        elif kind == "symlink":
            if self.creates(args[1]):
                self.charge_file()
            os.symlink(args[0], self.ref / args[1])
        else:
            getattr(os, kind)(self.ref / args[0])
        return None

    def creates(self, name: str | Path) -> bool:
        """Whether making ``name`` (relative to the reference, or absolute) would make a new
        file (its parent is a directory)."""
        path = self.ref / name
        try:
            # The kernel resolves the parent, ".." and links in it included, as it stands on
            # disk: a ".." after a missing directory is ENOENT, never a lexical step back.
            in_a_directory = stat.S_ISDIR(os.stat(path.parent).st_mode)
        except OSError:
            return False
        return in_a_directory and not os.path.lexists(path)

    def charge_file(self) -> None:
        if held(self.ref)[1] >= QUOTA_FILES:
            raise OSError(errno.EDQUOT, "over the file quota")

    def cap(self, size: int) -> int:
        """The largest size a file now of ``size`` bytes may grow to within the quota."""
        return max(size, QUOTA_BYTES - (held(self.ref)[0] - size))

    @staticmethod
    def writable(fd: int) -> bool:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)

    @staticmethod
    def is_file(path: Path) -> bool:
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            return False

    def fits(self, fd: int, length: int, offset: int | None) -> int:
        """How much of a write of ``length`` bytes the quota lets through (the write itself
        decides every other error). Raises ENOSPC if nothing fits."""
        if not self.writable(fd):
            return length
        size = os.fstat(fd).st_size
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            position = size
        else:
            position = os.lseek(fd, 0, os.SEEK_CUR) if offset is None else offset
        cap = self.cap(size)
        if position + length <= cap:
            return length
        if cap - position <= 0:
            raise OSError(errno.ENOSPC, "over the byte quota")
        return cap - position

    def free_slot(self) -> int:
        return min(set(range(SLOTS)) - set(self.fds))

    # -- the rules -------------------------------------------------------------------------
    @initialize(access=st.sampled_from(sorted(ACCESS)),
                extra=st.sets(st.sampled_from(sorted(EXTRA))))
    def open_a_shared_file(self, access: str, extra: set[str]) -> None:
        # A descriptor from the start, on a file the staging shares with the host, so the
        # descriptor rules have something to work on from the first step.
        self.step(["open", "a", access, sorted(extra), self.free_slot()])

    @precondition(lambda self: len(self.fds) < SLOTS)
    @rule(name=st.sampled_from(NAMES), access=st.sampled_from(sorted(ACCESS)),
          extra=st.sets(st.sampled_from(sorted(EXTRA))))
    def open(self, name: str, access: str, extra: set[str]) -> None:
        self.step(["open", name, access, sorted(extra), self.free_slot()])

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), payload=st.binary(min_size=1, max_size=24))
    def write(self, data: st.DataObject, payload: bytes) -> None:
        self.step(["write", data.draw(st.sampled_from(sorted(self.fds))), payload])

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), payload=st.binary(min_size=1, max_size=24),
          offset=st.integers(0, 60))
    def pwrite(self, data: st.DataObject, payload: bytes, offset: int) -> None:
        self.step(["pwrite", data.draw(st.sampled_from(sorted(self.fds))), payload, offset])

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), size=st.integers(0, 64))
    def read(self, data: st.DataObject, size: int) -> None:
        self.step(["read", data.draw(st.sampled_from(sorted(self.fds))), size])

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), offset=st.integers(-4, 60), whence=st.sampled_from([0, 1, 2]))
    def seek(self, data: st.DataObject, offset: int, whence: int) -> None:
        self.step(["seek", data.draw(st.sampled_from(sorted(self.fds))), offset, whence])

    @precondition(lambda self: self.fds)
    @rule(data=st.data(), size=st.integers(-1, 60))
    def ftruncate(self, data: st.DataObject, size: int) -> None:
        self.step(["ftruncate", data.draw(st.sampled_from(sorted(self.fds))), size])

    @rule(name=st.sampled_from(NAMES), size=st.integers(-1, 60))
    def truncate(self, name: str, size: int) -> None:
        self.step(["truncate", name, size])

    @precondition(lambda self: self.fds and len(self.fds) < SLOTS)
    @rule(data=st.data())
    def dup(self, data: st.DataObject) -> None:
        self.step(["dup", data.draw(st.sampled_from(sorted(self.fds))), self.free_slot()])

    @precondition(lambda self: self.fds)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        self.step(["close", data.draw(st.sampled_from(sorted(self.fds)))])

    @rule(kind=st.sampled_from(["rename", "replace"]), src=st.sampled_from(NAMES),
          dst=st.sampled_from(NAMES))
    def move(self, kind: str, src: str, dst: str) -> None:
        self.step([kind, src, dst])

    @rule(kind=st.sampled_from(["unlink", "mkdir", "rmdir"]), name=st.sampled_from(NAMES))
    def by_name(self, kind: str, name: str) -> None:
        self.step([kind, name])

    @rule(link=st.sampled_from(TARGETS), name=st.sampled_from(NAMES))
    def symlink(self, link: str, name: str) -> None:
        self.step(["symlink", link, name])

    # -- the guest, and the comparison -----------------------------------------------------
    def teardown(self) -> None:
        try:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
            if self.ops:
                self.check_guest()
        finally:
            shutil.rmtree(self.base)

    def check_guest(self) -> None:
        measured: list[tuple[int, int]] = []
        host_views: list[dict[str, bytes | str | None]] = []
        initial = contents(self.out)

        def measure() -> None:
            measured.append(held(staging_tree(self.out)))
            host_views.append(contents(self.out))

        mount = wasibox.Mount(self.out, "/out", writable=True, quota_bytes=QUOTA_BYTES,
                              quota_files=QUOTA_FILES)
        with wasibox.Sandbox(LIMITS, mounts=[mount], functions={"measure": measure}) as sb:
            r = sb.run(GUEST, entry="main", args=(self.ops,))
        assert r.ok, (r.error, r.stderr)
        steps = r.value
        assert len(steps) == len(self.ops) == len(measured)
        for number, (op, (result, state), (want, want_state, want_held), usage) in enumerate(
                zip(self.ops, steps, self.expected, measured, strict=True)):
            where = f"step {number}: {op!r}"
            assert result == want, f"{where}: the guest got {result}, the reference {want}"
            assert state == want_state, f"{where}: the guest sees {state}, not {want_state}"
            assert usage[0] <= QUOTA_BYTES and usage[1] <= QUOTA_FILES, f"{where}: {usage}"
            assert usage == want_held, f"{where}: the staging holds {usage}, not {want_held}"
        assert all(view == initial for view in host_views), "the host changed mid-run"
        final = contents(self.out)
        want_final = {name: value for name, value in contents(self.ref).items()
                      if not isinstance(value, str)}  # links are refused, not published
        assert final == want_final, f"published {final}, not {want_final}"
        used, files = published(self.out)
        assert used <= QUOTA_BYTES and files <= QUOTA_FILES, (used, files)


MountMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("WASIBOX_MOUNT_SOAK_EXAMPLES", 12)),
    stateful_step_count=25, deadline=None)
test_a_writable_mount_matches_a_real_directory = MountMachine.TestCase


# -- O_APPEND ---------------------------------------------------------------------------------

APPENDS = """
import os

def main(root):
    path = root + "/log"
    first = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    second = os.open(path, os.O_WRONLY | os.O_APPEND)
    plain = os.open(path, os.O_WRONLY)
    os.write(first, b"1")
    os.write(second, b"22")
    os.write(first, b"333")
    os.lseek(first, 0, os.SEEK_SET)       # an append descriptor's position does not matter
    os.write(first, b"4")
    os.pwrite(second, b"5", 0)            # Linux appends a pwrite on one too
    again = os.dup(first)                 # a dup shares the append flag
    os.write(again, b"6")
    os.write(plain, b"P")                 # a plain descriptor writes at its position
    with open(path, "a") as one, open(path, "a") as two:
        one.write("one")
        one.flush()
        two.write("two")
        two.flush()
        one.seek(0)
        one.write("!")
    for fd in (first, second, plain, again):
        os.close(fd)
    with open(path, "rb") as log:
        return log.read()
"""


def test_append_descriptors_write_at_the_end_and_interleave(tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "out"
    reference.mkdir()
    out.mkdir()
    namespace: dict[str, Any] = {}
    exec(textwrap.dedent(APPENDS), namespace)  # the same program on the host's own files
    expected = namespace["main"](str(reference))
    assert expected == b"P2233345" + b"6one" + b"two!"
    with wasibox.Sandbox(mounts=[wasibox.Mount(out, "/out", writable=True)]) as sb:
        r = sb.run(APPENDS, entry="main", args=("/out",))
    assert r.ok, r.error
    assert r.value == expected
    assert (out / "log").read_bytes() == expected


def test_appending_to_a_file_shared_with_the_host(tmp_path: Path) -> None:
    # The first change copies the host's file; the append descriptors follow the copy.
    out = tmp_path / "out"
    out.mkdir()
    (out / "log").write_bytes(b"host\n")
    with wasibox.Sandbox(mounts=[wasibox.Mount(out, "/out", writable=True)]) as sb:
        r = sb.run(textwrap.dedent("""
            import os
            reader = os.open("/out/log", os.O_RDONLY)
            first = os.open("/out/log", os.O_WRONLY | os.O_APPEND)
            second = os.open("/out/log", os.O_RDWR | os.O_APPEND)
            os.write(second, b"b\\n")
            os.lseek(first, 0, os.SEEK_SET)
            os.write(first, b"a\\n")
            print(os.read(reader, 100), os.pread(second, 100, 0))
        """))
    assert r.ok, r.error
    assert r.stdout == "b'host\\nb\\na\\n' b'host\\nb\\na\\n'\n"
    assert (out / "log").read_bytes() == b"host\nb\na\n"
