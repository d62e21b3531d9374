"""Host functions: calls, errors, denials, malformed and hostile payloads, limits, deadline."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import wasibox
from tests.conftest import open_fds
from wasibox import Limit
from wasibox._wire import MAX_DEPTH, ProtocolError, check_packed
from wasibox.capabilities.hostcall import (
    DENIED_MESSAGE,
    HostCalls,
    StopRun,
    check_functions,
    host_error_message,
)

pytestmark = pytest.mark.guest

BENIGN = "print(sum(range(10)))"
#: An element cap no test value reaches.
ELEMENTS = 2**20
HOST_PATHS = (str(Path(__file__).resolve().parents[2]), str(Path.home()), "/tmp", "/usr/lib")


def lookup(customer_id: int) -> dict[str, Any]:
    return {"id": customer_id, "name": "Ada", "tags": ["a", "b"], "raw": b"\x00\xff"}


def echo(*args: Any, **kwargs: Any) -> Any:
    return [list(args), kwargs]


def fails() -> None:
    raise FileNotFoundError(2, "No such file or directory", str(Path(__file__).resolve()))


def unencodable() -> Any:
    return {1, 2, 3}  # a set is not msgpack


def big(size: int) -> bytes:
    return b"x" * size


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "lookup": lookup, "echo": echo, "fails": fails, "unencodable": unencodable, "big": big}


@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(functions=FUNCTIONS) as sandbox:
        yield sandbox


@pytest.fixture()
def fds() -> int:
    return open_fds()


def assert_host_healthy(sb: wasibox.Sandbox, fds_before: int) -> None:
    after = sb.run(BENIGN)
    assert after.ok and after.stdout == "45\n"
    assert open_fds() <= fds_before + 2


# -- calls from the guest ------------------------------------------------------------------------

def test_call_by_attribute_and_by_name(sb: wasibox.Sandbox) -> None:
    r = sb.run("import host\nprint(host.lookup(42))\nprint(host.call('lookup', customer_id=7))")
    assert r.ok, r.error
    assert r.stdout == ("{'id': 42, 'name': 'Ada', 'tags': ['a', 'b'], 'raw': b'\\x00\\xff'}\n"
                        "{'id': 7, 'name': 'Ada', 'tags': ['a', 'b'], 'raw': b'\\x00\\xff'}\n")


def test_values_round_trip(sb: wasibox.Sandbox) -> None:
    code = "import host\ndef f(v):\n    return host.echo(v, 1.5, None, k=[True, {'x': 1}])"
    value = sb.call(code, "f", {"nested": [1, "two", b"3", {"4": None}]})
    assert value == [[{"nested": [1, "two", b"3", {"4": None}]}, 1.5, None],
                     {"k": [True, {"x": 1}]}]


def test_every_call_is_in_the_capability_log(sb: wasibox.Sandbox) -> None:
    r = sb.run("import host\nhost.lookup(1)\ntry:\n    host.missing()\nexcept PermissionError:\n"
               "    pass\n")
    assert r.ok
    first, second = r.capability_log
    assert (first.capability, first.action, first.target, first.allowed) == (
        "function", "call", "lookup", True)
    assert first.bytes_sent > 0 and first.bytes_received > 0 and first.duration_s >= 0
    assert (second.target, second.allowed) == ("missing", False)
    assert second.reason


def test_host_exception_reaches_guest_as_host_error_without_host_paths(
        sb: wasibox.Sandbox, fds: int) -> None:
    r = sb.run("import host\ntry:\n    host.fails()\nexcept host.HostError as e:\n"
               "    print(e.type, '|', e.message)\n")
    assert r.ok
    assert r.stdout == "FileNotFoundError | [Errno 2] No such file or directory: '<path>'\n"
    # Uncaught, it ends the guest's program like any exception: no host frames or paths.
    r = sb.run("import host\nhost.fails()")
    assert r.error is not None and r.error.type == "HostError"
    for text in (r.error.message, r.error.traceback, r.stdout, r.stderr):
        assert not any(path in text for path in HOST_PATHS), text
        assert "hostcall.py" not in text and "wasibox/" not in text
    assert_host_healthy(sb, fds)


def test_unknown_name_is_capability_denied(sb: wasibox.Sandbox) -> None:
    r = sb.run("import host\ntry:\n    host.os_system('id')\nexcept host.CapabilityDenied as e:\n"
               "    print(isinstance(e, PermissionError), e)\n")
    assert r.stdout == f"True {DENIED_MESSAGE}\n"


def test_no_functions_granted_means_every_name_is_denied() -> None:
    with wasibox.Sandbox() as sandbox:
        r = sandbox.run("import host\ntry:\n    host.lookup(1)\nexcept PermissionError as e:\n"
                        "    print(type(e).__name__)\n")
        assert r.stdout == "CapabilityDenied\n"


def test_unencodable_return_value_is_a_host_error(sb: wasibox.Sandbox) -> None:
    r = sb.run("import host\ntry:\n    host.unencodable()\nexcept host.HostError as e:\n"
               "    print(e.type)\n")
    assert r.stdout == "TypeError\n"


def test_wrong_arguments_are_a_host_error(sb: wasibox.Sandbox) -> None:
    r = sb.run("import host\ntry:\n    host.lookup(1, 2, 3)\nexcept host.HostError as e:\n"
               "    print(e.type)\n")
    assert r.stdout == "TypeError\n"


# -- hostile payloads from the guest -------------------------------------------------------------

RAW_CHANNEL = """\
from wit_world.imports import host as channel
from componentize_py_types import Err
import msgpack
def send(name, payload):
    try:
        return 'ok', channel.call(name, payload)
    except Err as err:
        return 'err', msgpack.unpackb(err.value.encode('latin-1'))
