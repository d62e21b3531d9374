"""``wasibox mcp``, driven by the official ``mcp`` client over stdio (the server spawned as a
subprocess, as an agent's client does) and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import http.server
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("mcp", reason="the mcp package (the 'mcp' extra) is not installed")

from mcp import Client, StdioServerParameters  # noqa: E402

from tests.conftest import PYTHON, child_env  # noqa: E402
from tests.services import mcp_functions  # noqa: E402
from wasibox._errors import UsageError  # noqa: E402
from wasibox._limits import FUEL_PER_SECOND, Limits  # noqa: E402
from wasibox.capabilities.files.mount import STAGING_DIR  # noqa: E402
from wasibox.services.config import load_config, parse_config  # noqa: E402
from wasibox.services.mcp import (  # noqa: E402
    McpPolicy,
    WorkspaceStore,
    _read,
    _workspace_parts,
    _write,
    create_mcp_server,
    describe_functions,
    operator_message,
)

pytestmark = pytest.mark.guest
T = TypeVar("T")

CONFIG = """\
[tenants.agent]
token_sha256 = "{digest}"
limits = {{ fuel = 400_000_000, memory_bytes = "64MiB", timeout_s = 4, output_bytes = "64KiB" }}

[tenants.agent.functions]
add = "tests.services.mcp_functions:add"
greet = "tests.services.mcp_functions:greet"

[tenants.agent.http]
allow = ["example.com"]
allow_loopback_endpoints = ["127.0.0.1:{port}"]
"""


class Loopback(http.server.BaseHTTPRequestHandler):
    """The loopback test service the config opts into."""

    def do_GET(self) -> None:
        body = b"hello from loopback"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture(scope="module")
def loopback_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loopback)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def config(tmp_path: Path, loopback_port: int) -> Path:
    path = tmp_path / "wasibox.toml"
    path.write_text(CONFIG.format(digest="0" * 64, port=loopback_port), encoding="utf-8")
    return path


def fetch_code(port: int) -> str:
    return ("import urllib.request\n"
            f"print(urllib.request.urlopen('http://127.0.0.1:{port}/data').read())")


def text(result: Any) -> str:
    assert len(result.content) == 1
    return str(result.content[0].text)


async def core_cases(client: Client, loopback_port: int) -> None:
    """The behaviour every transport must show, on one connected client."""
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == {"run_python", "write_file", "read_file", "list_files",
                          "call_function", "reset"}
    run = tools["run_python"]
    assert run.input_schema["required"] == ["code"]
    assert run.input_schema["properties"]["code"]["type"] == "string"
    assert "timeout_s" in run.input_schema["properties"]
    assert "State PERSISTS between calls" in (run.description or "")
    assert set(tools["write_file"].input_schema["required"]) == {"path", "content"}

    call = tools["call_function"]
    assert call.input_schema["required"] == ["name"]
    assert call.input_schema["properties"]["name"]["enum"] == ["add", "greet"]
    assert "array" in str(call.input_schema["properties"]["args"])
    assert "object" in str(call.input_schema["properties"]["kwargs"])
    assert "- add(a: int, b: int) -> int: Add two integers.\n" in (call.description or "")
    assert "not part of the summary" not in (call.description or "")

    # A configured host function, called directly, and an unknown one.
    result = await client.call_tool("call_function", {"name": "add", "args": [2, 3]})
    assert not result.is_error and "result (JSON):\n5\n" in text(result)
    result = await client.call_tool("call_function", {"name": "nope", "args": []})
    assert result.is_error
    assert "no function 'nope'" in text(result) and "you can call are: add, greet" in text(result)

    # The loopback service the config opts into is reachable from code.
    report = text(await client.call_tool("run_python", {"code": fetch_code(loopback_port)}))
    assert "status: ok" in report and "b'hello from loopback'" in report

    # A computation.
    result = await client.call_tool("run_python", {"code": "print(sum(range(101)))"})
    assert not result.is_error
    assert "status: ok" in text(result) and "\n5050" in text(result)
    assert "fuel used:" in text(result) and "backend: wasm" in text(result)

    # A guest exception: type, message and traceback, no host stack.
    result = await client.call_tool("run_python", {"code": "def f():\n    1/0\nf()"})
    report = text(result)
    assert "status: error: ZeroDivisionError: division by zero" in report
    assert "traceback:" in report and "line 2, in f" in report
    assert "wasibox/" not in report

    # The program's stdin, argv and environment, given by the caller alone.
    result = await client.call_tool("run_python", {
        "code": "import os, sys\nprint(sys.stdin.read().upper(), sys.argv, dict(os.environ))",
        "stdin": "piped", "argv": ["tool.py", "--all"], "env": {"MODE": "fast"}})
    assert "\nPIPED ['tool.py', '--all'] {'MODE': 'fast'}" in text(result), text(result)
    result = await client.call_tool("run_python", {"code": "pass", "argv": ["a\x00b"]})
    assert result.is_error and "NUL" in text(result)

    # A limit, in plain words, with its name.
    result = await client.call_tool("run_python", {"code": "while True: pass"})
    assert "the run used all of its CPU budget (fuel: 400,000,000 units) after" in text(result)
    assert "the operator can raise limits.fuel in the configuration" in text(result)
    assert "\nlimit exceeded: fuel\n" in text(result)

    # A timeout above the policy is clamped, and the result says so.
    result = await client.call_tool("run_python", {"code": "print('hi')", "timeout_s": 999})
    assert "above this server's limit; the run used 4 s" in text(result)

    # Output past the output limit is cut with a visible marker.
    result = await client.call_tool("run_python", {"code": "print('x' * 100_000)"})
    assert "stdout truncated" in text(result)

    # The cloud metadata endpoint is denied, and the run reports it.
    code = ("import urllib.request\n"
            "urllib.request.urlopen('http://169.254.169.254/latest/meta-data/')")
    report = text(await client.call_tool("run_python", {"code": code}))
    assert "CapabilityDenied" in report
    assert "denied: http" in report and "169.254.169.254" in report

    # Files written by code are readable with read_file; state carries over until reset.
    code = (
        "import os\nos.makedirs('/workspace/out', exist_ok=True)\n"
        "open('/workspace/out/result.txt', 'w').write('42\\n')\nx = 1")
    assert "status: ok" in text(await client.call_tool("run_python", {"code": code}))
    assert text(await client.call_tool("read_file", {"path": "out/result.txt"})) == "42\n"
    assert text(await client.call_tool("read_file",
                                       {"path": "/workspace/out/result.txt"})) == "42\n"
    assert "\n1\n" in text(await client.call_tool("run_python", {"code": "print(x)"}))
    assert "was reset" in text(await client.call_tool("reset", {}))
    assert "NameError" in text(await client.call_tool("run_python", {"code": "print(x)"}))
    written = await client.call_tool("write_file", {"path": "in.txt", "content": "hello"})
    assert not written.is_error
    listing = text(await client.call_tool("list_files", {}))
    assert "out/result.txt (3 bytes)" in listing and "in.txt (5 bytes)" in listing
    result = await client.call_tool("run_python",
                                     {"code": "print(open('/workspace/in.txt').read())"})
    assert "\nhello" in text(result)

    # Path traversal in the file tools is refused as a tool error.
    for bad in ("../escape.txt", "a/../../escape.txt", "/etc/passwd", ".wasibox-staging/x"):
        result = await client.call_tool("write_file", {"path": bad, "content": "x"})
        assert result.is_error, bad
        result = await client.call_tool("read_file", {"path": bad})
        assert result.is_error, bad
    result = await client.call_tool("read_file", {"path": "missing.txt"})
    assert result.is_error and "no file" in text(result)

    # Malformed arguments give a clean tool error, not a crash.
    for arguments in ({}, {"code": 5}, {"code": "print(1)", "timeout_s": "soon"},
                      {"code": "print(1)", "timeout_s": -1}):
        result = await client.call_tool("run_python", arguments)
        assert result.is_error, arguments
        assert "Traceback" not in text(result)
    result = await client.call_tool("write_file", {"path": "x.txt"})
    assert result.is_error
    # ... and the server is still healthy afterwards.
    result = await client.call_tool("run_python", {"code": "print('still here')"})
    assert "still here" in text(result)


def server_env(tmp: Path) -> dict[str, str]:
    """The child's environment, with its temporary files (so its workspaces) under ``tmp``."""
    tmp.mkdir()
    return {**child_env(), "TMPDIR": str(tmp)}


