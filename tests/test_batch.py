"""The host's checks on a batch reply, which the guest can forge (no guest needed)."""

from __future__ import annotations

import copy
import gc
import json
import marshal
import struct
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasibox import _batch
from wasibox._batch import decode_batch_reply, encode_records
from wasibox._progress import library_reporter
from wasibox._wire import ProtocolError
from wasibox.backends.wasm import native as native_extension

LIMIT = 2**20
#: An element cap no test reply reaches.
ELEMENTS = 2**20


def reply(values: object, count: int, errors: list[object] | None = None, tail: str = "",
          **header: object) -> str:
    body = {"error": None, "memory_error": False, "count": count, "errors": errors or [],
            "values": values, **header}
    return json.dumps(body) + ("\x00" + tail if tail else "")


def marshalled(values: list[object]) -> str:
    return marshal.dumps(values, 2).decode("latin-1")


def test_columns_decode_to_rows() -> None:
    ints = struct.pack("<3q", 1, -2, 2**62).decode("latin-1")
    text = reply({"columns": ["q", ["a", None, "c"], "g", "i"], "keys": ["n", "s", "x", "k"]},
                 3, tail=ints + marshalled([0.5, -0.0, float("inf")])
                 + marshalled([7, -(2**31), 2**31 - 1]))
    decoded = decode_batch_reply(text, 3, LIMIT, ELEMENTS)
    assert decoded.values == [{"n": 1, "s": "a", "x": 0.5, "k": 7},
                              {"n": -2, "s": None, "x": -0.0, "k": -(2**31)},
                              {"n": 2**62, "s": "c", "x": float("inf"), "k": 2**31 - 1}]
    assert [list(map(type, row.values())) for row in decoded.values] == [[int, str, float, int],
                                                                          [int, type(None),
                                                                           float, int],
                                                                          [int, str, float, int]]


@pytest.mark.parametrize("kind, tail", [
    ("i", marshalled([1, 2])[:10] + "T" + marshalled([1, 2])[11:]),  # a forged item tag
    ("i", marshalled([1, True])),              # a bool where an int32 belongs
    ("i", marshalled([1.5, 2.5])[:15]),        # float tags
    ("g", marshalled([1, 2]) + "\x00" * 8),   # int tags where floats belong
    ("i", marshalled([1, 2, 3])[:-5]),         # the header says 3 items, not 2
    ("q", "\x00" * 15),                       # short int64 column
])
def test_forged_marshalled_columns_are_protocol_errors(kind: str, tail: str) -> None:
    text = reply({"columns": [kind], "keys": ["n"]}, 2, tail=tail)
    with pytest.raises(ProtocolError):
        decode_batch_reply(text, 2, LIMIT, ELEMENTS)


def test_str_columns_split_their_text() -> None:
    names = ["ana", "", "Zoë 🎉", "x" * 300]
    joined = "\x00".join(names)
    text = reply({"columns": [{"s": len(joined)}, "i"], "keys": ["name", "n"]},
                 4, tail=joined + marshalled([1, 2, 3, 4]))
    assert decode_batch_reply(text, 4, LIMIT, ELEMENTS).values == [
        {"name": name, "n": n} for name, n in zip(names, [1, 2, 3, 4], strict=True)]


@pytest.mark.parametrize("column, count, tail", [
    ({"s": 3}, 2, "abc"),              # one str where two belong
    ({"s": 5}, 2, "a\x00b\x00c"),       # three
    ({"s": 2}, 2, "a\x00b"),            # a length that is not the text's
    ({"s": -1}, 1, ""),
    ({"s": 1.5}, 1, "a"),
    ({"s": 1, "t": 1}, 1, "a"),
    ({"s": True}, 1, "a"),
])
def test_forged_str_columns_are_protocol_errors(column: object, count: int, tail: str) -> None:
    text = reply({"columns": [column], "keys": ["n"]}, count, tail=tail)
    with pytest.raises(ProtocolError):
        decode_batch_reply(text, count, LIMIT, ELEMENTS)