"""


@pytest.mark.parametrize("payload", [
    "",  # nothing
    "\xc1",  # a byte msgpack never uses
    "\x92\x90",  # an array of two with one element
    "\x92\x90\x80\x00",  # trailing byte
    "\x92\x90\x80" + "\xc7\x01\x05x",  # an extension type
    "\xdb\xff\xff\xff\xff",  # a str declaring 4 GiB
    "\xdd\xff\xff\xff\xff",  # an array declaring 4 billion elements
    "\x92\x90\x81\x90\x00",  # a map with a list key
    "\x92\x80\x80",  # args is a map, not a list
    "\x91\x90",  # not [args, kwargs]
    "\x92\x90\x80\u0100",  # a char that is not one byte
    "\x92\x91\xa2\xff\xfe\x80",  # invalid UTF-8 in a str
])
def test_malformed_payload_is_one_clean_error(sb: wasibox.Sandbox, payload: str,
                                              fds: int) -> None:
    r = sb.run(RAW_CHANNEL + f"print(send('echo', {payload!r}))")
    assert r.ok, r.error
    assert r.stdout == ("('err', {'kind': 'invalid', 'type': 'ProtocolError', "
                        "'message': \"the call's payload is malformed\"})\n")
    assert r.capability_log[-1].allowed is False
    assert_host_healthy(sb, fds)


def test_depth_bomb_from_the_guest_is_refused(sb: wasibox.Sandbox, fds: int) -> None:
    bomb = "\x92\x91" + "\x91" * 1000 + "\xc0\x80"
    r = sb.run(RAW_CHANNEL + f"print(send('echo', {bomb!r})[1]['kind'])\n"
               "import host\nv = []\nfor _ in range(40):\n    v = [v]\n"
               "try:\n    host.echo(v)\nexcept host.HostError as e:\n    print(e.type)\n")
    assert r.stdout == "invalid\nProtocolError\n"
    assert_host_healthy(sb, fds)


def test_guest_cannot_reach_host_internals_through_names(sb: wasibox.Sandbox) -> None:
    r = sb.run(RAW_CHANNEL + "for name in ['__import__', 'os.system', '', '\\x00', 'echo.x', "
               "'__class__']:\n    print(send(name, '\\x92\\x90\\x80')[1]['kind'])\n")
    assert r.stdout == "denied\n" * 6


# -- limits --------------------------------------------------------------------------------------

def test_call_count_limit_ends_the_run(fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(host_calls=5), functions=FUNCTIONS) as sandbox:
        r = sandbox.run("import host\nfor i in range(10):\n    host.echo(i)\n"
                        "    print(i, flush=True)\n")
        assert r.limit_exceeded is Limit.HOST_CALLS and r.limit_exceeded == "host_calls"
        assert r.stdout == "0\n1\n2\n3\n4\n" and not r.ok
        assert len(r.capability_log) == 5
        assert_host_healthy(sandbox, fds)


def test_payload_over_the_per_call_cap_ends_the_run(fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(host_call_bytes="4KiB"), functions=FUNCTIONS) as sandbox:
        assert sandbox.run("import host\nhost.echo(b'x' * 4000)").ok
        r = sandbox.run("import host\nhost.echo(b'x' * 5000)")
        assert r.limit_exceeded is Limit.HOST_CALLS
        # The reply is capped the same way.
        r = sandbox.run("import host\nhost.big(5000)")
        assert r.limit_exceeded is Limit.HOST_CALLS
        assert_host_healthy(sandbox, fds)


def test_total_bytes_cap_ends_the_run(fds: int) -> None:
    limits = wasibox.Limits(host_call_bytes="4KiB", host_total_bytes="20KiB")
    with wasibox.Sandbox(limits, functions=FUNCTIONS) as sandbox:
        r = sandbox.run("import host\nfor i in range(100):\n    host.big(3000)\n"
                        "    print(i, flush=True)\n")
        assert r.limit_exceeded is Limit.HOST_CALLS
        assert 3 <= len(r.stdout.split()) <= 7
        assert_host_healthy(sandbox, fds)


def test_blocking_host_function_ends_at_the_timeout(fds: int) -> None:
    release = threading.Event()

    def blocks() -> None:
        release.wait()

    try:
        with wasibox.Sandbox(wasibox.Limits(timeout_s=0.5), functions={"blocks": blocks}) as sb:
            r = sb.run("import host\nprint('before', flush=True)\nhost.blocks()\nprint('after')")
            assert r.limit_exceeded is Limit.TIMEOUT
            assert r.stdout == "before\n"
            assert r.duration_s < 30  # generous: only proves the wait did not run unbounded
            assert r.capability_log[-1].reason == "still running at the deadline"
            assert_host_healthy(sb, fds)
    finally:
        release.set()


def test_host_function_may_take_time_within_the_timeout() -> None:
    done = threading.Event()

    def slow() -> str:
        done.wait(0.2)
        return "done"

    with wasibox.Sandbox(wasibox.Limits(timeout_s=5), functions={"slow": slow}) as sb:
        assert sb.call("import host\ndef f():\n    return host.slow()", "f") == "done"


# -- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("functions", [
    {"1bad": echo}, {"has space": echo}, {"__dunder__": echo}, {"ok": 42}, {3: echo}, [echo],
])
def test_bad_functions_are_usage_errors(functions: Any) -> None:
    with pytest.raises(wasibox.UsageError):
        wasibox.Sandbox(functions=functions)
    assert check_functions(None) == {}


@pytest.mark.parametrize("field, value", [
    ("host_calls", 0), ("host_calls", True), ("host_call_bytes", "lots"), ("host_total_bytes", 0),
])
def test_bad_host_call_limits_are_usage_errors(field: str, value: object) -> None:
    with pytest.raises(wasibox.UsageError, match=field):
        wasibox.Limits(**{field: value})  # type: ignore[arg-type]


# -- the host side, without a guest --------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=30)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, [*value, *value.values()]), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_every_msgpack_value_within_depth_is_accepted(value: Any) -> None:
    assume(depth(value) <= MAX_DEPTH)
    check_packed(msgpack.packb(value, use_bin_type=True), ELEMENTS)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_the_scan_agrees_with_msgpack(data: bytes) -> None:
    try:
        decoded = msgpack.unpackb(data, raw=True, strict_map_key=False)
    except TypeError:  # an unhashable map key: msgpack stops there, before the rest is read
        with contextlib.suppress(ProtocolError):
            check_packed(data, ELEMENTS)
        return
    except (ValueError, msgpack.UnpackException):
        with pytest.raises(ProtocolError):
            check_packed(data, ELEMENTS)
        return
    if "ExtType" in repr(decoded) or "Timestamp" in repr(decoded):
        with pytest.raises(ProtocolError):
            check_packed(data, ELEMENTS)
    else:
        check_packed(data, ELEMENTS)


def test_depth_is_capped_at_max_depth() -> None:
    def nested(depth: int) -> bytes:
        return b"\x91" * (depth - 1) + b"\x90"

    check_packed(nested(MAX_DEPTH), ELEMENTS)
    with pytest.raises(ProtocolError, match="deeper"):
        check_packed(nested(MAX_DEPTH + 1), ELEMENTS)
    with pytest.raises(ProtocolError):
        check_packed(nested(100_000), ELEMENTS)


def test_declared_lengths_are_checked_before_anything_is_read() -> None:
    for lie in (b"\xc6\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdc\xff\xff"):
        with pytest.raises(ProtocolError):
            check_packed(lie, ELEMENTS)


def test_host_error_messages_lose_host_paths_but_keep_urls() -> None:
    message = host_error_message(OSError(f"cannot open '/srv/data/x.db' or {Path.home()}/y "
                                         "(see https://example.com/docs/a)"))
    assert "/srv" not in message and str(Path.home()) not in message
    assert "https://example.com/docs/a" in message


def test_limits_apply_before_decoding() -> None:
    calls = HostCalls(functions={"echo": echo},
                      limits=wasibox.Limits(host_calls=2, host_call_bytes=100), http=None)
    ok = calls.handle("echo", msgpack.packb([[1], {}]).decode("latin-1"))
    assert ok.ok
    with pytest.raises(StopRun) as stop:
        calls.handle("echo", "\xc1" * 101)  # over the cap: refused before it is looked at
    assert stop.value.limit is Limit.HOST_CALLS
    with pytest.raises(StopRun):
        calls.handle("echo", "")
