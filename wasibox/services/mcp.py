"""``wasibox mcp``: wasibox as the code-execution tool of an AI agent, over the Model Context
Protocol (the official ``mcp`` SDK; stdio or streamable HTTP).

Policy. With no configuration the server is safe as it stands: wasibox's default limits, no
network, no host functions, no mounts, only the session's workspace. A configuration (the same
TOML file as ``wasibox serve``, ``wasibox.services.config``) adds one tenant's limits, mounts, HTTP
allowlist, host functions and backend; its ``token_sha256`` is not needed (stdio reaches only
the process that started the server, and the HTTP transport has no authentication, so it
listens only on loopback). Nothing a tool call sends can change the policy: the tools take
code, a timeout that is clamped to the policy's, and workspace-relative paths. Errors a model
receives name the configuration keys the operator can change, never a Python API the model
cannot call.

Sessions. Every MCP session gets its own workspace directory, mounted writable at
``/workspace``, so files persist from call to call. When the policy enables sessions
(``[tenants.NAME.sessions] enabled``, on by default), every MCP session also gets one live
interpreter (a ``wasibox.Session``): ``run_python`` calls share its variables, imports and open
files, as an agent used to a notebook expects, and a ``reset`` tool ends it. A call that
exceeds a limit ends that interpreter; its result says so, and the next ``run_python`` starts
a fresh one and says so in a note (never silently). While it lives, its writes to /workspace
are staged in its own view, which the file tools read and write, and published when it ends.
With sessions off, every ``run_python`` gets a fresh interpreter. Over stdio the process is
the session. Over streamable HTTP the
session is the transport's session id (``Mcp-Session-Id``); a request that has none (the
stateless 2026 protocol) runs code in a throw-away workspace, and the file tools say they need
a session. Workspaces are deleted when their session ends, after ``idle_timeout_s`` without a
call, and when the server stops.

Host functions. When the policy configures ``functions``, a ``call_function`` tool lets the
model call them directly with JSON arguments. Each call goes through the same host-call
channel as a call from guest code (``wasibox.capabilities.hostcall.HostCalls``): unknown names are
refused, the arguments and the result are each capped at ``host_call_bytes`` (and together
at ``host_total_bytes``), and a function still running at the policy's ``timeout_s`` is
abandoned. One ``call_function`` is one call, as if a run made one host call; the
``host_calls`` count limit applies to the calls code makes within one ``run_python``. With no
functions configured the tool is not listed at all, so a model never sees a tool it cannot
use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import inspect
import ipaddress
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import msgpack
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel, Field

from .._errors import ConfigError, UsageError, WasiboxError
from .._limits import Limit, Limits
from .._result import RunResult, json_value
from .._sandbox import Sandbox
from .._session import Session
from .._version import __version__
from ..capabilities.files.mount import STAGING_DIR, Mount
from ..capabilities.files.walk import DIR_FLAGS, Blocked, walk
from ..capabilities.hostcall import HostCalls, StopRun, host_error_message
from .config import Config, TenantConfig, load_config

__all__ = ["McpPolicy", "RunReport", "SessionPool", "WorkspaceStore", "call_host_function",
           "create_mcp_server", "describe_functions", "describe_result", "operator_message",
           "serve_mcp", "structured_result"]

#: Characters of stdout (and of stderr) a tool result carries before it is cut with a marker.
TEXT_LIMIT = 20_000
#: Largest file the file tools write or read, in bytes.
FILE_LIMIT = 1 * 2**20
#: Entries list_files reports at most.
LIST_LIMIT = 1_000
#: A workspace not touched for this long is deleted (seconds).
IDLE_TIMEOUT_S = 30 * 60.0
WORKSPACE = "/workspace"
#: Longest wait between two sweeps for idle workspaces (seconds).
SWEEP_INTERVAL_S = 60.0


@dataclasses.dataclass(frozen=True)
class McpPolicy:
    """The policy of one MCP server: a tenant of the config file, resolved."""

    tenant: str
    limits: Limits
    config: TenantConfig
    functions: dict[str, Callable[..., Any]]

    @classmethod
    def default(cls) -> McpPolicy:
        """The policy of ``wasibox mcp`` without a configuration: default limits, no network,
        no host functions, no mounts."""
        config = TenantConfig()
        return cls("default", config.limits.to_limits(), config, {})

    @classmethod
    def from_config(cls, config: Config, tenant: str | None = None) -> McpPolicy:
        """Pick the tenant (the only one, if not named). Raises ConfigError."""
        if tenant is None:
            if len(config.tenants) != 1:
                names = ", ".join(sorted(config.tenants))
                raise ConfigError(f"the configuration has several tenants ({names}); "
                                  "choose one with --tenant")
            tenant = next(iter(config.tenants))
        if tenant not in config.tenants:
            raise ConfigError(f"the configuration has no tenant {tenant!r}")
        chosen = config.tenants[tenant]
        return cls(tenant, chosen.limits.to_limits(), chosen, chosen.resolve_functions(tenant))

    def sandbox(self, workspace: Path, timeout_s: float) -> Sandbox:
        """A Sandbox enforcing this policy, with ``workspace`` at /workspace."""
        mounts: list[Mount] = [m.to_mount() for m in self.config.mounts]
        http = self.config.http.to_policy() if self.config.http is not None else None
        limits = self.limits.narrow({"timeout_s": timeout_s})
        return Sandbox(limits, seed=self.config.seed, clock=self.config.clock,
                       entropy=self.config.entropy, mounts=mounts, workspace=workspace,
                       http=http, functions=self.functions, backend=self.config.backend,
                       allow_emulation=self.config.allow_emulation,
                       **self.config.sandbox_options())

    def warnings(self) -> list[str]:
        """What the operator should know at start-up (see ``TenantConfig.warnings``)."""
        return self.config.warnings(self.tenant)


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


class SessionPool:
    """The live interpreter (``wasibox.Session``) of each MCP session, by session key.

    Each has its own Sandbox under the policy, with the session's workspace at /workspace;
    it is made by the first ``run_python`` and ends by ``reset``, by a limit, by the policy's
    idle timeout or maximum age, or when its workspace is deleted. Thread-safe.
    """

    def __init__(self, policy: McpPolicy) -> None:
        self._policy = policy
        self._live: dict[str, tuple[Sandbox, Session]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, root: Path) -> tuple[Session, str | None]:
        """The live session of ``key`` (made now if there is none), and a note for the model
        if an earlier one had ended. Raises WasiboxError if it cannot be made."""
        note = None
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[1].ended is None:
                return entry[1], None
            self._live.pop(key, None)
        if entry is not None:
            ended = entry[1]._ended
            why = ended.detail if ended is not None else "it ended"
            note = (f"the previous Python session ended ({why}); this call ran in a fresh "
                    "interpreter: variables, imports and functions from earlier calls are "
                    "gone, files in /workspace are kept")
            entry[0].close()
        options = self._policy.config.sessions
        sandbox = self._policy.sandbox(root, self._policy.limits.timeout_s)
        try:
            session = sandbox.session(idle_timeout_s=options.idle_timeout_s,
                                      max_age_s=options.max_age_s, publish="always")
        except BaseException:
            sandbox.close()
            raise
        with self._lock:
            racing = self._live.get(key)
            if racing is not None and racing[1].ended is None:
                sandbox.close()  # a concurrent call made one first: use it
                return racing[1], note
            self._live[key] = (sandbox, session)
        return session, note

    def view(self, key: str | None) -> Path | None:
        """Where the live session of ``key`` sees /workspace (its staged view), or None."""
        with self._lock:
            entry = self._live.get(key) if key is not None else None
        return entry[1]._view(WORKSPACE) if entry is not None else None

    def drop(self, key: str) -> bool:
        """End the session of ``key``, publishing its workspace files; True if one lived."""
        with self._lock:
            entry = self._live.pop(key, None)
        if entry is None:
            return False
        live = entry[1].ended is None
        entry[0].close()
        return live

    def close(self) -> None:
        with self._lock:
            entries, self._live = list(self._live.values()), {}
        for sandbox, _ in entries:
            sandbox.close()


# -- results a model can act on ---------------------------------------------------------------

def _clip(text: str, limit: int = TEXT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return (text[:limit] + f"\n[... output truncated: {len(text) - limit} more characters "
            "not shown ...]")


def _limit_words(result: RunResult, limits: Limits) -> str:
    after = f"after {result.duration_s:.1f} s"
    match str(result.limit_exceeded):
        case "fuel":
            return (f"the run used all of its CPU budget (fuel: {result.fuel_used:,} units) "
                    f"{after}; the operator can raise limits.fuel in the configuration")
        case "timeout":
            return f"the run hit its wall-clock time limit of {limits.timeout_s:g} s"
        case "memory":
            return (f"the run hit its memory limit of {limits.memory_bytes // 2**20} MiB "
                    f"{after}")
        case "output":
            return (f"the run wrote more than its output limit of {limits.output_bytes} bytes "
                    f"and was stopped {after}")
        case "host_calls":
            return (f"the run went past its host-call limits (at most {limits.host_calls} "
                    f"calls, {limits.host_call_bytes} bytes per call and "
                    f"{limits.host_total_bytes} bytes in all) and was stopped {after}")
        case "cancelled":
            return "the run was cancelled"
        case other:
            return f"the run hit its {other} limit {after}"


def describe_result(result: RunResult, limits: Limits, notes: list[str],
                    staged: list[dict[str, Any]] | None = None) -> str:
    """The plain-text report of a run that a model reads; ``staged`` lists what a session
    call changed under /workspace, not yet published (see ``staged_changes``)."""
    lines: list[str] = []
    if result.ok:
        lines.append("status: ok")
    elif result.limit_exceeded is not None:
        lines.append(f"status: stopped: {_limit_words(result, limits)}")
        lines.append(f"limit exceeded: {result.limit_exceeded}")
    elif result.error is not None:
        lines.append(f"status: error: {result.error.type}: {result.error.message}")
    else:
        lines.append(f"status: exited with code {result.exit_code}")
    lines.extend(f"note: {note}" for note in notes)
    stdout = _clip(result.stdout)
    if result.stdout_truncated:
        stdout += "\n[... stdout truncated by the output limit ...]"
    stderr = _clip(result.stderr)
    if result.stderr_truncated:
        stderr += "\n[... stderr truncated by the output limit ...]"
    lines.append("stdout:\n" + (stdout if stdout else "(empty)"))
    if stderr:
        lines.append("stderr:\n" + stderr)
    if result.error is not None:
        lines.append("traceback:\n" + _clip(result.error.traceback))
    denied = [e for e in result.capability_log if not e.allowed]
    for event in denied:
        lines.append(f"denied: {event.capability} {event.action} {event.target}")
    if result.files:
        lines.append("files written: " + ", ".join(f.path for f in result.files))
    if staged:
        lines.append("files changed by this call (kept in this session's view of "
                     "/workspace, which read_file and list_files already see; published to "
                     "the workspace when the session ends): " + ", ".join(
                         f"{change['path']} ({change['change']}"
                         + (f", {change['size']} bytes)" if change["change"] == "written"
                            else ")") for change in staged))
    lines.append(f"fuel used: {result.fuel_used}; duration: {result.duration_s:.3f} s; "
                 f"backend: {result.backend}")
    return "\n".join(lines)


class RunReport(BaseModel):
    """A run_python result as structured content: the fields a client program reads."""

    status: Literal["ok", "error", "exit", "limit"] = Field(
        description="ok; error: the code raised; exit: it exited non-zero; limit: a limit "
                    "stopped it")
    stdout: str
    stderr: str
    error: dict[str, str] | None = Field(description="type, message and traceback")
    limit: str | None = Field(description="the limit that stopped the run, if one did")
    fuel: int = Field(description="fuel used (the deterministic CPU budget)")
    files: list[dict[str, Any]] = Field(
        description="files written under /workspace and other writable mounts: path, size, "
                    "sha256")
    files_staged: list[dict[str, Any]] = Field(
        default_factory=list,
        description="in a session: the files this call wrote or deleted under /workspace, "
                    "not published yet (read_file and list_files see them; they are "
                    "published when the session ends): path, size, change (written or "
                    "deleted)")
    exit_code: int
    duration_s: float
    backend: str
    notes: list[str]


def structured_result(result: RunResult, notes: list[str],
                      staged: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``structured_content`` of a run_python result (see ``RunReport``), built from the
    one JSON form of a result (``RunResult.to_dict``), with the text clipped as in the text
    report; ``staged`` as for ``describe_result``."""
    data = result.to_dict()
    status: Literal["ok", "error", "exit", "limit"]
    if data["ok"]:
        status = "ok"
    elif data["limit_exceeded"] is not None:
        status = "limit"
    elif data["error"] is not None:
        status = "error"
    else:
        status = "exit"
    error = data["error"]
    if error is not None:
        error = {**error, "traceback": _clip(error["traceback"])}
    return RunReport(
        status=status, stdout=_clip(data["stdout"]), stderr=_clip(data["stderr"]),
        error=error, limit=data["limit_exceeded"], fuel=data["fuel_used"],
        files=data["files"], exit_code=data["exit_code"], duration_s=data["duration_s"],
        backend=data["backend"], notes=list(notes), files_staged=list(staged or ())
    ).model_dump()