def test_a_str_column_of_nuls_is_refused_before_it_is_split() -> None:
    # Split first, 10 million NULs would hold a list of 10 million strs (80 MB of pointers)
    # before the count could be checked; counted first, the host holds nothing but the text.
    tail = "\x00" * 10_000_000
    text = reply({"columns": [{"s": len(tail)}], "keys": ["n"]}, 2, tail=tail)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="malformed str column"):
            decode_batch_reply(text, 2, 2 * len(text), ELEMENTS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(text) + 2**20


def test_keys_are_data_never_code() -> None:
    key = "a}: __import__('os').system('false'), {'b"
    text = reply({"columns": [[1]], "keys": [key]}, 1)
    assert decode_batch_reply(text, 1, LIMIT, ELEMENTS).values == [{key: 1}]


def test_failed_positions_are_skipped_by_columns() -> None:
    error = {"type": "ValueError", "message": "m", "traceback": ""}
    text = reply({"columns": [[10, 30]], "keys": ["v"]}, 3, errors=[[1, error]])
    decoded = decode_batch_reply(text, 3, LIMIT, ELEMENTS)
    assert decoded.errors == {1: error}
    assert decoded.values[0] == {"v": 10} and decoded.values[2] == {"v": 30}


@pytest.mark.parametrize("text, count", [
    ("not json", 1),
    (reply({"columns": ["q"], "keys": ["n"]}, 2, tail="x" * 15), 2),    # short column
    (reply({"columns": ["d"], "keys": ["n"]}, 1, tail="x" * 8), 1),     # no such kind
    (reply({"columns": ["q"], "keys": ["n"]}, 1, tail="\u0100" * 8), 1),  # not bytes
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
        decode_batch_reply(text, count, LIMIT, ELEMENTS)


def test_a_json_bomb_is_refused_before_parsing() -> None:
    for bomb in ("[" * 10**6, '{"a":' * 10**5, reply({"json": ["[" * 50]}, 1)):
        if bomb.startswith("{\"error"):
            # inside a string
            assert decode_batch_reply(bomb, 1, 10**8, ELEMENTS).values == ["[" * 50]
        else:
            with pytest.raises(ProtocolError, match="nests deeper"):
                decode_batch_reply(bomb, 1, 10**8, ELEMENTS)


def test_oversized_reply_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="larger"):
        decode_batch_reply(" " * 100, 1, 50, ELEMENTS)


def test_equal_records_marshal_to_equal_bytes() -> None:
    key = "".join(["pr", "ice"])  # not interned, unlike the literal below
    assert encode_records([{key: 1}, {key: 2}]) == encode_records([{"price": 1}, {"price": 2}])


def test_dicts_with_the_same_keys_go_keyed_and_load_exactly() -> None:
    records = [{"id": i, "name": f"n{i}" * (i % 3), "price": i / 4, "tags": [i, (i,)],
                "flag": i % 2 == 0, "none": None, "big": 2**40 + i, "raw": b"\x00"}
               for i in range(50)]
    keys, loaded = marshal.loads(encode_records(records))  # no str repeats: nothing shared
    assert keys == tuple(records[0])
    assert loaded == records
    assert [[type(v) for v in r.values()] for r in loaded] == \
        [[type(v) for v in r.values()] for r in records]
    assert all(list(r) == list(keys) for r in loaded)


#: Values by kind of column: fixed-size marshal (int32s, floats, singletons) or not.
_KINDS = {
    "int32": st.integers(-(2**31), 2**31 - 1),
    "float": st.floats(allow_nan=False),
    "single": st.sampled_from([None, True, False]),
    "big": st.integers(2**31, 2**70),
    "str": st.text(max_size=8),
    "list": st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
    "mixed": st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.tuples(st.booleans())),
}


@settings(max_examples=150, deadline=None)
@given(data=st.data(), kinds=st.lists(st.sampled_from(sorted(_KINDS)), min_size=1, max_size=7),
       count=st.integers(1, 12))
def test_keyed_records_of_any_column_kinds_load_exactly(data: st.DataObject, kinds: list[str],
                                                        count: int) -> None:
    keys = [f"k{i}" for i in range(len(kinds))]
    records = [{key: data.draw(_KINDS[kind]) for key, kind in zip(keys, kinds, strict=True)}
               for _ in range(count)]
    payload = encode_records(records)
    assert payload == encode_records(copy.deepcopy(records))
    loaded_keys, *_, loaded = marshal.loads(payload)
    assert loaded_keys == tuple(keys) and loaded == records
    assert [[type(v) for v in r.values()] for r in loaded] == \
        [[type(v) for v in r.values()] for r in records]


class _Text(str):
    """A str subclass, which marshal refuses."""


def _native_encoder() -> Any:
    native = native_extension.load(library_reporter())
    if native.module is None:
        pytest.skip(f"the native extension is unavailable: {native.reason}")
    return native.module.encode_keyed


#: Values for the native encoder's comparison: every kind of column above, strs that repeat
#: (shared) or not, non-ASCII and lone surrogates, lists of strs that repeat.
_NATIVE_VALUES = st.one_of(
    *_KINDS.values(),
    st.sampled_from(["Lisbon", "Zoë", "\ud800", "", "a\x00b"]),
    st.lists(st.sampled_from(["new", "vip", "é", "\udfff"]), max_size=3),
    st.sampled_from([2**31 - 1, -(2**31), 2**31, -(2**31) - 1, float("nan"), -0.0]),
)


#: Columns whose strs (or lists of strs) repeat, and so are shared.
_REPEATING = [st.sampled_from(["Lisbon", "Zoë", "\ud800"]),
              st.lists(st.sampled_from(["new", "vip", "é"]), max_size=2)]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), width=st.integers(0, 5), count=st.integers(1, 10),
       uniform=st.booleans())
