"""The guest's file operations during one run: ``FileSession``.

Guest paths are resolved lexically and matched to the mounts; every directory on the way is
opened with the one confinement walker (``walk.py``). Descriptors, the per-run quotas' checks
and the errors the guest sees (``FilesError``, a WIT ``error-code`` name) are kept here; a
writable mount's staging tree and its publishing are ``staging.py``'s. The threat the files
capability mediates, and what it guarantees, open this package
(``wasibox/capabilities/files/__init__.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..._result import FileRecord, RefusedFile
from .mount import MAX_DEPTH, STAGING_DIR, Mount
from .staging import Inode, Mounted, copy_file, plan_mount, publish_mount, tree_usage
from .walk import DIR_FLAGS, FILE_FLAGS, Blocked, blocked, walk

__all__ = [
    "FD_BASE",
    "F_APPEND",
    "F_CREATE",
    "F_DIRECTORY",
    "F_EXCL",
    "F_NOFOLLOW",
    "F_NOTDIR",
    "F_READ",
    "F_TRUNC",
    "F_WRITE",
    "MAX_LINKS",
    "MAX_NAME",
    "MAX_PATH",
    "MAX_READ",
    "FileSession",
    "FilesError",
    "StatInfo",
    "encodable",
]

#: The first descriptor number handed to the guest, far from its stdio descriptors.
FD_BASE = 256
#: Largest read served in one call; the guest's buffered reader asks for less.
MAX_READ = 16 * 2**20
#: Longest guest path, and longest name in it (in bytes of UTF-8), as Linux allows.
MAX_PATH = 4096
MAX_NAME = 255
#: How many symbolic links one lookup follows before it fails with ELOOP, as on Linux.
MAX_LINKS = 40

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


class FilesError(Exception):
    """An expected failure of a guest file operation; ``code`` is a WIT ``error-code`` name."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _from_os(exc: OSError) -> FilesError:
    return FilesError(_ERRNO_NAMES.get(exc.errno or 0, "io"))


def _check_length(path: str) -> None:
    """Refuse (``nametoolong``) a path or link target longer than Linux allows, or holding a
    longer name."""
    if len(path) > MAX_PATH or any(
            len(part.encode("utf-8", "surrogatepass")) > MAX_NAME for part in path.split("/")):
        raise FilesError("nametoolong")


def _link_target(dir_fd: int, name: str, *, missing_ok: bool) -> str | None:
    """The target of the symbolic link ``name`` in ``dir_fd``, or None if ``name`` is not a
    link (or, with ``missing_ok``, does not exist). A target that is empty or not text the
    guest could name leads nowhere (``noent``); one longer than Linux allows is refused
    (``nametoolong``). Raises FilesError."""
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL or (missing_ok and exc.errno == errno.ENOENT):
            return None
        raise _from_os(exc) from None
    if not target or "\x00" in target or not encodable(target):
        raise FilesError("noent")
    _check_length(target)
    return target


def _names(parts: list[str]) -> int:
    """How many of a path's components are not empty or ``.``."""
    return len(parts) - parts.count("") - parts.count(".")


#: How many directory descriptors one lookup keeps while it walks down (see _locate).
_HELD = 16


def _close_held(held: Sequence[int | None]) -> None:
    for fd in held:
        if fd is not None:
            os.close(fd)


def _walk_error(stop: Blocked) -> FilesError:
    """What the guest sees for a path the walker would not follow: ``loop`` for a symbolic
    link, ``notdir`` for anything else that is not a directory, else the open's own error."""
    if stop.error.errno in (errno.ENOTDIR, errno.ELOOP) and stop.is_link is not None:
        return FilesError("loop" if stop.is_link else "notdir")
    return _from_os(stop.error)


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


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class _Handle:
    """An open file description: one host descriptor, shared by every guest descriptor that
    ``dup`` made from the first (they share its position and flags, as on POSIX)."""

    __slots__ = ("fd", "mounted", "readable", "writable", "append", "is_dir", "inode", "refs")

    def __init__(self, fd: int, mounted: Mounted, readable: bool, writable: bool,
                 append: bool, is_dir: bool, inode: Inode | None = None) -> None:
        self.fd = fd
        self.mounted = mounted
        self.readable = readable
        self.writable = writable
        self.append = append
        self.is_dir = is_dir
        #: What the quotas count for it (None on a read-only mount and for a mount's root).
        self.inode = inode
        self.refs = 1  # guest descriptors that name it


