"""``wasibox mcp``: wasibox as the code-execution tool of an AI agent, over the Model Context
Protocol (the official ``mcp`` SDK; stdio or streamable HTTP).

Policy comes from the same TOML file as ``wasibox serve`` (``wasibox._config``): one tenant's
limits, mounts, HTTP allowlist and host functions. Nothing a tool call sends can change it: the
tools take code, a timeout that is clamped to the policy's, and workspace-relative paths.

Sessions. Every MCP session gets its own workspace directory, mounted writable at
``/workspace`` in each run, so files persist from call to call; every ``run_python`` still
gets a fresh interpreter. Over stdio the process is the session. Over streamable HTTP the
session is the transport's session id (``Mcp-Session-Id``); a request that has none (the
stateless 2026 protocol) runs code in a throw-away workspace, and the file tools say they need
a session. Workspaces are deleted when their session ends, after ``idle_timeout_s`` without a
call, and when the server stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from ._config import Config, TenantConfig, load_config
from ._errors import ConfigError, UsageError, WasiboxError
from ._files import STAGING_DIR, Mount
from ._limits import Limits
from ._result import RunResult
from ._sandbox import Sandbox
from ._version import __version__

__all__ = ["McpPolicy", "WorkspaceStore", "create_mcp_server", "describe_result", "serve_mcp"]

#: Characters of stdout (and of stderr) a tool result carries before it is cut with a marker.
TEXT_LIMIT = 20_000
#: Largest file the file tools write or read, in bytes.
FILE_LIMIT = 1 * 2**20
#: Entries list_files reports at most.
LIST_LIMIT = 1_000
#: A workspace not touched for this long is deleted (seconds).
IDLE_TIMEOUT_S = 30 * 60.0
WORKSPACE = "/workspace"


@dataclasses.dataclass(frozen=True)
class McpPolicy:
    """The policy of one MCP server: a tenant of the config file, resolved."""

    tenant: str
    limits: Limits
    config: TenantConfig
    functions: dict[str, Callable[..., Any]]

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
        limits = dataclasses.replace(self.limits, timeout_s=timeout_s)
        return Sandbox(limits, seed=self.config.seed, clock=self.config.clock,
                       entropy=self.config.entropy, mounts=mounts, workspace=workspace,
                       http=http, functions=self.functions)


class WorkspaceStore:
    """One directory per session under a private temporary root; idle ones are deleted."""

    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="wasibox-mcp-"))
        self.idle_timeout_s = idle_timeout_s
        self._dirs: dict[str, tuple[Path, float]] = {}
        self._lock = threading.Lock()
        self._count = 0

    def get(self, key: str) -> Path:
        """The workspace of session ``key``, made on first use; marks it used now."""
        self.sweep()
        with self._lock:
            entry = self._dirs.get(key)
            if entry is None:
                self._count += 1
                path = self.root / f"session-{self._count}"
                path.mkdir(mode=0o700)
            else:
                path = entry[0]
            self._dirs[key] = (path, time.monotonic())
            return path

    def ephemeral(self) -> Path:
        """A workspace for one call outside any session (delete it with ``discard``)."""
        return Path(tempfile.mkdtemp(prefix="call-", dir=self.root))

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def drop(self, key: str) -> None:
        """Delete the workspace of a session that ended."""
        with self._lock:
            entry = self._dirs.pop(key, None)
        if entry is not None:
            shutil.rmtree(entry[0], ignore_errors=True)

    def sweep(self) -> None:
        """Delete the workspaces idle for longer than the timeout."""
        now = time.monotonic()
        with self._lock:
            idle = [k for k, (_, used) in self._dirs.items()
                    if now - used > self.idle_timeout_s]
        for key in idle:
            self.drop(key)

    def close(self) -> None:
        with self._lock:
            self._dirs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


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
            return f"the run used all of its CPU budget (fuel) {after}"
        case "timeout":
            return f"the run hit its wall-clock time limit of {limits.timeout_s:g} s"
        case "memory":
            return (f"the run hit its memory limit of {limits.memory_bytes // 2**20} MiB "
                    f"{after}")
        case "output":
            return (f"the run wrote more than its output limit of {limits.output_bytes} bytes "
                    f"and was stopped {after}")
        case "host_calls":
            return (f"the run made more host calls (or moved more bytes through them) than "
                    f"its policy allows {after}")
        case "cancelled":
            return "the run was cancelled"
        case other:
            return f"the run hit its {other} limit {after}"


def describe_result(result: RunResult, limits: Limits, notes: list[str]) -> str:
    """The plain-text report of a run that a model reads."""
    lines: list[str] = []
    if result.ok:
        lines.append("status: ok")
    elif result.limit_exceeded is not None:
        lines.append(f"status: stopped: {_limit_words(result, limits)}")
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
    lines.append(f"fuel used: {result.fuel_used}; duration: {result.duration_s:.3f} s; "
                 f"backend: {result.backend}")
    return "\n".join(lines)


# -- confined paths ---------------------------------------------------------------------------

def _confine(root: Path, path: str) -> Path:
    """``path`` (relative, or under /workspace) inside ``root``. Raises UsageError."""
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
    target = root.joinpath(*parts)
    # Refuse symbolic links anywhere on the way: the guest cannot make them, and a path
    # through one could lead out of the workspace.
    probe = root
    for part in parts:
        probe = probe / part
        if probe.is_symlink():
            raise UsageError(f"{path!r} goes through a symbolic link, which is refused")
    return target


def _write(root: Path, path: str, content: str) -> str:
    data = content.encode("utf-8")
    if len(data) > FILE_LIMIT:
        raise UsageError(f"the content is {len(data)} bytes; files are capped at "
                         f"{FILE_LIMIT} bytes")
    target = _confine(root, path)
    if target == root:
        raise UsageError("give a file path, not the workspace itself")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return f"wrote {len(data)} bytes to {WORKSPACE}/{target.relative_to(root).as_posix()}"


def _read(root: Path, path: str) -> str:
    target = _confine(root, path)
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise UsageError(f"there is no file {path!r} in the workspace") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UsageError(f"{path!r} is not a regular file")
        data = handle.read(FILE_LIMIT + 1)
    if len(data) > FILE_LIMIT:
        raise UsageError(f"{path!r} is over {FILE_LIMIT} bytes; read it in code and print "
                         "the part you need")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path!r} is not UTF-8 text; inspect it with run_python") from None


def _list(root: Path) -> str:
    entries: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != STAGING_DIR)
        for name in sorted(filenames):
            full = Path(dirpath) / name
            try:
                size = full.lstat().st_size
            except OSError:
                continue
            entries.append(f"{full.relative_to(root).as_posix()} ({size} bytes)")
            if len(entries) >= LIST_LIMIT:
                entries.append(f"[... listing stopped at {LIST_LIMIT} files ...]")
                return "\n".join(entries)
    return "\n".join(entries) if entries else "(the workspace is empty)"


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

TIMEOUT_DESCRIPTION = ("wall-clock limit for this run in seconds; values above the operator's "
                       "limit are lowered to it (the result says so)")


def create_mcp_server(policy: McpPolicy, store: WorkspaceStore, *,
                      transport: Literal["stdio", "http"]) -> MCPServer[Any]:
    """The ``mcp`` MCPServer exposing run_python and the workspace file tools."""
    server: MCPServer[Any] = MCPServer(
        "wasibox", version=__version__,
        instructions=("Runs Python in a sandbox. Each run_python call is a fresh interpreter; "
                      "files in /workspace persist for this session."))

    def session_key(ctx: Context) -> str | None:
        if transport == "stdio":
            return "stdio"
        session = ctx.request_context.session
        connection: Any = getattr(session, "_connection", None)
        session_id = getattr(connection, "session_id", None)
        if session_id is None:
            return None
        key = f"http:{session_id}"
        # Delete the workspace when the session ends (the client's DELETE, or expiry).
        if key not in getattr(connection, "state", {}):
            connection.state[key] = True
            connection.exit_stack.callback(store.drop, key)
        return key

    def workspace(ctx: Context) -> Path:
        key = session_key(ctx)
        if key is None:
            raise ToolError("the file tools need an MCP session (a stateful connection); "
                            "this request has none")
        return store.get(key)

    def tool_error(exc: WasiboxError) -> ToolError:
        return ToolError(str(exc))

    @server.tool(description=RUN_PYTHON_DESCRIPTION)
    async def run_python(
        code: Annotated[str, Field(description="the Python source to run")],
        ctx: Context,
        timeout_s: Annotated[float | None, Field(gt=0, description=TIMEOUT_DESCRIPTION)] = None,
    ) -> str:
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
            root = store.get(key)
        try:
            sandbox = policy.sandbox(root, timeout)
        except WasiboxError as exc:
            raise tool_error(exc) from None
        try:
            task = asyncio.ensure_future(sandbox.arun(code))
            started = time.monotonic()
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
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
            raise tool_error(exc) from None
        finally:
            sandbox.close()
            if key is None:
                store.discard(root)
        return describe_result(result, sandbox.limits, notes)

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

    return server


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def serve_mcp(config_path: str, *, tenant: str | None = None,
              transport: Literal["stdio", "http"] = "stdio", host: str = "127.0.0.1",
              port: int = 8765, idle_timeout_s: float = IDLE_TIMEOUT_S) -> int:
    """Run ``wasibox mcp`` until stopped. Raises ConfigError for a bad config."""
    policy = McpPolicy.from_config(load_config(config_path), tenant)
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
