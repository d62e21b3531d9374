"""Mounts inside the microVM: the guest side of copying a run's mounts in and its changes out.

The host copies each mount's contents over the channel (no host path or disk reaches the
VM); the agent, as root and before the job's child is forked, puts them where the wasm guest
would see them:

* **The job's root.** The VM's root file system is read-only, so a mount at ``/data`` has no
  directory to sit on. The job gets its own root: a tmpfs that holds, for each entry of the
  VM's root, a bind mount of it (or the same symlink), except along the path to a mount,
  where the directory is recreated in the same way one level down. The child ``chroot``\\ s
  into it before dropping its privileges. Nothing of the VM's own root changes.
* **One tmpfs per mount**, mounted ``nosymfollow`` (a symbolic link in a mount is never
  followed: ``open`` gives ``ELOOP``, ``readlink`` works, as on wasm), ``nodev``, ``nosuid``
  and ``noexec``. A read-only mount is remounted read-only once filled (``EROFS``). A
  writable one belongs to the job's user and is sized so that it admits everything the wasm
  backend's quota admits; the host checks the exact quota when the changes come back.
* **Special files** of a read-only mount (FIFOs, devices, sockets) are shown as socket
  inodes, which no one can open (``ENXIO``), as the wasm backend refuses to open them.

After the job, :meth:`Mounts.collect` walks each writable mount without following anything
and reports its final state to the host, which applies it to the run's staging directory
and publishes it with the wasm backend's own code. The host trusts none of it. In a
session it reports after every call, each time sending only the files changed since its
last report.

Entries, host to guest (one ``files`` frame holds several; ``rel`` is "/"-joined)::

    ["d", rel, mode, mtime_ns]                     a directory
    ["f", rel, mode, mtime_ns, data, last]         a chunk of a regular file
    ["l", rel, target]                             a symbolic link (read-only mounts)
    ["o", rel]                                     a special file (read-only mounts)

Guest to host::

    ["d", rel]                                     a directory
    ["k", rel]                                     a file copied in and not changed
    ["f", rel, mode, data, last]                   a chunk of a new or changed file
    ["x", rel, reason]                             an entry that must not be published
    ["q", what, used, cap]                         over the quota: nothing is published

This file never imports the host package; the one host module it shares, dependency-free,
is packed into the image beside it (``wasibox_refusals``).
"""

import ctypes
import os
import stat

# Packed beside this file from the host's wasibox/capabilities/files/refusals.py: the
# deepest nesting reported and the refusal reasons are the host's own.
from wasibox_refusals import MAX_DEPTH, refusal

__all__ = ["Mounts"]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOSYMFOLLOW, MS_BIND, MS_REC = 32, 256, 4096, 16384
MNT_DETACH = 2
NOBODY = 65534
#: Where the job's root is built (inside the VM's /run tmpfs).
ROOT = "/run/wasibox/root"
#: Data in one frame to the host, and entries in one frame (the host accepts 1024).
FRAME_DATA = 1 << 20
FRAME_ENTRIES = 512
_MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOSYMFOLLOW
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _mount(source, target, fstype, flags, data=None):
    if _libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                   flags, data and data.encode()) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"mount {target}: {os.strerror(number)}")


