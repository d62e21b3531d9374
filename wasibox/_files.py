"""Mounts, staging and publishing: the host side of the ``files`` capability.

**The threat it mediates.** Guest code is hostile and may try to read or change host files
outside what it was granted: by ``..`` traversal, absolute or relative symlinks, trailing-slash
tricks, hard links, or by racing, filling or planting things in a directory the host later
trusts. It may also try to exhaust the host: disk space, inodes, file descriptors. And a run
that dies half-way must not leave half-written files behind for the host to consume.

**Why the host mediates every operation (and not WASI preopens).** Wasmtime's own WASI
filesystem confines paths well, but it cannot give a byte or file-count quota the guest sees
as ``ENOSPC``/``EDQUOT``, a per-run cap on open files (``EMFILE``), per-run staging with a
publish step, refusal of planted links/FIFOs/devices, or an audit of what was written. So the
guest gets *no* preopens at all, and the guest runner routes ``open``, ``os.*`` and everything
built on them (pathlib, csv over files, shutil, os.walk, tempfile) through the ``files``
interface (``guest/wit/files.wit``); everything here is ordinary host Python, checked
before it touches the disk. Bypassing the guest's Python-level patches reaches nothing: there
is no WASI directory to reach. The exception is a ``c_access`` mount, which C code (sqlite3)
needs: it is also preopened, but only as the run's private staging tree of copies, and what
it holds is checked when the run ends (docs/c-level-files.md).

The price, measured with ``bench/files.py`` on a shared, loaded 2-core machine (so the
figures moved between runs): reading through the host in 64 KiB chunks ran at 8-28 MB/s
against 80-380 MB/s for a WASI preopen (0.06-0.36x; ASCII text is the fast end), and a run
writing and publishing 100 small files spent ~18-25 ms per file, most of it three host calls
and an fsync. Most runs that use files read a few CSV or JSON files; for those this is
milliseconds, and it buys the guarantees above.

File data crosses as a latin-1 string, as the ``stdio`` capability's does: wasmtime-py lowers
a ``list<u8>`` one element at a time; base64 and hex cost the guest as much fuel to decode as
latin-1 costs it to lift for random bytes (~60 fuel a byte: bytes >= 0x80 are two bytes of
UTF-8), and ten times more for ASCII text, which latin-1 passes through unchanged (~6). A
``stat`` travels as a string too: lowering a record field by field cost about three calls.

**Confinement.** A guest path is made absolute, then ``.`` and ``..`` are resolved lexically
(``..`` never leaves through a link, because it never meets one), then it is matched to the
mount with the longest guest prefix; anything else does not exist. Inside a mount, each
component is opened relative to its parent's directory descriptor with ``O_NOFOLLOW``: a
symbolic link is never followed, wherever it points (the guest sees ``ELOOP``), so no link
can lead out of a mount; a trailing ``/`` demands a directory. Opening anything that is not a
regular file or directory (FIFO, device, socket) is refused with ``ENXIO``, and it is opened
``O_NONBLOCK`` first, so a planted FIFO cannot hang the host. Read-only mounts refuse every
mutation with ``EROFS``: writing, ``O_TRUNC``, create, delete, rename, ``chmod``, ``utime``,
``mkdir``. Guests cannot make links at all (``EPERM``), so nothing can be hard-linked out of
a read-only mount into a writable one.

**Staging and publishing.** A writable mount's guest view is a per-run staging tree inside
the mount's host directory (``<mount>/.wasibox-staging/run-*/tree``, hidden from the guest;
inside, so every publish is a same-filesystem ``rename``). The staging directory stays,
with its two lock files and a ``README.txt`` that tells a user what it is; removing it when
idle would race a concurrent session that has it open. At the start of a run the tree is
populated with hard links to the mount's current files (one ``link`` per file, no data copied)
and the inode of each is remembered. A file shared with the host this way is copied before
anything changes it (write, truncate, ``chmod``, ``utime``), so the host's file is never
touched during the run; descriptors already open on it move to the copy, so all of them see
one file, as on a real filesystem. When the run ends **ok** (exit status 0, no exception, no
limit), :meth:`FileSession.publish` walks the tree without following anything and:

* measures what the tree holds and, if that is over the mount's quotas, publishes nothing
  (``_sandbox.run_with_files`` makes the run fail with an ``OSError``): this holds a backend whose
  guest writes the tree itself to the same quotas, and trusts no count kept during the run;
* refuses, and reports in ``RunResult.files_refused``, every symlink, FIFO, device or socket,
  and every file hard-linked to an inode that was not in the mount at the start (the wasm
  guest cannot make these, but a backend whose guest writes the staging tree directly can);
* writes a journal, then moves each new or changed file into the host directory with one
  ``rename`` (the file appears complete or not at all), creating host directories component
  by component, again never following a link; then removes what the guest deleted, if the
  host still holds the same inode there (first, where the guest put a directory in place of
  a file or the reverse: the old entry must go before the new one can take its place);
* returns a :class:`FileRecord` (guest path, size, sha256) for each file it published.

Any other ending (an exception, a non-zero exit, a limit, a timeout, a cancel, a host error)
discards the staging tree. A host process that dies mid-run leaves a staging directory whose
lock is no longer held: the next session on that mount reclaims it, finishing the publish if
its journal was written, discarding it otherwise. Concurrent runs on one mount stage
separately and publish one at a time (a lock file), each file last-writer-wins; a reader of
the host directory sees each file old or new, never partial, though a multi-file publish is
not one atomic step.

**Limits.** Each writable mount has a byte quota (the sum of its regular files' sizes; a write
or truncate that would pass it writes what fits, then fails with ``ENOSPC``) and a file-count
quota (files plus directories; ``EDQUOT``). Both count files, not names (``_Inode``): a file is
counted while a name links to it or a descriptor holds it open, as a filesystem counts an
inode, so a file unlinked or replaced while open still counts until its last descriptor is
closed, and renames, replaces and truncation through any descriptor can never credit the same
bytes twice. A mount that already holds more than its quotas may shrink, but not grow.
Descriptors opened to append are ``O_APPEND`` on the host: the kernel puts each write at the
end of the file, whatever the descriptor's position, and two of them interleave.
Each run may hold at most ``Limits.open_files`` descriptors
(``EMFILE``), so one run cannot take the host's descriptors from another; the host holds one
directory descriptor per mount and one per open guest file, and closes all of them at the
end of the run.

This module is backend-agnostic: it knows nothing about wasmtime. A backend exposes the
``FileSession`` operations to its guest (the wasm backend as host functions); a backend whose
guest writes to a real directory can share :attr:`FileSession.trees` with it and reuse
``publish``, whose refusals exist for exactly that case.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._errors import UsageError
from ._limits import parse_size
from ._result import FileRecord, RefusedFile

__all__ = [
    "STAGING_DIR",
    "STAGING_README",
    "FileSession",
    "FilesError",
    "Mount",
    "QuotaExceeded",
    "StatInfo",
    "check_mounts",
    "guest_path_for",
]

#: The directory inside each writable mount that holds its runs' staging trees.
STAGING_DIR = ".wasibox-staging"
#: The first descriptor number handed to the guest, far from its stdio descriptors.
FD_BASE = 256
#: Largest read served in one call; the guest's buffered reader asks for less.
MAX_READ = 16 * 2**20
_MAX_PATH = 4096
_MAX_NAME = 255
#: Deepest directory nesting inside a writable mount. Staging and publishing walk a tree
#: holding a descriptor per level, so a guest must not be able to build (and persist, in a
#: workspace) a tree deep enough to exhaust the host's descriptors or recursion limit.
MAX_DEPTH = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20

# The bits of the `open` flags parameter (guest/wit/files.wit).
F_READ, F_WRITE, F_CREATE, F_EXCL, F_TRUNC, F_APPEND, F_DIRECTORY, F_NOFOLLOW, F_NOTDIR = (
    1 << i for i in range(9))

_ERRNO_NAMES = {
    errno.ENOENT: "noent", errno.EEXIST: "exist", errno.ENOTDIR: "notdir",
    errno.EISDIR: "isdir", errno.ENOTEMPTY: "notempty", errno.ELOOP: "loop",
    errno.EACCES: "acces", errno.EPERM: "perm", errno.EROFS: "rofs", errno.EXDEV: "xdev",
    errno.EINVAL: "inval", errno.EBADF: "badf", errno.EMFILE: "mfile", errno.ENOSPC: "nospc",
    errno.EDQUOT: "dquot", errno.ENAMETOOLONG: "nametoolong", errno.ENXIO: "nxio",
    errno.EFBIG: "fbig",
}


class QuotaExceeded(Exception):
    """A writable mount's staging tree holds more than its quotas allow; nothing of the run
    is published (``_sandbox.run_with_files`` reports it as the run's ``OSError``)."""


class FilesError(Exception):
    """An expected failure of a guest file operation; ``code`` is a WIT ``error-code`` name."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _from_os(exc: OSError) -> FilesError:
    return FilesError(_ERRNO_NAMES.get(exc.errno or 0, "io"))


@dataclasses.dataclass(frozen=True)
class Mount:
    """A host directory the guest sees at ``guest_path``.

    Read-only unless ``writable``. A writable mount's changes are staged per run and
    published into ``host_path`` only when the run ends ok; it holds at most ``quota_bytes``
    (ints or shorthand such as ``"64MiB"``) in at most ``quota_files`` files and directories.

    ``Mount.scratch("/tmp")`` is a writable directory that starts empty for every run and
    is thrown away when the run ends (``host_path`` is None).

    ``c_access=True`` also shows a writable or scratch mount to C code inside the wasm guest
    (``sqlite3.connect("/out/db.sqlite")``), through a WASI preopen of the run's staging
    tree. Such a run gets a new guest instance rather than a pooled one, and its staging
    holds private copies of the mount's files, copied at the start of every run (instead of
    links), so C code never writes a host file in place; the quotas and refusals are then
    checked on what the tree holds when the run ends (see docs/c-level-files.md).

    Raises UsageError if ``host_path`` is not an existing directory, ``guest_path`` is not
    an absolute path below ``/``, or ``c_access`` is asked of a read-only mount.
    """

    host_path: str | os.PathLike[str] | None
    guest_path: str
    writable: bool = False
    quota_bytes: int | str = 64 * 2**20
    quota_files: int = 10_000
    c_access: bool = False

    @classmethod
    def scratch(cls, guest_path: str = "/tmp", *, quota_bytes: int | str = 64 * 2**20,
                quota_files: int = 10_000, c_access: bool = False) -> Mount:
        """A private, empty, writable directory for each run, discarded when it ends."""
        return cls(None, guest_path, writable=True, quota_bytes=quota_bytes,
                   quota_files=quota_files, c_access=c_access)

    def __post_init__(self) -> None:
        if self.c_access and not self.writable:
            # A preopen of the host directory itself would show C code what the Python view
            # hides (links, FIFOs, other runs' staging): only a private staging tree is safe.
            raise UsageError("c_access needs a writable (or scratch) mount, whose staging "
                             "tree C code can be given; mount it writable with a quota")
        object.__setattr__(self, "c_access", bool(self.c_access))
        if self.host_path is None:
            if not self.writable:
                raise UsageError("a scratch Mount (host_path=None) must be writable")
        else:
            try:
                host = Path(os.fspath(self.host_path)).resolve(strict=True)
            except (OSError, TypeError, ValueError):
                raise UsageError(f"Mount host_path must be an existing directory, not "
                                 f"{self.host_path!r}") from None
            if not host.is_dir():
                raise UsageError(f"Mount host_path must be a directory: {self.host_path!r}")
            object.__setattr__(self, "host_path", host)
        guest = self.guest_path
        if not isinstance(guest, str) or not guest.startswith("/") or "\x00" in guest:
            raise UsageError(f"Mount guest_path must be an absolute path such as '/data', "
                             f"not {guest!r}")
        parts = _lexical_parts(guest)
        if not parts:
            raise UsageError("Mount guest_path cannot be '/': mount below it, e.g. '/data'")
        object.__setattr__(self, "guest_path", "/" + "/".join(parts))
        object.__setattr__(self, "writable", bool(self.writable))
        object.__setattr__(self, "quota_bytes", parse_size(self.quota_bytes, "quota_bytes"))
        files = self.quota_files
        if isinstance(files, bool) or not isinstance(files, int) or files <= 0:
            raise UsageError(f"quota_files must be a positive int, not {files!r}")

    @property
    def parts(self) -> tuple[str, ...]:
        return _lexical_parts(self.guest_path)



@dataclasses.dataclass(frozen=True, slots=True)
class StatInfo:
    """The status of a file as the guest sees it (the WIT ``stat`` record)."""

    kind: str
    mode: int
    size: int
    ino: int
    dev: int
    nlink: int
    atime: int
    mtime: int
    ctime: int

    def encode(self) -> str:
        """The wire form (guest/wit/files.wit, ``fstat``)."""
        return " ".join(map(str, (_KINDS.index(self.kind), self.mode, self.size, self.ino,
                                  self.dev, self.nlink, self.atime, self.mtime, self.ctime)))


_KINDS = ("regular", "directory", "symlink", "other")


def check_mounts(mounts: Sequence[Mount]) -> tuple[Mount, ...]:
    """Validate a mount table: Mount objects, no guest path inside another, and no writable
    host directory inside another mount's. Raises UsageError."""
    table = tuple(mounts)
    for mount in table:
        if not isinstance(mount, Mount):
            raise UsageError(f"mounts must be wasibox.Mount objects, not {type(mount).__name__}")
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            if _nested(a.parts, b.parts):
                raise UsageError(f"mounts {a.guest_path!r} and {b.guest_path!r} overlap")
            if a.host_path is None or b.host_path is None:
                continue
            if (a.writable or b.writable) and _nested(Path(a.host_path).parts,
                                                      Path(b.host_path).parts):
                raise UsageError(f"the host directories of {a.guest_path!r} and "
                                 f"{b.guest_path!r} overlap, and one of them is writable")
    return table