def workspaces(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("wasibox-mcp-*/session-*"))


def test_stdio(config: Path, tmp_path: Path, loopback_port: int) -> None:
    params = StdioServerParameters(
        command=PYTHON, args=["-m", "wasibox", "mcp", "--config", str(config)],
        env=server_env(tmp_path / "tmp"))

    async def main() -> None:
        async with Client(params, read_timeout_seconds=60) as client:
            await core_cases(client, loopback_port)
            assert len(workspaces(tmp_path / "tmp")) == 1

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while list((tmp_path / "tmp").glob("wasibox-mcp-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list((tmp_path / "tmp").glob("wasibox-mcp-*")), "the workspace outlived the session"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def http_server(config: Path, tmp: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [PYTHON, "-m", "wasibox", "mcp", "--config", str(config), "--transport", "http",
         "--port", str(port)], env=server_env(tmp), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the MCP server did not start: "
                                       + process.stderr.read().decode()) from None  # type: ignore[union-attr]
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stderr is not None:
            process.stderr.close()


@contextlib.asynccontextmanager
async def http_client(url: str) -> AsyncIterator[Client]:
    # The handshake ("legacy") mode gives the connection a session id, and so a workspace.
    async with Client(url, mode="legacy", read_timeout_seconds=60) as client:
        yield client


def test_streamable_http(config: Path, tmp_path: Path, loopback_port: int) -> None:
    async def main(url: str) -> None:
        async with http_client(url) as client:
            await core_cases(client, loopback_port)

    with http_server(config, tmp_path / "tmp") as url:
        asyncio.run(main(url))
    # Stopping the server (SIGTERM) deletes every workspace it made.
    assert not list((tmp_path / "tmp").glob("wasibox-mcp-*"))


