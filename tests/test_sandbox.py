"""Sandbox.run / call / wasibox.run: results, values, guest exceptions, isolation, threads."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import pytest

import wasibox
from wasibox import Limit

pytestmark = pytest.mark.guest


def test_run_reports_output_and_success(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("print(1+1)")
    assert r.ok and r.exit_code == 0
    assert r.stdout == "2\n" and r.stderr == ""
    assert not r.stdout_truncated and not r.stderr_truncated
    assert r.error is None and r.limit_exceeded is None
    assert r.fuel_used > 0 and r.memory_peak_bytes > 0 and r.duration_s > 0
    assert r.backend == "wasm"


def test_one_shot_run() -> None:
    assert wasibox.run("print('hi')").stdout == "hi\n"


def test_guest_exception_is_reported_with_guest_traceback(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("def f():\n    raise ValueError('boom')\nf()\n")
    assert not r.ok and r.exit_code == 1
    assert r.error is not None
    assert (r.error.type, r.error.message) == ("ValueError", "boom")
    assert 'File "<sandbox>", line 2, in f' in r.error.traceback
    assert "raise ValueError('boom')" in r.error.traceback  # the source line is shown
    for runner_module in ("wasibox_guest", "wasibox_job"):  # the runner's frames are hidden
        assert runner_module not in r.error.traceback


def test_stderr_and_exit_codes(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("import sys\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (r.ok, r.exit_code, r.error, r.stderr) == (False, 3, None, "oops\n")
    assert sandbox.run("raise SystemExit('bye')").exit_code == 1
    assert sandbox.run("raise SystemExit").exit_code == 0


def test_os_exit_keeps_its_status(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("import os\nos._exit(4)")
    assert r.exit_code == 4 and r.limit_exceeded is None and r.error is None


def test_call_returns_values() -> None:
    with wasibox.Sandbox() as sb:
        assert sb.call("def f(x):\n    return x * 2", "f", 21) == 42
        value = {"a": [1, 2.5, None, True], "b": b"\x00\xff", "c": {"nested": "ok"}, 7: "int key"}
        assert sb.call("def echo(v):\n    return v", "echo", value) == value
        assert sb.call("def kw(a, *, b):\n    return a - b", "kw", 10, b=3) == 7


def test_call_raises_guest_error() -> None:
    with wasibox.Sandbox() as sb:
        with pytest.raises(wasibox.GuestError) as info:
            sb.call("def f(x):\n    return 1 / x", "f", 0)
    assert info.value.type == "ZeroDivisionError"
    assert "division by zero" in info.value.message
    assert "<sandbox>" in info.value.traceback
    assert info.value.result is not None and not info.value.result.ok


def test_call_errors_for_missing_entry_and_bad_values(sandbox: wasibox.Sandbox) -> None:
    with pytest.raises(wasibox.GuestError, match="no callable named 'g'"):
        sandbox.call("def f(): pass", "g")
    with pytest.raises(wasibox.GuestError, match="not msgpack-compatible"):
        sandbox.call("def f():\n    return object()", "f")
    with pytest.raises(wasibox.UsageError, match="msgpack"):
        sandbox.call("def f(x): pass", "f", object())
    with pytest.raises(wasibox.UsageError, match="msgpack"):
        sandbox.call("def f(x): pass", "f", 2**70)
    with pytest.raises(wasibox.UsageError, match="entry"):
        sandbox.call("def f(): pass", "not an identifier")


def test_call_raises_limit_exceeded() -> None:
    with wasibox.Sandbox(wasibox.Limits(fuel=50_000_000)) as sb:
        with pytest.raises(wasibox.LimitExceeded) as info:
            sb.call("def spin():\n    while True: pass", "spin")
    assert info.value.limit is Limit.FUEL
    assert info.value.result is not None and info.value.result.fuel_used == 50_000_000


def test_every_run_gets_a_fresh_instance(sandbox: wasibox.Sandbox) -> None:
    tamper = """
import builtins, sys, json
builtins.len = lambda x: 42
builtins.SENTINEL = 'leaked'
sys.modules['json'] = None
sys.path.append('/evil')
import random; random.seed(123)
"""
    assert sandbox.run(tamper).ok
    check = """
import builtins, sys
print(len('abc'), hasattr(builtins, 'SENTINEL'), sys.modules.get('json') is not None, sys.path)
import json; print(json.dumps([1]))
"""
    r = sandbox.run(check)
    assert r.stdout == "3 False True ['']\n[1]\n"


def test_no_ambient_authority(sandbox: wasibox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_CANARY_SECRET", "s3cr3t-canary")
    r = sandbox.run("""
