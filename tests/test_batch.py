"""The host's checks on a batch reply, which the guest can forge (no guest needed)."""

from __future__ import annotations

import json
import struct

import pytest

from wasibox._batch import decode_batch_reply, encode_records
from wasibox._wire import ProtocolError

LIMIT = 2**20


def reply(values: object, count: int, errors: list[object] | None = None, tail: str = "",
          **header: object) -> str:
    body = {"error": None, "memory_error": False, "count": count, "errors": errors or [],
            "values": values, **header}
    return json.dumps(body) + ("\x00" + tail if tail else "")


def test_columns_decode_to_rows() -> None:
    ints = struct.pack("<3q", 1, -2, 2**62).decode("latin-1")
    floats = struct.pack("<3d", 0.5, -0.0, float("inf")).decode("latin-1")
    text = reply({"columns": ["q", ["a", None, "c"], "d"], "keys": ["n", "s", "x"]}, 3,
                 tail=ints + floats)
    decoded = decode_batch_reply(text, 3, LIMIT)
    assert decoded.values == [{"n": 1, "s": "a", "x": 0.5}, {"n": -2, "s": None, "x": -0.0},
                              {"n": 2**62, "s": "c", "x": float("inf")}]


def test_keys_are_data_never_code() -> None:
    key = "a}: __import__('os').system('false'), {'b"
    text = reply({"columns": [[1]], "keys": [key]}, 1)
    assert decode_batch_reply(text, 1, LIMIT).values == [{key: 1}]


def test_failed_positions_are_skipped_by_columns() -> None:
    error = {"type": "ValueError", "message": "m", "traceback": ""}
    text = reply({"columns": [[10, 30]], "keys": ["v"]}, 3, errors=[[1, error]])
    decoded = decode_batch_reply(text, 3, LIMIT)
    assert decoded.errors == {1: error}
    assert decoded.values[0] == {"v": 10} and decoded.values[2] == {"v": 30}


@pytest.mark.parametrize("text, count", [
    ("not json", 1),
    (reply({"columns": ["q"], "keys": ["n"]}, 2, tail="x" * 15), 2),    # short column
    (reply({"columns": ["q"], "keys": ["n"]}, 1, tail="\u0100" * 8), 1), # not bytes
    (reply({"columns": [[1]], "keys": ["n", "n"]}, 1), 1),               # duplicate keys
    (reply({"columns": [[[1]]], "keys": ["n"]}, 1), 1),                  # nested in a column
    (reply({"json": [1, 2]}, 3), 3),                                     # wrong length
    (reply({"json": [1]}, 2), 1),                                        # wrong count
    (reply({"json": [1]}, 1, errors=[[5, {"type": "E"}]]), 1),           # bad error entry
    (reply({"json": [1]}, 1, tail="junk"), 1),                           # bytes after JSON
    (reply({"json": [json.loads("[" * 40 + "]" * 40)]}, 1), 1),          # too deep
    (reply({"json": [None], "packed": {"0": "not base64!"}}, 1), 1),
])
def test_malformed_replies_are_protocol_errors(text: str, count: int) -> None:
    with pytest.raises(ProtocolError):
        decode_batch_reply(text, count, LIMIT)


def test_a_json_bomb_is_refused_before_parsing() -> None:
    for bomb in ("[" * 10**6, '{"a":' * 10**5, reply({"json": ["[" * 50]}, 1)):
        if bomb.startswith("{\"error"):
            assert decode_batch_reply(bomb, 1, 10**8).values == ["[" * 50]  # inside a string
        else:
            with pytest.raises(ProtocolError, match="nests deeper"):
                decode_batch_reply(bomb, 1, 10**8)


def test_oversized_reply_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="larger"):
        decode_batch_reply(" " * 100, 1, 50)


def test_equal_records_marshal_to_equal_bytes() -> None:
    key = "".join(["pr", "ice"])  # not interned, unlike the literal below
    assert encode_records([{key: 1}, {key: 2}]) == encode_records([{"price": 1}, {"price": 2}])