def test_http_sessions_have_separate_workspaces(config: Path, tmp_path: Path) -> None:
    async def session(url: str, name: str) -> tuple[str, str]:
        async with http_client(url) as client:
            code = f"open('/workspace/{name}.txt', 'w').write('{name}')\nwho = '{name}'"
            assert "status: ok" in text(await client.call_tool("run_python", {"code": code}))
            listing = text(await client.call_tool("list_files", {}))
            mine = text(await client.call_tool("read_file", {"path": f"{name}.txt"}))
            # Each session has its own interpreter, which keeps its own variables.
            await asyncio.sleep(0.2)
            kept = text(await client.call_tool("run_python", {"code": "print(who)"}))
            assert f"\n{name}\n" in kept, kept
            return listing, mine

    async def main(url: str) -> None:
        (one, a), (two, b) = await asyncio.gather(session(url, "alpha"),
                                                  session(url, "beta"))
        assert (a, b) == ("alpha", "beta")
        assert "alpha.txt" in one and "beta.txt" not in one
        assert "beta.txt" in two and "alpha.txt" not in two
        # Each client closed its session on exit (DELETE), which deleted its workspace.
        deadline = time.monotonic() + 10
        while workspaces(tmp_path / "tmp") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert workspaces(tmp_path / "tmp") == []

    with http_server(config, tmp_path / "tmp") as url:
        asyncio.run(main(url))


def test_stateless_http_run_gets_a_throwaway_workspace(config: Path, tmp_path: Path) -> None:
    async def main(url: str) -> None:
        async with Client(url, read_timeout_seconds=60) as client:  # the 2026 stateless mode
            result = await client.call_tool("run_python", {"code": "print(6 * 7)"})
            assert "\n42" in text(result) and "no MCP session" in text(result)
            result = await client.call_tool("list_files", {})
            assert result.is_error and "need an MCP session" in text(result)

    with http_server(config, tmp_path / "tmp") as url:
        asyncio.run(main(url))


# -- host logic, no guest needed --------------------------------------------------------------

@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "/etc/passwd", "/workspace/../x",
                                  "", "a\x00b", ".wasibox-staging/run", "a\\..\\x"])
def test_confine_refuses_paths_outside(tmp_path: Path, path: str) -> None:
    with pytest.raises(UsageError):
        _workspace_parts(path)
    with pytest.raises(UsageError):
        _write(tmp_path, path, "x")
    assert list(tmp_path.iterdir()) == []


def test_confine_refuses_symlinks_on_the_way_and_at_the_end(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "dir-link").symlink_to(outside)
    (workspace / "file-link").symlink_to(outside / "secret")
    for path in ("dir-link/secret", "file-link", "/workspace/dir-link/new"):
        with pytest.raises(UsageError, match="symbolic link"):
            _read(workspace, path)
        with pytest.raises(UsageError, match="symbolic link"):
            _write(workspace, path, "overwritten")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "secret"
    assert _write(workspace, "/workspace/a/b.txt", "x") == "wrote 1 bytes to /workspace/a/b.txt"
    assert (workspace / "a" / "b.txt").read_text() == "x"
    assert _read(workspace, "a/b.txt") == "x"


def test_confine_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    for action in (lambda: _read(tmp_path, "pipe"), lambda: _write(tmp_path, "pipe", "x")):
        with pytest.raises(UsageError, match="not a regular file|cannot open"):
            action()


#: Path components a model might send, among them ways out of the workspace: "..", the
#: staging directory, a link ("l") planted to a directory outside, and bytes a path forbids.
PATH_PARTS = ["a", "b", ".", "..", "l", "", STAGING_DIR, "a\x00", "\u00e9", "a\\b"]


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(PATH_PARTS), max_size=6), absolute=st.booleans())
def test_file_tools_never_reach_outside_the_workspace(parts: list[str], absolute: bool) -> None:
    path = ("/workspace/" if absolute else "") + "/".join(parts)
    with tempfile.TemporaryDirectory() as top:
        outside = Path(top, "outside")
        outside.mkdir()
        (outside / "a").write_text("secret")
        workspace = Path(top, "workspace")
        workspace.mkdir()
        (workspace / "l").symlink_to(outside)
        try:
            _write(workspace, path, "x")
        except UsageError:
            written = False
        else:
            written = True
            assert _read(workspace, path) == "x"
        if not written:
            with pytest.raises(UsageError):
                _read(workspace, path)
        assert sorted(os.listdir(top)) == ["outside", "workspace"]
        assert [p.name for p in outside.iterdir()] == ["a"]
        assert (outside / "a").read_text() == "secret"


def test_workspaces_are_deleted_when_idle_or_closed() -> None:
    store = WorkspaceStore(idle_timeout_s=0.2)
    try:
        first, renewed = store.acquire("one", hold=True)  # held: not idle while written
        (first / "f").write_text("x")
        store.release("one")
        assert not renewed
        second = store.get("two")
        # Nothing calls in: the store's own sweep deletes both once they are idle.
        assert wait_for(lambda: not first.exists() and not second.exists())
        third, renewed = store.acquire("one")
        assert renewed and third.exists() and third not in (first, second)
        assert store.acquire("one") == (third, False)
        store.drop("one")
        assert not third.exists()
    finally:
        store.close()
    assert not store.root.exists() and not store._sweeper.is_alive()
    store.close()  # idempotent