def guest_path_for(host_file: str | os.PathLike[str], mounts: Sequence[Mount]) -> str | None:
    """The path at which the guest sees ``host_file`` through ``mounts``, or None if no
    mount shows it (a scratch mount shows no host file)."""
    try:
        target = Path(os.fspath(host_file)).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    for mount in mounts:
        if mount.host_path is None:
            continue
        try:
            inside = target.relative_to(mount.host_path)
        except ValueError:
            continue
        return "/".join((mount.guest_path, *inside.parts))
    return None


def _nested(a: Sequence[str], b: Sequence[str]) -> bool:
    n = min(len(a), len(b))
    return tuple(a[:n]) == tuple(b[:n])


def _lexical_parts(path: str) -> tuple[str, ...]:
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return tuple(parts)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _refusal(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "not a regular file or directory"


class _Inode:
    """A file or directory of a writable mount's guest view, as the quotas count it.

    Quotas count the underlying file, never a name: an inode is counted (its size against
    the byte quota, itself against the file quota) while a name in the view links to it or
    a guest descriptor holds it open, as a filesystem counts it until its last link is gone
    and its last descriptor closed. So removing or replacing an open file frees nothing
    until it is closed, and a file that is renamed, replaced or unlinked and then written
    or truncated through a descriptor is still the one file it always was.
    """

    __slots__ = ("ino", "size", "links", "opens")

    def __init__(self, ino: int, size: int) -> None:
        self.ino = ino
        self.size = size
        self.links = 0  # names in the guest view (staging tree) that link to it
        self.opens = 0  # open file descriptions (_Handle) that hold it


class _Handle:
    """An open file description: one host descriptor, shared by every guest descriptor that
    ``dup`` made from the first (they share its position and flags, as on POSIX)."""

    __slots__ = ("fd", "mounted", "readable", "writable", "append", "is_dir", "inode", "refs")

    def __init__(self, fd: int, mounted: _Mounted, readable: bool, writable: bool,
                 append: bool, is_dir: bool, inode: _Inode | None = None) -> None:
        self.fd = fd
        self.mounted = mounted
        self.readable = readable
        self.writable = writable
        self.append = append
        self.is_dir = is_dir
        #: What the quotas count for it (None on a read-only mount and for a mount's root).
        self.inode = inode
        self.refs = 1  # guest descriptors that name it


class _Mounted:
    """One mount during one run: its root descriptor and, if writable, its staging."""

    def __init__(self, mount: Mount, index: int) -> None:
        self.mount = mount
        self.dev = index + 1
        self.writable = mount.writable
        self.scratch = mount.host_path is None
        self.host = (Path(tempfile.mkdtemp(prefix="wasibox-scratch-")) if mount.host_path is None
                     else Path(mount.host_path))
        self.host_fd = os.open(self.host, _DIR_FLAGS)
        self.root_fd = self.host_fd
        self.run_dir: Path | None = None
        self.lock_fd: int | None = None
        self.tree: Path | None = None
        #: rel path -> (kind, inode) of what the host held when the run started.
        self.baseline: dict[tuple[str, ...], tuple[str, int]] = {}
        #: inode -> (path, size, mtime in ns) of each private copy a c_access staging made of
        #: a host file; a copy still at that path with that size and mtime is unchanged.
        self.copies: dict[int, tuple[tuple[str, ...], int, int]] = {}
        #: inode -> the permission bits the guest set, where the disk keeps the owner access
        #: the host needs (see _owner_bits); shown by stat and published with the file.
        self.modes: dict[int, int] = {}
        #: What the quotas count, by inode number of the guest view (see _Inode), and the
        #: sum of their sizes.
        self.inodes: dict[int, _Inode] = {}
        self.used_bytes = 0
        self.quota_bytes = int(mount.quota_bytes)
        #: What the view held when the run started: a mount already over its quota may keep
        #: what it holds, but not grow.
        self.baseline_bytes = 0
        self.baseline_files = 0

    # -- quota accounting -----------------------------------------------------------------
    @property
    def used_files(self) -> int:
        return len(self.inodes)

    def linked(self, st: os.stat_result) -> _Inode:
        """Count one more name in the view linking to the file ``st`` describes."""
        inode = self.inodes.get(st.st_ino)
        if inode is None:
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            inode = self.inodes[st.st_ino] = _Inode(st.st_ino, size)
            self.used_bytes += size
        inode.links += 1
        return inode

    def opened(self, st: os.stat_result) -> _Inode:
        """Count a new open file description of the file ``st`` describes (which a name in
        the view links to: it was just opened by one)."""
        inode = self.inodes.get(st.st_ino)
        if inode is None:
            inode = self.linked(st)
        inode.opens += 1
        self.resize(inode, st.st_size if stat.S_ISREG(st.st_mode) else 0)
        return inode

    def unlinked(self, st: os.stat_result) -> None:
        """Count one name fewer linking to the file ``st`` described before it went."""
        inode = self.inodes.get(st.st_ino)
        if inode is not None:
            inode.links -= 1
            self.forget_if_unused(inode)

    def closed(self, inode: _Inode) -> None:
        inode.opens -= 1
        self.forget_if_unused(inode)

    def forget_if_unused(self, inode: _Inode) -> None:
        if inode.links <= 0 and inode.opens <= 0 and self.inodes.get(inode.ino) is inode:
            del self.inodes[inode.ino]
            self.used_bytes -= inode.size

    def resize(self, inode: _Inode, size: int) -> None:
        self.used_bytes += size - inode.size
        inode.size = size

    def cap(self, inode: _Inode) -> int:
        """The largest size ``inode`` may grow to within the byte quota (it may always keep
        the size it has)."""
        return max(inode.size, self.quota_bytes - (self.used_bytes - inode.size))

    # -- staging --------------------------------------------------------------------------
    def stage(self) -> None:
        """Make this run's staging tree and populate it with links to the host's files."""
        staging = _open_staging(self.host_fd)
        try:
            with _Lock(staging, "setup.lock"):
                _reclaim(staging)
                name = f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                os.mkdir(name, 0o700, dir_fd=staging)
                self.run_dir = self.host / STAGING_DIR / name
                run_fd = os.open(name, _DIR_FLAGS, dir_fd=staging)
                try:
                    self.lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                           | os.O_CLOEXEC, 0o600, dir_fd=run_fd)
                    fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
                    os.mkdir("tree", 0o755, dir_fd=run_fd)
                    self.root_fd = os.open("tree", _DIR_FLAGS, dir_fd=run_fd)
                finally:
                    os.close(run_fd)
        finally:
            os.close(staging)
        self.tree = self.run_dir / "tree"
        self._populate(self.host_fd, self.root_fd, ())
        self.baseline_bytes, self.baseline_files = self.used_bytes, self.used_files

    def _populate(self, src_fd: int, dst_fd: int, rel: tuple[str, ...]) -> None:
        with os.scandir(src_fd) as entries:
            listing = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
        for name, st in listing:
            if name == STAGING_DIR:
                continue
            if stat.S_ISDIR(st.st_mode) and len(rel) < MAX_DEPTH:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
                except OSError:
                    continue  # changed under us, or unreadable: not part of the guest's view
                try:
                    os.mkdir(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=dst_fd)
                    copy = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                    try:
                        self.linked(os.fstat(copy))
                        self._populate(child, copy, (*rel, name))
                    finally:
                        os.close(copy)
                finally:
                    os.close(child)
                self.baseline[(*rel, name)] = ("directory", st.st_ino)
            elif stat.S_ISREG(st.st_mode):
                try:
                    if self.mount.c_access:
                        self._copy_in(src_fd, dst_fd, name, (*rel, name))
                    else:
                        os.link(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd,
                                follow_symlinks=False)
                except OSError:
                    continue  # e.g. protected_hardlinks: the file stays invisible to the guest
                self.baseline[(*rel, name)] = ("regular", st.st_ino)
                # What was linked, not what was listed (the host may have replaced it since);
                # a file with two names in the mount is one inode, counted once.
                self.linked(os.stat(name, dir_fd=dst_fd, follow_symlinks=False))
            # Symlinks, FIFOs, devices and sockets in the host directory are not shown to
            # the guest of a writable mount, and publishing never touches them.

    def _copy_in(self, src_fd: int, dst_fd: int, name: str, path: tuple[str, ...]) -> None:
        """Stage a private copy of the host's regular file ``name`` (for C access), with its
        mode and times. Raises OSError if it is no longer a regular file."""
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                      dir_fd=src_fd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.ENXIO, "not a regular file")
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, stat.S_IMODE(st.st_mode) | 0o600, dir_fd=dst_fd)
            try:
                _copy_contents(src, dst, st)
                copied = os.fstat(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        self.copies[copied.st_ino] = (path, copied.st_size, copied.st_mtime_ns)

    def close(self) -> None:
        for fd in (self.root_fd if self.root_fd != self.host_fd else None, self.host_fd,
                   self.lock_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.root_fd = self.host_fd = -1
        self.lock_fd = None

    def discard(self) -> None:
        """Remove this run's staging directory, or its scratch directory (after ``close``)."""
        if self.scratch:
            shutil.rmtree(self.host, ignore_errors=True)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None


def _copy_contents(src: int, dst: int, st: os.stat_result) -> None:
    """Copy the open file ``src`` into ``dst``, then give ``dst`` the times in ``st``."""
    while chunk := os.read(src, _COPY_CHUNK):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _height(parent_fd: int, name: str) -> int:
    """How many directory levels lie below directory ``name`` (0 if it holds none)."""
    height = 0
    for top, _, _, _ in os.fwalk(name, dir_fd=parent_fd):  # never follows links
        height = max(height, top.count("/"))
    return height


def _open_staging(host_fd: int) -> int:
    try:
        os.mkdir(STAGING_DIR, 0o700, dir_fd=host_fd)
    except FileExistsError:
        pass
    try:
        staging_fd = os.open(STAGING_DIR, _DIR_FLAGS, dir_fd=host_fd)
    except OSError as exc:
        raise UsageError(f"the writable mount cannot keep its staging directory "
                         f"{STAGING_DIR!r}: {exc.strerror}") from None
    _explain_staging(staging_fd)
    return staging_fd


#: What a user who finds the staging directory in their own directory reads there.
STAGING_README = """\
This directory belongs to wasibox (https://pypi.org/project/wasibox/).

The directory above it is mounted writable into a wasibox sandbox. Each run's changes are
staged here (run-*/) and moved into the directory above only when the run ends ok, so a
failed run leaves nothing half-written. setup.lock and publish.lock keep concurrent runs
from stepping on each other; they are empty files.

It is safe to delete this directory while no wasibox run uses the mount. A run-* directory
left by a process that died is finished or discarded by the next run that mounts this
directory; deleting it instead may lose that run's half-published changes.
"""


def _explain_staging(staging_fd: int) -> None:
    """Leave a README.txt in the staging directory if there is none (never follows a link)."""
    try:
        fd = os.open("README.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644, dir_fd=staging_fd)
    except OSError:
        return  # already there, or not writable: staging works without it
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(STAGING_README)


def _reclaim(staging_fd: int) -> None:
    """Finish or discard the staging of runs whose process died (their lock is free).

    Called with ``setup.lock`` held, so every run directory without a lock file is dead."""
    host_fd = os.open("..", _DIR_FLAGS, dir_fd=staging_fd)
    try:
        _reclaim_runs(staging_fd, host_fd)
    finally:
        os.close(host_fd)


def _reclaim_runs(staging_fd: int, host_fd: int) -> None:
    for name in os.listdir(staging_fd):
        if not name.startswith("run-"):
            continue
        try:
            run_fd = os.open(name, _DIR_FLAGS, dir_fd=staging_fd)
        except OSError:
            continue
        try:
            try:
                lock = os.open("lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run_fd)
            except FileNotFoundError:
                lock = None  # died before taking its lock: nothing was published from it
            except OSError:
                continue
            try:
                if lock is not None:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a live run
                journal = _read_journal(run_fd)
                if journal is not None:
                    with _Lock(staging_fd, "publish.lock"):
                        _apply(journal, run_fd, host_fd, records=None)
            finally:
                if lock is not None:
                    os.close(lock)
        finally:
            os.close(run_fd)
        _rmtree_at(staging_fd, name)


def _rmtree_at(dir_fd: int, name: str) -> None:
    try:
        shutil.rmtree(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


class _Lock:
    """An exclusive flock on ``name`` in the staging directory, across threads and processes.

    ``setup.lock`` is held while a run's staging is made and while stale ones are reclaimed
    (so a reclaimer never mistakes a staging being made for a dead one); ``publish.lock``
    while a journal is applied, so publishes to one mount happen one at a time."""

    def __init__(self, staging_fd: int, name: str) -> None:
        self._staging_fd = staging_fd
        self._name = name
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600, dir_fd=self._staging_fd)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc_info: object) -> None:
        os.close(self._fd)


class FileSession:
    """The files one run can see: its mounts, open descriptors, quotas and staging.

    Every operation takes absolute guest paths and raises FilesError with an ``error-code``
    name for anything the guest did wrong; nothing else escapes for guest input. Used by one
    thread (the run's). ``close`` discards unpublished staging and is idempotent.
    """

    def __init__(self, mounts: Sequence[Mount], open_files: int) -> None:
        self._open_files = open_files
        self._handles: dict[int, _Handle] = {}
        self._mounted: list[_Mounted] = []
        self._closed = False
        self._refused: list[RefusedFile] = []
        self.published = False
        try:
            for index, mount in enumerate(mounts):
                mounted = _Mounted(mount, index)
                self._mounted.append(mounted)
                if mount.writable and not mounted.scratch:
                    mounted.stage()
        except BaseException:
            self.close()
            raise
        # Longest guest prefix first, so /data/raw wins over /data (they cannot overlap,
        # but the order keeps matching obviously right).
        self._table = sorted(((m.mount.parts, m) for m in self._mounted),
                             key=lambda item: -len(item[0]))

    def __enter__(self) -> FileSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def trees(self) -> dict[str, Path]:
        """Guest path -> host staging tree of each writable mount (for directory backends)."""
        return {m.mount.guest_path: m.tree for m in self._mounted if m.tree is not None}

    def preopens(self) -> list[tuple[str, str]]:
        """(host directory, guest path) of each ``c_access`` mount, for a WASI preopen: the
        run's staging tree of a writable mount, the scratch directory of a scratch one."""
        return [(str(m.tree if m.tree is not None else m.host), m.mount.guest_path)
                for m in self._mounted if m.mount.c_access]

    def c_access_overrun(self) -> str | None:
        """Why a ``c_access`` mount's tree holds more than its quotas right now, or None.

        C code in the guest writes those trees through its WASI preopen, past the file
        layer's accounting, so while such a run goes on they are measured from outside
        (``run_with_files`` polls this) and the run is stopped once one is over.
        """
        for mounted in self._mounted:
            if not mounted.mount.c_access:
                continue
            quota_bytes = max(mounted.quota_bytes, mounted.baseline_bytes)
            quota_files = max(mounted.mount.quota_files, mounted.baseline_files)
            used_bytes, used_files = _tree_usage(
                mounted.tree if mounted.tree is not None else mounted.host, quota_files + 1)
            where = mounted.mount.guest_path
            if used_bytes > quota_bytes:
                return (f"C code wrote {used_bytes} bytes into {where!r}, over its quota "
                        f"of {quota_bytes}")
            if used_files > quota_files:
                return (f"C code made {used_files} files and directories in {where!r}, "
                        f"over its quota of {quota_files}")
        return None

    def views(self) -> list[tuple[Mount, int | None]]:
        """Each mount with a descriptor of the directory its guest view starts at: the host
        directory of a read-only mount, the staging tree of a writable one, None for a
        scratch mount (it starts empty). For backends that copy mounts into their guest; the
        session owns the descriptors."""
        return [(m.mount, None if m.scratch else m.root_fd) for m in self._mounted]

    def refuse(self, path: str, reason: str) -> None:
        """Report a guest entry that will not be published (a backend whose guest writes its
        own copy of a mount finds these before anything reaches the staging tree)."""
        self._refused.append(RefusedFile(path=path, reason=reason))

    # -- resolving paths --------------------------------------------------------------------
    def _locate(self, path: str) -> tuple[_Mounted | None, tuple[str, ...], bool]:
        """(mount, path inside it, must be a directory); (None, parts, True) for a
        directory of the virtual tree above the mounts. Raises FilesError."""
        if not isinstance(path, str) or "\x00" in path or not path.startswith("/"):
            raise FilesError("inval")
        if len(path) > _MAX_PATH:
            raise FilesError("nametoolong")
        parts = _lexical_parts(path)
        if any(len(part.encode("utf-8", "surrogatepass")) > _MAX_NAME for part in parts):
            raise FilesError("nametoolong")
        wants_dir = path.endswith(("/", "/.", "/..")) or path.rstrip("/") == ""
        for prefix, mounted in self._table:
            if parts[:len(prefix)] == prefix:
                rel = parts[len(prefix):]
                if rel and rel[0] == STAGING_DIR:
                    raise FilesError("noent")
                return mounted, rel, wants_dir
        for prefix, _ in self._table:
            if prefix[:len(parts)] == parts:
                return None, parts, True
        raise FilesError("noent")

    def _locate_for_change(self, path: str) -> tuple[_Mounted | None, tuple[str, ...], bool]:
        """``_locate``, except that a new name in a directory of the virtual tree above the
        mounts is refused (EACCES) rather than missing: that directory exists, read-only."""
        try:
            return self._locate(path)
        except FilesError as exc:
            if exc.code == "noent" and isinstance(path, str) and path.startswith("/"):
                parent = _lexical_parts(path)[:-1]
                if any(prefix[:len(parent)] == parent for prefix, _ in self._table):
                    raise FilesError("acces") from None
            raise

    def _parent(self, mounted: _Mounted, rel: tuple[str, ...]) -> int:
        """A descriptor of the directory holding ``rel[-1]``, walked without following
        anything. The caller closes it."""
        fd = os.dup(mounted.root_fd)
        try:
            for part in rel[:-1]:
                if part == STAGING_DIR:
                    raise FilesError("noent")
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self._walk_error(exc, fd, part) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _walk_error(exc: OSError, dir_fd: int, name: str) -> FilesError:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                return _from_os(exc)
            return FilesError("loop" if stat.S_ISLNK(st.st_mode) else "notdir")
        return _from_os(exc)

    def _lstat(self, mounted: _Mounted, rel: tuple[str, ...]) -> os.stat_result:
        if not rel:
            return os.fstat(mounted.root_fd)
        parent = self._parent(mounted, rel)
        try:
            return os.stat(rel[-1], dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)

    def _info(self, st: os.stat_result, mounted: _Mounted) -> StatInfo:
        # A read-only mount shows no write permission, so os.access and friends tell the truth.
        mode = mounted.modes.get(st.st_ino, stat.S_IMODE(st.st_mode))
        mode &= 0o7777 if mounted.writable else ~0o222
        return StatInfo(kind=_kind(st.st_mode), mode=mode, size=st.st_size,
                        ino=st.st_ino, dev=mounted.dev, nlink=st.st_nlink, atime=st.st_atime_ns,
                        mtime=st.st_mtime_ns, ctime=st.st_ctime_ns)

    def _mutable(self, path: str) -> tuple[_Mounted, tuple[str, ...], bool]:
        mounted, rel, wants_dir = self._locate_for_change(path)
        if mounted is None:
            raise FilesError("acces")
        if not mounted.writable:
            raise FilesError("rofs")
        return mounted, rel, wants_dir

    # -- operations on paths ----------------------------------------------------------------
    def stat(self, path: str) -> StatInfo:
        mounted, rel, wants_dir = self._locate(path)
        if mounted is None:
            return StatInfo(kind="directory", mode=0o555, size=0, ino=0, dev=0, nlink=2,
                            atime=0, mtime=0, ctime=0)
        st = self._guarded(lambda: self._lstat(mounted, rel))
        if wants_dir and not stat.S_ISDIR(st.st_mode):
            raise FilesError("loop" if stat.S_ISLNK(st.st_mode) else "notdir")
        return self._info(st, mounted)

    def readdir(self, path: str) -> str:
        mounted, rel, _ = self._locate(path)
        if mounted is None:
            parts = _lexical_parts(path)
            names = sorted({prefix[len(parts)] for prefix, _ in self._table
                            if len(prefix) > len(parts) and prefix[:len(parts)] == parts})
            return "/".join("d" + name for name in names)
        fd = self._open_dir(mounted, rel)
        try:
            entries = []
            with os.scandir(fd) as listing:
                for entry in listing:
                    name = entry.name
                    if name == STAGING_DIR or not _encodable(name):
                        continue
                    if entry.is_symlink():
                        tag = "l"
                    elif entry.is_dir(follow_symlinks=False):
                        tag = "d"
                    elif entry.is_file(follow_symlinks=False):
                        tag = "f"
                    else:
                        tag = "o"
                    entries.append(tag + name)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(fd)
        return "/".join(entries)

    def _open_dir(self, mounted: _Mounted, rel: tuple[str, ...]) -> int:
        if not rel:
            return os.dup(mounted.root_fd)
        parent = self._parent(mounted, rel)
        try:
            return os.open(rel[-1], _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise self._walk_error(exc, parent, rel[-1]) from None
        finally:
            os.close(parent)

    def mkdir(self, path: str, mode: int) -> None:
        mounted, rel, _ = self._mutable(path)
        if not rel:
            raise FilesError("exist")
        _check_mode(mode)
        parent = self._parent(mounted, rel)
        try:
            name = rel[-1]
            if _exists(parent, name):
                raise FilesError("exist")  # before the quota, as a filesystem answers
            self._charge_file(mounted, rel)
            os.mkdir(name, (mode & 0o777) | 0o700, dir_fd=parent)
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            mounted.linked(st)
            _remember_mode(mounted, st, mode)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)

    def unlink(self, path: str) -> None:
        mounted, rel, wants_dir = self._mutable(path)
        if not rel or wants_dir:
            raise FilesError("isdir" if not rel else "notdir")
        parent = self._parent(mounted, rel)
        try:
            st = os.stat(rel[-1], dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise FilesError("isdir")
            os.unlink(rel[-1], dir_fd=parent)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)
        mounted.unlinked(st)  # still counted while a descriptor holds it open

    def rmdir(self, path: str) -> None:
        mounted, rel, _ = self._mutable(path)
        if not rel:
            raise FilesError("acces")
        parent = self._parent(mounted, rel)
        try:
            st = os.stat(rel[-1], dir_fd=parent, follow_symlinks=False)
            os.rmdir(rel[-1], dir_fd=parent)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)
        mounted.unlinked(st)

    def rename(self, src: str, dst: str) -> None:
        source, src_rel, _ = self._locate(src)
        target, dst_rel, _ = self._locate_for_change(dst)
        if source is None or target is None:
            raise FilesError("acces")
        if not source.writable or not target.writable:
            raise FilesError("rofs")
        if source is not target:
            raise FilesError("xdev")
        if not src_rel or not dst_rel:
            raise FilesError("acces")
        src_parent = self._parent(source, src_rel)
        try:
            dst_parent = self._parent(target, dst_rel)
        except BaseException:
            os.close(src_parent)
            raise
        try:
            try:
                replaced: os.stat_result | None = os.stat(dst_rel[-1], dir_fd=dst_parent,
                                                          follow_symlinks=False)
            except FileNotFoundError:
                replaced = None
            moved = os.stat(src_rel[-1], dir_fd=src_parent, follow_symlinks=False)
            if (stat.S_ISDIR(moved.st_mode) and len(dst_rel) > len(src_rel)
                    and len(dst_rel) + _height(src_parent, src_rel[-1]) > MAX_DEPTH):
                raise FilesError("nametoolong")
            os.rename(src_rel[-1], dst_rel[-1], src_dir_fd=src_parent, dst_dir_fd=dst_parent)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(src_parent)
            os.close(dst_parent)
        if replaced is not None and replaced.st_ino != moved.st_ino:
            # The replaced file loses this name; an open descriptor keeps it counted.
            # (Two names of one file: rename does nothing, as POSIX says.)
            target.unlinked(replaced)

    def chmod(self, path: str, mode: int) -> None:
        mounted, rel, _ = self._mutable(path)

        def change(fd: int, st: os.stat_result) -> None:
            _check_mode(mode)
            os.chmod(fd, mode | _owner_bits(st))
            mounted.modes[st.st_ino] = mode

        self._with_own_inode(mounted, rel, change)

    def utime(self, path: str, atime: int, mtime: int, now: bool) -> None:
        mounted, rel, _ = self._mutable(path)
        self._with_own_inode(mounted, rel, lambda fd, st: os.utime(fd) if now
                             else os.utime(fd, ns=(atime, mtime)))

    def link(self, src: str, dst: str) -> None:
        self._locate(src)
        self._locate(dst)
        raise FilesError("perm")

    def symlink(self, target: str, path: str) -> None:
        self._locate(path)
        raise FilesError("perm")

    def readlink(self, path: str) -> str:
        mounted, rel, _ = self._locate(path)
        if mounted is None or not rel:
            raise FilesError("inval")
        parent = self._parent(mounted, rel)
        try:
            target = os.readlink(rel[-1], dir_fd=parent)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)
        if not _encodable(target):
            raise FilesError("inval")
        return target

    def _with_own_inode(self, mounted: _Mounted, rel: tuple[str, ...],
                        change: Callable[[int, os.stat_result], None]) -> None:
        """Apply ``change`` to the file or directory at ``rel`` through a descriptor, after
        copying a file whose inode is still shared with the host."""
        if not rel:
            st = os.fstat(mounted.root_fd)
            self._guarded(lambda: change(mounted.root_fd, st))
            return
        parent = self._parent(mounted, rel)
        try:
            name = rel[-1]
            st = self._guarded(lambda: os.stat(name, dir_fd=parent, follow_symlinks=False))
            if stat.S_ISLNK(st.st_mode):
                raise FilesError("loop")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise FilesError("nxio")
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                self._guarded(lambda: self._copy_up(mounted, parent, name))
            flags = (_DIR_FLAGS if stat.S_ISDIR(st.st_mode)
                     else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            fd = self._guarded(lambda: os.open(name, flags, dir_fd=parent))
            try:
                self._guarded(lambda: change(fd, os.fstat(fd)))
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    @staticmethod
    def _guarded(action: Callable[[], Any]) -> Any:
        try:
            return action()
        except OSError as exc:
            raise _from_os(exc) from None

    def _copy_up(self, mounted: _Mounted, parent: int, name: str) -> None:
        """Replace a staged hard link to a host file with a private copy of it.

        The copy is a new file for the quotas. Descriptors open on the shared file move to
        the copy when no other name of the guest view still links to the shared one, so
        every descriptor of the guest's file sees its changes, as on one filesystem (and
        the shared file, no longer part of the view, stops being counted). Raises FilesError
        ``nospc`` if the shared file stays in the view and its copy does not fit the quota.
        """
        temp = f".wasibox-copy-{uuid.uuid4().hex[:12]}"
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            st = os.fstat(src)
            shared = mounted.inodes.get(st.st_ino)
            if (shared is None or shared.links > 1) and (
                    mounted.used_bytes + st.st_size > mounted.quota_bytes):
                raise FilesError("nospc")
            dst = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, stat.S_IMODE(st.st_mode) | 0o600, dir_fd=parent)
            try:
                _copy_contents(src, dst, st)
                copied = os.fstat(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        copy = mounted.linked(copied)
        if shared is None:
            return
        shared.links -= 1
        if shared.links <= 0:
            for handle in self._descriptions(self._handles):
                if handle.inode is shared:
                    self._reopen(handle, parent, name, copy)
        mounted.forget_if_unused(shared)

    @staticmethod
    def _reopen(handle: _Handle, parent: int, name: str, inode: _Inode) -> None:
        """Point an open file description at the file now named ``name``, keeping its host
        descriptor number, access mode, flags and position."""
        access = (os.O_RDWR if handle.readable and handle.writable
                  else os.O_WRONLY if handle.writable else os.O_RDONLY)
        fd = os.open(name, access | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                     | (os.O_APPEND if handle.append else 0), dir_fd=parent)
        try:
            os.lseek(fd, os.lseek(handle.fd, 0, os.SEEK_CUR), os.SEEK_SET)
            os.dup2(fd, handle.fd, inheritable=False)
        finally:
            os.close(fd)
        if handle.inode is not None:
            handle.mounted.closed(handle.inode)
        handle.inode = inode
        inode.opens += 1

    def _charge_file(self, mounted: _Mounted, rel: tuple[str, ...]) -> None:
        if len(rel) > MAX_DEPTH:
            raise FilesError("nametoolong")
        if mounted.used_files >= mounted.mount.quota_files:
            raise FilesError("dquot")

    # -- descriptors ------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int) -> int:
        if len(self._handles) >= self._open_files:
            raise FilesError("mfile")
        writing = bool(flags & (F_WRITE | F_CREATE | F_TRUNC | F_APPEND))
        mounted, rel, wants_dir = (self._locate_for_change if writing else self._locate)(path)
        if mounted is None:
            raise FilesError("isdir" if writing or flags & F_NOTDIR else "acces")
        if writing and not mounted.writable:
            raise FilesError("rofs")
        readable = bool(flags & F_READ) or not flags & F_WRITE
        writable = bool(flags & F_WRITE)
        if not rel:
            if flags & F_CREATE and flags & F_EXCL:
                raise FilesError("exist")
            if writable or flags & (F_NOTDIR | F_CREATE | F_TRUNC):
                raise FilesError("isdir")
            fd = os.dup(mounted.root_fd)
            return self._add(_Handle(fd, mounted, True, False, False, True))
        os_flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        os_flags |= os.O_RDWR if readable and writable else os.O_WRONLY if writable else 0
        if flags & F_APPEND:
            # The kernel puts every write of an append descriptor at the end of the file,
            # whatever its position (pwrite too, as Linux does): nothing here decides it.
            os_flags |= os.O_APPEND
        if flags & F_DIRECTORY or wants_dir:
            os_flags |= os.O_DIRECTORY
        parent = self._parent(mounted, rel)
        try:
            name = rel[-1]
            try:
                existing: os.stat_result | None = os.stat(name, dir_fd=parent,
                                                          follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            except OSError as exc:
                raise _from_os(exc) from None
            if existing is None:
                if not flags & F_CREATE:
                    raise FilesError("noent")
                if wants_dir:
                    raise FilesError("isdir")
                self._charge_file(mounted, rel)
                os_flags |= os.O_CREAT | os.O_EXCL
            else:
                if flags & F_CREATE and flags & F_EXCL:
                    raise FilesError("exist")
                if stat.S_ISLNK(existing.st_mode):
                    raise FilesError("loop")
                if not (stat.S_ISREG(existing.st_mode) or stat.S_ISDIR(existing.st_mode)):
                    raise FilesError("nxio")
                if stat.S_ISDIR(existing.st_mode) and (
                        writable or flags & (F_TRUNC | F_NOTDIR | F_CREATE)):
                    raise FilesError("isdir")
                if (mounted.writable and (writable or flags & F_TRUNC)
                        and existing.st_nlink > 1):
                    self._guarded(lambda: self._copy_up(mounted, parent, name))
                if flags & F_TRUNC and stat.S_ISREG(existing.st_mode):
                    os_flags |= os.O_TRUNC
            try:
                fd = os.open(name, os_flags, (mode & 0o777) | 0o600, dir_fd=parent)
            except OSError as exc:
                raise self._walk_error(exc, parent, name) from None
        finally:
            os.close(parent)
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            os.close(fd)  # replaced by something else between the check and the open
            raise FilesError("nxio")
        inode = None
        if mounted.writable:
            if existing is None:
                mounted.linked(st)
                _remember_mode(mounted, st, mode & 0o777)
            inode = mounted.opened(st)  # its size now: O_TRUNC may have emptied it
        return self._add(_Handle(fd, mounted, readable, writable, bool(flags & F_APPEND),
                                 stat.S_ISDIR(st.st_mode), inode))

    def _add(self, handle: _Handle) -> int:
        number = FD_BASE
        while number in self._handles:
            number += 1
        self._handles[number] = handle
        return number

    @staticmethod
    def _descriptions(handles: dict[int, _Handle]) -> list[_Handle]:
        """Each open file description once, however many descriptors ``dup`` gave it."""
        return list({id(handle): handle for handle in handles.values()}.values())

    def _handle(self, fd: int) -> _Handle:
        handle = self._handles.get(fd)
        if handle is None:
            raise FilesError("badf")
        return handle

    def read(self, fd: int, size: int) -> str:
        handle = self._readable(fd)
        data = self._guarded(lambda: os.read(handle.fd, min(size, MAX_READ)))
        return str(data.decode("latin-1"))

    def pread(self, fd: int, size: int, offset: int) -> str:
        """Read at ``offset`` without moving the descriptor's position."""
        handle = self._readable(fd)
        if offset < 0:
            raise FilesError("inval")
        data = self._guarded(lambda: os.pread(handle.fd, min(size, MAX_READ), offset))
        return str(data.decode("latin-1"))

    def _readable(self, fd: int) -> _Handle:
        handle = self._handle(fd)
        if handle.is_dir:
            raise FilesError("isdir")
        if not handle.readable:
            raise FilesError("badf")
        return handle

    def write(self, fd: int, data: str) -> int:
        """Write at the descriptor's position, or at the end of the file if it was opened
        to append; returns the bytes written, fewer than given only at the byte quota."""
        return self._write(fd, data, None)

    def pwrite(self, fd: int, data: str, offset: int) -> int:
        """Write at ``offset`` without moving the descriptor's position (at the end of the
        file if it was opened to append, as on Linux)."""
        if offset < 0:
            raise FilesError("inval")
        return self._write(fd, data, offset)

    def _write(self, fd: int, data: str, offset: int | None) -> int:
        handle = self._handle(fd)
        if not handle.writable:
            raise FilesError("badf")
        try:
            payload = data.encode("latin-1")
        except UnicodeEncodeError:
            raise FilesError("inval") from None
        if not payload:
            return 0
        mounted, inode = handle.mounted, handle.inode
        assert inode is not None  # a writable descriptor is a file of a writable mount
        size: int = self._guarded(lambda: os.fstat(handle.fd).st_size)
        if handle.append:
            position = size
        elif offset is None:
            position = self._guarded(lambda: os.lseek(handle.fd, 0, os.SEEK_CUR))
        else:
            position = offset
        mounted.resize(inode, size)
        cap = mounted.cap(inode)
        if position + len(payload) > cap:
            fits = cap - position
            if fits <= 0:
                raise FilesError("nospc")
            payload = payload[:fits]
        written: int = self._guarded(
            lambda: os.write(handle.fd, payload) if offset is None
            else os.pwrite(handle.fd, payload, offset))
        mounted.resize(inode, max(size, position + written))
        return written

    def seek(self, fd: int, offset: int, whence: int) -> int:
        handle = self._handle(fd)
        if whence not in (0, 1, 2):
            raise FilesError("inval")
        position: int = self._guarded(lambda: os.lseek(handle.fd, offset, whence))
        return position

    def truncate(self, fd: int, size: int) -> None:
        """Set the size of the descriptor's file, wherever its names have gone since."""
        handle = self._handle(fd)
        mounted, inode = handle.mounted, handle.inode
        if not mounted.writable:
            raise FilesError("rofs")
        if not handle.writable or inode is None or size < 0:
            raise FilesError("inval")  # as Linux answers for a descriptor not open to write
        current: int = self._guarded(lambda: os.fstat(handle.fd).st_size)
        mounted.resize(inode, current)
        if size > mounted.cap(inode):
            raise FilesError("nospc")
        self._guarded(lambda: os.ftruncate(handle.fd, size))
        mounted.resize(inode, size)

    def dup(self, fd: int) -> int:
        """Another descriptor for the same open file: both share its position and flags."""
        handle = self._handle(fd)
        if len(self._handles) >= self._open_files:
            raise FilesError("mfile")
        handle.refs += 1
        return self._add(handle)

    def close_fd(self, fd: int) -> None:
        handle = self._handles.pop(fd, None)
        if handle is None:
            raise FilesError("badf")
        handle.refs -= 1
        if handle.refs == 0:
            self._release(handle)

    @staticmethod
    def _release(handle: _Handle) -> None:
        os.close(handle.fd)
        if handle.inode is not None:
            handle.mounted.closed(handle.inode)  # an unlinked file stops counting here

    def fstat(self, fd: int) -> StatInfo:
        handle = self._handle(fd)
        return self._info(self._guarded(lambda: os.fstat(handle.fd)), handle.mounted)

    # -- the end of the run -----------------------------------------------------------------
    def _close_handles(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in self._descriptions(handles):
            try:
                self._release(handle)
            except OSError:
                pass

    def publish(self) -> tuple[list[FileRecord], list[RefusedFile]]:
        """Move every writable mount's new and changed files into its host directory.

        Returns what was published and what was refused. Raises QuotaExceeded, publishing
        nothing, if what a staging tree holds is over its mount's quotas (however it got
        there: this counts what is in the tree, not what the run's accounting says), and
        OSError only for a failure of the host itself (a full host disk); the staging is
        discarded either way.
        """
        if self._closed or self.published:
            raise RuntimeError("this file session is closed or already published")
        self._close_handles()
        records: list[FileRecord] = []
        refused: list[RefusedFile] = list(self._refused)
        try:
            # Every mount is planned, and held to its quotas, before anything is moved.
            plans = [(mounted, _plan_mount(mounted)) for mounted in self._mounted
                     if mounted.tree is not None]
            for mounted, plan in plans:
                _publish(mounted, plan, records, refused)
        finally:
            self.published = True
            self.close()
        return records, refused

    def close(self) -> None:
        """Close every descriptor and discard unpublished staging. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_handles()
        for mounted in self._mounted:
            mounted.close()
            mounted.discard()


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- publishing ------------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """What publishing one writable mount will do, found by walking its staging tree."""

    puts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    dirs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: Paths (relative to the mount) of the host's entries still in the tree.
    seen: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    #: Refusals, with paths relative to the mount.
    refused: list[RefusedFile] = dataclasses.field(default_factory=list)
    #: Inode -> size of every regular file the mount will hold, and its directories.
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    directories: int = 0


def _plan_mount(mounted: _Mounted) -> _Plan:
    """Walk a staging tree, digest what changed, and check the result against the quotas.

    Raises QuotaExceeded if the mount would hold more bytes or files than its quotas allow
    (or than it held at the start, if that was more).
    """
    assert mounted.run_dir is not None
    plan = _Plan()
    run_fd = os.open(mounted.run_dir, _DIR_FLAGS)
    try:
        tree_fd = os.open("tree", _DIR_FLAGS, dir_fd=run_fd)
        try:
            inodes = {ino for kind, ino in mounted.baseline.values() if kind == "regular"}
            _plan(mounted, tree_fd, (), plan, inodes)
        finally:
            os.close(tree_fd)
    finally:
        os.close(run_fd)
    used_bytes, used_files = sum(plan.sizes.values()), len(plan.sizes) + plan.directories
    quota_bytes = max(mounted.quota_bytes, mounted.baseline_bytes)
    quota_files = max(mounted.mount.quota_files, mounted.baseline_files)
    where = mounted.mount.guest_path
    if used_bytes > quota_bytes:
        raise QuotaExceeded(f"the run left {used_bytes} bytes in {where!r}, over its quota "
                            f"of {quota_bytes}")
    if used_files > quota_files:
        raise QuotaExceeded(f"the run left {used_files} files and directories in {where!r}, "
                            f"over its quota of {quota_files}")
    return plan


def _tree_usage(root: Path, max_entries: int) -> tuple[int, int]:
    """Bytes (each file once, by inode) and entries below ``root``, symlinks not followed;
    the walk stops once it has seen ``max_entries`` entries.

    The tree is being written while it is measured: entries that vanish are skipped, and a
    directory swapped for a symlink can at worst be counted again, which the entry bound
    keeps finite.
    """
    sizes: dict[int, int] = {}
    entries = 0
    pending = [str(root)]
    while pending:
        try:
            with os.scandir(pending.pop()) as listing:
                for entry in listing:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries += 1
                    if entries >= max_entries:
                        return sum(sizes.values()), entries
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(entry.path)
                    elif stat.S_ISREG(info.st_mode):
                        sizes[info.st_ino] = info.st_size
        except OSError:
            continue
    return sum(sizes.values()), entries


def _publish(mounted: _Mounted, plan: _Plan, records: list[FileRecord],
             refused: list[RefusedFile]) -> None:
    assert mounted.run_dir is not None
    local = plan.refused  # paths relative to the mount until the end
    run_fd = os.open(mounted.run_dir, _DIR_FLAGS)
    try:
        deletes: list[dict[str, Any]] = [{"path": list(rel), "kind": kind, "ino": ino}
                   for rel, (kind, ino) in mounted.baseline.items() if rel not in plan.seen]
        # Files before directories, deepest first, so emptied directories can go too.
        deletes.sort(key=lambda item: (item["kind"] == "directory", -len(item["path"])))
        journal = {"dirs": plan.dirs, "puts": plan.puts, "deletes": deletes}
        _write_journal(run_fd, journal)
        host_fd = os.open(mounted.host, _DIR_FLAGS)
        try:
            staging_fd = os.open(STAGING_DIR, _DIR_FLAGS, dir_fd=host_fd)
            try:
                with _Lock(staging_fd, "publish.lock"):
                    published = _apply(journal, run_fd, host_fd, records=local)
            finally:
                os.close(staging_fd)
        finally:
            os.close(host_fd)
        for put in plan.puts:
            if tuple(put["path"]) in published:
                records.append(FileRecord(path=_guest(mounted, put["path"]), size=put["size"],
                                          sha256=put["sha256"]))
    finally:
        os.close(run_fd)
    mounted.discard()
    refused.extend(RefusedFile(path=_guest(mounted, item.path.split("/")), reason=item.reason)
                   for item in local)


def _guest(mounted: _Mounted, rel: Sequence[str]) -> str:
    return "/".join((mounted.mount.guest_path, *rel))


def _plan(mounted: _Mounted, dir_fd: int, rel: tuple[str, ...], plan: _Plan,
          inodes: set[int]) -> None:
    with os.scandir(dir_fd) as listing:
        names = sorted(entry.name for entry in listing)
    for name in names:
        path = (*rel, name)
        if path == (STAGING_DIR,):  # made by C code (c_access): never moved onto the real one
            plan.refused.append(RefusedFile(path=name, reason="a name wasibox reserves"))
            continue
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        baseline = mounted.baseline.get(path)
        if stat.S_ISDIR(st.st_mode) and len(path) > MAX_DEPTH:
            plan.refused.append(RefusedFile(path="/".join(path), reason="nested too deep"))
        elif stat.S_ISDIR(st.st_mode):
            plan.directories += 1
            if baseline is not None and baseline[0] == "directory":
                plan.seen.add(path)
            else:
                plan.dirs.append({"path": list(path),
                                  "mode": mounted.modes.get(st.st_ino, stat.S_IMODE(st.st_mode))})
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _plan(mounted, child, path, plan, inodes)
            finally:
                os.close(child)
        elif stat.S_ISREG(st.st_mode):
            if baseline == ("regular", st.st_ino) or (
                    baseline is not None and baseline[0] == "regular"
                    and mounted.copies.get(st.st_ino) == (path, st.st_size, st.st_mtime_ns)):
                plan.seen.add(path)  # the host's own file (or its private copy), unchanged
                plan.sizes[st.st_ino] = st.st_size
                continue
            if st.st_nlink > 1 and st.st_ino not in inodes:
                plan.refused.append(RefusedFile(path="/".join(path), reason="hard link"))
                continue
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
            try:
                digest = hashlib.sha256()
                size = 0
                while chunk := os.read(fd, _COPY_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            plan.sizes[st.st_ino] = size
            plan.puts.append({"path": list(path), "size": size, "sha256": digest.hexdigest(),
                              "ino": st.st_ino,
                              "mode": mounted.modes.get(st.st_ino, stat.S_IMODE(st.st_mode))})
        else:
            plan.refused.append(RefusedFile(path="/".join(path), reason=_refusal(st.st_mode)))


def _write_journal(run_fd: int, journal: dict[str, Any]) -> None:
    data = json.dumps(journal).encode()
    fd = os.open("journal.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600, dir_fd=run_fd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename("journal.tmp", "journal", src_dir_fd=run_fd, dst_dir_fd=run_fd)
    os.fsync(run_fd)


def _read_journal(run_fd: int) -> dict[str, Any] | None:
    try:
        fd = os.open("journal", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run_fd)
    except OSError:
        return None
    try:
        with os.fdopen(os.dup(fd), "rb") as handle:
            journal: dict[str, Any] = json.load(handle)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return journal


def _check_mode(mode: int) -> None:
    """Refuse (``EPERM``) set-id and sticky bits, which the host never grants, rather than
    drop them silently."""
    if mode & ~0o777:
        raise FilesError("perm")


def _owner_bits(st: os.stat_result) -> int:
    """What the disk keeps for the owner whatever the guest asks: the host must still read,
    list and publish what the guest made."""
    return 0o700 if stat.S_ISDIR(st.st_mode) else 0o600


def _remember_mode(mounted: _Mounted, st: os.stat_result, requested: int) -> None:
    """After a create: the mode the guest sees is the disk's (its umask applied) with the
    owner bits it asked for, which the disk may not have."""
    owner = _owner_bits(st)
    mode = (stat.S_IMODE(st.st_mode) & ~owner) | (requested & owner)
    if mode == stat.S_IMODE(st.st_mode):
        mounted.modes.pop(st.st_ino, None)  # a reused inode: nothing left from its old file
    else:
        mounted.modes[st.st_ino] = mode


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _set_mode(parent_fd: int, name: str, mode: int, flags: int) -> None:
    """chmod ``name`` in ``parent_fd`` without following a link; a failure is left alone
    (the content is what a publish guarantees; the mode is kept where the host allows)."""
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError:
        return
    try:
        os.chmod(fd, mode & 0o777)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Blocked(Exception):
    """A host path component is not a plain directory (a symlink, a file, ...)."""


def _walk_host(host_fd: int, parts: Sequence[str], create: bool) -> int:
    """A descriptor of the host directory ``parts``, walked with O_NOFOLLOW and made if
    ``create``. Raises _Blocked if a component is a link or not a directory."""
    fd = os.dup(host_fd)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise _Blocked(part) from None
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    raise _Blocked(part) from None
            except OSError:
                raise _Blocked(part) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _apply(journal: dict[str, Any], run_fd: int, host_fd: int,
           records: list[RefusedFile] | None) -> set[tuple[str, ...]]:
    """Carry out a publish journal (idempotently: a reclaim may repeat one); return the
    paths that were moved into place. Refusals are appended to ``records`` if given."""
    moved: set[tuple[str, ...]] = set()

    def refuse(path: Sequence[str], reason: str) -> None:
        if records is not None:
            records.append(RefusedFile(path="/".join(path), reason=reason))

    # Where the run changed a path's kind (a directory where the host has a file, or a file
    # where it has a directory), the old entry must go before the new one can take its
    # place, so those deletes come first. Every other delete waits for the puts: a changed
    # file is replaced by one rename, so readers never see it missing.
    dirs = {tuple(item["path"]) for item in journal["dirs"]}
    puts = {tuple(item["path"]) for item in journal["puts"]}

    def in_the_way(item: dict[str, Any]) -> bool:
        path = tuple(item["path"])
        if item["kind"] == "directory":
            return path in puts
        return path in dirs or any(path[:depth] in puts for depth in range(1, len(path)))

    for item in journal["deletes"]:
        if in_the_way(item):
            _delete(host_fd, item)
    for item in journal["dirs"]:
        parts = item["path"]
        try:
            os.close(_walk_host(host_fd, parts, create=True))
        except _Blocked:
            refuse(parts, "the host path is blocked by a link or a file")
    tree_fd = os.open("tree", _DIR_FLAGS, dir_fd=run_fd)
    try:
        for item in journal["puts"]:
            parts = item["path"]
            try:
                source = _walk_host(tree_fd, parts[:-1], create=False)
            except _Blocked:
                continue  # already moved by an earlier attempt
            try:
                try:
                    target = _walk_host(host_fd, parts[:-1], create=True)
                except _Blocked:
                    refuse(parts, "the host path is blocked by a link or a file")
                    continue
                try:
                    st = os.stat(parts[-1], dir_fd=source, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_ino != item["ino"]:
                        continue  # already moved (a reclaim), or changed after planning
                    if "mode" in item:  # the mode the guest saw, set before the file appears
                        _set_mode(source, parts[-1], item["mode"], _FILE_FLAGS)
                    os.rename(parts[-1], parts[-1], src_dir_fd=source, dst_dir_fd=target)
                    moved.add(tuple(parts))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    refuse(parts, f"the host refused it: {exc.strerror}")
                finally:
                    os.close(target)
            finally:
                os.close(source)
    finally:
        os.close(tree_fd)
    for item in journal["dirs"]:  # last, so files could still be moved into them
        try:
            parent = _walk_host(host_fd, item["path"][:-1], create=False)
        except _Blocked:
            continue
        try:
            _set_mode(parent, item["path"][-1], item["mode"], _DIR_FLAGS)
        finally:
            os.close(parent)
    for item in journal["deletes"]:
        if not in_the_way(item):
            _delete(host_fd, item)
    return moved


def _delete(host_fd: int, item: dict[str, Any]) -> None:
    """Remove what the run deleted from the host directory, if the host still holds the
    same entry there (files before directories: an emptied directory goes too)."""
    parts = item["path"]
    try:
        parent = _walk_host(host_fd, parts[:-1], create=False)
    except _Blocked:
        return
    try:
        st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        if st.st_ino != item["ino"] or (item["kind"] == "directory") != stat.S_ISDIR(
                st.st_mode):
            return  # replaced on the host since the run started: leave it
        if item["kind"] == "directory":
            os.rmdir(parts[-1], dir_fd=parent)
        else:
            os.unlink(parts[-1], dir_fd=parent)
    except OSError:
        pass  # gone already, or a directory that is not empty any more
    finally:
        os.close(parent)