#: Python API in wasibox's messages, and the configuration key the operator sets instead.
_OPERATOR_WORDS = (
    (re.compile(r"Sandbox\(allow_emulation=True\)|--allow-emulation"),
     "allow_emulation = true in the tenant's configuration"),
    (re.compile(r"Limits\((\w+)=\.\.\.\)|Limits\.(\w+)"),
     lambda match: f"limits.{match.group(1) or match.group(2)}"),
    (re.compile(r"backend='(\w+)'"), r'backend = "\1"'),
)


def operator_message(exc: BaseException) -> str:
    """A wasibox error as a model should read it: no host paths, and the configuration keys
    the operator can change rather than a Python API the model cannot call."""
    text = host_error_message(exc)
    for pattern, words in _OPERATOR_WORDS:
        text = pattern.sub(words, text)
    return (f"{text}\n(this server's operator sets its limits and backend in its "
            "configuration file; a tool call cannot change them)")


# -- confined paths ---------------------------------------------------------------------------

def _workspace_parts(path: str) -> tuple[str, ...]:
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


def _open_confined(root: Path, path: str, flags: int, *, make_dirs: bool = False) -> int:
    """Open the file ``path`` inside the workspace ``root`` with the confinement walker.

    No symbolic link is followed, on the way or at the end (the guest cannot make one, and
    one planted there could lead out of the workspace), and there is no window between a
    check and the open. A FIFO cannot hang the server: the file is opened non-blocking and
    must be a regular file. With ``make_dirs``, missing directories on the way are made.
    Raises UsageError.
    """
    parts = _workspace_parts(path)
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