def test_long_runs_report_progress() -> None:
    # In-process client: the transport is not what this checks, and it saves a process.
    config = parse_config({"tenants": {"agent": {
        "token_sha256": "0" * 64, "limits": {"fuel": 10**13, "timeout_s": 1.6}}}})
    store = WorkspaceStore()
    server = create_mcp_server(McpPolicy.from_config(config), store, transport="stdio")
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    async def main() -> str:
        async with Client(server) as client:
            result = await client.call_tool("run_python", {"code": "while True: pass"},
                                            progress_callback=progress)
            return text(result)

    try:
        report = asyncio.run(main())
    finally:
        store.close()
    assert "the run hit its wall-clock time limit of 1.6 s" in report
    assert seen and seen[0][1] == 1.6 and "running for" in (seen[0][2] or "")


# -- in-process: the policy's limits, host functions, loopback, idle cleanup -------------------

def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def agent_policy(**tenant: Any) -> McpPolicy:
    return McpPolicy.from_config(parse_config(
        {"tenants": {"agent": {"token_sha256": "0" * 64, **tenant}}}))


def in_process(policy: McpPolicy, main: Callable[[Client], Awaitable[T]],
               store: WorkspaceStore | None = None) -> T:
    """Run ``main`` with the SDK's client connected to the server in memory.

    The transports are covered above; these tests check what the tools do, and save a process.
    """
    store = store or WorkspaceStore()
    server = create_mcp_server(policy, store, transport="stdio")

    async def run() -> T:
        async with Client(server) as client:
            return await main(client)

    try:
        return asyncio.run(run())
    finally:
        store.close()


FUNCTIONS = {name: f"tests.services.mcp_functions:{name}"
             for name in ("add", "greet", "fail", "repeat", "nap", "raw")}

LIMIT_CASES = [
    ("fuel", {"code": "while True: pass"},
     "the run used all of its CPU budget (fuel: 50,000,000 units) after"),
    ("timeout", {"code": "import time\ntime.sleep(60)", "timeout_s": 0.5},
     "the run hit its wall-clock time limit of 0.5 s"),
    ("memory", {"code": "x = bytearray(200 * 2**20)"},
     "the run hit its memory limit of 64 MiB"),
    ("output", {"code": "print('x' * 10_000)"},
     "the run wrote more than its output limit of 4096 bytes and was stopped"),
    # host_calls: the number of calls, one call's argument, one call's result.
    ("host_calls", {"code": "import host\nfor _ in range(10):\n    host.add(1, 2)"},
     "the run went past its host-call limits (at most 3 calls, 16384 bytes per call"),
    ("host_calls", {"code": "import host\nhost.repeat('x' * 20_000, 1)"},
     "the run went past its host-call limits (at most 3 calls, 16384 bytes per call"),
    ("host_calls", {"code": "import host\nhost.repeat('x', 20_000)"},
     "the run went past its host-call limits (at most 3 calls, 16384 bytes per call"),
]


def test_each_limit_is_reported_in_plain_words_with_its_name() -> None:
    policy = agent_policy(
        limits={"fuel": 50_000_000, "memory_bytes": "64MiB", "timeout_s": 2,
                "output_bytes": "4KiB", "host_calls": 3, "host_call_bytes": "16KiB"},
        functions=FUNCTIONS)

    async def main(client: Client) -> None:
        for limit, arguments, words in LIMIT_CASES:
            report = text(await client.call_tool("run_python", arguments))
            assert f"status: stopped: {words}" in report, (limit, report)
            assert f"\nlimit exceeded: {limit}\n" in report, (limit, report)
            assert "Traceback" not in report.split("traceback:")[0], report
        # Within the limits, the same calls work: the limits above were what stopped them.
        report = text(await client.call_tool(
            "run_python", {"code": "import host\nprint(host.add(1, 2))"}))
        assert "status: ok" in report and "\n3\n" in report
        # A timeout_s above the policy is clamped to it, and the result says so.
        report = text(await client.call_tool(
            "run_python", {"code": "import time\ntime.sleep(60)", "timeout_s": 999}))
        assert "note: timeout_s=999 is above this server's limit; the run used 2 s" in report
        assert "the run hit its wall-clock time limit of 2 s" in report
        assert "\nlimit exceeded: timeout\n" in report

    in_process(policy, main)


