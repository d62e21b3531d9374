"""Forged replies: the guest replaces the runner's reply encoder with its own bytes.

The guest shares an interpreter with the runner, so the reply that says how its code ended
is attacker-controlled. Every malformed, oversized, deep or lying reply must become one
clean ``ProtocolError`` in the result, never a host exception, crash or hang.
"""

from __future__ import annotations

import base64
import subprocess
import textwrap
from collections.abc import Iterator

import pytest

import wasibox
from tests.conftest import PYTHON, child_env
from tests.security.conftest import HostBaseline, run_in_child_host

pytestmark = pytest.mark.guest

FORGE = "import sys\nsys.modules['wasibox_job'].encode_reply = lambda *fields: {reply}\n"
GOOD = '{"exit_code":0,"memory_error":false,"heap_top":0'


def _value(raw: bytes) -> str:
    """A reply whose ``value`` carries these raw msgpack bytes."""
    return GOOD + ',"value":"' + base64.b64encode(raw).decode() + '"}'


FORGED = {
    "not JSON": repr("garbage"),
    "JSON array bomb": "'[' * 10**6",
    "JSON object bomb": "'{\"a\":' * 10**6",
    "brackets behind an unterminated string": "'\"' + '[' * 10**6",
    "not a map": repr("1"),
    "exit code out of range": repr('{"exit_code":300,"memory_error":false,"heap_top":0}'),
    "exit code of the wrong type": repr('{"exit_code":"0","memory_error":false,"heap_top":0}'),
    "exit code with 100,000 digits": "'{\"exit_code\":' + '9' * 10**5 + '}'",
    "malformed error": repr(GOOD + ',"error":{"type":1,"message":"m","traceback":""}}'),
    "value not base64": repr(GOOD + ',"value":"!!!"}'),
    "array32 claiming 4 G elements": repr(_value(b"\xdd\xff\xff\xff\xff")),
    "str32 claiming 4 GB": repr(_value(b"\xdb\xff\xff\xff\xff")),
    "map32 claiming 4 G pairs": repr(_value(b"\xdf\xff\xff\xff\xff")),
    "bin32 claiming 4 GB": repr(_value(b"\xc6\xff\xff\xff\xff")),
    "msgpack depth bomb": repr(_value(b"\x91" * 100_000 + b"\xc0")),
    "value deeper than the wire allows": repr(_value(b"\x91" * 40 + b"\xc0")),
    "unhashable map key": repr(_value(b"\x81\x90\x01")),
    "truncated msgpack": repr(_value(b"\x93\x01")),
}


@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(wasibox.Limits(fuel=800_000_000, timeout_s=10)) as sandbox:
        yield sandbox


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_reply_is_one_clean_protocol_error(sb: wasibox.Sandbox, host: HostBaseline,
                                                    name: str) -> None:
    r = sb.run(FORGE.format(reply=FORGED[name]))
    assert r.error is not None and r.error.type == "ProtocolError", (name, r)
    assert not r.ok and r.value is None
    host.assert_unaffected(sb)


def test_a_reply_over_the_size_limit_is_refused_before_it_is_parsed() -> None:
    size = wasibox._sandbox.REPLY_LIMIT_BYTES * 4 // 3 + 8192
    report = run_in_child_host(FORGE.format(reply=f"'x' * {size}"),
                               memory_bytes="512MiB", timeout_s=20)
    assert report["error"] == "ProtocolError" and report["next_ok"]
    # Lifting the string out of the guest costs the host a few copies of it (see
    # test_exhaustion.py); parsing it would cost more, and does not happen.
    assert report["peak_growth_bytes"] < 8 * size  # type: ignore[operator]


_RAISED_LIMIT_HOST = textwrap.dedent("""
    import sys, threading, wasibox
    forged = sys.argv[1]
    sandbox = wasibox.Sandbox()
    sys.setrecursionlimit(10**6)  # an embedder that needs deep recursion of its own
    print(sandbox.run(forged).error.type)
    sys.setrecursionlimit(1000)
    threading.stack_size(64 * 1024)  # and one that serves runs from small threads
    results = []
    worker = threading.Thread(target=lambda: results.append(sandbox.run(forged)))
    worker.start()
    worker.join()
    print(results[0].error.type)
""")