def _write(root: Path, path: str, content: str) -> str:
    data = content.encode("utf-8")
    if len(data) > FILE_LIMIT:
        raise UsageError(f"the content is {len(data)} bytes; files are capped at "
                         f"{FILE_LIMIT} bytes")
    fd = _open_confined(root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_dirs=True)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return f"wrote {len(data)} bytes to {WORKSPACE}/{'/'.join(_workspace_parts(path))}"


def _read(root: Path, path: str) -> str:
    fd = _open_confined(root, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(FILE_LIMIT + 1)
    if len(data) > FILE_LIMIT:
        raise UsageError(f"{path!r} is over {FILE_LIMIT} bytes; read it in code and print "
                         "the part you need")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path!r} is not UTF-8 text; inspect it with run_python") from None


def _workspace_files(root: Path) -> Iterator[tuple[str, os.stat_result]]:
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


def _list(root: Path) -> str:
    entries: list[str] = []
    for path, info in _workspace_files(root):
        if len(entries) >= LIST_LIMIT:
            entries.append(f"[... listing stopped at {LIST_LIMIT} files ...]")
            break
        entries.append(f"{path} ({info.st_size} bytes)")
    return "\n".join(entries) if entries else "(the workspace is empty)"


#: A file of a session's view as seen before and after a call: (inode, size, mtime in ns).
_FileState = tuple[int, int, int]


