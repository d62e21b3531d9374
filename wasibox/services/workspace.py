"""The MCP server's workspaces: one directory per session, and the file tools' access to it.

``WorkspaceStore`` keeps one directory per session under a private temporary root, mounted
writable at ``/workspace`` for the session's runs, and deletes it when the session ends, when
it has been idle for ``idle_timeout_s`` and when the server stops.

Threat: the paths the file tools (``write_file``, ``read_file``, ``list_files``) receive come
from a model and may aim anywhere, and the workspace holds whatever guest code wrote there.
``open_confined`` opens every path with the files capability's one confinement walker
(``capabilities/files/walk.py``): no ``..``, no staging directory, no symbolic link on the way
or at the end, no window between a check and the open, and no FIFO that could hang the server.
Every refusal is a ``UsageError`` whose message a model can act on.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from .._errors import UsageError
from ..capabilities.files.mount import STAGING_DIR
from ..capabilities.files.walk import DIR_FLAGS, Blocked, walk

__all__ = ["FILE_LIMIT", "IDLE_TIMEOUT_S", "LIST_LIMIT", "SWEEP_INTERVAL_S", "WORKSPACE",
           "FileState", "WorkspaceStore", "list_workspace", "open_confined", "read_text",
           "staged_changes", "view_state", "workspace_files", "workspace_parts", "write_text"]

#: Largest file the file tools write or read, in bytes.
FILE_LIMIT = 1 * 2**20
#: Entries list_files reports at most.
LIST_LIMIT = 1_000
#: A workspace not touched for this long is deleted (seconds).
IDLE_TIMEOUT_S = 30 * 60.0
WORKSPACE = "/workspace"
#: Longest wait between two sweeps for idle workspaces (seconds).
SWEEP_INTERVAL_S = 60.0


class WorkspaceStore:
    """One directory per session under a private temporary root; idle ones are deleted.

    A daemon thread sweeps for idle workspaces, so one is deleted on time even when no other
    call comes in; ``close`` stops it and deletes everything.
    """

    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="wasibox-mcp-"))
        self.idle_timeout_s = idle_timeout_s
        #: Called with a session's key before its workspace is deleted (a live interpreter
        #: holds a view of it).
        self.on_drop: Callable[[str], object] = _ignore
        self._dirs: dict[str, tuple[Path, float]] = {}
        self._expired: set[str] = set()
        self._busy: dict[str, int] = {}  # runs using a session's workspace right now
        self._lock = threading.Lock()
        self._count = 0
        self._closed = threading.Event()
        interval = min(max(idle_timeout_s / 4, 0.05), SWEEP_INTERVAL_S)
        self._sweeper = threading.Thread(target=self._sweep_until_closed, args=(interval,),
                                         name="wasibox-mcp-sweeper", daemon=True)
        self._sweeper.start()

    def _sweep_until_closed(self, interval: float) -> None:
        while not self._closed.wait(interval):
            self.sweep()

    def get(self, key: str) -> Path:
        """The workspace of session ``key``, made on first use; marks it used now."""
        return self.acquire(key)[0]

    def acquire(self, key: str, *, hold: bool = False) -> tuple[Path, bool]:
        """Like ``get``; the flag says the session's old workspace was deleted as idle.

        With ``hold``, the workspace is in use (never idle) until ``release(key)``.
        """
        self.sweep()
        with self._lock:
            if hold:
                self._busy[key] = self._busy.get(key, 0) + 1
            entry = self._dirs.get(key)
            renewed = False
            if entry is None:
                self._count += 1
                path = self.root / f"session-{self._count}"
                path.mkdir(mode=0o700)
                renewed = key in self._expired
                self._expired.discard(key)
            else:
                path = entry[0]
            self._dirs[key] = (path, time.monotonic())
            return path, renewed

    def release(self, key: str) -> None:
        """End a ``hold``: the workspace counts as used now, and can become idle again."""
        with self._lock:
            left = self._busy.pop(key, 0) - 1
            if left > 0:
                self._busy[key] = left
            entry = self._dirs.get(key)
            if entry is not None:
                self._dirs[key] = (entry[0], time.monotonic())

    def ephemeral(self) -> Path:
        """A workspace for one call outside any session (delete it with ``discard``)."""
        return Path(tempfile.mkdtemp(prefix="call-", dir=self.root))

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def drop(self, key: str) -> None:
        """Delete the workspace of a session that ended."""
        self.on_drop(key)
        with self._lock:
            entry = self._dirs.pop(key, None)
            self._expired.discard(key)
        if entry is not None:
            shutil.rmtree(entry[0], ignore_errors=True)

    def sweep(self) -> None:
        """Delete the workspaces idle for longer than the timeout."""
        now = time.monotonic()
        with self._lock:
            idle = [(key, path) for key, (path, used) in self._dirs.items()
                    if now - used > self.idle_timeout_s and key not in self._busy]
            for key, _ in idle:
                del self._dirs[key]
                self._expired.add(key)
        for key, path in idle:
            self.on_drop(key)
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Stop sweeping and delete every workspace (idempotent)."""
        self._closed.set()
        if self._sweeper is not threading.current_thread():
            self._sweeper.join()
        with self._lock:
            keys = list(self._dirs)
            self._dirs.clear()
        for key in keys:
            self.on_drop(key)
        shutil.rmtree(self.root, ignore_errors=True)


def _ignore(key: str) -> None:
    return None


