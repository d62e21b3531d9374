"""The host/guest wire contract: requests are exact, forged replies are contained."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

import wasibox
from wasibox._wire import (
    MAX_DEPTH,
    ProtocolError,
    Reply,
    _decode_json_reply,
    decode_reply,
    encode_request,
)

#: An element cap no test value reaches.
ELEMENTS = 2**20


def reply(**fields: object) -> str:
    base = {"exit_code": 0, "memory_error": False, "heap_top": 0}
    return json.dumps({**base, **fields})


def packed(value: object) -> str:
    return base64.b64encode(msgpack.packb(value, use_bin_type=True)).decode()


def test_value_round_trips_with_msgpack_types() -> None:
    value = {"a": [1, 2.5, None, True, b"\x00\xff", "é"], 3: {"nested": []}}
    assert decode_reply(reply(value=packed(value)), 2**20, ELEMENTS).value == value


@pytest.mark.guest
def test_arguments_reach_the_guest_as_msgpack_delivers_them(
        sandbox: wasibox.Sandbox) -> None:
    code = "def f(*args, **kwargs):\n    return [repr(args), repr(kwargs)]"
    args, kwargs = sandbox.call(code, "f", (1, 2), b"x", k={"t": (3,)})
    assert args == "([1, 2], b'x')"
    assert kwargs == "{'k': {'t': [3]}}"


def _both_readings(text: str) -> tuple[Reply | str, Reply | str]:
    """What ``decode_reply`` and the JSON parser's path make of ``text`` (a ProtocolError as
    its type name)."""
    readings: list[Reply | str] = []
    for decode in (decode_reply, _decode_json_reply):
        try:
            readings.append(decode(text, 2**20, ELEMENTS))
        except ProtocolError as exc:
            readings.append(type(exc).__name__)
    return readings[0], readings[1]


@given(exit_code=st.integers(-3, 300), memory_error=st.booleans(),
       heap_top=st.integers(-3, 2**70), compact=st.booleans())
def test_a_plain_reply_reads_as_the_json_parser_reads_it(
        exit_code: int, memory_error: bool, heap_top: int, compact: bool) -> None:
    text = json.dumps({"exit_code": exit_code, "memory_error": memory_error,
                       "heap_top": heap_top}, separators=(",", ":") if compact else None)
    fast, parsed = _both_readings(text)
    assert fast == parsed


@given(tail=st.text(alphabet='0123456789-+.e,:}{ "truefalsheap_topmory', max_size=60))
def test_a_forged_near_plain_reply_reads_as_the_json_parser_reads_it(tail: str) -> None:
    fast, parsed = _both_readings('{"exit_code":' + tail)
    assert fast == parsed


def test_request_rejects_values_msgpack_cannot_carry() -> None:
    with pytest.raises(TypeError):
        encode_request({"op": "call", "args": [object()]})


@pytest.mark.parametrize("text, problem", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "nests deeper"),  # refused before parsing: a reply has no arrays
    ("[" * 100_000 + "]" * 100_000, "more than 64 elements"),  # a reply has a few fields
    ('"[" 1', "not valid JSON"),
    ("1", "not a map"),
    (reply(exit_code=256), "exit_code"),
    (reply(exit_code="0"), "exit_code"),
    (reply(error={"type": "X"}), "malformed error"),
    (reply(heap_top="big"), "memory fields"),
    (reply(value=12), "malformed value"),
    (reply(value="!!!not base64"), "not valid msgpack"),
    (reply(value=packed([[[[[[]]]]]] * 2)[:-3]), "not valid msgpack"),
])
@pytest.mark.guest
def test_malformed_replies_are_protocol_errors(text: str, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        decode_reply(text, 2**20, ELEMENTS)


def test_too_deep_value_is_refused() -> None:
    deep: list[object] = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ProtocolError, match="deeper"):
        decode_reply(reply(value=packed(deep)), 2**20, ELEMENTS)


def test_oversized_reply_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="larger"):
        decode_reply(reply(value=packed("x" * 10_000)), 1_000, ELEMENTS)


@pytest.mark.guest
def test_a_guest_that_forges_its_reply_gets_a_protocol_error(
        sandbox: wasibox.Sandbox) -> None:
    forge = ("import sys\n"
             "runner = sys.modules['wasibox_job']\n"
             "runner.encode_reply = lambda *a: '{\"exit_code\": 0, \"value\": 5}'\n")
    result = sandbox.run(forge)
    assert not result.ok
    assert result.error is not None and result.error.type == "ProtocolError"
    assert sandbox.run("print('next')").stdout == "next\n"


@given(code=st.text(), seed=st.one_of(st.none(), st.integers(-2**64, 2**64)),
       compiled=st.one_of(st.none(), st.binary(min_size=1)))
def test_a_plain_run_request_is_flat_and_carries_its_fields(
        code: str, seed: int | None, compiled: bytes | None) -> None:
    fields = {"op": "run", "code": code, "seed": seed,
              **({"compiled": compiled} if compiled is not None else {})}
    request = encode_request(fields)
    if not request.startswith("\x01"):  # a seed past 64 bits, or a lone surrogate
        assert (seed is not None and seed.bit_length() > 64) or any(
            "\ud800" <= char <= "\udfff" for char in code)
        assert request.startswith("\x00")
        return
    # Sliced as the guest runner slices it (guest/runner/wasibox_guest.py, _flat_run).
    seed_end = request.index("\x00", 1)
    code_start = request.index("\x00", seed_end + 1) + 1
    code_end = code_start + int(request[seed_end + 1:code_start - 1])
    assert request[code_start:code_end] == code
    assert (int(request[1:seed_end]) if seed_end > 1 else None) == seed
    assert (request[code_end:].encode("latin-1") or None) == compiled
    request.encode("utf-8")  # what crosses into the guest


@pytest.mark.parametrize("fields", [
    {"op": "run", "code": "pass", "seed": 0, "filename": "x.py"},
    {"op": "run", "code": "pass", "seed": 0, "prime": True},
    {"op": "call", "code": "pass", "seed": 0, "entry": "f", "args": [], "kwargs": {}},
    {"op": "compile", "code": "pass", "seed": 0},
])
def test_requests_other_than_a_plain_run_are_maps(fields: dict[str, object]) -> None:
    assert encode_request(fields).startswith("\x00")