def _view_state(view: Path | None) -> dict[str, _FileState]:
    """What each file of a live session's view of /workspace is now (nothing without one);
    the first LIST_LIMIT + 1 files only, as list_files shows them."""
    if view is None:
        return {}
    return {path: (info.st_ino, info.st_size, info.st_mtime_ns)
            for path, info in _workspace_files(view)}


def staged_changes(before: dict[str, _FileState],
                   after: dict[str, _FileState]) -> list[dict[str, Any]]:
    """The files a session call wrote or deleted under /workspace, from the states of its
    view before and after the call: path, size and change ("written" or "deleted")."""
    written = [{"path": f"{WORKSPACE}/{path}", "size": state[1], "change": "written"}
               for path, state in after.items() if before.get(path) != state]
    deleted = [{"path": f"{WORKSPACE}/{path}", "size": 0, "change": "deleted"}
               for path in before if path not in after]
    return sorted(written + deleted, key=lambda change: str(change["path"]))


# -- the server -------------------------------------------------------------------------------

RUN_PYTHON_DESCRIPTION = """\
Run Python 3 code in an isolated sandbox (CPython compiled to WebAssembly) and return its \
stdout, stderr, the exception with its traceback if one was raised, which limit stopped it (in \
plain words), the CPU budget (fuel) used, and the backend.

Every call starts a FRESH interpreter: variables, imports and functions from earlier calls are \
gone, so put everything a computation needs in one call. Files persist: the session's workspace \
is mounted at /workspace (use absolute paths such as /workspace/out.csv). Files written there \
by a run that ends without an error can be read with read_file and are seen by later runs; a \
run that fails writes nothing.

The sandbox has the standard library only (no pip installs), no network except the hosts the \
operator allowed (others fail with an error), and limits on CPU (fuel), memory, wall-clock time \
and output set by the operator. Print what you want to see; output is truncated past a limit."""

