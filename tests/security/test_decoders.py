"""Decoder fuzzing: every host-side decoder of guest data, fed forged bytes.

The decoders are the run reply (``decode_reply``), a msgpack value (``unpack``, the one way
guest msgpack becomes values), a host call's payload (``HostCalls.handle``), a batch reply
(``decode_batch_reply``) and a microVM frame (``Channel.frames``). Hypothesis generates byte
strings shaped like their formats (headers that lie about counts and lengths, extension
types, depth bombs, truncations) as well as plain noise, and hand-forged worst cases sit
exactly at and just past the element cap. Each decoder answers with a typed error
(``ProtocolError``, a refused call) or a value of the documented plain types within the
caps, and the host memory a decode costs, measured by tracemalloc, stays within the bound
``wasibox/_wire.py`` documents: ``HOST_BYTES_PER_ELEMENT`` per element plus 4 bytes per
byte decoded.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import Limit
from wasibox._batch import batch_elements, decode_batch_reply
from wasibox._wire import (
    MAX_DEPTH,
    MIN_ELEMENTS,
    ProtocolError,
    decode_reply,
    json_outline,
    max_elements,
    unpack,
)
from wasibox.backends.microvm.channel import MAX_FRAME_ELEMENTS, Channel
from wasibox.capabilities.hostcall import HostCalls, StopRun

pytestmark = pytest.mark.guest

#: What one decoded element may cost the host, at most (wasibox/_wire.py; ~110 measured).
HOST_BYTES_PER_ELEMENT = 128
#: What a refusal may allocate, whatever the size of what it refuses (msgpack's Packer,
#: which encodes the answer to a refused call, starts with a 256 KiB buffer).
REFUSAL_BYTES = 320 * 2**10
#: The element cap of these tests: ``max_elements`` of a small guest (tracemalloc is slow).
CAP = max_elements(16 * 2**20)
PLAIN_TYPES = (type(None), bool, int, float, str, bytes, list, dict)


def walk(value: Any) -> tuple[int, int]:
    """(elements, depth) of a decoded value, asserting every part is a plain type."""
    elements, deepest = 0, 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        elements += 1
        assert type(item) in PLAIN_TYPES, type(item)
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for pair in item.items() for child in pair)
    return elements, deepest


def measured(decode: Callable[[], Any], attempts: int = 3) -> tuple[Any, int]:
    """Run ``decode``; return its result (or the ProtocolError it raised) and the peak
    host memory it allocated, by tracemalloc.

    tracemalloc counts every thread's allocations, and threads earlier tests left running
    (a warm pool's filler, the epoch ticker) may allocate during the window. The decode is
    deterministic and that noise only adds, so the least peak of a few attempts is the
    decode's own.
    """
    peaks = []
    for _ in range(attempts):
        tracemalloc.start()
        try:
            try:
                result: Any = decode()
            except ProtocolError as exc:
                result = exc
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    return result, min(peaks)


def assert_bounded(decode: Callable[[], Any], size: int, elements: int = CAP) -> Any:
    result, peak = measured(decode)
    assert peak <= HOST_BYTES_PER_ELEMENT * elements + 4 * size + REFUSAL_BYTES, peak
    return result


# -- forged msgpack --------------------------------------------------------------------------

def _header(byte: int, width: int) -> st.SearchStrategy[bytes]:
    """A sized header with a count or length anywhere from honest to absurd."""
    return st.integers(0, 2 ** (8 * width) - 1).map(
        lambda n: bytes([byte]) + n.to_bytes(width, "big"))


_PIECES = st.one_of(
    st.integers(0x80, 0x9F).map(lambda b: bytes([b])),  # fixmap / fixarray headers
    st.sampled_from([0xDC, 0xDE]).flatmap(lambda b: _header(b, 2)),
    st.sampled_from([0xDD, 0xDF]).flatmap(lambda b: _header(b, 4)),
    st.sampled_from([0xC4, 0xD9]).flatmap(lambda b: _header(b, 1)),  # str8, bin8
    st.sampled_from([0xC5, 0xDA]).flatmap(lambda b: _header(b, 2)),
    st.sampled_from([0xC6, 0xDB]).flatmap(lambda b: _header(b, 4)),
    # extension types: fixext 1-16, ext 8/16/32 (Timestamp is type -1)
    st.tuples(st.sampled_from([0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8]),
              st.binary(max_size=12)).map(lambda t: bytes([t[0]]) + t[1]),
    st.sampled_from([b"\xc0", b"\xc1", b"\xc2", b"\xc3", b"\x00", b"\x7f", b"\xe0", b"\xa1a",
                     b"\xcb" + struct.pack(">d", 1.5), b"\xcf" + b"\xff" * 8,
                     b"\xca\x7f\xc0\x00\x00", b"\xa2\xff\xfe", b"\x90" * 40, b"\x91" * 40]),
    st.binary(max_size=8),
)
forged_msgpack = st.lists(_PIECES, max_size=40).map(b"".join)


def assert_plain_within_caps(result: Any, elements: int) -> None:
    if isinstance(result, ProtocolError):
        return
    value, used = result
    found, depth = walk(value)
    assert found <= used <= elements  # a map with a repeated key holds fewer than it declared
    assert depth <= MAX_DEPTH


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(forged_msgpack, st.binary(max_size=200)), st.integers(1, 64))
def test_forged_msgpack_is_a_protocol_error_or_a_bounded_plain_value(data: bytes,
                                                                    elements: int) -> None:
    result = assert_bounded(lambda: unpack(data, "the value", elements), len(data), elements)
    assert_plain_within_caps(result, elements)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
                    | st.text(max_size=8) | st.binary(max_size=8),
                    lambda children: st.lists(children, max_size=5)
                    | st.dictionaries(st.text(max_size=3), children, max_size=5),
                    max_leaves=60))
def test_every_plain_value_within_the_caps_decodes_exactly(value: Any) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    elements, depth = walk(value)
    if depth > MAX_DEPTH:
        with pytest.raises(ProtocolError):
            unpack(data, "the value", CAP)
        return
    decoded, used = unpack(data, "the value", CAP)
    assert used == elements
    # NaN is not equal to itself: compare the encodings.
    assert msgpack.packb(decoded, use_bin_type=True) == data
    with pytest.raises(ProtocolError, match="more than"):
        unpack(data, "the value", elements - 1)


#: Hand-forged values of exactly ``n`` elements, each the dearest of its kind for the host.
FORGERIES: dict[str, Callable[[int], bytes]] = {
    "empty lists": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\x90" * (n - 1),
    "empty maps": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\x80" * (n - 1),
    "one-pair maps": lambda n: (b"\xdd" + ((n - 1) // 3).to_bytes(4, "big")
                                + b"\x81\x00\x90" * ((n - 1) // 3)),
    "two-character strs": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\xa2ab" * (n - 1),
    "one wide str and many short": lambda n: (b"\xdd" + (n - 1).to_bytes(4, "big")
                                              + b"\xda\x10\x00" + "\U0001f600".encode() * 1024
                                              + b"\xa1a" * (n - 2)),
    "one-byte bins": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\xc4\x01x" * (n - 1),
    "floats": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\xcb" + b"\x01" * 8 * 1
                        + (b"\xcb" + b"\x01" * 8) * (n - 2),
    "big ints": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\xcf" + b"\xff" * 8 * 1
                          + (b"\xcf" + b"\xff" * 8) * (n - 2),
    "one-pair maps nested 30 deep": lambda n: (  # within the depth cap, in an array
        b"\xdd" + ((n - 1) // 61).to_bytes(4, "big")
        + b"".join((b"\x81\xa4" + f"{i:04x}".encode()) * 30 + b"\x80"
                   for i in range((n - 1) // 61))),
    "one map, one key repeated": lambda n: (b"\xdf" + ((n - 1) // 2).to_bytes(4, "big")
                                            + b"\xa1k\x90" * ((n - 1) // 2)),
    "nil": lambda n: b"\xdd" + (n - 1).to_bytes(4, "big") + b"\xc0" * (n - 1),
    "nested to the depth cap": lambda n: (b"\x91" * (MAX_DEPTH - 2) + b"\xdd"
                                          + (n - MAX_DEPTH + 1).to_bytes(4, "big")
                                          + b"\x90" * (n - MAX_DEPTH + 1)),
}


@pytest.mark.parametrize("shape", sorted(FORGERIES))
def test_a_value_at_the_element_cap_costs_the_host_a_bounded_amount(shape: str) -> None:
    data = FORGERIES[shape](CAP)
    value, used = assert_bounded(lambda: unpack(data, "the value", CAP), len(data))
    assert used <= CAP and walk(value)[0] <= CAP


@pytest.mark.parametrize("shape", sorted(FORGERIES))
def test_one_element_past_the_cap_is_refused_before_anything_is_built(shape: str) -> None:
    data = FORGERIES[shape](CAP + 61)  # + 61: the largest unit of a forgery here
    result, peak = measured(lambda: unpack(data, "the value", CAP))
    assert isinstance(result, ProtocolError) and "more than" in str(result)
    assert peak <= REFUSAL_BYTES


@pytest.mark.parametrize("data", [
    b"\xdd\xff\xff\xff\xff" + b"\x90" * 1000,   # an array claiming 2**32 - 1 elements
    b"\xdf\xff\xff\xff\xff",                      # a map claiming 2**32 - 1 pairs
    b"\xdb\xff\xff\xff\xff" + b"a" * 100,         # a str claiming 4 GiB
    b"\xc6\x7f\xff\xff\xff",                      # a bin claiming 2 GiB
    b"\x91" * 100_000 + b"\xc0",                  # 100,000 levels deep
    b"\x91" * MAX_DEPTH + b"\x90",                # one level too deep
    b"\x92\xc0",                                  # truncated
    b"\xc0\xc0",                                  # bytes after the value
    b"\xc1",                                      # the byte msgpack never uses
    b"\x81\x90\x00",                              # an unhashable map key
    b"\xa2\xff\xfe",                              # invalid UTF-8 in a str
    msgpack.packb(msgpack.Timestamp(1, 0)),
    msgpack.packb(msgpack.ExtType(5, b"x")),
    msgpack.packb([1, {"a": msgpack.ExtType(127, b"")}]),
    b"\xc7\x00\xff",                              # a zero-length Timestamp
])
def test_hand_forged_values_are_protocol_errors(data: bytes) -> None:
    result, peak = measured(lambda: unpack(data, "the value", CAP))
    assert isinstance(result, ProtocolError), result
    assert peak <= REFUSAL_BYTES + 4 * len(data)


def test_extension_types_are_refused_by_name() -> None:
    for value in (msgpack.Timestamp(1, 0), msgpack.ExtType(1, b"x")):
        with pytest.raises(ProtocolError, match="not plain data.*extension types"):
            unpack(msgpack.packb(value), "the value", CAP)


# -- the run reply ---------------------------------------------------------------------------

GOOD = {"exit_code": 0, "memory_error": False, "heap_top": 0}
_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
_REPLY_FIELDS = st.dictionaries(
    st.sampled_from(["exit_code", "error", "value", "memory_error", "heap_top", "x"]),
    st.one_of(_JSON_SCALARS, forged_msgpack.map(lambda b: base64.b64encode(b).decode()),
              st.fixed_dictionaries({"type": st.text(max_size=5), "message": _JSON_SCALARS,
                                     "traceback": st.text(max_size=5)}),
              st.lists(_JSON_SCALARS, max_size=3)))


@settings(max_examples=300, deadline=None)
@given(st.one_of(_REPLY_FIELDS.map(lambda fields: json.dumps({**GOOD, **fields})),
                 st.text(max_size=300)))
def test_forged_replies_are_protocol_errors_or_bounded_replies(text: str) -> None:
    result = assert_bounded(lambda: decode_reply(text, 2**20, CAP), len(text))
    if not isinstance(result, ProtocolError):
        assert 0 <= result.exit_code <= 255 and result.heap_top >= 0
        assert walk(result.value)[0] <= CAP
        assert result.error is None or set(result.error) == {"type", "message", "traceback"}


def test_a_reply_of_many_empty_strings_is_refused_from_its_quotes() -> None:
    # A regular expression that matched each string took 45 s over 256 MiB of "",""...
    text = '{"exit_code":0,"x":["' + '","' * 2**20 + '"]}'
    result, peak = measured(lambda: decode_reply(text, 2**24, CAP))
    assert isinstance(result, ProtocolError) and "elements" in str(result)
    assert peak <= 2 * len(text)


def test_a_reply_with_a_huge_number_is_refused_before_int_parses_it() -> None:
    # With the embedder's int-digit limit lifted, int() of 10**6 digits would be quadratic.
    for text in ('{"exit_code":' + "9" * 10**6 + "}", '{"heap_top":1' + "0" * 5000 + "}"):
        with pytest.raises(ProtocolError, match="longer than 4300 digits"):
            decode_reply(text, 2**24, CAP)


# -- batch replies ---------------------------------------------------------------------------

_JSON_TOKENS = st.sampled_from(['[', ']', '{', '}', ',', ':', '"', '"a"', '"\\"', '\\\\',
                                '0', '-1.5e3', '1e999', 'NaN', 'null', 'true', ' ', '[]',
                                '{}', '"json"', '"columns"', '"keys"', '"values"', '"count"',
                                '"errors"', '"packed"', '"error"', '"memory_error"', 'false',
                                '\x00', '"q"', '"g"', '"i"'])


def _batch_reply(values: Any, count: int) -> str:
    return json.dumps({"error": None, "memory_error": False, "count": count, "errors": [],
                       "values": values})


_BATCH_TEXTS = st.one_of(
    st.lists(_JSON_TOKENS, max_size=60).map("".join),
    st.tuples(st.lists(_JSON_SCALARS | st.lists(_JSON_SCALARS, max_size=3), min_size=1,
                       max_size=4),
              st.dictionaries(st.sampled_from(["0", "1", "9"]),
                              forged_msgpack.map(lambda b: base64.b64encode(b).decode()),
                              max_size=2))
    .map(lambda t: _batch_reply({"json": t[0], "packed": t[1]}, len(t[0]))),
    st.text(max_size=200),
)


@settings(max_examples=300, deadline=None)
@given(_BATCH_TEXTS, st.integers(1, 4), st.integers(1, 200))
def test_forged_batch_replies_are_protocol_errors_or_bounded_values(
        text: str, count: int, elements: int) -> None:
    result = assert_bounded(lambda: decode_batch_reply(text, count, 2**20, elements),
                            len(text), elements)
    if not isinstance(result, ProtocolError):
        assert len(result.values) == count
        assert walk(result.values)[0] <= elements + 1


@pytest.mark.parametrize("element", ["[]", "{}", '{"a":[]}', '"ab"', "0.5", "null"])
def test_a_batch_reply_past_its_cap_is_refused_before_it_is_parsed(element: str) -> None:
    elements = batch_elements(16 * 2**20, 1)
    text = _batch_reply({"json": [[element] * elements]}, 1).replace('"' + element + '"',
                                                                      element)
    result, peak = measured(lambda: decode_batch_reply(text, 1, 2**28, elements))
    assert isinstance(result, ProtocolError) and "more than" in str(result)
    assert peak <= 3 * len(text)  # the outline's copies of the text, never its values


def test_a_batch_reply_cannot_build_more_rows_than_its_cap() -> None:
    # 1000 numeric columns of 100 rows: 100,000 values from a few kilobytes of JSON.
    keys = [f"k{i}" for i in range(1000)]
    column = struct.pack("<100q", *range(100)).decode("latin-1")
    text = (json.dumps({"error": None, "memory_error": False, "count": 100, "errors": [],
                        "values": {"columns": ["q"] * 1000, "keys": keys}})
            + "\x00" + column * 1000)
    with pytest.raises(ProtocolError, match="more elements than its cap"):
        decode_batch_reply(text, 100, 2**28, 50_000)
    assert len(decode_batch_reply(text, 100, 2**28, 200_000).values) == 100


def test_packed_values_share_the_reply_cap() -> None:
    packed = base64.b64encode(msgpack.packb([0] * 600)).decode()
    text = _batch_reply({"json": [None, None], "packed": {"0": packed, "1": packed}}, 2)
    assert decode_batch_reply(text, 2, 2**20, 2000).values == [[0] * 600] * 2
    with pytest.raises(ProtocolError, match="more than"):
        decode_batch_reply(text, 2, 2**20, 1000)


# -- host-call payloads ----------------------------------------------------------------------

def echo(*args: Any, **kwargs: Any) -> Any:
    return [list(args), kwargs]


def _calls(**limits: Any) -> HostCalls:
    return HostCalls(functions={"echo": echo},
                     limits=wasibox.Limits(memory_bytes=16 * 2**20, **limits), http=None)


@settings(max_examples=300, deadline=None)
@given(st.one_of(forged_msgpack, st.binary(max_size=100),
                 forged_msgpack.map(lambda b: b"\x92" + b)),
       st.sampled_from(["echo", "not_granted", "@http"]))
def test_any_payload_to_any_name_is_answered_or_stops_the_run(payload: bytes,
                                                              name: str) -> None:
    calls = _calls()
    try:
        reply = calls.handle(name, payload.decode("latin-1"))
    except StopRun as stop:
        assert stop.limit is Limit.HOST_CALLS
        return
    decoded = msgpack.unpackb(reply.payload.encode("latin-1"), raw=False)
    if name != "echo":  # refused from the name alone, whatever the payload
        assert not reply.ok and decoded["kind"] == "denied"
    elif not reply.ok:
        assert decoded["kind"] in ("invalid", "error")
    assert len(calls.log) == 1


HOSTILE_PAYLOADS = {
    "2**32 claimed elements": b"\x92\xdd\xff\xff\xff\xff" + b"\x90" * (2**24 - 6),
    "16 Mi empty lists": b"\x92\xdd" + (2**24 - 7).to_bytes(4, "big") + b"\x90" * (2**24 - 7)
                         + b"\x80",
    "a depth bomb": b"\x92" + b"\x91" * (2**24 - 3) + b"\xc0\x80",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_PAYLOADS))
def test_a_call_to_a_name_never_granted_is_refused_without_reading_its_payload(
        name: str) -> None:
    payload = HOSTILE_PAYLOADS[name].decode("latin-1")
    calls = _calls()
    reply, peak = measured(lambda: calls.handle("not_granted", payload))
    assert not reply.ok and peak <= REFUSAL_BYTES
    assert calls.log[-1].allowed is False and calls.log[-1].reason == (
        "no host function of this name")


@pytest.mark.parametrize("name", sorted(HOSTILE_PAYLOADS))
def test_a_granted_call_refuses_a_payload_past_its_caps_before_decoding(name: str) -> None:
    payload = HOSTILE_PAYLOADS[name].decode("latin-1")
    calls = _calls()
    reply, peak = measured(lambda: calls.handle("echo", payload))
    assert not reply.ok and peak <= REFUSAL_BYTES + len(payload)  # its latin-1 bytes
    assert "malformed payload" in calls.log[-1].reason


def test_a_call_after_the_deadline_or_a_cancel_stops_the_run_first() -> None:
    calls = _calls()
    with pytest.raises(StopRun) as stop:
        calls.handle("echo", "\x92\x90\x80", deadline=time.monotonic() - 1)
    assert stop.value.limit is Limit.TIMEOUT and calls.calls == 0
    cancel = HostCalls(functions={"echo": echo}, limits=wasibox.Limits(), http=None)
    cancel._cancel.set()
    with pytest.raises(StopRun):
        cancel.handle("echo", "\x92\x90\x80")


# -- microVM frames --------------------------------------------------------------------------

@pytest.fixture()
def channel() -> Iterator[tuple[Channel, socket.socket]]:
    host, guest = socket.socketpair()
    host.setblocking(False)
    yield Channel(host), guest
    host.close()
    guest.close()


def _frames(channel: Channel, guest: socket.socket, payloads: list[bytes]) -> list[Any]:
    """Send ``payloads`` as frames; what the host decodes, up to the first error."""
    guest.sendall(b"".join(struct.pack(">I", len(p)) + p for p in payloads))
    assert channel.feed()  # small frames: one read takes them all
    got: list[Any] = []
    try:
        for frame in channel.frames():
            got.append(frame)
    except ValueError as exc:  # the run ends with a ProtocolError fault
        got.append(exc)
    return got


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(forged_msgpack, forged_msgpack.map(lambda b: b"\x82" + b)),
                min_size=1, max_size=3))
def test_forged_frames_are_errors_or_plain_maps(
        channel: tuple[Channel, socket.socket], payloads: list[bytes]) -> None:
    host, guest = channel
    for frame in _frames(host, guest, payloads):
        if isinstance(frame, ValueError):
            return
        assert isinstance(frame, dict)
        assert walk(frame)[0] <= MAX_FRAME_ELEMENTS


def test_a_frame_past_its_element_cap_is_refused(channel: tuple[Channel, socket.socket]
                                                 ) -> None:
    host, guest = channel
    entries = [["f", "a", 0, b"", False]] * (MAX_FRAME_ELEMENTS // 6 + 1)
    frame = msgpack.packb({"kind": "files", "mount": 0, "entries": entries})
    result = _frames(host, guest, [frame])
    assert isinstance(result[-1], ProtocolError) and "more than" in str(result[-1])
    timestamp = msgpack.packb({"kind": "done", "reply": msgpack.Timestamp(0, 0)})
    result = _frames(host, guest, [timestamp])
    assert isinstance(result[-1], ProtocolError) and "extension" in str(result[-1])


# -- values a real guest returns -------------------------------------------------------------

@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(wasibox.Limits(timeout_s=10)) as sandbox:
        yield sandbox


@pytest.mark.parametrize("expression", [
    "msgpack.Timestamp(1, 0)",
    "msgpack.ExtType(5, b'x')",
    "[1, {'when': msgpack.Timestamp.from_unix(1.5)}]",
])
def test_a_value_that_is_not_plain_data_is_a_typed_error(sb: wasibox.Sandbox,
                                                         expression: str) -> None:
    code = f"import msgpack\ndef f():\n    return {expression}\n"
    r = sb.run(code, entry="f")
    assert not r.ok and r.value is None
    assert r.error is not None and r.error.type == "ProtocolError"
    assert "extension types" in r.error.message
    json.dumps(r.to_dict(), default=repr)  # nothing but plain data in the result
    with pytest.raises(wasibox.GuestError) as raised:
        sb.call(code, "f")
    assert raised.value.type == "ProtocolError"


def test_plain_values_come_back_as_documented(sb: wasibox.Sandbox) -> None:
    value = sb.call("def f():\n    return (1, [2.5, None, True], {'k': b'\\x00', 3: 'x'})",
                    "f")
    assert value == [1, [2.5, None, True], {"k": b"\x00", 3: "x"}]


def test_a_transform_record_that_returns_an_extension_type_fails_alone() -> None:
    code = ("import msgpack\ndef transform(r):\n"
            "    return msgpack.ExtType(1, b'x') if r == 2 else [r, b'raw']\n")
    with wasibox.Transform(code, on_error="collect") as t:
        out = t.map(range(4))
    assert [o for i, o in enumerate(out) if i != 2] == [[0, b"raw"], [1, b"raw"],
                                                        [3, b"raw"]]
    assert isinstance(out[2], wasibox.Failed) and out[2].error.type == "ProtocolError"


def test_a_forged_batch_reply_from_a_real_guest_fails_its_records_with_a_typed_error(
        ) -> None:
    # The function's module replaces the runner's batch encoder: 10 million empty lists.
    code = ("import sys\n"
            "body = '{\"json\":[' + '[],' * 10**7 + '[]]}'\n"
            "sys.modules['wasibox_batch'].encode_values = lambda values, errors: (body, [])\n"
            "def transform(record):\n    return record\n")
    with wasibox.Transform(code, on_error="collect") as t:
        out = t.map([1, 2])
    assert all(isinstance(o, wasibox.Failed) and o.error.type == "ProtocolError"
               and "more than" in o.error.message for o in out), out
    with wasibox.Transform("def transform(r):\n    return r + 1\n") as t:
        assert t.map([1, 2]) == [2, 3]


def test_the_element_cap_follows_the_memory_limit() -> None:
    assert max_elements(wasibox.Limits().memory_bytes) == 2**20
    assert max_elements(2**30) == 2**22
    assert max_elements(1) == MIN_ELEMENTS
    with pytest.raises(ProtocolError):
        json_outline("[" + "0," * MIN_ELEMENTS + "0]", MIN_ELEMENTS)