class Mounts:
    """One job's mounts: built from the host's ``specs``, filled from its frames."""

    def __init__(self, specs, root=ROOT):
        self.root = root
        self.specs = list(specs)
        self._file = None  # (fd, rel, mount index) of the file being copied in
        self._dir_times = []
        self._baseline = {}  # mount index -> {rel: (ino, size, mtime_ns, ctime_ns, mode)}

    def _where(self, index, rel=""):
        base = self.root + self.specs[index]["path"]
        return base + "/" + rel if rel else base

    # -- before the job ------------------------------------------------------------------
    def build(self):
        """Make the job's root with an empty tmpfs at each mount's guest path."""
        os.makedirs(self.root, mode=0o755, exist_ok=True)
        _mount("tmpfs", self.root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=25%")
        tree = {}
        for index, spec in enumerate(self.specs):
            node = tree
            parts = [part for part in spec["path"].split("/") if part]
            for part in parts[:-1]:
                node = node.setdefault(part, {})
                if isinstance(node, int):
                    raise ValueError(f"mount {spec['path']} lies inside another mount")
            node[parts[-1]] = index
        self._shadow("/", self.root, tree)
        # The bind of the VM's /run holds a copy of this root's own mount: take it away.
        nested = self.root + ROOT
        if os.path.isdir(nested) and os.path.ismount(nested):
            _libc.umount2(nested.encode(), MNT_DETACH)

    def _shadow(self, original, target, tree):
        """Fill ``target`` (an empty directory of the job's root) with what ``original``
        holds, recursing where ``tree`` places mounts."""
        try:
            listing = sorted(os.listdir(original)) if os.path.isdir(original) else []
        except OSError:
            listing = []
        for name in listing:
            if name in tree:
                continue
            source = os.path.join(original, name)
            destination = os.path.join(target, name)
            try:
                st = os.lstat(source)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(source), destination)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(destination, 0o755)
                _mount(source, destination, None, MS_BIND | MS_REC)
            else:
                os.close(os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                _mount(source, destination, None, MS_BIND)
        for name, node in tree.items():
            source = os.path.join(original, name)
            destination = os.path.join(target, name)
            os.mkdir(destination, 0o755)
            if isinstance(node, int):
                self._mount_tmpfs(node, destination)
                continue
            try:
                st = os.stat(source)
                os.chmod(destination, stat.S_IMODE(st.st_mode))
                os.chown(destination, st.st_uid, st.st_gid)
            except OSError:
                pass  # not in the VM's root: a plain directory
            self._shadow(source, destination, node)

    def _mount_tmpfs(self, index, where):
        spec = self.specs[index]
        mode = self._mode(spec["mode"], spec["writable"], directory=True)
        options = [f"mode={mode:o}", f"uid={NOBODY}", f"gid={NOBODY}"]
        if spec["writable"]:
            options += [f"size={int(spec['size'])}", f"nr_inodes={int(spec['inodes'])}"]
        _mount("tmpfs", where, "tmpfs", _MOUNT_FLAGS, ",".join(options))

    def receive(self, frame):
        """Apply one ``files`` frame of the copy-in."""
        index = int(frame["mount"])
        writable = self.specs[index]["writable"]
        for entry in frame["entries"]:
            kind, rel = entry[0], entry[1]
            path = self._where(index, rel)
            if kind == "d":
                mode = self._mode(entry[2], writable, directory=True)
                os.mkdir(path, 0o700)
                os.chmod(path, mode)
                os.chown(path, NOBODY, NOBODY)
                self._dir_times.append((path, entry[3]))
            elif kind == "f":
                self._chunk(index, rel, path, entry, writable)
            elif kind == "l":
                os.symlink(entry[2], path)
                os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
            elif kind == "o":
                # A socket inode nothing listens on: opening it gives ENXIO.
                os.mknod(path, stat.S_IFSOCK | 0o444)
                os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
            else:
                raise ValueError(f"unknown copy-in entry {kind!r}")

    @staticmethod
    def _mode(mode, writable, directory):
        mode = int(mode) & 0o7777
        if writable:
            # The job's user owns a writable mount and may change anything in it, as the
            # wasm guest may: the host writes on its behalf there.
            return mode | (0o700 if directory else 0o600)
        # Read-only: no write bits (as the wasm guest sees them), readable as it was read.
        return (mode & ~0o222) | (0o500 if directory else 0o400)

    def _chunk(self, index, rel, path, entry, writable):
        _, _, mode, mtime_ns, data, last = entry[:6]
        if self._file is None or self._file[1:] != (rel, index):
            if self._file is not None:
                raise ValueError("a copied file ended without its last chunk")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            self._file = (fd, rel, index)
        fd = self._file[0]
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if last:
            os.fchmod(fd, self._mode(mode, writable, directory=False))
            os.fchown(fd, NOBODY, NOBODY)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
            os.close(fd)
            self._file = None

    def seal(self):
        """After the copy-in: set directory times, make read-only mounts read-only, and
        remember what each writable mount holds, to tell what the job changed."""
        if self._file is not None:
            raise ValueError("a copied file ended without its last chunk")
        for path, mtime_ns in reversed(self._dir_times):
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        for index, spec in enumerate(self.specs):
            where = self._where(index)
            if not spec["writable"]:
                _mount(None, where, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _MOUNT_FLAGS)
            elif spec.get("collect"):
                baseline = self._baseline[index] = {}
                for rel, st, _ in self._walk(where):
                    if stat.S_ISREG(st.st_mode):
                        baseline[rel] = (st.st_ino, st.st_size, st.st_mtime_ns,
                                         st.st_ctime_ns, st.st_mode)

    def enter(self):
        """In the job's child, still root: make the job's root its own."""
        os.chroot(self.root)
        os.chdir("/")

    # -- after the job -------------------------------------------------------------------
    @staticmethod
    def _walk(top, rel="", depth=0):
        """(rel, lstat, depth) of everything under ``top``, in sorted order, parents first,
        never following a link. Directories deeper than MAX_DEPTH are reported, not
        entered."""
        try:
            names = sorted(os.listdir(top + "/" + rel if rel else top))
        except OSError:
            return
        for name in names:
            child = rel + "/" + name if rel else name
            try:
                st = os.lstat(top + "/" + child)
            except OSError:
                continue
            yield child, st, depth + 1
            if stat.S_ISDIR(st.st_mode) and depth + 1 <= MAX_DEPTH:
                yield from Mounts._walk(top, child, depth + 1)

    def collect(self, send):
        """Report every writable mount's final state to the host, through ``send(frame)``."""
        for index, spec in enumerate(self.specs):
            if spec["writable"] and spec.get("collect"):
                self._collect(index, spec, send)

    def _collect(self, index, spec, send):
        where = self._where(index)
        baseline = self._baseline.get(index, {})
        plan = []
        held = {}  # what the host's staging holds once this report is applied
        total_bytes = 0
        walked = list(self._walk(where))
        # A hard link the job made (the wasm guest cannot make one) is published under one
        # name: the one copied in, else the first in sorted order; the others are refused.
        primary = {}
        for rel, st, _ in walked:
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                before = baseline.get(rel)
                if before is not None and before[0] == st.st_ino:
                    primary[st.st_ino] = rel
                else:
                    primary.setdefault(st.st_ino, rel)
        for rel, st, depth in walked:
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                plan.append(["x", rel.encode("utf-8", "replace").decode(),
                             "the name is not UTF-8"])
                continue
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                plan.append(["d", rel] if depth <= MAX_DEPTH else
                            ["x", rel, "nested too deep"])
            elif not stat.S_ISREG(mode):
                plan.append(["x", rel, refusal(mode)])
            else:
                if st.st_nlink > 1 and primary.get(st.st_ino) != rel:
                    plan.append(["x", rel, "hard link"])
                    continue
                before = baseline.get(rel)
                now = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, mode)
                if before is not None and st.st_nlink > 1:
                    # Making a link changes the ctime of the file it links to.
                    same = before[:3] + before[4:] == now[:3] + now[4:]
                else:
                    same = before == now
                plan.append(["k", rel] if same else ["f", rel, stat.S_IMODE(mode)])
                held[rel] = now
                total_bytes += st.st_size
        entries_used = sum(1 for item in plan if item[0] in "dkf")
        if total_bytes > spec["cap_bytes"]:
            send({"kind": "files", "mount": index,
                  "entries": [["q", "bytes", total_bytes, spec["cap_bytes"]]]})
            return
        if entries_used > spec["cap_files"]:
            send({"kind": "files", "mount": index,
                  "entries": [["q", "files", entries_used, spec["cap_files"]]]})
            return
        batch = []
        size = 0
        for item in plan:
            if item[0] != "f":
                batch.append(item)
            else:
                for chunk, last in self._chunks(where + "/" + item[1]):
                    batch.append(["f", item[1], item[2], chunk, last])
                    size += len(chunk)
                    if size >= FRAME_DATA or len(batch) >= FRAME_ENTRIES:
                        send({"kind": "files", "mount": index, "entries": batch})
                        batch, size = [], 0
            if len(batch) >= FRAME_ENTRIES:
                send({"kind": "files", "mount": index, "entries": batch})
                batch, size = [], 0
        if batch:
            send({"kind": "files", "mount": index, "entries": batch})
        # A session reports again after its next call: only what changed since this report
        # is sent then (a file changed while it was read here changes its ctime, so it is).
        self._baseline[index] = held

    @staticmethod
    def _chunks(path):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            chunk = os.read(fd, FRAME_DATA)
            while True:
                following = os.read(fd, FRAME_DATA) if chunk else b""
                yield chunk, not following
                if not following:
                    return
                chunk = following
        finally:
            os.close(fd)