def test_call_function_runs_configured_functions_under_the_host_call_policy() -> None:
    policy = agent_policy(limits={"timeout_s": 1, "host_call_bytes": "16KiB"},
                          functions=FUNCTIONS)

    async def call(client: Client, arguments: dict[str, Any]) -> tuple[bool, str]:
        result = await client.call_tool("call_function", arguments)
        return bool(result.is_error), text(result)

    async def main(client: Client) -> None:
        ok = await call(client, {"name": "greet", "args": ["Ada"], "kwargs": {"excited": True}})
        assert ok == (False, ok[1]) and 'result (JSON):\n{"greeting": "Hello, Ada!"}' in ok[1]
        assert "result (JSON):\n{\"base64\": \"AAAA\"}" in (
            await call(client, {"name": "raw", "args": [3]}))[1]

        failed, report = await call(client, {"name": "fail", "args": ["secrets"]})
        assert failed and report.endswith("the function 'fail' raised ValueError: cannot "
                                          "open <path>: secrets")
        failed, report = await call(client, {"name": "add", "args": ["a", 1]})
        assert failed and "the function 'add' raised TypeError" in report
        # Unknown names, and the name the guest's HTTP client uses, are refused.
        for name in ("nope", "@http", "__import__"):
            failed, report = await call(client, {"name": name})
            assert failed and f"there is no function {name!r}" in report, report
            assert "add, fail, greet, nap, raw, repeat" in report

        # The payload caps: the arguments, then the result.
        failed, report = await call(client, {"name": "repeat", "args": ["x" * 20_000, 1]})
        assert failed and "its arguments are 20007 bytes once encoded, more than this " \
            "server's limit of 16384 bytes per host call (host_call_bytes)" in report
        assert report.endswith("\nlimit exceeded: host_calls")
        failed, report = await call(client, {"name": "repeat", "args": ["x", 20_000]})
        assert failed and "its result is larger than this server's limit of 16384 bytes" \
            in report and report.endswith("\nlimit exceeded: host_calls")
        # A function still running at the policy's timeout is abandoned.
        failed, report = await call(client, {"name": "nap", "args": [30]})
        assert failed and report.endswith(
            "the function 'nap' was still running after 1 s, this server's time limit, and "
            "its result was abandoned\nlimit exceeded: timeout")

        # Malformed arguments are clean tool errors.
        for arguments in ({"args": [1, 2]}, {"name": "add", "args": "1, 2"},
                          {"name": "add", "kwargs": [1]}, {"name": 5},
                          {"name": "add", "args": [2**70, 1]}):
            failed, report = await call(client, arguments)
            assert failed and "Traceback" not in report, arguments
        assert (await call(client, {"name": "add", "args": [2**70, 1]}))[1].endswith(
            "integers are limited to 64 bits")
        # ... and the server still answers.
        assert "result (JSON):\n3\n" in (await call(client, {"name": "add",
                                                              "kwargs": {"a": 1, "b": 2}}))[1]

    in_process(policy, main)


def test_call_function_is_listed_only_when_functions_are_configured() -> None:
    async def names(client: Client) -> set[str]:
        return {tool.name for tool in (await client.list_tools()).tools}

    assert in_process(agent_policy(), names) == {
        "run_python", "reset", "write_file", "read_file", "list_files"}
    assert "call_function" in in_process(agent_policy(functions={"add": FUNCTIONS["add"]}),
                                         names)


def test_describe_functions_for_a_model() -> None:
    import math

    description = describe_functions({"add": mcp_functions.add, "hypot": math.hypot,
                                      "nodoc": lambda x: x})
    assert description.splitlines() == [
        "- add(a: int, b: int) -> int: Add two integers.",
        "- hypot(...): " + " ".join((math.hypot.__doc__ or "").split("\n\n")[0].split()),
        "- nodoc(x): (no description)",
    ]
    many = describe_functions({f"f{i:03d}": mcp_functions.add for i in range(60)})
    assert many.splitlines()[-1].startswith("- also: f050, f051")


def test_loopback_service_is_reachable_only_with_the_opt_in(loopback_port: int) -> None:
    code = fetch_code(loopback_port)

    async def run(client: Client) -> str:
        return text(await client.call_tool("run_python", {"code": code}))

    opted_in = in_process(agent_policy(http={
        "allow": ["example.com"], "allow_loopback_endpoints": [f"127.0.0.1:{loopback_port}"]}),
        run)
    assert "status: ok" in opted_in and "b'hello from loopback'" in opted_in
    for http_table in ({"allow": ["example.com"]}, {"allow": [f"127.0.0.1:{loopback_port}"]}):
        denied = in_process(agent_policy(http=http_table), run)
        assert "status: error: CapabilityDenied" in denied, denied
        assert f"denied: http GET http://127.0.0.1:{loopback_port}/data" in denied


def test_idle_workspace_is_deleted_without_another_call() -> None:
    store = WorkspaceStore(idle_timeout_s=0.5)

    async def main(client: Client) -> None:
        assert not (await client.call_tool("write_file", {"path": "a.txt",
                                                          "content": "x"})).is_error
        workspace = store.root / "session-1"  # the first session's (maybe already swept)
        assert await asyncio.to_thread(wait_for, lambda: not workspace.exists())
        report = text(await client.call_tool("run_python", {"code": "import os\n"
                                                            "print(os.listdir('/workspace'))"}))
        assert "note: this session's workspace was deleted after 0.5 s without a call" in report
        assert "\n[]\n" in report
        assert text(await client.call_tool("list_files", {})) == "(the workspace is empty)"

    in_process(agent_policy(), main, store)


def test_a_workspace_in_use_by_a_run_is_not_idle() -> None:
    store = WorkspaceStore(idle_timeout_s=0.2)
    code = ("import time\nopen('/workspace/before.txt', 'w').write('1')\n"
            "time.sleep(1.0)\nopen('/workspace/after.txt', 'w').write('2')")

    async def main(client: Client) -> None:
        # The run outlives the idle timeout several times over; its workspace must stay, or
        # the run could not publish what it wrote.
        report = text(await client.call_tool("run_python", {"code": code}))
        assert "status: ok" in report, report
        assert "files written: /workspace/after.txt, /workspace/before.txt" in report \
            or "files written: /workspace/before.txt, /workspace/after.txt" in report, report

    # Per-run publishing is the sessionless mode's (a session publishes when it ends).
    in_process(agent_policy(clock="real", sessions={"enabled": False}), main, store)