RUN_PYTHON_SESSION_DESCRIPTION = """\
Run Python 3 code in an isolated sandbox (CPython compiled to WebAssembly) and return its \
stdout, stderr, the exception with its traceback if one was raised, which limit stopped it (in \
plain words), the CPU budget (fuel) used, and the backend.

State PERSISTS between calls, as in a notebook: variables, imports, functions and open files \
from earlier calls are still there, so build on them step by step. Call the reset tool to start \
a fresh interpreter. A call that exceeds a limit (CPU, time, memory, output) ends the \
interpreter: the result says so, and the next call starts fresh (so does a session left idle \
for {idle:g} s). Files persist too: the session's workspace is mounted at /workspace (use \
absolute paths such as /workspace/out.csv); read_file and list_files see what code wrote there, \
and each result lists the files the call wrote or deleted.

The sandbox has the standard library only (no pip installs), no network except the hosts the \
operator allowed (others fail with an error), and limits on CPU (fuel), memory, wall-clock time \
and output set by the operator. Each call has its own CPU and time limits. Print what you want \
to see; output is truncated past a limit."""

RESET_DESCRIPTION = ("End this session's Python interpreter: the next run_python starts a fresh "
                     "one, without the variables, imports and functions of earlier calls. "
                     "Files in /workspace are kept.")

TIMEOUT_DESCRIPTION = ("wall-clock limit for this run in seconds; values above the operator's "
                       "limit are lowered to it (the result says so)")


CALL_FUNCTION_DESCRIPTION = """\
Call a function that the operator of this server provides, by name, with JSON arguments, and \
get its return value back as JSON. The function runs on the host, outside the sandbox, under \
the same policy as a call from sandboxed code: only the functions listed below exist, the \
arguments and the result are each limited to {call_bytes} bytes once encoded, and a call still \
running after {timeout:g} s is abandoned. Code in run_python can call the same functions \
(`import host; host.NAME(...)`). In a result, bytes are shown as {{"base64": "..."}}, NaN and \
infinities as {{"float": "nan"}}, and maps with keys that are not strings as \
{{"map": [[key, value], ...]}}.

Functions:
{functions}"""

#: Characters of one function's summary in the call_function description.
SUMMARY_LIMIT = 300
#: Functions the call_function description lists by signature (the rest by name).
LISTED_FUNCTIONS = 50


def describe_functions(functions: dict[str, Callable[..., Any]]) -> str:
    """One line per function for a model: its name, signature and docstring summary."""
    lines: list[str] = []
    for name in sorted(functions)[:LISTED_FUNCTIONS]:
        function = functions[name]
        try:
            signature = str(inspect.signature(function, eval_str=True))
        except Exception:  # noqa: BLE001 - unresolvable annotations, builtins
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                signature = "(...)"
        doc = (inspect.getdoc(function) or "").strip()
        summary = " ".join(doc.split("\n\n", 1)[0].split()) if doc else "(no description)"
        if len(summary) > SUMMARY_LIMIT:
            summary = summary[:SUMMARY_LIMIT] + "..."
        lines.append(f"- {name}{signature}: {summary}")
    rest = sorted(functions)[LISTED_FUNCTIONS:]
    if rest:
        lines.append("- also: " + ", ".join(rest))
    return "\n".join(lines)


def _as_json(value: object) -> str:
    return json.dumps(json_value(value), ensure_ascii=False)


