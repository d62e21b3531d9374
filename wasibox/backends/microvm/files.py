"""Mounts for the microVM backend: copied into the VM, and its changes applied to the staging.

**The threat it mediates.** The guest is a whole VM whose kernel the guest code may own, so
everything that comes back from it is hostile: names with ``..``, absolute paths, links,
special files, more data than the quota, frames out of order. It must not be able to read
or change a host file outside its mounts, make the host follow anything it created, or get
a partial result published.

**How.** The VM gets no host directory or disk. Before the run, :class:`CopyIn` walks each
mount's guest view, exactly as the wasm backend's ``FileSession`` presents it (the host
directory of a read-only mount, the per-run staging tree of a writable one, nothing for a
scratch mount), without following anything, and sends its contents over the VM's channel
in bounded frames; the agent rebuilds them in tmpfs at the same guest paths
(``guest/microvm/wasibox_vm_files.py``). What the wasm guest could not see is not sent:
names that are not UTF-8 and the staging directory; in a writable mount, links and special
files (``FileSession`` never stages them). A read-only mount's symlinks are sent as
symlinks (they cannot be followed in the VM either) and its special files as unopenable
placeholders.

After the run, :class:`CopyOut` takes the guest's account of each writable mount and
applies it to that mount's staging tree: new and changed files are written to fresh files
and renamed into place (a staged hard link to a host file is replaced, never written
through), directories are made, and what the guest deleted is removed. It checks every
name (one component at a time: no ``..``, ``.``, empty or over-long names, no NUL, not the
staging directory, at most ``MAX_DEPTH`` deep), walks the staging tree one component at a
time with ``O_NOFOLLOW``, creates only regular files and directories, and counts bytes and
entries against the mount's quota as they arrive. Anything the guest made that the wasm
guest cannot (symlinks, FIFOs, sockets, devices, extra hard links) is reported in
``RunResult.files_refused`` and never reaches the host. Publishing is then the wasm
backend's own: ``run_with_files`` calls ``FileSession.publish`` if and only if the run
ended ok, so a run that hit a limit, was killed or broke the protocol publishes nothing.

**Limits.** The copy-in is bounded before the VM starts (:func:`copy_in_caps`): the VM
holds mounts in its RAM, so their contents may take at most a quarter of ``memory_bytes``
and ``MAX_COPY_ENTRIES`` entries (UsageError otherwise, before anything runs). A writable
mount's tmpfs in the VM admits at least what the wasm backend's quota admits (its bytes
plus a page per file); the exact quota (bytes and entries, with the wasm backend's rule
that a mount already over it may not grow) is checked when the changes come back, and again
by publishing, on what the staging tree then holds; a run over it fails with an ``OSError``
and publishes nothing. On wasm the write itself would
fail with ``ENOSPC``; this is the one difference a program can see. Both copies happen
inside the run's ``timeout_s``: a run whose copy is cut short by it reports ``"timeout"``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import Any

from ..._errors import UsageError
from ..._result import RefusedFile
from ...capabilities.files.mount import MAX_DEPTH, STAGING_DIR, Mount
from ...capabilities.files.session import MAX_NAME, MAX_PATH, FileSession, encodable
from ...capabilities.files.staging import QuotaExceeded
from ...capabilities.files.walk import DIR_FLAGS, FILE_FLAGS, Blocked, walk

__all__ = ["MAX_COPY_ENTRIES", "CopyIn", "CopyOut", "QuotaExceeded", "copy_in_caps"]

#: Most entries (files, directories, links) copied into one VM.
MAX_COPY_ENTRIES = 20_000
#: Data in one frame, either way; the channel caps frames far above this.
FRAME_DATA = 1 << 20
#: Entries in one frame (the host decodes arrays of at most 1024 items from the guest).
FRAME_ENTRIES = 512
PAGE = 4096


def copy_in_caps(memory_bytes: int) -> tuple[int, int]:
    """(bytes, entries) the mounts of one run may hold in a VM of ``memory_bytes``."""
    return memory_bytes // 4, MAX_COPY_ENTRIES


@dataclasses.dataclass
class _Entry:
    kind: str  # "d", "f", "l" or "o"
    parts: tuple[str, ...]
    mode: int = 0
    mtime_ns: int = 0
    size: int = 0
    target: bytes = b""


@dataclasses.dataclass
class _View:
    mount: Mount
    root_fd: int | None
    entries: list[_Entry]
    #: Entries copied in, by path, with their kind (what the guest can delete).
    sent: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
    bytes: int = 0

    @property
    def collect(self) -> bool:
        return self.mount.writable and self.root_fd is not None


class CopyIn:
    """What one run's mounts hold, walked before the VM starts; sent as frames.

    Raises UsageError if the mounts hold more than a VM of ``memory_bytes`` takes, or a
    read-only mount is nested deeper than ``MAX_DEPTH`` directories.
    """

    def __init__(self, session: FileSession, memory_bytes: int) -> None:
        cap_bytes, cap_entries = copy_in_caps(memory_bytes)
        self.views: list[_View] = []
        total_bytes = total_entries = 0
        for mount, root_fd in session.views():
            entries: list[_Entry] = []
            if root_fd is not None:
                self._walk(root_fd, (), mount, entries)
            view = _View(mount, root_fd, entries,
                         bytes=sum(entry.size for entry in entries))
            self.views.append(view)
            total_bytes += view.bytes
            total_entries += len(entries)
        if total_bytes > cap_bytes or total_entries > cap_entries:
            raise UsageError(
                f"the mounts hold {total_bytes} bytes in {total_entries} entries; the "
                f"microVM copies them into its RAM and takes at most {cap_bytes} bytes (a "
                f"quarter of memory_bytes) and {cap_entries} entries. Raise "
                "Limits.memory_bytes, mount less, or run on backend='wasm'")

    def _walk(self, dir_fd: int, rel: tuple[str, ...], mount: Mount,
              out: list[_Entry]) -> None:
        with os.scandir(dir_fd) as listing:
            found = sorted((entry.name, entry.stat(follow_symlinks=False))
                           for entry in listing)
        for name, st in found:
            if not encodable(name) or (not rel and name == STAGING_DIR):
                continue  # the wasm guest cannot see these either
            parts = (*rel, name)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if len(parts) > MAX_DEPTH:
                    if mount.writable:
                        continue  # never staged
                    raise UsageError(
                        f"the mount {mount.guest_path!r} is nested deeper than {MAX_DEPTH} "
                        "directories, which the microVM does not copy; run on "
                        "backend='wasm'")
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # changed under us, or unreadable: not part of the view
                try:
                    out.append(_Entry("d", parts, stat.S_IMODE(mode), st.st_mtime_ns))
                    self._walk(child, parts, mount, out)
                finally:
                    os.close(child)
            elif stat.S_ISREG(mode):
                out.append(_Entry("f", parts, stat.S_IMODE(mode), st.st_mtime_ns,
                                  st.st_size))
            elif mount.writable:
                continue  # links and special files are never staged
            elif stat.S_ISLNK(mode):
                try:
                    target = os.readlink(name, dir_fd=dir_fd)
                except OSError:
                    continue
                out.append(_Entry("l", parts, target=os.fsencode(target)))
            else:
                out.append(_Entry("o", parts))

    def specs(self) -> list[dict[str, Any]]:
        """The mount table the agent builds, in the run request."""
        specs = []
        for view in self.views:
            mount = view.mount
            spec: dict[str, Any] = {"path": mount.guest_path, "writable": mount.writable,
                                    "collect": view.collect, "mode": 0o755}
            if view.root_fd is not None:
                spec["mode"] = stat.S_IMODE(os.fstat(view.root_fd).st_mode)
            if mount.writable:
                cap_bytes, cap_files = self.caps(view)
                spec.update(cap_bytes=cap_bytes, cap_files=cap_files,
                            size=cap_bytes + PAGE * (cap_files + 1), inodes=cap_files + 1)
            specs.append(spec)
        return specs

    @staticmethod
    def caps(view: _View) -> tuple[int, int]:
        """The quota a writable mount's final state must fit: as on wasm, a mount that
        already holds more than its quota may keep it, but not grow."""
        mount = view.mount
        return (max(int(mount.quota_bytes), view.bytes),
                max(mount.quota_files, len(view.entries)))

    def frames(self) -> Iterator[dict[str, Any]]:
        """The copy-in, as ``files`` frames; each file is read when its turn comes."""
        for index, view in enumerate(self.views):
            if view.root_fd is None:
                continue
            batch: list[list[Any]] = []
            size = 0
            for entry in view.entries:
                rel = "/".join(entry.parts)
                if entry.kind == "d":
                    batch.append(["d", rel, entry.mode, entry.mtime_ns])
                elif entry.kind == "l":
                    batch.append(["l", rel, entry.target])
                elif entry.kind == "o":
                    batch.append(["o", rel])
                else:
                    for chunk, last in _read(view.root_fd, entry):
                        batch.append(["f", rel, entry.mode, entry.mtime_ns, chunk, last])
                        size += len(chunk)
                        if size >= FRAME_DATA or len(batch) >= FRAME_ENTRIES:
                            yield {"kind": "files", "mount": index, "entries": batch}
                            batch, size = [], 0
                view.sent[entry.parts] = entry.kind
                if len(batch) >= FRAME_ENTRIES:
                    yield {"kind": "files", "mount": index, "entries": batch}
                    batch, size = [], 0
            if batch:
                yield {"kind": "files", "mount": index, "entries": batch}


def _read(root_fd: int, entry: _Entry) -> Iterator[tuple[bytes, bool]]:
    """A file's data in chunks, at most its planned size; walked without following links.
    A file that has gone or changed kind since the walk reads as empty."""
    try:
        parent = walk(root_fd, entry.parts[:-1])
    except Blocked:
        yield b"", True
        return
    try:
        fd = os.open(entry.parts[-1], FILE_FLAGS, dir_fd=parent)
    except OSError:
        yield b"", True
        return
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield b"", True
            return
        left = entry.size
        chunk = os.read(fd, min(left, FRAME_DATA))
        while True:
            left -= len(chunk)
            following = os.read(fd, min(left, FRAME_DATA)) if chunk and left > 0 else b""
            yield chunk, not following
            if not following:
                return
            chunk = following
    finally:
        os.close(fd)


class _Writing:
    """A file being received: a fresh file in the staging tree, renamed into place at its
    last chunk."""

    def __init__(self, parent: int, parts: tuple[str, ...], mode: int) -> None:
        self.parent = parent
        self.parts = parts
        self.mode = mode
        self.temp = f".wasibox-vm-{uuid.uuid4().hex}"
        self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600, dir_fd=parent)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> None:
        os.fchmod(self.fd, (self.mode & 0o777) | 0o600)
        os.close(self.fd)
        self.fd = -1
        name = self.parts[-1]
        try:
            st: os.stat_result | None = os.stat(name, dir_fd=self.parent,
                                                follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.parent)  # the guest replaced a directory
        os.rename(self.temp, name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
        os.close(self.parent)
        self.parent = -1

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.parent >= 0:
            try:
                os.unlink(self.temp, dir_fd=self.parent)
            except OSError:
                pass
            os.close(self.parent)
            self.parent = -1


@dataclasses.dataclass
class _Target:
    view: _View
    root_fd: int
    cap_bytes: int
    cap_files: int
    #: Paths the guest reported, and those plus their parents (what it still holds).
    reported: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    mentioned: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    #: The kind of each file and directory the staging holds once this account is applied.
    held: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    files: int = 0


class CopyOut:
    """Applies the guest's account of its writable mounts to their staging trees.

    ``apply`` raises ValueError for a frame that breaks the protocol and QuotaExceeded for
    a mount over its quota; the caller then fails the run, so nothing is published.
    ``finish`` removes what the guest deleted. ``close`` (idempotent) abandons a file half
    received.
    """

    def __init__(self, session: FileSession, copy_in: CopyIn) -> None:
        self.session = session
        self.targets: dict[int, _Target] = {}
        for index, view in enumerate(copy_in.views):
            if view.collect:
                assert view.root_fd is not None
                cap_bytes, cap_files = CopyIn.caps(view)
                self.targets[index] = _Target(view, view.root_fd, cap_bytes, cap_files)
        self._writing: _Writing | None = None
        self._writing_mount = -1
        #: What this account refused (a session withdraws it when the next one comes).
        self.refused: list[RefusedFile] = []

    def apply(self, frame: dict[str, Any]) -> None:
        index, entries = frame.get("mount"), frame.get("entries")
        if type(index) is not int or index not in self.targets or not isinstance(entries,
                                                                                 list):
            raise ValueError("a malformed files frame")
        target = self.targets[index]
        for entry in entries:
            if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
                raise ValueError("a malformed files entry")
            self._entry(index, target, entry)

    def _entry(self, index: int, target: _Target, entry: list[Any]) -> None:
        kind = entry[0]
        if kind == "q":
            what, used, cap = (entry + [None, None, None])[1:4]
            raise QuotaExceeded(f"the run left {used} {what} in {target.view.mount.guest_path!r}"
                                f", over its quota of {cap}")
        if len(entry) < 2:
            raise ValueError("a malformed files entry")
        parts = _parts(entry[1])
        if self._writing is not None and (kind != "f" or self._writing.parts != parts
                                          or self._writing_mount != index):
            raise ValueError("a file ended without its last chunk")
        if parts[0] == STAGING_DIR:
            if len(parts) == 1:
                self._refuse(target, parts, "reserved name")
            return
        for depth in range(1, len(parts)):
            target.mentioned.add(parts[:depth])
        if kind == "x":
            reason = entry[2] if len(entry) > 2 and isinstance(entry[2], str) else "refused"
            self._refuse(target, parts, reason[:200])
            return
        if kind == "d":
            self._count(target, parts)
            self._directory(target, parts)
            target.held[parts] = "d"
        elif kind == "k":
            self._count(target, parts)
            if target.view.sent.get(parts) == "f":
                self._charge(target, self._size(target, parts))
                target.held[parts] = "f"
        elif kind == "f":
            if len(entry) != 5 or type(entry[2]) is not int or not isinstance(
                    entry[3], bytes) or not isinstance(entry[4], bool):
                raise ValueError("a malformed file chunk")
            if self._writing is None:
                if len(parts) > MAX_DEPTH + 1:
                    raise ValueError("a file nested deeper than the guest can make")
                self._count(target, parts)
                try:
                    parent = walk(target.root_fd, parts[:-1], create=True)
                except Blocked:
                    raise ValueError(f"a file inside a non-directory: {entry[1]!r}") from None
                try:
                    self._writing = _Writing(parent, parts, entry[2])
                except BaseException:
                    os.close(parent)
                    raise
                self._writing_mount = index
                target.held[parts] = "f"
            self._charge(target, len(entry[3]))
            self._writing.write(entry[3])
            if entry[4]:
                writing, self._writing = self._writing, None
                try:
                    writing.finish()
                except BaseException:
                    writing.abandon()
                    raise
        else:
            raise ValueError(f"an unknown files entry {kind!r}")

    def _refuse(self, target: _Target, parts: tuple[str, ...], reason: str) -> None:
        # A refused entry is still an entry of the guest's copy of the mount, and counting
        # it against the file quota is what bounds the list: the guest names as many as it
        # likes, and each costs host memory until the run ends.
        self._over_files(target)
        self.refused.append(self.session.refuse(_guest(target, parts), reason))

    def _count(self, target: _Target, parts: tuple[str, ...]) -> None:
        if parts in target.reported:
            raise ValueError(f"{'/'.join(parts)!r} was reported twice")
        target.reported.add(parts)
        target.mentioned.add(parts)
        self._over_files(target)

    @staticmethod
    def _over_files(target: _Target) -> None:
        target.files += 1
        if target.files > target.cap_files:
            raise QuotaExceeded(f"the run left more than {target.cap_files} files and "
                                f"directories in {target.view.mount.guest_path!r}, its quota")

    @staticmethod
    def _charge(target: _Target, size: int) -> None:
        target.bytes += size
        if target.bytes > target.cap_bytes:
            raise QuotaExceeded(f"the run left more than {target.cap_bytes} bytes in "
                                f"{target.view.mount.guest_path!r}, its quota")

    @staticmethod
    def _size(target: _Target, parts: tuple[str, ...]) -> int:
        try:
            parent = walk(target.root_fd, parts[:-1])
        except Blocked:
            return 0
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return 0
        finally:
            os.close(parent)
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    @staticmethod
    def _directory(target: _Target, parts: tuple[str, ...]) -> None:
        if len(parts) > MAX_DEPTH:
            raise ValueError("a directory nested deeper than the guest can make")
        try:
            parent = walk(target.root_fd, parts[:-1], create=True)
        except Blocked:
            raise ValueError(f"a directory inside a non-directory: {'/'.join(parts)!r}") \
                from None
        try:
            name = parts[-1]
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)  # the guest replaced a file
                st = None
            if st is None:
                os.mkdir(name, 0o755, dir_fd=parent)
        finally:
            os.close(parent)

    def finish(self) -> None:
        """Remove from the staging what the guest deleted: what was copied in (or, in a
        session, held after the last account) and not reported back. Raises ValueError if a
        file was left half sent."""
        if self._writing is not None:
            raise ValueError("a file ended without its last chunk")
        for target in self.targets.values():
            gone = [parts for parts in target.view.sent if parts not in target.mentioned]
            # Files before directories, deepest first, so emptied directories go too; a
            # directory still holding what the guest never saw stays, as on wasm.
            gone.sort(key=lambda parts: (target.view.sent[parts] == "d", -len(parts)))
            for parts in gone:
                try:
                    parent = walk(target.root_fd, parts[:-1])
                except Blocked:
                    continue
                try:
                    st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        os.rmdir(parts[-1], dir_fd=parent)
                    else:
                        os.unlink(parts[-1], dir_fd=parent)
                except OSError:
                    pass  # gone already, or a directory that is not empty
                finally:
                    os.close(parent)
            # A session's next account is taken against what the staging holds now.
            target.view.sent = {**dict.fromkeys(target.mentioned, "d"), **target.held}

    def close(self) -> None:
        if self._writing is not None:
            self._writing.abandon()
            self._writing = None


def _guest(target: _Target, parts: tuple[str, ...]) -> str:
    return "/".join((target.view.mount.guest_path, *parts))


def _parts(rel: object) -> tuple[str, ...]:
    """The components of a relative path from the guest; ValueError for anything a real
    directory walk could not have produced."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH:
        raise ValueError("a files entry with a malformed path")
    parts = tuple(rel.split("/"))
    for part in parts:
        if part in ("", ".", "..") or "\x00" in part:
            raise ValueError(f"a files entry with a forbidden path: {rel!r}")
        try:
            if len(part.encode("utf-8")) > MAX_NAME:
                raise ValueError(f"a files entry with a name too long: {rel[:80]!r}")
        except UnicodeEncodeError:
            raise ValueError("a files entry whose path is not UTF-8") from None
    if len(parts) > MAX_DEPTH + 1:
        raise ValueError("a files entry nested too deep")
    return parts