def test_readme_policy_and_client_registration_are_valid() -> None:
    import json
    import tomllib

    readme = README.read_text(encoding="utf-8")
    tenant = parse_config(tomllib.loads(readme_agent_toml())).tenants["agent"]
    assert set(tenant.functions) == {"factorial"}
    assert tenant.http is not None and tenant.http.allow_loopback_endpoints == ["127.0.0.1:8000"]
    (registration,) = [json.loads(block) for block in
                       re.findall(r"```json\n(.*?)```", readme, re.DOTALL)
                       if "mcpServers" in block]
    entry = registration["mcpServers"]["wasibox"]
    assert entry["command"] == "wasibox" and entry["args"][:1] == ["mcp"]


def test_a_cancelled_tool_call_stops_its_run() -> None:
    ticks: list[float] = []
    config = parse_config({"tenants": {"agent": {
        "token_sha256": "0" * 64, "clock": "real", "limits": {"fuel": 10**13, "timeout_s": 60}}}})
    policy = dataclasses.replace(McpPolicy.from_config(config),
                                 functions={"tick": lambda: ticks.append(time.monotonic())})
    code = "import host, time\nwhile True:\n    host.tick()\n    time.sleep(0.05)"

    async def main(client: Client) -> None:
        call = asyncio.ensure_future(client.call_tool("run_python", {"code": code}))
        assert await asyncio.to_thread(wait_for, lambda: len(ticks) >= 3)
        call.cancel()  # the client cancels the request (notifications/cancelled)
        with contextlib.suppress(asyncio.CancelledError):
            await call

        # The run stops: the guest makes no more calls (within the 60 s it was allowed).
        def quiet() -> bool:
            seen = len(ticks)
            time.sleep(0.5)
            return len(ticks) == seen

        assert await asyncio.to_thread(wait_for, quiet)
        result = await client.call_tool("run_python", {"code": "print('next')"})
        assert "\nnext" in text(result)

    in_process(policy, main)


def test_run_python_keeps_state_until_reset_or_a_limit() -> None:
    policy = agent_policy(limits={"fuel": 50_000_000, "timeout_s": 4})

    async def main(client: Client) -> None:
        async def run(code: str) -> dict[str, Any]:
            result = await client.call_tool("run_python", {"code": code})
            assert not result.is_error and result.structured_content is not None
            return result.structured_content

        assert (await run("import json\nrows = [1, 2]"))["status"] == "ok"
        assert (await run("rows.append(3)\nprint(json.dumps(rows))"))["stdout"] == "[1, 2, 3]\n"
        # A file left open by one call is still open in the next.
        assert (await run("log = open('/workspace/log.txt', 'w')\nlog.write('a')"))["status"] \
            == "ok"
        assert (await run("log.write('b')\nlog.flush()"))["status"] == "ok"
        assert text(await client.call_tool("read_file", {"path": "log.txt"})) == "ab"
        # A limit ends the interpreter, and both that call and the next one say so.
        stopped = await run("while True: pass")
        assert stopped["limit"] == "fuel"
        assert any("ended the Python session" in note for note in stopped["notes"])
        fresh = await run("print('rows' in dir())")
        assert fresh["stdout"] == "False\n"
        assert any("previous Python session ended" in note and "fuel" in note
                   for note in fresh["notes"])
        # The files it wrote were kept (published when the interpreter ended).
        assert text(await client.call_tool("read_file", {"path": "log.txt"})) == "ab"
        # reset ends the interpreter on request.
        assert (await run("kept = 1"))["status"] == "ok"
        assert "was reset" in text(await client.call_tool("reset", {}))
        again = await run("print('kept' in dir())")
        assert again["stdout"] == "False\n" and again["notes"] == []

    in_process(policy, main)