def call_host_function(policy: McpPolicy, name: str, args: list[Any],
                       kwargs: dict[str, Any], cancel: threading.Event) -> str:
    """Call host function ``name`` through the host-call channel; the report for a model.

    Blocks until the function returns, the policy's timeout passes or ``cancel`` is set.
    Raises ToolError, in plain words, when the call does not produce a value.
    """
    limits = policy.limits
    available = ", ".join(sorted(policy.functions)) or "(none)"
    try:
        payload = msgpack.packb([args, kwargs], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ToolError(f"the arguments cannot be passed to a host function ({exc}); "
                        "integers are limited to 64 bits") from None
    calls = HostCalls(functions=policy.functions, limits=limits, http=None, cancel=cancel)
    started = time.monotonic()
    try:
        reply = calls.handle(name, payload.decode("latin-1"), started + limits.timeout_s)
    except StopRun as stop:
        if stop.limit is Limit.TIMEOUT:
            raise ToolError(f"the function {name!r} was still running after "
                            f"{limits.timeout_s:g} s, this server's time limit, and its "
                            f"result was abandoned\nlimit exceeded: {Limit.TIMEOUT}") from None
        if len(payload) > limits.host_call_bytes:
            words = (f"its arguments are {len(payload)} bytes once encoded, more than this "
                     f"server's limit of {limits.host_call_bytes} bytes per host call "
                     "(host_call_bytes)")
        elif len(payload) > limits.host_total_bytes:
            words = (f"its arguments are {len(payload)} bytes once encoded, more than this "
                     f"server's limit of {limits.host_total_bytes} bytes per run "
                     "(host_total_bytes)")
        else:
            words = (f"its result is larger than this server's limit of "
                     f"{limits.host_call_bytes} bytes per host call (host_call_bytes) or "
                     f"{limits.host_total_bytes} bytes in all (host_total_bytes)")
        raise ToolError(f"the call to {name!r} was stopped: {words}\n"
                        f"limit exceeded: {stop.limit}") from None
    # Arrays as tuples, so that a map keyed by a tuple decodes (JSON shows them as arrays).
    decoded = msgpack.unpackb(reply.payload.encode("latin-1"), raw=False,
                              strict_map_key=False, use_list=False)
    if not reply.ok:
        kind, kind_type = decoded.get("kind"), decoded.get("type")
        if kind == "denied":
            raise ToolError(f"there is no function {name!r} on this server (the policy "
                            f"refuses it); the functions you can call are: {available}")
        if kind == "error":
            raise ToolError(f"the function {name!r} raised {kind_type}: "
                            f"{decoded.get('message')}")
        raise ToolError(f"the call to {name!r} failed: {decoded.get('message')}")
    return (f"status: ok\nresult (JSON):\n{_clip(_as_json(decoded))}\n"
            f"duration: {time.monotonic() - started:.3f} s")


def create_mcp_server(policy: McpPolicy, store: WorkspaceStore, *,
                      transport: Literal["stdio", "http"]) -> MCPServer[Any]:
    """The ``mcp`` MCPServer exposing run_python and the workspace file tools."""
    sessions_on = policy.config.sessions.enabled
    server: MCPServer[Any] = MCPServer(
        "wasibox", version=__version__,
        instructions=("Runs Python in a sandbox. run_python calls share one interpreter, so "
                      "variables persist between calls until reset; files in /workspace "
                      "persist for this session." if sessions_on else
                      "Runs Python in a sandbox. Each run_python call is a fresh interpreter; "
                      "files in /workspace persist for this session."))
    pool = SessionPool(policy)
    store.on_drop = pool.drop

    def session_key(ctx: Context) -> str | None:
        if transport == "stdio":
            return "stdio"
        # The SDK's documented place for per-connection cleanup is the `Connection`'s
        # `exit_stack`, unwound when the session ends (the client's DELETE, or the transport's
        # idle expiry). mcp 2.3 hands a tool that Connection only through the session's
        # private `_connection`: the public `Context.connection` of `mcp.server.context` is
        # not built for tool handlers yet (its ServerRunner passes a ServerRequestContext),
        # and no public hook reports a session's end. The public Mcp-Session-Id header is no
        # substitute: on the stateless path nothing checks it, so a client could name any
        # workspace. If a later SDK drops the attribute, this fails safe: every request is
        # treated as sessionless (throw-away workspaces), and the HTTP tests fail loudly.
        connection: Any = getattr(ctx.request_context.session, "_connection", None)
        session_id = getattr(connection, "session_id", None)
        if not isinstance(session_id, str):
            return None
        key = f"http:{session_id}"
        # Delete the workspace when the session ends.
        if key not in connection.state:
            connection.state[key] = True
            connection.exit_stack.callback(store.drop, key)
        return key

    def workspace(ctx: Context) -> Path:
        key = session_key(ctx)
        if key is None:
            raise ToolError("the file tools need an MCP session (a stateful connection); "
                            "this request has none")
        root = store.get(key)
        # A live interpreter sees /workspace through its own view until it ends.
        return pool.view(key) or root

    def tool_error(exc: WasiboxError) -> ToolError:
        return ToolError(str(exc))

    async def run_in_sandbox(code: str, root: Path, timeout: float, notes: list[str],
                             ctx: Context, program: dict[str, Any],
                             key: str | None) -> CallToolResult:
        """Run ``code`` with ``root`` at /workspace (in the live session of ``key`` when
        sessions are on), sending progress while it runs; ``program`` holds the run's
        stdin, argv and env."""
        session: Session | None = None
        before: dict[str, _FileState] = {}
        try:
            if sessions_on and key is not None:
                live, note = await asyncio.to_thread(pool.get, key, root)
                if note is not None:
                    notes.append(note)
                session, sandbox = live, live._sandbox
                # A session publishes its files when it ends: tell the model which files
                # this call changed by comparing the session's view before and after it.
                before = await asyncio.to_thread(_view_state, pool.view(key))
                narrow = {"timeout_s": timeout} if timeout < policy.limits.timeout_s else None
                call = live.arun(code, limits=narrow, **program)
            else:
                sandbox = policy.sandbox(root, timeout)
                call = sandbox.arun(code, **program)
        except WasiboxError as exc:
            raise ToolError(operator_message(exc)) from None
        task = asyncio.ensure_future(call)
        try:
            started = time.monotonic()
            while True:
                try:
                    done, _ = await asyncio.wait({task}, timeout=1.0)
                except asyncio.CancelledError:
                    task.cancel()  # the client cancelled the call: cancel the run too
                    raise
                if done:
                    break
                elapsed = time.monotonic() - started
                try:
                    await ctx.report_progress(min(elapsed, timeout), timeout,
                                              f"running for {elapsed:.0f} s")
                except Exception:  # noqa: BLE001 - progress is best effort
                    pass
            result = task.result()
        except WasiboxError as exc:
            raise ToolError(operator_message(exc)) from None
        finally:
            if session is None:
                sandbox.close()
        limits = sandbox.limits.narrow({"timeout_s": timeout})
        staged: list[dict[str, Any]] = []
        if session is not None and session.ended is not None:
            notes.append("this call ended the Python session: its variables are gone, and "
                         "the next run_python starts a fresh interpreter; the files it had "
                         "written to /workspace were published (files)")
            result = dataclasses.replace(result, files=list(session.files),
                                         files_refused=list(session.files_refused))
        elif session is not None:
            after = await asyncio.to_thread(_view_state, pool.view(key))
            staged = staged_changes(before, after)
        return CallToolResult(
            content=[TextContent(type="text",
                                 text=describe_result(result, limits, notes, staged))],
            structured_content=structured_result(result, notes, staged))

    @server.tool(description=(RUN_PYTHON_SESSION_DESCRIPTION.format(
        idle=policy.config.sessions.idle_timeout_s) if sessions_on else RUN_PYTHON_DESCRIPTION))
    async def run_python(
        code: Annotated[str, Field(description="the Python source to run")],
        ctx: Context,
        timeout_s: Annotated[float | None, Field(gt=0, description=TIMEOUT_DESCRIPTION)] = None,
        stdin: Annotated[str | None, Field(
            description="text the code reads from sys.stdin (default: empty)")] = None,
        argv: Annotated[list[str] | None, Field(
            description="the code's whole sys.argv, argv[0] included (default: [''])")] = None,
        env: Annotated[dict[str, str] | None, Field(
            description="the code's os.environ (default: empty)")] = None,
    ) -> Annotated[CallToolResult, RunReport]:
        notes: list[str] = []
        ceiling = policy.limits.timeout_s
        timeout = ceiling
        if timeout_s is not None:
            if timeout_s > ceiling:
                notes.append(f"timeout_s={timeout_s:g} is above this server's limit; "
                             f"the run used {ceiling:g} s")
            else:
                timeout = timeout_s
        key = session_key(ctx)
        if key is None:
            root = store.ephemeral()
            notes.append("no MCP session: /workspace was a throw-away directory for this run")
        else:
            root, renewed = store.acquire(key, hold=True)
            if renewed:
                notes.append(f"this session's workspace was deleted after "
                             f"{store.idle_timeout_s:g} s without a call; /workspace started "
                             "empty")
        try:
            return await run_in_sandbox(code, root, timeout, notes, ctx,
                                        {"stdin": stdin, "argv": argv, "env": env}, key)
        finally:
            if key is None:
                store.discard(root)
            else:
                store.release(key)

    @server.tool(description=(
        "Write a UTF-8 text file into the session's workspace (seen by code as /workspace/"
        f"PATH). PATH is relative to the workspace; '..' is refused. At most {FILE_LIMIT} "
        "bytes; an existing file is replaced."))
    async def write_file(
        path: Annotated[str, Field(description="file path relative to /workspace")],
        content: Annotated[str, Field(description="the text to write")],
        ctx: Context,
    ) -> str:
        try:
            return _write(workspace(ctx), path, content)
        except WasiboxError as exc:
            raise tool_error(exc) from None

    @server.tool(description=(
        "Read a UTF-8 text file from the session's workspace, including files that "
        "run_python code wrote under /workspace. PATH is relative to the workspace (or "
        f"starts with /workspace/). At most {FILE_LIMIT} bytes."))
    async def read_file(
        path: Annotated[str, Field(description="file path relative to /workspace")],
        ctx: Context,
    ) -> str:
        try:
            return _read(workspace(ctx), path)
        except WasiboxError as exc:
            raise tool_error(exc) from None

    @server.tool(description=(
        "List the files in the session's workspace (/workspace), with their sizes."))
    async def list_files(ctx: Context) -> str:
        return _list(workspace(ctx))

    if sessions_on:
        @server.tool(description=RESET_DESCRIPTION)
        async def reset(ctx: Context) -> str:
            key = session_key(ctx)
            if key is None:
                return ("this request has no MCP session, so there is no interpreter to "
                        "reset: every run_python is already fresh")
            live = await asyncio.to_thread(pool.drop, key)
            return ("the Python session was reset: the next run_python starts a fresh "
                    "interpreter; files in /workspace are kept" if live else
                    "there was no live Python session; the next run_python starts a fresh "
                    "interpreter; files in /workspace are kept")

    if policy.functions:
        async def call_function(name: str, args: list[Any] | None = None,
                                kwargs: dict[str, Any] | None = None) -> str:
            cancel = threading.Event()
            try:
                return await asyncio.to_thread(call_host_function, policy, name, args or [],
                                               kwargs or {}, cancel)
            except asyncio.CancelledError:
                cancel.set()  # stop waiting for the function (its thread cannot be killed)
                raise

        # The schema lists the configured names (an enum the model can read). They are only
        # known here, so the annotations are objects rather than strings the SDK would
        # evaluate in this module's globals.
        names: list[Any] = sorted(policy.functions)
        call_function.__annotations__ = {
            "name": Annotated[str, Field(description="the function's name, one of those listed",
                                         json_schema_extra={"enum": names})],
            "args": Annotated[list[Any] | None, Field(
                description="positional arguments, as a JSON array")],
            "kwargs": Annotated[dict[str, Any] | None, Field(
                description="keyword arguments, as a JSON object")],
            "return": str,
        }
        server.tool(description=CALL_FUNCTION_DESCRIPTION.format(
            call_bytes=policy.limits.host_call_bytes, timeout=policy.limits.timeout_s,
            functions=describe_functions(policy.functions)))(call_function)

    return server


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_mcp(config_path: str | None = None, *, tenant: str | None = None,
              transport: Literal["stdio", "http"] = "stdio", host: str = "127.0.0.1",
              port: int = 8765, idle_timeout_s: float = IDLE_TIMEOUT_S) -> int:
    """Run ``wasibox mcp`` until stopped; without ``config_path``, under the default policy.

    Warnings about the policy go to stderr (a stdio client's log). Raises ConfigError for a
    bad config, or for ``tenant`` without a config, and UsageError for an HTTP ``host`` that
    is not a loopback address (the transport has no authentication).
    """
    if transport == "http" and not _loopback(host):
        raise UsageError(f"the MCP HTTP transport has no authentication, so it listens only on "
                         f"a loopback address (127.0.0.1, ::1, localhost), not {host!r}; to "
                         "reach it from elsewhere, put an authenticating proxy in front of it")
    if config_path is None:
        if tenant is not None:
            raise ConfigError("--tenant names a tenant of a configuration: give --config too")
        policy = McpPolicy.default()
    else:
        policy = McpPolicy.from_config(load_config(config_path), tenant)
    for warning in policy.warnings():
        print(f"wasibox mcp: warning: {warning}", file=sys.stderr, flush=True)
    store = WorkspaceStore(idle_timeout_s)
    if threading.current_thread() is threading.main_thread():
        # Turn SIGTERM into an orderly exit, so the workspaces are deleted (uvicorn hands a
        # SIGTERM it caught back to this handler once it has shut down).
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server = create_mcp_server(policy, store, transport=transport)
        if transport == "stdio":
            server.run()
        else:
            server.run("streamable-http", host=host, port=port,
                       session_idle_timeout=idle_timeout_s)
    finally:
        store.close()
    return 0
