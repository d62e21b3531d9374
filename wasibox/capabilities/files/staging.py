"""A writable mount's staging: the per-run tree of hard links to the mount's files, its quota
accounting, the journal, and publishing into the host directory when the run ends ok (or
reclaiming what a process that died left behind).

The threat the files capability mediates, and what it guarantees, open this package
(``wasibox/capabilities/files/__init__.py``).
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._errors import UsageError
from ..._result import FileRecord, RefusedFile
from .mount import MAX_DEPTH, STAGING_DIR, Mount
from .refusals import refusal
from .walk import DIR_FLAGS, FILE_FLAGS, Blocked, walk

__all__ = [
    "COPY_CHUNK",
    "STAGING_README",
    "copy_file",
    "Inode",
    "Mounted",
    "Plan",
    "QuotaExceeded",
    "plan_mount",
    "publish_mount",
    "tree_usage",
]

#: The size of one read or write when the host copies or digests a file.
COPY_CHUNK = 1 << 20


class QuotaExceeded(Exception):
    """A writable mount's staging tree holds more than its quotas allow; nothing of the run
    is published (``_sandbox.run_with_files`` reports it as the run's ``OSError``)."""


class Inode:
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
        self.opens = 0  # open file descriptions (_Handle in session.py) that hold it


class Mounted:
    """One mount during one run: its root descriptor and, if writable, its staging."""

    def __init__(self, mount: Mount, index: int) -> None:
        self.mount = mount
        self.dev = index + 1
        self.writable = mount.writable
        self.scratch = mount.host_path is None
        self.host = (Path(tempfile.mkdtemp(prefix="wasibox-scratch-")) if mount.host_path is None
                     else Path(mount.host_path))
        self.host_fd = os.open(self.host, DIR_FLAGS)
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
        #: the host needs (see _owner_bits in session.py); shown by stat and published with
        #: the file.
        self.modes: dict[int, int] = {}
        #: What the quotas count, by inode number of the guest view (see Inode), and the
        #: sum of their sizes.
        self.inodes: dict[int, Inode] = {}
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

    def linked(self, st: os.stat_result) -> Inode:
        """Count one more name in the view linking to the file ``st`` describes."""
        inode = self.inodes.get(st.st_ino)
        if inode is None:
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            inode = self.inodes[st.st_ino] = Inode(st.st_ino, size)
            self.used_bytes += size
        inode.links += 1
        return inode

    def opened(self, st: os.stat_result) -> Inode:
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

    def closed(self, inode: Inode) -> None:
        inode.opens -= 1
        self.forget_if_unused(inode)

    def forget_if_unused(self, inode: Inode) -> None:
        if inode.links <= 0 and inode.opens <= 0 and self.inodes.get(inode.ino) is inode:
            del self.inodes[inode.ino]
            self.used_bytes -= inode.size

    def resize(self, inode: Inode, size: int) -> None:
        self.used_bytes += size - inode.size
        inode.size = size

    def cap(self, inode: Inode) -> int:
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
                run_fd = os.open(name, DIR_FLAGS, dir_fd=staging)
                try:
                    self.lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                           | os.O_CLOEXEC, 0o600, dir_fd=run_fd)
                    fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
                    os.mkdir("tree", 0o755, dir_fd=run_fd)
                    self.root_fd = os.open("tree", DIR_FLAGS, dir_fd=run_fd)
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
                    child = os.open(name, DIR_FLAGS, dir_fd=src_fd)
                except OSError:
                    continue  # changed under us, or unreadable: not part of the guest's view
                try:
                    os.mkdir(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=dst_fd)
                    copy = os.open(name, DIR_FLAGS, dir_fd=dst_fd)
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
        src = os.open(name, FILE_FLAGS, dir_fd=src_fd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.ENXIO, "not a regular file")
            copied = copy_file(src, st, dst_fd, name)
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
        """Remove this run's staging directory, or its scratch directory (before ``close``:
        the staging goes while its lock is held, see ``_remove_run``)."""
        if self.scratch:
            shutil.rmtree(self.host, ignore_errors=True)
        if self.run_dir is not None:
            try:
                staging = os.open(self.run_dir.parent, DIR_FLAGS)
            except OSError:
                pass  # the staging directory went with the mount's host directory
            else:
                try:
                    _remove_run(staging, self.run_dir.name)
                finally:
                    os.close(staging)
            self.run_dir = None


def copy_file(src: int, st: os.stat_result, dir_fd: int, name: str) -> os.stat_result:
    """Copy the open file ``src``, whose status is ``st``, into a new file ``name`` in
    ``dir_fd`` (never through a link, never over an existing name), with its mode (and the
    owner's read and write) and its times; return the new file's status. Raises OSError."""
    dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  stat.S_IMODE(st.st_mode) | 0o600, dir_fd=dir_fd)
    try:
        while chunk := os.read(src, COPY_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view):]
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        return os.fstat(dst)
    finally:
        os.close(dst)


