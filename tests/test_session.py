"""wasibox.Session: one live interpreter whose state persists across calls, under limits."""

from __future__ import annotations

import asyncio
import http.server
import pickle
import threading
import time
from pathlib import Path

import pytest

import wasibox
from wasibox import Limit, SessionEnd, SessionEnded

pytestmark = pytest.mark.guest


def test_variables_and_imports_persist_across_calls() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        first = session.run("import json\nx = 41\ndef bump(v):\n    return v + 1")
        assert first.ok, first
        second = session.run("x = bump(x)\nprint(json.dumps({'x': x}))")
        assert second.ok and second.stdout == '{"x": 42}\n'
        assert session.calls == 2 and session.ended is None


def test_an_open_file_stays_open_across_calls(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("one\ntwo\nthree\n")
    mount = wasibox.Mount(tmp_path, "/data")
    with wasibox.Sandbox(mounts=[mount]) as sb, sb.session() as session:
        assert session.run("f = open('/data/data.txt')\nprint(f.readline(), end='')"
                           ).stdout == "one\n"
        assert session.run("print(f.readline(), end='')").stdout == "two\n"
        assert session.run("print(f.read(), end='')\nf.close()").stdout == "three\n"


def test_writes_are_published_when_the_session_closes(tmp_path: Path) -> None:
    with wasibox.Sandbox(workspace=tmp_path) as sb:
        session = sb.session()
        result = session.run("out = open('/workspace/out.txt', 'w')\nout.write('a')")
        assert result.ok, result
        assert session.run("out.write('b')\nout.close()").ok
        assert not (tmp_path / "out.txt").exists()  # staged until the session closes
        session.close()
        assert (tmp_path / "out.txt").read_text() == "ab"
        assert [record.path for record in session.files] == ["/workspace/out.txt"]


def test_writes_of_a_session_ended_by_a_limit_are_discarded(tmp_path: Path) -> None:
    with wasibox.Sandbox(workspace=tmp_path) as sb, sb.session() as session:
        assert session.run("open('/workspace/out.txt', 'w').write('a')").ok
        assert session.run("while True: pass", limits={"fuel": 10**7}).limit_exceeded
    assert not (tmp_path / "out.txt").exists()


def test_clocks_and_entropy_run_on_from_call_to_call() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        session.run("import random, time, os\nt0 = time.monotonic()\nw0 = time.time()\n"
                    "r0 = random.random()\nu0 = os.urandom(8)")
        result = session.run("print(time.monotonic() > t0, time.time() > w0, "
                             "random.random() != r0, os.urandom(8) != u0)")
        assert result.stdout == "True True True True\n"


def test_sessions_are_deterministic() -> None:
    code = ["import random\nxs = [random.random() for _ in range(3)]",
            "import time\nprint(xs, time.time())"]

    def replay() -> list[tuple[str, int]]:
        with wasibox.Sandbox(seed=7) as sb, sb.session() as session:
            return [(r.stdout, r.fuel_used) for r in map(session.run, code)]

    assert replay() == replay()


def test_two_sessions_are_isolated() -> None:
    with wasibox.Sandbox() as sb, sb.session() as one, sb.session() as two:
        assert one.run("secret = 'one'").ok
        leak = two.run("print(secret)")
        assert leak.error is not None and leak.error.type == "NameError"
        assert two.ended is None  # a guest exception is not a limit: the session goes on
        assert one.run("print(secret)").stdout == "one\n"
        # ... and an ordinary run starts from the snapshot, as always.
        assert sb.run("print('secret' in dir())").stdout == "False\n"


def test_an_exception_or_exit_status_does_not_end_the_session() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        assert session.run("x = 1\nraise ValueError('no')").error is not None
        assert session.run("import sys\nsys.exit(3)").exit_code == 3
        assert session.run("print(x)").stdout == "1\n"


def test_each_call_has_its_own_fuel_and_timeout() -> None:
    with wasibox.Sandbox(wasibox.Limits(timeout_s=2)) as sb, sb.session() as session:
        # Many calls each well under the fuel limit, together far over it.
        cap = 5 * 10**7
        for _ in range(4):
            result = session.run("s = sum(range(20_000))", limits={"fuel": cap})
            assert result.ok and cap / 10 < result.fuel_used < cap
        assert session.run("import time\ntime.sleep(1.5)").ok  # under the 2 s timeout
        timed_out = session.run("import time\ntime.sleep(1.5)", limits={"timeout_s": 1})
        assert timed_out.limit_exceeded is Limit.TIMEOUT


@pytest.mark.parametrize("code, limits, limit", [
    ("while True: pass", {"fuel": 10**7}, Limit.FUEL),
    ("while True: pass", {"timeout_s": 0.3, "fuel": 10**13}, Limit.TIMEOUT),
    ("x = bytearray(300 * 2**20)", {}, Limit.MEMORY),
    ("print('x' * 5000)", {"output_bytes": 1000}, Limit.OUTPUT),
])
def test_a_limit_ends_the_session(code: str, limits: dict[str, float], limit: Limit) -> None:
    with wasibox.Sandbox(wasibox.Limits(memory_bytes="128MiB", fuel=10**13)) as sb:
        session = sb.session()
        assert session.run("kept = 1").ok
        result = session.run(code, limits=limits)
        assert result.limit_exceeded is limit and not result.ok
        assert session.ended is SessionEnd.LIMIT
        with pytest.raises(SessionEnded) as raised:
            session.run("print(kept)")
        assert raised.value.reason == "limit" and raised.value.result == result
        assert f"exceeded its {limit.value} limit" in str(raised.value)
        assert "open a new session" in str(raised.value).lower()
        # The error survives pickling (it can travel back from a worker process).
        assert pickle.loads(pickle.dumps(raised.value)).reason == "limit"
        # A new session starts fresh; the Sandbox is unaffected.
        with sb.session() as fresh:
            assert fresh.run("print('kept' in dir())").stdout == "False\n"
        assert sb.run("print(1)").ok


def test_the_memory_cap_is_for_the_whole_session() -> None:
    with wasibox.Sandbox(wasibox.Limits(memory_bytes="96MiB")) as sb, \
            sb.session() as session:
        # Each call allocates under the cap; the session keeps them all.
        assert session.run("blocks = [bytearray(20 * 2**20)]").ok
        assert session.run("blocks.append(bytearray(20 * 2**20))").ok
        result = session.run("blocks.append(bytearray(40 * 2**20))")
        assert result.limit_exceeded is Limit.MEMORY
        assert session.ended is SessionEnd.LIMIT
        with pytest.raises(wasibox.UsageError, match="whole life"):
            sb.session().run("pass", limits={"memory_bytes": "64MiB"})


def test_os_exit_ends_the_session() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        result = session.run("import os\nos._exit(5)")
        assert result.exit_code == 5
        assert session.ended is SessionEnd.TRAP
        with pytest.raises(SessionEnded, match="trapped or exited"):
            session.run("pass")


def test_idle_timeout_ends_the_session() -> None:
    with wasibox.Sandbox() as sb:
        session = sb.session(idle_timeout_s=0.3)
        assert session.run("x = 1").ok
        time.sleep(0.1)
        assert session.run("x += 1").ok  # a call resets the idle clock
        deadline = time.monotonic() + 5
        while session.ended is None and time.monotonic() < deadline:
            time.sleep(0.05)  # ended by the expiry thread, with no call coming in
        assert session.ended is SessionEnd.IDLE
        with pytest.raises(SessionEnded, match="idle timeout of 0.3 s") as raised:
            session.run("print(x)")
        assert raised.value.reason == "idle" and raised.value.result is None


def test_max_age_ends_a_busy_session() -> None:
    with wasibox.Sandbox() as sb:
        session = sb.session(max_age_s=0.5, idle_timeout_s=60)
        started = time.monotonic()
        while time.monotonic() - started < 0.4:
            assert session.run("pass").ok  # never idle
        time.sleep(0.3)
        with pytest.raises(SessionEnded, match="maximum age") as raised:
            session.run("pass")
        assert raised.value.reason == "max_age"


def test_cancelling_a_call_ends_the_session() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        session.run("x = 1")
        handle = session.start("while True: pass")
        time.sleep(0.2)
        assert handle.cancel()
        result = handle.result(timeout=10)
        assert result.limit_exceeded is Limit.CANCELLED
        assert session.ended is SessionEnd.LIMIT
        with pytest.raises(SessionEnded, match="cancelled"):
            session.run("print(x)")


def test_async_calls_and_task_cancellation() -> None:
    async def main() -> None:
        with wasibox.Sandbox() as sb:
            async with sb.session() as session:
                assert (await session.arun("x = 20")).ok
                assert (await session.arun("print(x + 1)")).stdout == "21\n"
                task = asyncio.ensure_future(session.arun("while True: pass"))
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert session.ended is SessionEnd.LIMIT
            assert session.ended is SessionEnd.LIMIT

    asyncio.run(main())


def test_calls_of_one_session_run_one_at_a_time() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        session.run("n = 0")
        handles = [session.start("import time\nm = n\ntime.sleep(0.05)\nn = m + 1")
                   for _ in range(5)]
        assert all(handle.result(timeout=30).ok for handle in handles)
        assert session.run("print(n)").stdout == "5\n"


def test_close_ends_the_session_and_closing_the_sandbox_closes_its_sessions() -> None:
    sb = wasibox.Sandbox()
    session = sb.session()
    session.close()
    session.close()  # idempotent
    with pytest.raises(SessionEnded, match="closed"):
        session.run("pass")
    other = sb.session()
    sb.close()
    assert other.ended is SessionEnd.CLOSED
    with pytest.raises(wasibox.SandboxClosed):
        sb.session()


def test_bad_session_options_are_usage_errors() -> None:
    with wasibox.Sandbox() as sb:
        for bad in (0, -1, float("nan"), float("inf"), "5", True):
            with pytest.raises(wasibox.UsageError):
                sb.session(idle_timeout_s=bad)  # type: ignore[arg-type]
            with pytest.raises(wasibox.UsageError):
                sb.session(max_age_s=bad)  # type: ignore[arg-type]
        with sb.session() as session:
            with pytest.raises(wasibox.UsageError):
                session.run("pass", limits={"fuel": 10**20})  # above the sandbox's


def test_host_functions_and_stdin_per_call() -> None:
    calls: list[int] = []

    def record(value: int) -> int:
        calls.append(value)
        return value * 2

    with wasibox.Sandbox(functions={"record": record}) as sb, sb.session() as session:
        assert session.run("import host\ndoubled = host.record(21)").ok
        assert session.run("import sys\nprint(doubled, sys.stdin.read())",
                           stdin="in").stdout == "42 in\n"
        assert session.run("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"
    assert calls == [21]


def test_a_session_does_not_block_other_threads_runs() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        handle = session.start("import time\ntime.sleep(0.5)")
        done = threading.Event()

        def other() -> None:
            assert sb.run("print(1)").ok
            done.set()

        threading.Thread(target=other).start()
        assert done.wait(10)
        assert handle.result(timeout=10).ok


def test_mediated_http_is_granted_to_every_call() -> None:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello {self.path}".encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    try:
        policy = wasibox.HttpPolicy(allow=[endpoint], allow_loopback_endpoints=[endpoint])
        with wasibox.Sandbox(http=policy) as sb, sb.session() as session:
            assert session.run(f"import urllib.request\nbase = 'http://{endpoint}'").ok
            first = session.run("print(urllib.request.urlopen(base + '/a').read())")
            assert first.stdout == "b'hello /a'\n"
            second = session.run("print(urllib.request.urlopen(base + '/b').read())")
            assert second.stdout == "b'hello /b'\n"
            # Each call's capability log holds that call's own decisions.
            assert [event.target.endswith("/b") for event in second.capability_log] == [True]
            denied = session.run("urllib.request.urlopen('http://169.254.169.254/')")
            assert denied.error is not None and denied.error.type == "CapabilityDenied"
    finally:
        server.shutdown()
        server.server_close()
