"""``wasibox mcp``, driven by the official ``mcp`` client over stdio (the server spawned as a
subprocess, as an agent's client does) and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the mcp package (the 'mcp' extra) is not installed")

from mcp import Client, StdioServerParameters  # noqa: E402

from tests.conftest import PYTHON, child_env  # noqa: E402
from wasibox._config import parse_config  # noqa: E402
from wasibox._errors import UsageError  # noqa: E402
from wasibox._mcp import McpPolicy, WorkspaceStore, _confine, create_mcp_server  # noqa: E402

pytestmark = pytest.mark.guest

CONFIG = """\
[tenants.agent]
token_sha256 = "{digest}"
limits = {{ fuel = 400_000_000, memory_bytes = "64MiB", timeout_s = 4, output_bytes = "64KiB" }}

[tenants.agent.http]
allow = ["example.com"]
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "wasibox.toml"
    path.write_text(CONFIG.format(digest="0" * 64), encoding="utf-8")
    return path


def text(result: Any) -> str:
    assert len(result.content) == 1
    return str(result.content[0].text)


async def core_cases(client: Client) -> None:
    """The behaviour every transport must show, on one connected client."""
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) >= {"run_python", "write_file", "read_file", "list_files"}
    run = tools["run_python"]
    assert run.input_schema["required"] == ["code"]
    assert run.input_schema["properties"]["code"]["type"] == "string"
    assert "timeout_s" in run.input_schema["properties"]
    assert "FRESH interpreter" in (run.description or "")
    assert set(tools["write_file"].input_schema["required"]) == {"path", "content"}

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

    # A limit, in plain words.
    result = await client.call_tool("run_python", {"code": "while True: pass"})
    assert "the run used all of its CPU budget (fuel) after" in text(result)

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

    # Files written by code are readable with read_file; state does not carry over.
    code = (
        "import os\nos.makedirs('/workspace/out', exist_ok=True)\n"
        "open('/workspace/out/result.txt', 'w').write('42\\n')\nx = 1")
    assert "status: ok" in text(await client.call_tool("run_python", {"code": code}))
    assert text(await client.call_tool("read_file", {"path": "out/result.txt"})) == "42\n"
    assert text(await client.call_tool("read_file",
                                       {"path": "/workspace/out/result.txt"})) == "42\n"
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


def test_stdio(config: Path, tmp_path: Path) -> None:
    params = StdioServerParameters(
        command=PYTHON, args=["-m", "wasibox", "mcp", "--config", str(config)],
        env=server_env(tmp_path / "tmp"))

    async def main() -> None:
        async with Client(params, read_timeout_seconds=60) as client:
            await core_cases(client)
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


def test_streamable_http(config: Path, tmp_path: Path) -> None:
    async def main(url: str) -> None:
        async with http_client(url) as client:
            await core_cases(client)

    with http_server(config, tmp_path / "tmp") as url:
        asyncio.run(main(url))
    # Stopping the server (SIGTERM) deletes every workspace it made.
    assert not list((tmp_path / "tmp").glob("wasibox-mcp-*"))


def test_http_sessions_have_separate_workspaces(config: Path, tmp_path: Path) -> None:
    async def session(url: str, name: str) -> tuple[str, str]:
        async with http_client(url) as client:
            code = f"open('/workspace/{name}.txt', 'w').write('{name}')"
            assert "status: ok" in text(await client.call_tool("run_python", {"code": code}))
            listing = text(await client.call_tool("list_files", {}))
            mine = text(await client.call_tool("read_file", {"path": f"{name}.txt"}))
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
        _confine(tmp_path, path)


def test_confine_refuses_symlinks(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(UsageError, match="symbolic link"):
        _confine(tmp_path, "link/passwd")
    assert _confine(tmp_path, "/workspace/a/b.txt") == tmp_path / "a" / "b.txt"


def test_workspaces_are_deleted_when_idle_or_closed() -> None:
    store = WorkspaceStore(idle_timeout_s=0.0)
    first = store.get("one")
    (first / "f").write_text("x")
    time.sleep(0.01)
    second = store.get("two")  # sweeps "one", idle past the timeout
    assert not first.exists() and second.exists() and second != first
    store.drop("two")
    assert not second.exists()
    store.close()
    assert not store.root.exists()


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