def _open_staging(host_fd: int) -> int:
    try:
        os.mkdir(STAGING_DIR, 0o700, dir_fd=host_fd)
    except FileExistsError:
        pass
    try:
        staging_fd = os.open(STAGING_DIR, DIR_FLAGS, dir_fd=host_fd)
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
    host_fd = os.open("..", DIR_FLAGS, dir_fd=staging_fd)
    try:
        _reclaim_runs(staging_fd, host_fd)
    finally:
        os.close(host_fd)


def _reclaim_runs(staging_fd: int, host_fd: int) -> None:
    for name in os.listdir(staging_fd):
        if not name.startswith("run-"):
            continue
        try:
            run_fd = os.open(name, DIR_FLAGS, dir_fd=staging_fd)
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
        _remove_run(staging_fd, name)


def _remove_run(staging_fd: int, name: str) -> None:
    """Remove the run directory ``name``: its journal first, its lock file last.

    Its owner removes it with its lock still held, so a reclaimer that finds the directory
    meanwhile either finds the lock file, and held, or finds no journal left to carry out;
    it never takes a directory being removed for a dead run's and publishes it again (from
    a tree already gone). A removal cut short (the process died) leaves the lock file, so
    the next reclaim finishes it, and never a tree without its journal's lock."""
    try:
        run_fd = os.open(name, DIR_FLAGS, dir_fd=staging_fd)
    except OSError:
        return  # removed already (by its owner, or a reclaim)
    try:
        entries = sorted(os.listdir(run_fd), key=lambda entry: (entry == "lock",
                                                                 entry != "journal"))
        for entry in entries:
            try:
                if stat.S_ISDIR(os.stat(entry, dir_fd=run_fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(entry, dir_fd=run_fd)
                else:
                    os.unlink(entry, dir_fd=run_fd)
            except OSError:
                pass  # gone already, or kept from the host by what a guest made of it
    finally:
        os.close(run_fd)
    try:
        os.rmdir(name, dir_fd=staging_fd)
    except OSError:
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


# -- publishing ------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
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


def plan_mount(mounted: Mounted) -> Plan:
    """Walk a staging tree, digest what changed, and check the result against the quotas.

    Raises QuotaExceeded if the mount would hold more bytes or files than its quotas allow
    (or than it held at the start, if that was more).
    """
    assert mounted.run_dir is not None
    plan = Plan()
    run_fd = os.open(mounted.run_dir, DIR_FLAGS)
    try:
        tree_fd = os.open("tree", DIR_FLAGS, dir_fd=run_fd)
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


def tree_usage(root: Path, max_entries: int) -> tuple[int, int]:
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


def publish_mount(mounted: Mounted, plan: Plan, records: list[FileRecord],
             refused: list[RefusedFile]) -> None:
    assert mounted.run_dir is not None
    local = plan.refused  # paths relative to the mount until the end
    run_fd = os.open(mounted.run_dir, DIR_FLAGS)
    try:
        deletes: list[dict[str, Any]] = [{"path": list(rel), "kind": kind, "ino": ino}
                   for rel, (kind, ino) in mounted.baseline.items() if rel not in plan.seen]
        # Files before directories, deepest first, so emptied directories can go too.
        deletes.sort(key=lambda item: (item["kind"] == "directory", -len(item["path"])))
        journal = {"dirs": plan.dirs, "puts": plan.puts, "deletes": deletes}
        _write_journal(run_fd, journal)
        host_fd = os.open(mounted.host, DIR_FLAGS)
        try:
            staging_fd = os.open(STAGING_DIR, DIR_FLAGS, dir_fd=host_fd)
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


def _guest(mounted: Mounted, rel: Sequence[str]) -> str:
    return "/".join((mounted.mount.guest_path, *rel))


def _plan(mounted: Mounted, dir_fd: int, rel: tuple[str, ...], plan: Plan,
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
            child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
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
            fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
            try:
                digest = hashlib.sha256()
                size = 0
                while chunk := os.read(fd, COPY_CHUNK):
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
            plan.refused.append(RefusedFile(path="/".join(path), reason=refusal(st.st_mode)))


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
            os.close(walk(host_fd, parts, create=True))
        except Blocked:
            refuse(parts, "the host path is blocked by a link or a file")
    tree_fd = os.open("tree", DIR_FLAGS, dir_fd=run_fd)
    try:
        for item in journal["puts"]:
            parts = item["path"]
            try:
                source = walk(tree_fd, parts[:-1])
            except Blocked:
                continue  # already moved by an earlier attempt
            try:
                try:
                    target = walk(host_fd, parts[:-1], create=True)
                except Blocked:
                    refuse(parts, "the host path is blocked by a link or a file")
                    continue
                try:
                    st = os.stat(parts[-1], dir_fd=source, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_ino != item["ino"]:
                        continue  # already moved (a reclaim), or changed after planning
                    if "mode" in item:  # the mode the guest saw, set before the file appears
                        _set_mode(source, parts[-1], item["mode"], FILE_FLAGS)
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
            parent = walk(host_fd, item["path"][:-1])
        except Blocked:
            continue
        try:
            _set_mode(parent, item["path"][-1], item["mode"], DIR_FLAGS)
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
        parent = walk(host_fd, parts[:-1])
    except Blocked:
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