def test_a_session_call_lists_the_files_it_changed_before_they_are_published() -> None:
    policy = agent_policy(limits={"fuel": 50_000_000, "timeout_s": 4})

    async def main(client: Client) -> None:
        async def run(code: str) -> tuple[dict[str, Any], str]:
            result = await client.call_tool("run_python", {"code": code})
            assert not result.is_error and result.structured_content is not None
            return result.structured_content, text(result)

        first, report = await run("open('/workspace/a.txt', 'w').write('abc')\n"
                                  "open('/workspace/b.txt', 'w').write('1')")
        assert first["files"] == []  # a session publishes when it ends
        assert first["files_staged"] == [
            {"path": "/workspace/a.txt", "size": 3, "change": "written"},
            {"path": "/workspace/b.txt", "size": 1, "change": "written"}]
        assert "files changed by this call" in report and "published to the workspace " \
            "when the session ends" in report
        assert "/workspace/a.txt (written, 3 bytes), /workspace/b.txt (written, 1 bytes)" \
            in report
        second, report = await run(
            "import os\nopen('/workspace/a.txt', 'a').write('de')\n"
            "os.remove('/workspace/b.txt')\nos.mkdir('/workspace/sub')\n"
            "open('/workspace/sub/c.txt', 'w').close()")
        assert second["files_staged"] == [
            {"path": "/workspace/a.txt", "size": 5, "change": "written"},
            {"path": "/workspace/b.txt", "size": 0, "change": "deleted"},
            {"path": "/workspace/sub/c.txt", "size": 0, "change": "written"}]
        assert "/workspace/b.txt (deleted)" in report
        # Reading changes nothing; a file the write_file tool wrote is not a call's change.
        assert not (await client.call_tool("write_file", {"path": "tool.txt",
                                                          "content": "x"})).is_error
        third, report = await run("print(open('/workspace/a.txt').read())")
        assert third["stdout"] == "abcde\n" and third["files_staged"] == []
        assert "files changed" not in report
        # A call that ends the session publishes its files, and its result lists them.
        stopped, report = await run("open('/workspace/late.txt', 'w').write('z')\n"
                                    "while True: pass")
        assert stopped["limit"] == "fuel" and stopped["files_staged"] == []
        assert sorted(f["path"] for f in stopped["files"]) == [
            "/workspace/a.txt", "/workspace/late.txt", "/workspace/sub/c.txt",
            "/workspace/tool.txt"]
        assert any("were published" in note for note in stopped["notes"])
        assert text(await client.call_tool("read_file", {"path": "late.txt"})) == "z"

    in_process(policy, main)


def test_sessions_can_be_turned_off() -> None:
    async def main(client: Client) -> None:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert "reset" not in tools
        assert "FRESH interpreter" in (tools["run_python"].description or "")
        await client.call_tool("run_python", {"code": "x = 1"})
        result = await client.call_tool("run_python", {"code": "print(x)"})
        assert "NameError" in text(result)

    in_process(agent_policy(sessions={"enabled": False}), main)