def test_the_native_encoder_gives_the_python_encoders_bytes(
        data: st.DataObject, width: int, count: int, uniform: bool) -> None:
    encode_keyed = _native_encoder()
    keys = data.draw(st.lists(st.text(max_size=3), min_size=width, max_size=width,
                              unique=True))
    # A column of one kind (so that fixed-size and shared encodings come up), or of any.
    kinds = [data.draw(st.sampled_from([*_KINDS.values(), *_REPEATING, _NATIVE_VALUES]))
             if uniform else _NATIVE_VALUES for _ in keys]
    records: list[Any] = [{key: data.draw(kind) for key, kind in zip(keys, kinds, strict=True)}
                          for _ in range(count)]
    # Sometimes a str subclass (never shared) or a value marshal refuses (left to the Python
    # encoder), put in here: hypothesis cannot replay such values of its own drawing.
    odd = data.draw(st.integers(0, 15))
    if keys and odd < 4:
        place, key = data.draw(st.integers(0, count - 1)), data.draw(st.sampled_from(keys))
        value = records[place][key]
        records[place][key] = (_Text(value) if isinstance(value, str) else _Text("Lisbon"),
                               {1, 2}, object(), print)[odd]
    if data.draw(st.integers(0, 3)) == 0:  # sometimes records not all keyed alike
        records[data.draw(st.integers(0, count - 1))] = data.draw(st.one_of(
            st.dictionaries(st.text(max_size=2), st.integers(), max_size=3),
            st.lists(st.integers(), max_size=2)))
    native = encode_keyed(records)
    try:
        python = _batch._keyed(records)
    except ValueError:  # marshal refuses a value: so must the native encoder
        python = None
        assert native is None
    if native is not None:  # None: left to the Python encoder, which then decides alone
        assert native == python
    elif python is not None:
        with pytest.raises(ValueError):
            marshal.dumps(records, 2)  # undecided only where marshal itself refuses