def test_a_json_bomb_reply_cannot_crash_a_host_with_a_raised_recursion_limit() -> None:
    # Regression: json.loads recursed once per '[' up to the host's recursion limit; with
    # sys.setrecursionlimit(10**6) in the host, or on a 64 KiB thread, a forged reply of
    # '[' * 10**6 killed the host with SIGSEGV.
    done = subprocess.run([PYTHON, "-c", _RAISED_LIMIT_HOST,
                           FORGE.format(reply=FORGED["JSON array bomb"])],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ProtocolError", "ProtocolError"]


def _forged_value(prefix: bytes, unit: bytes, count: int) -> str:
    """Guest code that forges a well-formed reply whose value is the msgpack bytes
    ``prefix + unit * count``, base64-encoded by repeating the encoding of three units (so
    that tens of millions of elements cost the guest a few memory copies, not its fuel)."""
    assert len(unit) % 3 or not len(prefix) % 3
    return ("import sys, binascii\n"
            "def b64(data):\n"
            "    return binascii.b2a_base64(data, newline=False).decode()\n"
            f"prefix, unit, count = {prefix!r}, {unit!r}, {count}\n"
            "r = next(r for r in range(3) if (len(prefix) + r * len(unit)) % 3 == 0)\n"
            "m, rest = divmod(count - r, 3)\n"
            "value = b64(prefix + unit * r) + b64(unit * 3) * m + b64(unit * rest)\n"
            "reply = ('{\"exit_code\":0,\"memory_error\":false,\"heap_top\":0,\"value\":\"'\n"
            "         + value + '\"}')\n"
            "del value\n"
            "sys.modules['wasibox_job'].encode_reply = lambda *fields: reply\n")


def _array32(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big")


#: Values of tens of millions of elements, the class that cost hosts 0.8 to 3.4 GB and up
#: to 98 s after the run ended: (prefix, repeated unit, repeats). Each is within the reply's
#: byte cap.
HUGE_VALUES = {
    "32 Mi empty lists": (_array32(2**25), b"\x90", 2**25),
    "an array claiming 2**32 - 1 nils": (_array32(2**32 - 1), b"\xc0", 2**25),
    "8 Mi one-pair maps": (_array32(2**23), b"\x81\xa1k\x90", 2**23),
    "one map of 8 Mi pairs with one key": (b"\xdf" + (2**23).to_bytes(4, "big"),
                                           b"\xa2kk\x90", 2**23),
}


@pytest.mark.parametrize("name", sorted(HUGE_VALUES))
def test_a_forged_value_of_tens_of_millions_of_elements_is_refused_within_the_deadline(
        name: str) -> None:
    # 5 s, not less: on a loaded machine the guest must still get to send its forgery
    # before the deadline, or the run ends as a timeout and tests nothing.
    report = run_in_child_host(_forged_value(*HUGE_VALUES[name]), timeout_s=5)
    assert report["error"] == "ProtocolError" and report["next_ok"], report
    assert report["wall_s"] < 4 * 5  # type: ignore[operator]  # generous: not 4x the timeout
    # Lifting the reply out of the guest costs a few copies of it (at most ~64 MiB here);
    # decoding it would have cost gigabytes, and does not happen.
    assert report["peak_growth_bytes"] < 8 * 64 * 2**20  # type: ignore[operator]


def test_a_forged_value_at_the_element_cap_costs_a_bounded_amount_and_arrives() -> None:
    cap = wasibox._wire.max_elements(wasibox.Limits().memory_bytes)
    maps = (cap - 1) // 4  # one array of one-pair maps: the dearest elements for the host
    report = run_in_child_host(_forged_value(_array32(maps), b"\x81\xa1k\x90", maps),
                               timeout_s=10)
    assert report["error"] is None and report["value_length"] == maps, report
    reply_bytes = 4 * (5 + 4 * maps) // 3
    # The documented bound: ~100 bytes per element, on top of lifting the reply.
    assert report["peak_growth_bytes"] < 8 * reply_bytes + 100 * cap  # type: ignore[operator]