def _height(parent_fd: int, name: str) -> int:
    """How many directory levels lie below directory ``name`` (0 if it holds none)."""
    height = 0
    for top, _, _, _ in os.fwalk(name, dir_fd=parent_fd):  # never follows links
        height = max(height, top.count("/"))
    return height


class FileSession:
    """The files one run can see: its mounts, open descriptors, quotas and staging.

    Every operation takes absolute guest paths and raises FilesError with an ``error-code``
    name for anything the guest did wrong; nothing else escapes for guest input. Used by one
    thread (the run's). ``close`` discards unpublished staging and is idempotent.
    """

    def __init__(self, mounts: Sequence[Mount], open_files: int) -> None:
        self._open_files = open_files
        self._handles: dict[int, _Handle] = {}
        self._mounted: list[Mounted] = []
        self._closed = False
        self._refused: list[RefusedFile] = []
        #: The directory holding the last name the latest lookup reached, as (mount, path
        #: inside it, descriptor): the operation's ``_parent`` takes it rather than walk
        #: the same path again.
        self._kept: tuple[Mounted, tuple[str, ...], int] | None = None
        self.published = False
        try:
            for index, mount in enumerate(mounts):
                mounted = Mounted(mount, index)
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
        self._by_parts = dict(self._table)

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
            used_bytes, used_files = tree_usage(
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

    def refuse(self, path: str, reason: str) -> RefusedFile:
        """Report a guest entry that will not be published (a backend whose guest writes its
        own copy of a mount finds these before anything reaches the staging tree)."""
        refused = RefusedFile(path=path, reason=reason)
        self._refused.append(refused)
        return refused

    def withdraw(self, refused: Sequence[RefusedFile]) -> None:
        """Forget refusals ``refuse`` reported, once each: a microVM session reports its
        mounts' whole state after every call, so only its latest report stands."""
        drop = collections.Counter(refused)
        kept = []
        for item in self._refused:
            if drop[item]:
                drop[item] -= 1
            else:
                kept.append(item)
        self._refused = kept

    # -- resolving paths --------------------------------------------------------------------
    def _locate(self, path: str, *, follow: bool = True, change: bool = False
                ) -> tuple[Mounted | None, tuple[str, ...], bool]:
        """(mount, path inside it, must be a directory); (None, parts, True) for a
        directory of the virtual tree above the mounts.

        ``path`` is resolved as Linux resolves it, but in the guest's namespace: ``..`` is the
        parent of what the path has reached so far, and a symbolic link met on the way (at
        the end too, with ``follow`` or a trailing ``/``) is read relative to its parent's
        descriptor and its target spliced into what is left of the path: a relative target
        from the link's directory, an absolute one from the guest's root, so it names the
        mount table, never the host's files. Every directory on the way is opened with
        ``DIR_FLAGS`` from the one before; the OS never follows a link. The result names no
        link but, without ``follow``, its last component. With ``change``, a new name in a
        directory of the virtual tree is refused (``acces``: it exists, read-only) rather
        than missing.

        Raises FilesError: ``inval`` for a path that is not absolute text, ``nametoolong``,
        ``noent``, ``notdir``, ``loop`` past MAX_LINKS links, or the open's own error.
        """
        if not isinstance(path, str) or "\x00" in path or not path.startswith("/"):
            raise FilesError("inval")
        _check_length(path)
        self._drop_kept()
        wants_dir = path.endswith(("/", "/.", "/..")) or path.rstrip("/") == ""
        pending = path.split("/")[::-1]  # the next component last
        names = _names(pending)  # how many of them are names (not "", ".")
        resolved: list[str] = []
        mounted: Mounted | None = None
        base = 0  # how many components of `resolved` name the mount
        # Inside a mount, descriptors of the directories from its root down to `resolved`
        # (the last is where the walk is), the highest let go (None) past _HELD of them:
        # ".." goes back to one held, and only past those walks again from the root.
        held: list[int | None] = []
        links = 0
        try:
            while pending:
                part = pending.pop()
                if part in ("", "."):
                    continue
                names -= 1
                if part == "..":
                    if resolved:
                        resolved.pop()
                    if mounted is not None:
                        _close_held(held[-1:])
                        del held[-1:]
                        if len(resolved) < base:
                            mounted = None
                        elif held[-1] is None:
                            _close_held(held)
                            held = self._hold(mounted, tuple(resolved[base:]))
                    continue
                last = not names
                if last and pending:
                    # A "/" follows the last name, in the path or a link's target: it must
                    # be a directory, so a link there is followed.
                    wants_dir = True
                if mounted is None:
                    resolved.append(part)
                    mounted = self._by_parts.get(tuple(resolved))
                    if mounted is not None:
                        base, held = len(resolved), [os.dup(mounted.root_fd)]
                    elif not self._virtual(tuple(resolved)):
                        raise FilesError("acces" if change and last else "noent")
                    continue
                if len(resolved) == base and part == STAGING_DIR:
                    # Hidden: missing to look at, and a name no change may take.
                    raise FilesError("acces" if change and last else "noent")
                fd = held[-1]
                assert fd is not None  # the last is always held
                target = None
                if last and (follow or wants_dir):
                    target = _link_target(fd, part, missing_ok=True)
                if last and target is None:
                    resolved.append(part)
                    held.pop()
                    self._kept = (mounted, tuple(resolved[base:-1]), fd)
                    break
                if not last:
                    try:
                        child = os.open(part, DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                            raise _from_os(exc) from None
                        target = _link_target(fd, part, missing_ok=False)
                        if target is None:
                            raise FilesError("notdir") from None
                    else:
                        held.append(child)
                        if len(held) > _HELD:
                            _close_held(held[-_HELD - 1:-_HELD])
                            held[-_HELD - 1] = None
                        resolved.append(part)
                        continue
                assert target is not None  # a link: the cases above continued or broke
                links += 1
                if links > MAX_LINKS:
                    raise FilesError("loop")
                spliced = target.split("/")
                pending.extend(reversed(spliced))
                names += _names(spliced)
                if target.startswith("/"):
                    resolved.clear()
                    mounted = None
                    _close_held(held)
                    held = []
        finally:
            _close_held(held)
        if mounted is None:
            return None, tuple(resolved), True
        return mounted, tuple(resolved[base:]), wants_dir

    def _virtual(self, parts: tuple[str, ...]) -> bool:
        """Whether ``parts`` is a directory of the virtual tree above the mounts."""
        return any(prefix[:len(parts)] == parts for prefix, _ in self._table)

    def _hold(self, mounted: Mounted, rel: tuple[str, ...]) -> list[int | None]:
        """``_locate``'s held descriptors for the directory ``rel``: the last _HELD of the
        directories from the mount's root down to it, walked again from the root."""
        first = max(0, len(rel) + 1 - _HELD)
        held: list[int | None] = [None] * first
        held.append(self._walk_to(mounted, rel[:first]))
        try:
            for part in rel[first:]:
                fd = held[-1]
                assert fd is not None
                held.append(walk(fd, (part,), hidden=STAGING_DIR))
        except Blocked as stop:
            _close_held(held)
            raise _walk_error(stop) from None
        except BaseException:
            _close_held(held)
            raise
        return held

    @staticmethod
    def _walk_to(mounted: Mounted, rel: tuple[str, ...]) -> int:
        """A descriptor of the directory ``rel`` of ``mounted``, walked without following
        anything (the staging directory does not exist for the guest). The caller closes it.
        Raises FilesError."""
        try:
            return walk(mounted.root_fd, rel, hidden=STAGING_DIR)
        except Blocked as stop:
            raise _walk_error(stop) from None

    def _parent(self, mounted: Mounted, rel: tuple[str, ...]) -> int:
        """A descriptor of the directory holding ``rel[-1]`` (see ``_walk_to``): the one
        the lookup kept, if it is that directory."""
        kept, self._kept = self._kept, None
        if kept is not None:
            if kept[0] is mounted and kept[1] == rel[:-1]:
                return kept[2]
            os.close(kept[2])
        return self._walk_to(mounted, rel[:-1])

    def _drop_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            os.close(kept[2])

    def _lstat(self, mounted: Mounted, rel: tuple[str, ...]) -> os.stat_result:
        if not rel:
            return os.fstat(mounted.root_fd)
        parent = self._parent(mounted, rel)
        try:
            return os.stat(rel[-1], dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)

    def _info(self, st: os.stat_result, mounted: Mounted) -> StatInfo:
        # A read-only mount shows no write permission, so os.access and friends tell the truth.
        mode = mounted.modes.get(st.st_ino, stat.S_IMODE(st.st_mode))
        mode &= 0o7777 if mounted.writable else ~0o222
        return StatInfo(kind=_kind(st.st_mode), mode=mode, size=st.st_size,
                        ino=st.st_ino, dev=mounted.dev, nlink=st.st_nlink, atime=st.st_atime_ns,
                        mtime=st.st_mtime_ns, ctime=st.st_ctime_ns)

    def _mutable(self, path: str, *, follow: bool
                 ) -> tuple[Mounted, tuple[str, ...], bool]:
        """``_locate`` for a change: refused (``acces``) in the virtual tree above the
        mounts, ``rofs`` on a read-only mount."""
        mounted, rel, wants_dir = self._locate(path, follow=follow, change=True)
        if mounted is None:
            raise FilesError("acces")
        if not mounted.writable:
            raise FilesError("rofs")
        return mounted, rel, wants_dir

    # -- operations on paths ----------------------------------------------------------------
    def stat(self, path: str, follow: bool = True) -> StatInfo:
        """The status of ``path``; of what a final symbolic link names if ``follow``."""
        mounted, rel, wants_dir = self._locate(path, follow=follow)
        if mounted is None:
            return StatInfo(kind="directory", mode=0o555, size=0, ino=0, dev=0, nlink=2,
                            atime=0, mtime=0, ctime=0)
        st = self._guarded(lambda: self._lstat(mounted, rel))
        if wants_dir and not stat.S_ISDIR(st.st_mode):
            raise FilesError("loop" if stat.S_ISLNK(st.st_mode) else "notdir")
        return self._info(st, mounted)

    def readdir(self, path: str) -> str:
        mounted, parts, _ = self._locate(path)
        if mounted is None:
            names = sorted({prefix[len(parts)] for prefix, _ in self._table
                            if len(prefix) > len(parts) and prefix[:len(parts)] == parts})
            return "/".join("d" + name for name in names)
        fd = self._open_dir(mounted, parts)
        try:
            entries = []
            with os.scandir(fd) as listing:
                for entry in listing:
                    name = entry.name
                    if name == STAGING_DIR or not encodable(name):
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

    def _open_dir(self, mounted: Mounted, rel: tuple[str, ...]) -> int:
        if not rel:
            return os.dup(mounted.root_fd)
        parent = self._parent(mounted, rel)
        try:
            return os.open(rel[-1], DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise _walk_error(blocked(parent, rel[-1], exc)) from None
        finally:
            os.close(parent)

    def mkdir(self, path: str, mode: int) -> None:
        mounted, rel, _ = self._mutable(path, follow=False)
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
        mounted, rel, wants_dir = self._mutable(path, follow=False)
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
        mounted, rel, _ = self._mutable(path, follow=False)
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
        source, src_rel, _ = self._locate(src, follow=False)
        target, dst_rel, _ = self._locate(dst, follow=False, change=True)
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
        """Set the permission bits of ``path`` (of what a final link names, as chmod(2)
        does: Linux cannot change a link's own mode)."""
        mounted, rel, _ = self._mutable(path, follow=True)

        def change(fd: int, st: os.stat_result) -> None:
            _check_mode(mode)
            os.chmod(fd, mode | _owner_bits(st))
            mounted.modes[st.st_ino] = mode

        self._with_own_inode(mounted, rel, change)

    def utime(self, path: str, atime: int, mtime: int, follow: bool = True) -> None:
        """Set the access and modification times of ``path`` (nanoseconds); without
        ``follow``, of a final symbolic link itself. The backend turns the guest's "now"
        into its run's clock's time, never the host's. Raises FilesError."""
        mounted, rel, _ = self._mutable(path, follow=follow)
        if not follow and rel:
            parent = self._parent(mounted, rel)
            try:
                name = rel[-1]
                st = self._guarded(lambda: os.stat(name, dir_fd=parent, follow_symlinks=False))
                if stat.S_ISLNK(st.st_mode):
                    # A link the guest made in the staging tree (the host's own are never
                    # staged): utimensat changes the link and never follows it.
                    self._guarded(lambda: os.utime(name, ns=(atime, mtime), dir_fd=parent,
                                                   follow_symlinks=False))
                    return
            finally:
                os.close(parent)
        self._with_own_inode(mounted, rel, lambda fd, st: os.utime(fd, ns=(atime, mtime)))

    def link(self, src: str, dst: str) -> None:
        """Hard links cannot be made (``perm``): one would tie a host file to the view."""
        self._locate(src, follow=False)
        self._locate(dst, follow=False)
        raise FilesError("perm")

    def symlink(self, target: str, path: str) -> None:
        """Make ``path`` a symbolic link holding ``target``, on a writable mount.

        The target is stored as given and only ever read back by ``_locate``, in the guest's
        namespace, so it may say anything: a link counts as a file against the quota.
        Raises FilesError: ``noent`` for an empty target, ``inval`` for one that is not
        encodable text, ``nametoolong`` for one of ``MAX_PATH`` bytes or more (its names
        may be of any length until it is followed, as on Linux), ``exist`` if ``path``
        names anything (a dangling link too), ``dquot``, or ``_locate``'s errors.
        """
        mounted, rel, wants_dir = self._mutable(path, follow=False)
        if not isinstance(target, str) or "\x00" in target or not encodable(target):
            raise FilesError("inval")
        if not target:
            raise FilesError("noent")
        if len(target.encode("utf-8")) >= MAX_PATH:
            raise FilesError("nametoolong")
        if not rel:
            raise FilesError("exist")
        parent = self._parent(mounted, rel)
        try:
            name = rel[-1]
            if _exists(parent, name):
                raise FilesError("exist")
            if wants_dir:
                raise FilesError("noent")  # as Linux: a new link's name cannot end in "/"
            self._charge_file(mounted, rel)
            os.symlink(target, name, dir_fd=parent)
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            mounted.linked(st)
            mounted.modes.pop(st.st_ino, None)  # a reused inode: a link's mode is 0o777
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)

    def readlink(self, path: str) -> str:
        """The target of the symbolic link ``path``; ``inval`` if it is not one."""
        mounted, rel, _ = self._locate(path, follow=False)
        if mounted is None or not rel:
            raise FilesError("inval")
        parent = self._parent(mounted, rel)
        try:
            target = os.readlink(rel[-1], dir_fd=parent)
        except OSError as exc:
            raise _from_os(exc) from None
        finally:
            os.close(parent)
        if not encodable(target):
            raise FilesError("inval")
        return target

    def _with_own_inode(self, mounted: Mounted, rel: tuple[str, ...],
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
            flags = DIR_FLAGS if stat.S_ISDIR(st.st_mode) else FILE_FLAGS
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

    def _copy_up(self, mounted: Mounted, parent: int, name: str) -> None:
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
            copied = copy_file(src, st, parent, temp)
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
    def _reopen(handle: _Handle, parent: int, name: str, inode: Inode) -> None:
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

    def _charge_file(self, mounted: Mounted, rel: tuple[str, ...]) -> None:
        if len(rel) > MAX_DEPTH:
            raise FilesError("nametoolong")
        if mounted.used_files >= mounted.mount.quota_files:
            raise FilesError("dquot")

    # -- descriptors ------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int) -> int:
        if len(self._handles) >= self._open_files:
            raise FilesError("mfile")
        writing = bool(flags & (F_WRITE | F_CREATE | F_TRUNC | F_APPEND))
        # As open(2): a final link is followed (a dangling one is created through) unless
        # O_NOFOLLOW, or O_CREAT | O_EXCL, which fails on any name that exists.
        follow = not (flags & F_NOFOLLOW or (flags & F_CREATE and flags & F_EXCL))
        mounted, rel, wants_dir = self._locate(path, follow=follow, change=writing)
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
                raise _walk_error(blocked(parent, name, exc)) from None
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
        return self._data(handle, data)

    def pread(self, fd: int, size: int, offset: int) -> str:
        """Read at ``offset`` without moving the descriptor's position."""
        handle = self._readable(fd)
        if offset < 0:
            raise FilesError("inval")
        data = self._guarded(lambda: os.pread(handle.fd, min(size, MAX_READ), offset))
        return self._data(handle, data)

    def _readable(self, fd: int) -> _Handle:
        handle = self._handle(fd)
        if not handle.readable:
            raise FilesError("badf")
        return handle

    @staticmethod
    def _data(handle: _Handle, data: bytes) -> str:
        # A directory is read like a file, so that the host's own file system says how it
        # fails (ext4: EISDIR, or EINVAL where position + size passes the largest offset);
        # should a read of one ever succeed, the guest still gets no directory bytes.
        if handle.is_dir:
            raise FilesError("isdir")
        return str(data.decode("latin-1"))

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
            plans = [(mounted, plan_mount(mounted)) for mounted in self._mounted
                     if mounted.tree is not None]
            for mounted, plan in plans:
                publish_mount(mounted, plan, records, refused)
        finally:
            self.published = True
            self.close()
        return records, refused

    def close(self) -> None:
        """Close every descriptor and discard unpublished staging. Idempotent."""
        self._drop_kept()
        if self._closed:
            return
        self._closed = True
        self._close_handles()
        for mounted in self._mounted:
            mounted.discard()
            mounted.close()


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_mode(mode: int) -> None:
    """Refuse (``EPERM``) set-id and sticky bits, which the host never grants, rather than
    drop them silently."""
    if mode & ~0o777:
        raise FilesError("perm")


def _owner_bits(st: os.stat_result) -> int:
    """What the disk keeps for the owner whatever the guest asks: the host must still read,
    list and publish what the guest made."""
    return 0o700 if stat.S_ISDIR(st.st_mode) else 0o600


def _remember_mode(mounted: Mounted, st: os.stat_result, requested: int) -> None:
    """After a create: the mode the guest sees is the disk's (its umask applied) with the
    owner bits it asked for, which the disk may not have."""
    owner = _owner_bits(st)
    mode = (stat.S_IMODE(st.st_mode) & ~owner) | (requested & owner)
    if mode == stat.S_IMODE(st.st_mode):
        mounted.modes.pop(st.st_ino, None)  # a reused inode: nothing left from its old file
    else:
        mounted.modes[st.st_ino] = mode