def test_help_names_every_tool(capsys: pytest.CaptureFixture[str]) -> None:
    from wasibox._cli import main

    with pytest.raises(SystemExit):
        main(["mcp", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    for tool in ("run_python", "reset", "write_file", "read_file", "list_files",
                 "call_function"):
        assert tool in usage
    assert "--idle-timeout" in usage


# -- zero configuration, the README's agent.toml, structured results ---------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_agent_toml() -> str:
    blocks = [block for block in re.findall(r"```toml\n(.*?)```", README.read_text(),
                                            flags=re.DOTALL)
              if block.startswith("# agent.toml\n")]
    assert len(blocks) == 1, "the README's agent.toml block is gone"
    return blocks[0]


def stdio_params(tmp: Path, *args: str) -> StdioServerParameters:
    return StdioServerParameters(command=PYTHON, args=["-m", "wasibox", "mcp", *args],
                                 env=server_env(tmp))


def test_stdio_without_a_config_is_a_safe_server(tmp_path: Path) -> None:
    async def main() -> None:
        async with Client(stdio_params(tmp_path / "tmp"), read_timeout_seconds=60) as client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            # No host functions, so no call_function tool.
            assert set(tools) == {"run_python", "reset", "write_file", "read_file",
                                  "list_files"}
            assert tools["run_python"].output_schema is not None
            result = await client.call_tool("run_python", {"code": "print(6 * 7)"})
            assert result.structured_content is not None
            assert (result.structured_content["status"], result.structured_content["stdout"]) \
                == ("ok", "42\n")
            # No network.
            code = "import urllib.request\nurllib.request.urlopen('http://example.com/')"
            report = await client.call_tool("run_python", {"code": code})
            assert report.structured_content is not None
            assert report.structured_content["error"]["type"] == "CapabilityDenied"
            assert "denied: http" in text(report)
            # No mounts but the session's workspace, which persists between runs.
            code = "import os\nopen('/workspace/a.txt', 'w').write('kept')\nos.listdir('/data')"
            report = await client.call_tool("run_python", {"code": code})
            assert report.structured_content is not None
            assert report.structured_content["error"]["type"] == "FileNotFoundError"
            code = "open('/workspace/b.txt', 'w').write('kept')"
            assert "status: ok" in text(await client.call_tool("run_python", {"code": code}))
            assert text(await client.call_tool("read_file", {"path": "b.txt"})) == "kept"
            # Default limits: a CPU-bound loop runs to its timeout, not out of fuel.
            report = await client.call_tool("run_python",
                                             {"code": "while True: pass", "timeout_s": 0.5})
            assert report.structured_content is not None
            assert report.structured_content["limit"] == "timeout"

    asyncio.run(main())


def test_the_readme_agent_toml_runs_as_written(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(readme_agent_toml(), encoding="utf-8")
    policy = McpPolicy.from_config(load_config(config))
    # The example allows as much CPU as its timeout.
    assert policy.limits.fuel == math.ceil(policy.limits.timeout_s * FUEL_PER_SECOND)
    assert policy.warnings() == []  # its memory is enough for the microVM too

    async def main() -> None:
        async with Client(stdio_params(tmp_path / "tmp", "--config", str(config)),
                          read_timeout_seconds=60) as client:
            tools = {tool.name for tool in (await client.list_tools()).tools}
            assert "call_function" in tools
            result = await client.call_tool("call_function",
                                            {"name": "factorial", "args": [5]})
            assert not result.is_error and "result (JSON):\n120\n" in text(result)
            code = "import host\nprint(host.factorial(6))"
            result = await client.call_tool("run_python", {"code": code})
            assert result.structured_content is not None
            assert result.structured_content["stdout"] == "720\n"

    asyncio.run(main())


def test_run_python_returns_structured_content() -> None:
    # Sessions off: each run reports the files it published.
    policy = agent_policy(limits={"fuel": 20_000_000, "timeout_s": 4},
                          sessions={"enabled": False})

    async def main(client: Client) -> None:
        async def run(code: str) -> dict[str, Any]:
            result = await client.call_tool("run_python", {"code": code})
            assert not result.is_error and result.structured_content is not None
            return result.structured_content

        ok = await run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
                       "open('/workspace/r.txt', 'w').write('abc')")
        assert {key: ok[key] for key in ("status", "stdout", "stderr", "error", "limit")} == {
            "status": "ok", "stdout": "out\n", "stderr": "err\n", "error": None,
            "limit": None}
        assert ok["fuel"] > 0 and ok["backend"] == "wasm" and ok["exit_code"] == 0
        assert ok["files"] == [{"path": "/workspace/r.txt", "size": 3,
                                "sha256": hashlib.sha256(b"abc").hexdigest()}]
        error = await run("raise KeyError('k')")
        assert error["status"] == "error" and error["files"] == []
        assert (error["error"]["type"], error["error"]["message"]) == ("KeyError", "'k'")
        assert "raise KeyError" in error["error"]["traceback"]
        limit = await run("while True: pass")
        assert (limit["status"], limit["limit"], limit["fuel"]) == ("limit", "fuel", 20_000_000)
        exited = await run("raise SystemExit(3)")
        assert (exited["status"], exited["exit_code"], exited["error"]) == ("exit", 3, None)
        noted = await client.call_tool("run_python", {"code": "pass", "timeout_s": 99})
        assert noted.structured_content is not None
        assert "above this server's limit" in noted.structured_content["notes"][0]

    in_process(policy, main)


def test_a_tenant_chooses_its_backend_and_emulation() -> None:
    policy = agent_policy(backend="wasm", allow_emulation=False)
    assert (policy.config.backend, policy.config.allow_emulation) == ("wasm", False)

    async def main(client: Client) -> dict[str, Any]:
        result = await client.call_tool("run_python", {"code": "import numpy"})
        assert result.structured_content is not None
        return result.structured_content

    # Forced to wasm: numpy is simply missing, whatever this machine's microVM can do.
    report = in_process(policy, main)
    assert (report["backend"], report["error"]["type"]) == ("wasm", "ModuleNotFoundError")


def test_errors_for_a_model_name_configuration_keys_not_python_api() -> None:
    # Real errors from the code that raises them; a runtime double stands for the machine.
    from wasibox.backends.base import Job, Policy
    from wasibox.backends.microvm.backend import MicroVMBackend

    @dataclasses.dataclass
    class Machine:
        accel: str

    refused = MicroVMBackend(allow_emulation=False, runtime_=Machine("tcg"))  # type: ignore[arg-type]
    with pytest.raises(UsageError) as emulation:
        refused.check_allowed()
    small = MicroVMBackend(allow_emulation=True, runtime_=Machine("kvm"))  # type: ignore[arg-type]
    with pytest.raises(UsageError) as memory:
        small.execute(Job(op="run", code="pass", limits=Limits(memory_bytes="128MiB"),
                          policy=Policy()))
    for exc, key in ((emulation.value, "allow_emulation = true"),
                     (memory.value, "memory_bytes")):
        words = operator_message(exc)
        assert key in words and "configuration" in words
        assert "Sandbox(" not in words and "Limits." not in words, words

    policy = agent_policy(limits={"source_bytes": 64})

    async def main(client: Client) -> str:
        result = await client.call_tool("run_python", {"code": "x = 1\n" * 100})
        assert result.is_error
        return text(result)

    words = in_process(policy, main)
    assert "limits.source_bytes" in words and "Limits." not in words


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                    reason="QEMU (qemu-system-x86_64) is not installed, so no run can need "
                           "the microVM's memory")
def test_a_policy_too_small_for_the_microvm_is_reported_at_start() -> None:
    warnings = agent_policy(limits={"memory_bytes": "128MiB"}).warnings()
    assert len(warnings) == 1
    assert "tenants.agent.limits.memory_bytes is 128 MiB" in warnings[0]
    assert "192MiB" in warnings[0] and 'backend = "wasm"' in warnings[0]
    assert agent_policy(limits={"memory_bytes": "128MiB"}, backend="wasm").warnings() == []


@pytest.mark.parametrize("host", ["0.0.0.0", "example.com"])
def test_the_unauthenticated_http_transport_listens_only_on_loopback(tmp_path: Path,
                                                                    host: str) -> None:
    done = subprocess.run([PYTHON, "-m", "wasibox", "mcp", "--transport", "http", "--host",
                           host, "--port", str(free_port())], capture_output=True, text=True,
                          env=server_env(tmp_path / "tmp"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"listens only on a loopback address (127.0.0.1, ::1, localhost), not {host!r}" \
        in done.stderr
