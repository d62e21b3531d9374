"""Text round trips: whatever text a guest writes, every str in its result encodes as UTF-8,
the documented replacement (U+FFFD, see ``wasibox._result``) stands where it was not valid,
and neither ``wasibox serve`` nor ``wasibox mcp`` (stdio and streamable HTTP) answers 500,
dies or breaks the session: the next request in the same session works.

The hostile text mixes lone surrogates (which ``st.text()`` never generates), NUL, control
characters and astral characters; the hostile bytes are arbitrary, with invalid UTF-8
sequences mixed in. They reach every output path: stdout and stderr (``os.write`` and
``sys.stdout.buffer``), the exception's message and traceback, the return value, and the
names of files a guest creates in a writable mount.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import json
import math
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
import wasibox.testing
from wasibox._events import CapabilityEvent
from wasibox._result import FileRecord, GuestException, RefusedFile, RunResult, json_value
from wasibox.services.config import hash_token

from ..conftest import PYTHON, child_env
from ..services.test_serve import TOKENS, Server

pytestmark = pytest.mark.guest
T = TypeVar("T")

REPLACEMENT = "\ufffd"
SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
#: Text a guest could hand back: lone surrogates, NUL, control and astral characters.
HOSTILE_TEXT = st.lists(
    st.one_of(st.text(max_size=4), SURROGATES,
              st.sampled_from(["\x00", "\r\n", "\x1b[31m", "\ufffd", "\U0001F600", "\u2028"])),
    max_size=12).map("".join)
#: Bytes a guest could write: anything, with invalid UTF-8 sequences mixed in.
HOSTILE_BYTES = st.lists(
    st.one_of(st.binary(max_size=6),
              st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                               b"\x00", b"\xe2\x82"])),
    max_size=8).map(b"".join)

#: Writes ``raw`` to stdout and stderr both ways, the text as UTF-8 with its surrogates
#: encoded as they are (which no decoder accepts), then raises with the text as message.
PROGRAM = """\
import os, sys
TEXT = {text!r}
RAW = {raw!r}
os.write(1, RAW)
sys.stdout.buffer.write(RAW)
sys.stdout.buffer.write(TEXT.encode("utf-8", "surrogatepass"))
sys.stdout.flush()
os.write(2, RAW)
raise ValueError(TEXT)
"""


def replaced(text: str) -> str:
    """The documented form of guest text: each lone surrogate becomes U+FFFD."""
    return "".join(REPLACEMENT if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def through_reply(text: str) -> str:
    """Guest text as the host reads it from the guest's JSON reply, then made valid: JSON
    reads an escaped high surrogate followed by a low one as the character they encode."""
    return replaced(json.loads(json.dumps(text)))


def strings(value: Any) -> Iterator[str]:
    """Every str in a result (or JSON data), keys and dataclass fields included."""
    if isinstance(value, str):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from strings(getattr(value, field.name))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings(item)


def assert_utf8(value: Any) -> None:
    for text in strings(value):
        text.encode("utf-8")  # raises UnicodeEncodeError for a lone surrogate


def assert_program_result(data: dict[str, Any], text: str, raw: bytes) -> None:
    """``data`` (a result's JSON form) is what PROGRAM documentedly produces."""
    assert_utf8(data)
    expected = (raw + raw + text.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")
    assert data["stdout"] == expected
    assert data["stderr"] == raw.decode("utf-8", "replace")
    assert data["error"]["type"] == "ValueError"
    assert data["error"]["message"] == through_reply(text)
    last = f"ValueError: {through_reply(text)}" if text else "ValueError"
    assert data["error"]["traceback"].endswith(last + "\n")
    assert not data["ok"] and data["limit_exceeded"] is None


# -- through Sandbox --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(wasibox.Limits(output_bytes=64 * 1024)) as sandbox:
        yield sandbox


@settings(max_examples=60, deadline=None)
@given(text=HOSTILE_TEXT, raw=HOSTILE_BYTES)
def test_sandbox_results_hold_only_utf8(sb: wasibox.Sandbox, text: str, raw: bytes) -> None:
    result = sb.run(PROGRAM.format(text=text, raw=raw))
    assert_utf8(result)
    assert_program_result(result.to_dict(), text, raw)
    # GuestError, the exception form of the same result, carries the same clean text.
    with pytest.raises(wasibox.GuestError) as caught:
        sb.call("def f(t):\n    raise ValueError(t)", "f", replaced(text))
    str(caught.value).encode("utf-8")


@settings(max_examples=40, deadline=None)
@given(text=HOSTILE_TEXT, raw=HOSTILE_BYTES)
def test_return_values_reach_json_in_one_form(sb: wasibox.Sandbox, text: str,
                                              raw: bytes) -> None:
    clean = replaced(text)
    code = ("import math\ndef f(text, raw):\n"
            "    return {'text': text, 'raw': raw, 'nan': math.nan, 'inf': -math.inf,\n"
            "            1: [text, raw], 'base64': 'not bytes'}")
    value = sb.call(code, "f", clean, raw)
    assert value["text"] == clean and value["raw"] == raw
    data = json_value(value)
    assert_utf8(data)
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    pairs = {json.dumps(key): item for key, item in data["map"]}
    assert pairs['"text"'] == clean
    assert pairs['"raw"'] == {"base64": base64.b64encode(raw).decode("ascii")}
    assert pairs['"nan"'] == {"float": "nan"} and pairs['"inf"'] == {"float": "-inf"}
    assert pairs["1"] == [clean, {"base64": base64.b64encode(raw).decode("ascii")}]


def test_a_value_with_a_lone_surrogate_is_a_guest_error(sb: wasibox.Sandbox) -> None:
    # The guest's msgpack refuses to encode it; a forged reply that carries one anyway is
    # refused by the host's strict UTF-8 decoding of msgpack strings (tests/security/
    # test_reply.py); either way the value never reaches the result.
    result = sb.run("def f():\n    return '\\ud800'", entry="f")
    assert not result.ok and result.value is None
    assert_utf8(result)


@settings(max_examples=100, deadline=None)
@given(text=HOSTILE_TEXT, number=st.floats(), blob=st.binary(max_size=16))
def test_every_result_field_is_cleaned_however_it_was_built(text: str, number: float,
                                                           blob: bytes) -> None:
    # The backends and dataclasses.replace build results; each way ends in the same checks.
    result = RunResult(
        ok=False, exit_code=1, stdout=text, stderr=text, stdout_truncated=False,
        stderr_truncated=False, error=GuestException(type=text, message=text, traceback=text),
        limit_exceeded=None, fuel_used=0, memory_peak_bytes=0, duration_s=0.0, backend="wasm",
        value=[text, number, blob, {"map": text}, {text: 1}],
        files=[FileRecord(path=f"/out/{text}", size=1, sha256="0" * 64)],
        files_refused=[RefusedFile(path=f"/out/{text}", reason="symlink")],
        capability_log=(CapabilityEvent(capability="function", action="call", target=text,
                                        allowed=False, reason=text),))
    for built in (result, dataclasses.replace(result, stdout=text)):
        assert_utf8(dataclasses.replace(built, value=None))
        data = built.to_dict()
        assert_utf8(data)
        assert data["stdout"] == data["error"]["message"] == replaced(text)
        assert data["files"][0]["path"] == f"/out/{replaced(text)}"
        encoded = json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
        assert json.loads(encoded) == data
        item = data["value"]
        assert item[0] == replaced(text) and item[2] == {"base64": base64.b64encode(blob).decode()}
        if math.isfinite(number):
            assert item[1] == number
        else:
            assert item[1] == {"float": "nan" if math.isnan(number) else
                               ("inf" if number > 0 else "-inf")}
        assert item[4] in ({replaced(text): 1}, {"map": [[replaced(text), 1]]})
        assert item[3] == {"map": [["map", replaced(text)]]}  # never read as a tag


def test_file_names_a_guest_creates_are_reported_as_utf8(tmp_path: Path) -> None:
    names = ["nul\x01ctl", "\ufffd", "\U0001F600", "line\u2028sep", "\x1b[31mred"]
    tried = [*names, "lone-\udc80", "bad-\ud800x"]
    code = ("import os\nmade = []\n"
            f"for name in {tried!r}:\n"
            "    try:\n"
            "        open('/out/' + name, 'w').write('x')\n"
            "        made.append(name)\n"
            "    except (OSError, UnicodeError) as exc:\n"
            "        print(type(exc).__name__)\n")
    # A host file whose name is not UTF-8: the guest cannot name it, and it stays as it was.
    (tmp_path / os.fsdecode(b"host-\xff")).write_text("host")
    with wasibox.Sandbox(mounts=[wasibox.Mount(tmp_path, "/out", writable=True)]) as sandbox:
        result = sandbox.run(code + "print(sorted(os.listdir('/out')))")
    assert result.ok, result
    assert_utf8(result)
    assert sorted(f.path for f in result.files) == sorted(f"/out/{n}" for n in names)
    on_host = set(os.listdir(os.fsencode(tmp_path))) - {b".wasibox-staging"}
    assert on_host == {n.encode() for n in names} | {b"host-\xff"}
    assert (tmp_path / os.fsdecode(b"host-\xff")).read_text() == "host"


@settings(max_examples=15, deadline=None)
@given(text=HOSTILE_TEXT)
def test_batch_values_and_errors_hold_only_utf8(text: str) -> None:
    # Transform and wasibox.testing read the guest's batch reply, which is JSON of its own.
    code = ("def f(pair):\n    text, fail = pair\n"
            "    if fail:\n        raise ValueError(text)\n"
            "    return {'k': text, 'l': [text, 1], text: 2}\n")
    transform = wasibox.Transform(code, entry="f", on_error="collect")
    value, failed = transform.map([[text, False], [text, True]])
    clean = through_reply(text)
    assert isinstance(failed, wasibox.Failed) and failed.error.message == clean
    assert_utf8(failed.to_dict())
    replayed = wasibox.testing.replay(code, "f", repr(([text, False],)))
    assert_utf8(replayed)
    if isinstance(value, wasibox.Failed):
        # A value JSON cannot carry exactly goes as msgpack, whose strict UTF-8 the guest's
        # own encoder enforces: the record fails instead, with a clean message.
        assert_utf8(value.to_dict())
        assert not replayed.ok
        return
    expected: dict[str, Any] = {"k": clean, "l": [clean, 1]}
    expected[clean] = 2
    assert value == expected and replayed.value == expected
    assert_utf8(value)


def test_huge_lines_stay_within_the_output_cap(sb: wasibox.Sandbox) -> None:
    cap = sb.limits.output_bytes
    result = sb.run("import sys\nsys.stdout.buffer.write(b'\\xff' * 10**6)\n"
                    "print('\\x00' * 10**6, end='')\n"
                    "raise ValueError('\\ud800' * 10**5)")
    assert result.stdout_truncated and result.limit_exceeded is wasibox.Limit.OUTPUT
    assert len(result.stdout.encode("utf-8")) <= 3 * cap  # U+FFFD is 3 bytes for each byte
    assert set(result.stdout) <= {REPLACEMENT, "\x00"}
    assert_utf8(result)


# -- through `wasibox serve` ------------------------------------------------------------------

SERVE_CONFIG = f"""
[tenants.alice]
token_sha256 = "{hash_token(TOKENS['alice'])}"
limits = {{ fuel = 400_000_000, timeout_s = 10, output_bytes = "64KiB" }}
"""


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve-text") / "wasibox.toml"
    config.write_text(SERVE_CONFIG)
    live = Server(config)
    yield live
    live.stop()
    assert "Traceback" not in "".join(live.lines)


@pytest.fixture(scope="module")
def alice(serve: Server) -> Iterator[httpx.Client]:
    with serve.client("alice") as client:
        yield client


def assert_serve_alive(serve: Server, alice: httpx.Client) -> None:
    assert serve.process.poll() is None, "".join(serve.lines)
    after = alice.post("/v1/run", json={"code": "print('alive')"})
    assert after.status_code == 200 and after.json()["stdout"] == "alive\n"


@settings(max_examples=8, deadline=None)
@given(text=HOSTILE_TEXT, raw=HOSTILE_BYTES)
def test_serve_answers_hostile_text(serve: Server, alice: httpx.Client, text: str,
                                    raw: bytes) -> None:
    response = alice.post("/v1/run", json={"code": PROGRAM.format(text=text, raw=raw)})
    assert response.status_code == 200, response.text
    assert_program_result(json.loads(response.content.decode("utf-8")), text, raw)
    value = alice.post("/v1/call", json={
        "code": "def f(t):\n    return [t, t.encode(), float('nan'), {1: t}]", "entry": "f",
        "args": [replaced(text)]})
    assert value.status_code == 200, value.text
    clean = replaced(text)
    assert value.json()["value"] == [
        clean, {"base64": base64.b64encode(clean.encode()).decode()}, {"float": "nan"},
        {"map": [[1, clean]]}]
    assert_serve_alive(serve, alice)


def test_serve_takes_code_with_lone_surrogates_and_huge_lines(serve: Server,
                                                              alice: httpx.Client) -> None:
    # JSON lets a client send a lone surrogate (as an escape); it reaches the guest's source.
    body = b'{"code": "x = \'\\ud800\'  # \\udfff\\nraise ValueError(x)"}'
    response = alice.post("/v1/run", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert_utf8(response.json())
    response = alice.post("/v1/run", json={
        "code": "import sys\nsys.stdout.buffer.write(b'\\xed\\xa0\\x80' * 10**6)"})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["stdout_truncated"] and data["limit_exceeded"] == "output"
    assert set(data["stdout"]) == {REPLACEMENT}
    assert_serve_alive(serve, alice)


def test_serve_documents_the_one_json_form(sb: wasibox.Sandbox) -> None:
    # The schema /openapi.json publishes has exactly the fields of the form every path writes.
    from wasibox.services.serve import RunResultModel

    assert set(RunResultModel.model_fields) == set(sb.run("print(1)").to_dict())


# -- through `wasibox mcp`, stdio and streamable HTTP -----------------------------------------

class McpSession:
    """One MCP client session held open on an event loop of its own, so that synchronous
    hypothesis tests can make calls in it one after another."""

    def __init__(self, open_client: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._stop = asyncio.Event()
        self._held = asyncio.run_coroutine_threadsafe(self._hold(open_client), self.loop)
        self.client = self._ready.result(timeout=120)

    async def _hold(self, open_client: Callable[[], Any]) -> None:
        try:
            async with open_client() as client:
                self._ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=120)

    def run_python(self, code: str) -> str:
        result = self.call(lambda: self.client.call_tool("run_python", {"code": code}))
        assert not result.is_error and len(result.content) == 1
        return str(result.content[0].text)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._held.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


MCP_CONFIG = f"""
[tenants.agent]
token_sha256 = "{"0" * 64}"
limits = {{ fuel = 400_000_000, timeout_s = 10, output_bytes = "64KiB" }}
"""


@pytest.fixture(scope="module", params=["stdio", "http"])
def mcp(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpSession]:
    pytest.importorskip("mcp", reason="the mcp package (the 'mcp' extra) is not installed")
    from mcp import Client, StdioServerParameters

    from ..services.test_mcp import http_client, http_server

    root = tmp_path_factory.mktemp(f"mcp-text-{request.param}")
    config = root / "agent.toml"
    config.write_text(MCP_CONFIG)
    env = {**child_env(), "TMPDIR": str(root)}
    if request.param == "stdio":
        params = StdioServerParameters(
            command=PYTHON, args=["-m", "wasibox", "mcp", "--config", str(config)], env=env)
        session = McpSession(lambda: Client(params, read_timeout_seconds=60))
        yield session
        session.close()
    else:
        with http_server(config, root / "tmp") as url:
            session = McpSession(lambda: http_client(url))
            yield session
            session.close()


@settings(max_examples=5, deadline=None)
@given(text=HOSTILE_TEXT, raw=HOSTILE_BYTES)
def test_mcp_reports_hostile_text_and_keeps_the_session(mcp: McpSession, text: str,
                                                        raw: bytes) -> None:
    report = mcp.run_python(PROGRAM.format(text=text, raw=raw))
    report.encode("utf-8")
    assert f"status: error: ValueError: {through_reply(text)}\n" in report
    assert (raw + raw).decode("utf-8", "replace") in report
    huge = mcp.run_python("import sys\nsys.stdout.buffer.write(b'\\xff' * 10**6)\n"
                          "raise ValueError('\\udc80' * 10**4)")
    assert "stdout truncated by the output limit" in huge and "limit exceeded: output" in huge
    assert mcp.run_python("print('alive')").count("alive") == 1