def workspace_parts(path: str) -> tuple[str, ...]:
    """``path`` (relative, or under /workspace) as its components inside the workspace.
    Raises UsageError for anything that would leave it."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise UsageError("give a file path such as 'data/input.csv'")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(WORKSPACE)
        except ValueError:
            raise UsageError(f"{path!r} is outside the workspace; use a path relative to "
                             f"{WORKSPACE}") from None
    parts = pure.parts
    if any(part in ("..", STAGING_DIR) for part in parts) or "\\" in path:
        raise UsageError(f"{path!r} leaves the workspace; '..' is not allowed")
    return parts


def open_confined(root: Path, path: str, flags: int, *, make_dirs: bool = False) -> int:
    """Open the file ``path`` inside the workspace ``root`` with the confinement walker.

    No symbolic link is followed, on the way or at the end (the guest cannot make one, and
    one planted there could lead out of the workspace), and there is no window between a
    check and the open. A FIFO cannot hang the server: the file is opened non-blocking and
    must be a regular file. With ``make_dirs``, missing directories on the way are made.
    Raises UsageError.
    """
    parts = workspace_parts(path)
    if not parts:
        raise UsageError("give a file path, not the workspace itself")
    root_fd = os.open(root, DIR_FLAGS)
    try:
        parent = walk(root_fd, parts[:-1], create=make_dirs)
    except Blocked as stop:
        if stop.is_link:
            raise UsageError(f"{path!r} goes through a symbolic link, which is refused") from None
        if isinstance(stop.error, FileNotFoundError):
            raise UsageError(f"there is no file {path!r} in the workspace") from None
        raise UsageError(f"{path!r} goes through {stop.part!r}, which is not a directory "
                         "in the workspace") from None
    finally:
        os.close(root_fd)
    try:
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                     dir_fd=parent)
    except FileNotFoundError:
        raise UsageError(f"there is no file {path!r} in the workspace") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{path!r} is a symbolic link, which is refused") from None
        raise UsageError(f"cannot open {path!r}: {exc.strerror}") from None
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path!r} is not a regular file")
    return fd


def write_text(root: Path, path: str, content: str) -> str:
    """Write ``content`` as UTF-8 to ``path`` in the workspace ``root``, making missing
    directories; return what was done, in words. Raises UsageError for content over
    FILE_LIMIT bytes and for a path ``open_confined`` refuses."""
    data = content.encode("utf-8")
    if len(data) > FILE_LIMIT:
        raise UsageError(f"the content is {len(data)} bytes; files are capped at "
                         f"{FILE_LIMIT} bytes")
    fd = open_confined(root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_dirs=True)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return f"wrote {len(data)} bytes to {WORKSPACE}/{'/'.join(workspace_parts(path))}"


def read_text(root: Path, path: str) -> str:
    """The UTF-8 text of ``path`` in the workspace ``root``. Raises UsageError for a path
    ``open_confined`` refuses, a file over FILE_LIMIT bytes, and bytes that are not UTF-8."""
    fd = open_confined(root, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(FILE_LIMIT + 1)
    if len(data) > FILE_LIMIT:
        raise UsageError(f"{path!r} is over {FILE_LIMIT} bytes; read it in code and print "
                         "the part you need")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path!r} is not UTF-8 text; inspect it with run_python") from None


def workspace_files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Each file below ``root`` (a workspace, or a session's view of it), in order, with its
    ``lstat``: at most LIST_LIMIT + 1 of them, so that a caller can say the walk stopped.
    Paths are relative, as valid UTF-8 text (bytes that are not shown as escapes); no
    symbolic link is followed, and wasibox's staging directories are left out."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != STAGING_DIR)
        for name in sorted(filenames):
            full = Path(dirpath) / name
            try:
                info = full.lstat()
            except OSError:
                continue
            relative = full.relative_to(root).as_posix()
            yield relative.encode("utf-8", "backslashreplace").decode("utf-8"), info
            count += 1
            if count > LIST_LIMIT:
                return


def list_workspace(root: Path) -> str:
    """The files of the workspace ``root`` with their sizes, one a line, as ``workspace_files``
    gives them (at most LIST_LIMIT, then a line saying the listing stopped)."""
    entries: list[str] = []
    for path, info in workspace_files(root):
        if len(entries) >= LIST_LIMIT:
            entries.append(f"[... listing stopped at {LIST_LIMIT} files ...]")
            break
        entries.append(f"{path} ({info.st_size} bytes)")
    return "\n".join(entries) if entries else "(the workspace is empty)"


#: A file of a session's view as seen before and after a call: (inode, size, mtime in ns).
FileState = tuple[int, int, int]


def view_state(view: Path | None) -> dict[str, FileState]:
    """What each file of a live session's view of /workspace is now (nothing without one);
    the first LIST_LIMIT + 1 files only, as list_files shows them."""
    if view is None:
        return {}
    return {path: (info.st_ino, info.st_size, info.st_mtime_ns)
            for path, info in workspace_files(view)}


def staged_changes(before: dict[str, FileState],
                   after: dict[str, FileState]) -> list[dict[str, Any]]:
    """The files a session call wrote or deleted under /workspace, from the states of its
    view before and after the call: path, size and change ("written" or "deleted")."""
    written = [{"path": f"{WORKSPACE}/{path}", "size": state[1], "change": "written"}
               for path, state in after.items() if before.get(path) != state]
    deleted = [{"path": f"{WORKSPACE}/{path}", "size": 0, "change": "deleted"}
               for path in before if path not in after]
    return sorted(written + deleted, key=lambda change: str(change["path"]))