import os, sys
print(dict(os.environ), sys.argv, os.getcwd())
print(os.listdir('/'))
""")
    assert "s3cr3t-canary" not in r.stdout + r.stderr
    assert r.stdout.startswith("{} [''] /\n")  # argv as for `python -c`
    # No files are granted: the root directory is empty or not readable at all.
    assert r.ok and r.stdout.splitlines()[1] == "[]" or (r.error and r.error.type.endswith("Error"))


def test_no_sockets(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("import socket\ns = socket.create_connection(('127.0.0.1', 80), timeout=1)")
    assert not r.ok and r.error is not None
    assert r.error.type in {"OSError", "PermissionError", "ConnectionRefusedError",
                            "BlockingIOError", "gaierror", "CapabilityDenied"} \
        or "Error" in r.error.type


@pytest.mark.parametrize("attempt", [
    "socket.socket()",
    "socket.create_connection(('93.184.216.34', 80), timeout=1)",
    "socket.getaddrinfo('example.com', 80)",
    "socket.gethostbyname('localhost')",
    "socket.socketpair()",
])
def test_sockets_are_refused_with_a_hint(sandbox: wasibox.Sandbox, attempt: str) -> None:
    r = sandbox.run(f"import socket\n{attempt}")
    assert r.error is not None and r.error.type == "CapabilityDenied", r.error
    assert "no network sockets" in r.error.message and "urllib.request" in r.error.message
    caught = sandbox.run(f"import socket\ntry:\n    {attempt}\nexcept PermissionError:\n"
                         "    print('caught as PermissionError')")
    assert caught.stdout == "caught as PermissionError\n"


def test_raw_sockets_stay_closed_without_the_hint(sandbox: wasibox.Sandbox) -> None:
    # The hint is the guest runner's; the guarantee is WASI's: the engine grants no sockets.
    r = sandbox.run("import _socket\ns = _socket.socket()\ns.connect(('93.184.216.34', 80))")
    assert r.error is not None and r.error.type in {"OSError", "PermissionError"}


@pytest.mark.parametrize("attempt", [
    "threading.Thread(target=print).start()",
    "concurrent.futures.ThreadPoolExecutor().submit(print)",
    "_thread.start_new_thread(print, ())",
])
def test_threads_say_the_guest_has_none(sandbox: wasibox.Sandbox, attempt: str) -> None:
    r = sandbox.run(f"import _thread, threading, concurrent.futures\n{attempt}")
    assert r.error is not None and r.error.type == "RuntimeError", r.error
    assert "can't start new thread: the sandbox has no threads" in r.error.message


def test_error_messages_contain_no_host_paths(sandbox: wasibox.Sandbox) -> None:
    import os

    r = sandbox.run("import nonexistent_module_xyz")
    text = r.error.traceback if r.error else ""
    assert "ModuleNotFoundError" in text
    for host_path in (os.getcwd(), os.path.expanduser("~"), os.path.dirname(wasibox.__file__)):
        assert host_path not in text


def test_source_limit_is_checked_before_running() -> None:
    with wasibox.Sandbox(wasibox.Limits(source_bytes=100)) as sb:
        with pytest.raises(wasibox.UsageError, match="source_bytes"):
            sb.run("x = 1\n" * 50)
        assert sb.run("x = 1").ok


def test_memory_cap_below_the_snapshot_minimum_is_a_usage_error() -> None:
    with wasibox.Sandbox(wasibox.Limits(memory_bytes=1 << 20)) as sb:
        with pytest.raises(wasibox.UsageError, match="minimum of [0-9]+ bytes"):
            sb.run("pass")


def test_closed_sandbox_refuses_work() -> None:
    sb = wasibox.Sandbox()
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(wasibox.SandboxClosed):
        sb.run("pass")
    assert "closed" in repr(sb)


def test_threads_share_one_sandbox() -> None:
    code = "import random\nprint(sum(i * i for i in range(20000)), random.random())"
    with wasibox.Sandbox() as sb:
        expected = sb.run(code)
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda _: sb.run(code), range(16)))
    assert all(r.stdout == expected.stdout and r.fuel_used == expected.fuel_used for r in results)
    assert threading.active_count() < 20


def test_guest_output_encoding(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("import sys\nprint('héllo ✓')\nsys.stdout.flush()\n"
                    "sys.stdout.buffer.write(b'\\xff\\n')")
    assert r.stdout == "héllo ✓\n\ufffd\n"


def test_a_plain_runs_result_holds_every_field_as_its_init_would(sandbox: wasibox.Sandbox) -> None:
    # build_result skips RunResult.__init__ when every field is clean already: a field added
    # to RunResult and not to that shortcut would be missing from plain runs' results.
    result = sandbox.run("print(1)")
    names = {field.name for field in dataclasses.fields(wasibox.RunResult)}
    assert set(vars(result)) == names
    assert result == wasibox.RunResult(**{name: getattr(result, name) for name in names})