def test_the_native_encoder_encodes_batches_of_every_shape() -> None:
    encode_keyed = _native_encoder()
    cities = ["Lisbon", "Zoë", "\ud800"]
    records = [{"id": i, "name": f"customer-{i}", "city": cities[i % 3], "price": i / 4,
                "qty": i % 13, "tags": [["new"], ["vip", "é"], []][i % 3], "ok": i % 2 == 0,
                "big": 2**40 + i, "mixed": [None, 1.5, "x", b"y"][i % 4]}
               for i in range(1000)]
    assert encode_keyed(records) == _batch._keyed(records)
    assert marshal.loads(encode_keyed(records))[-1] == records
    for other in ([], [{"a": 1}, {"b": 1}], [{"a": 1}, ["a"]], ({"a": 1},), [{1: 2}]):
        assert encode_keyed(other) is None  # the Python encoder decides these
    assert encode_keyed([{"a": object()}, {"a": object()}]) is None
    assert encode_records([{"a": 1}, {"a": 2}]) == _batch._keyed([{"a": 1}, {"a": 2}])


def test_the_native_encoder_holds_what_it_read_when_a_finalizer_changes_the_records() -> None:
    encode_keyed = _native_encoder()
    records = [{"tags": ["new", "vip"][: i % 3], "name": f"n{i}" * 50} for i in range(50)]
    expected = copy.deepcopy(records)

    class Cycle:
        def __del__(self) -> None:
            for record in records:
                record.clear()  # frees every value the encoder read, were they not held
            self.junk = [f"x{i}" * 60 for i in range(2000)]  # and reuses their memory

    cycle = Cycle()
    cycle.self = cycle  # type: ignore[attr-defined]
    del cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # the encoder's first dict starts a collection, and the finalizer
    try:
        payload = encode_keyed(records)
    finally:
        gc.set_threshold(*threshold)
    assert records == [{}] * 50
    assert marshal.loads(payload)[-1] == expected


def test_repeating_strs_are_written_once_and_shared() -> None:
    cities = ["Lisbon", "Zoë", "Lisbon", "\ud800", "Lisbon", "Zoë"]
    records = [{"id": i, "city": city, "name": f"n{i}", "again": city[::-1]}
               for i, city in enumerate(cities)]
    keys, shared, loaded = marshal.loads(encode_records(records))
    # "name" never repeats; "city" and "again" do, and share the one table.
    assert keys == ("id", "city", "name", "again")
    assert shared == ("Lisbon", "Zoë", "\ud800", "nobsiL", "ëoZ")
    assert loaded == records
    assert loaded[0]["city"] is loaded[2]["city"] is shared[0]
    assert encode_records(records) == encode_records(copy.deepcopy(records))


def test_repeating_lists_of_strs_share_their_strs_but_not_the_lists() -> None:
    tags = [["new"], ["vip", "new"], ["new"], [], ["vip", "new"], []]
    records = [{"tags": list(t), "n": i} for i, t in enumerate(tags)]
    keys, shared, loaded = marshal.loads(encode_records(records))
    assert shared == ("new", "vip") and loaded == records
    assert loaded[0]["tags"] is not loaded[2]["tags"]  # each record may change its own
    assert loaded[0]["tags"][0] is loaded[1]["tags"][1]
    # Lists that hold something else, or that do not repeat, go value by value.
    for other in ([["a", 1], ["a", 1]], [["a", b"b"], ["a", b"b"]], [["a"], ["b"]],
                  [[["a"]], [["a"]]]):
        mixed = [{"tags": value} for value in other]
        assert marshal.loads(encode_records(mixed))[-1] == mixed
        assert len(marshal.loads(encode_records(mixed))) == 2


@pytest.mark.parametrize("records", [
    [{"a": 1, "b": 2}, {"b": 1, "a": 2}],    # same keys, another order
    [{"a": 1}, {"a": 1, "b": 2}],             # a key more
    [{"a": 1}, {"b": 1}],
    [{1: "int key"}, {1: "int key"}],
    [{"a": 1}, [("a", 1)]],
])
def test_other_batches_go_as_one_plain_list(records: list[object]) -> None:
    payload = encode_records(records)
    assert payload == marshal.dumps(records, 2)
    assert marshal.loads(payload) == records
