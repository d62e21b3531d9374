"""The host side of a batch: encode records for the guest, check and decode its reply.

The shapes are documented in ``wasibox/_wire.py``. The reply is untrusted: it is size-checked,
outlined and its elements counted (see ``wasibox._wire.json_outline``) before it is parsed
(with the C JSON decoder, never marshal), then every part is shape- and depth-checked, and
everything it decodes to (JSON, packed values, the rows built from columns) counts against
one element cap for the whole reply. Column checks run at C speed (``set(map(type, ...))``);
only values that are not flat scalars pay for a Python-level depth walk.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import json
import marshal
import operator
import re
import struct
import sys
from collections.abc import Callable
from typing import Any

from ._result import clean_text, clean_value
from ._wire import (
    MAX_DEPTH,
    ProtocolError,
    check_depth,
    check_json_depth,
    decode_packed,
    json_outline,
    max_elements,
)

__all__ = ["BatchReply", "batch_elements", "decode_batch_reply", "encode_records",
           "use_native_encoder"]

_SCALARS = frozenset({str, int, float, bool, type(None)})
_EXCEPTION_KEYS = ("type", "message", "traceback")
#: A JSON escape of a lone surrogate: a high one not followed by a low one, or a low one not
#: preceded by a high one (an escaped pair is one character, which the guest's ASCII-only
#: JSON writes for every character outside the BMP).
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def encode_records(records: list[Any]) -> bytes:
    """Marshal ``records`` for a batch request; raises ValueError for non-plain data.

    Dicts that all have the same str keys in the same order go keyed (see ``_keyed``);
    anything else goes as one list in version 2 of marshal. Either way equal records give
    equal bytes whatever their object identity (and so the guest burns the same fuel):
    version 2 has no back-references and no interning flags, and the keyed form writes its
    own, from the keys' text alone.
    """
    keyed = _native_keyed(records) if _native_keyed is not None else None
    if keyed is None:
        keyed = _keyed(records)
    return keyed if keyed is not None else marshal.dumps(records, 2)


#: The native extension's twin of ``_keyed`` (``encode_keyed``), once a Wasm runtime has
#: loaded the extension (see ``use_native_encoder``); None: ``_keyed`` alone. It gives the
#: same bytes, or None where it leaves the decision to ``_keyed``: 100,000 records of the
#: transform bench's customers took 135-154 ms in ``_keyed``, 25-28 ms in C (records of
#: numbers only: 28 ms and 5 ms).
_native_keyed: Callable[[list[Any]], bytes | None] | None = None


def use_native_encoder(encode_keyed: Callable[[list[Any]], bytes | None] | None) -> None:
    """Encode keyed records with ``encode_keyed`` (the native extension's) from now on, or
    with the Python encoder alone if None. Either gives the same bytes."""
    global _native_keyed
    _native_keyed = encode_keyed


# marshal's type codes (CPython's Python/marshal.c), for the keyed form.
_LIST, _TUPLE, _DICT, _NULL, _REF, _INTERNED, _UNICODE = (
    b"[", b"(", b"{", b"0", b"r", b"t", b"u")
_FLAG_REF = 0x80
_INT32, _FLOAT = b"i", b"g"
_COUNT = struct.Struct("<i")
#: The types whose every value may marshal to the same size as the others of its column.
_FIXED_SIZE_TYPES = frozenset({int, float, bool, type(None)})
_STR = {str}
_LISTS = {list}


def _keyed(records: list[Any]) -> bytes | None:
    """``marshal`` bytes of ``(keys, records)``, or ``(keys, shared, records)``, in which
    every record's keys are references.

    The keys are written once, interned and flagged as back-references, and each record
    refers to them (``r`` and the key's index) instead of carrying its own copy: the guest
    then neither decodes nor hashes a key per record, and the function's ``r["id"]`` finds
    its interned constant by identity. Values are version-2 marshal, as in the plain form.
    None when the records are not dicts with the same str keys in the same order.

    A column of strs that repeat (each distinct one used at least twice on average, such as
    a city or a status) refers to them too: each distinct str is written once, flagged, in
    ``shared``, in order of first use. The guest then neither decodes nor allocates them per
    record (~850 fuel less a value), and the column becomes one of references, of fixed
    size. So does a column of lists of strs that repeat (tags), each record's list made of
    references. Equal strs are equal values, so the bytes still follow from the values
    alone.

    Columns whose values all have one fixed-size encoding (int32s, floats, singletons such
    as None, references) are laid out by strided byte copies; any other column marshals
    value by value. All of it runs in C: no Python loop over the records.
    """
    count = len(records)
    if not records or set(map(type, records)) != {dict}:
        return None
    keys = list(records[0])
    if set(map(type, keys)) - {str}:
        return None
    # Every record's keys, one after the other, are the first record's repeated: no dict
    # holds a key twice, so each record has exactly these keys, in this order.
    if list(itertools.chain.from_iterable(records)) != keys * count:
        return None
    shared: dict[str, bytes] = {}  # each shared str -> its reference, in order of first use
    columns = [_column_encoding(list(map(operator.itemgetter(key), records)), count,
                                len(keys), shared)
               for key in keys]
    head = [_TUPLE, _COUNT.pack(3 if shared else 2), _TUPLE, _COUNT.pack(len(keys))]
    for key in keys:
        text = key.encode("utf-8", "surrogatepass")
        head += [bytes([_INTERNED[0] | _FLAG_REF]), _COUNT.pack(len(text)), text]
    if shared:
        head += [_TUPLE, _COUNT.pack(len(shared))]
        for value in shared:
            text = value.encode("utf-8", "surrogatepass")
            head += [bytes([_UNICODE[0] | _FLAG_REF]), _COUNT.pack(len(text)), text]
    head += [_LIST, _COUNT.pack(count)]
    if all(isinstance(column, bytes) for column in columns):
        body: bytes | bytearray = _fixed_rows(columns, count)  # type: ignore[arg-type]
    else:
        body = _variable_rows(columns, count)
    # One copy of the body, the last: each copy of a large batch's bytes lands in fresh
    # pages, whose faults cost more than the copying.
    return b"".join([*head, body])


def _column_encoding(column: list[Any], count: int, first_shared: int,
                     shared: dict[str, bytes]) -> bytes | list[bytes]:
    """A column's values as marshal: one bytes of equal-size encodings, or one bytes each.

    A column of repeating strs becomes references, its strs added to ``shared``, whose
    references start at ``first_shared``.
    """
    kinds = set(map(type, column))
    if kinds == _STR:
        distinct = dict.fromkeys(column)
        if len(distinct) * 2 <= count:
            _share(distinct, first_shared, shared)
            return b"".join(map(shared.__getitem__, column))
    elif kinds == _LISTS and set(map(type, itertools.chain.from_iterable(column))) <= _STR:
        # Lists of strs that repeat (tags): each distinct list encoded once, of references;
        # every record still gets a list of its own.
        lists = list(map(tuple, column))
        distinct = dict.fromkeys(lists)
        if len(distinct) * 2 <= count:
            _share(dict.fromkeys(itertools.chain.from_iterable(distinct)), first_shared, shared)
            encoded = {texts: b"".join([_LIST, _COUNT.pack(len(texts)),
                                        *map(shared.__getitem__, texts)])
                       for texts in distinct}
            return list(map(encoded.__getitem__, lists))
    if not kinds <= _FIXED_SIZE_TYPES:  # strs, lists, ...: one each
        return list(map(marshal.dumps, column, itertools.repeat(2)))
    data = marshal.dumps(column, 2)[5:]  # without the list's own type code and length
    size, rest = divmod(len(data), count)
    if rest == 0 and (size == 1 or (size == 5 and data[::5] == _INT32 * count)
                      or (size == 9 and data[::9] == _FLOAT * count)):
        # One-byte values are singletons (None, True, False, ...); each code is its encoding.
        return data
    return list(map(marshal.dumps, column, itertools.repeat(2)))


def _share(texts: dict[str, None], first_shared: int, shared: dict[str, bytes]) -> None:
    """Give each of ``texts`` not yet in ``shared`` the next reference."""
    for text in texts:
        if text not in shared:
            shared[text] = _REF + _COUNT.pack(first_shared + len(shared))


def _fixed_rows(columns: list[bytes], count: int) -> bytearray:
    """Records whose every value has a fixed size: one record's bytes repeated, then the
    values' bytes copied in, one strided copy per byte position."""
    sizes = [len(column) // count for column in columns]
    template = bytearray(_DICT)
    copies = []  # (offset in a record, column, first byte of each value to copy)
    for index, (column, size) in enumerate(zip(columns, sizes, strict=True)):
        template += _REF + _COUNT.pack(index)
        # An int32's or a float's type code is the same in every record: it goes in the
        # template; a singleton's one byte is its value.
        tagged = size > 1
        copies.append((len(template), column, size, 1 if tagged else 0))
        template += column[:1] + bytes(size - 1) if tagged else b"\x00"
    template += _NULL
    width = len(template)
    rows = template * count
    for offset, column, size, first in copies:
        for position in range(first, size):
            rows[offset + position::width] = column[position::size]
    return rows


def _variable_rows(columns: list[bytes | list[bytes]], count: int) -> bytes:
    """Records with a column of varying sizes: one bytes per value of those columns, one
    per stretch of a record between them, interleaved and joined.

    The stretches (the dict's opening and end, the keys' references, the values of fixed
    size) are laid out for every record at once as ``_fixed_rows`` does, then cut into one
    bytes each by a single ``struct`` unpack: slicing them one by one in Python cost more
    than the rest of the encoding (~9 ms per 100,000 slices, 2.8 ms unpacked).
    """
    varying = [column for column in columns if isinstance(column, list)]
    template = bytearray(_DICT)
    copies = []  # (offset in a record's stretches, column, size, first byte to copy)
    widths = []  # each stretch's width
    start = 0
    for index, column in enumerate(columns):
        template += _REF + _COUNT.pack(index)
        if isinstance(column, list):
            widths.append(len(template) - start)
            start = len(template)
            continue
        size = len(column) // count
        tagged = size > 1
        copies.append((len(template), column, size, 1 if tagged else 0))
        template += column[:1] + bytes(size - 1) if tagged else b"\x00"
    template += _NULL
    widths.append(len(template) - start)
    width = len(template)
    rows = template * count
    for offset, column, size, first in copies:
        for position in range(first, size):
            rows[offset + position::width] = column[position::size]
    # A Struct of its own: struct.unpack would cache this one-off format, and its codes.
    stretches = struct.Struct("".join(f"{size}s" for size in widths) * count).unpack(rows)
    stride = 2 * len(varying) + 1
    pieces: list[bytes] = [b""] * (stride * count)
    for place in range(len(widths)):
        pieces[2 * place::stride] = stretches[place::len(widths)]
    for place, values in enumerate(varying):
        pieces[1 + 2 * place::stride] = values
    return b"".join(pieces)


@dataclasses.dataclass(frozen=True, slots=True)
class BatchReply:
    """A checked batch reply: one entry per record, by position in the batch."""

    #: The code itself failed (raised while loading, or has no such entry): every record fails.
    error: dict[str, str] | None
    memory_error: bool
    #: position -> the guest exception that record raised (or why its value cannot cross).
    errors: dict[int, dict[str, str]]
    #: One value per record; meaningless at the positions in ``errors``.
    values: list[Any]


#: Elements a batch reply may hold per record, on top of one value's cap (``batch_elements``).
ELEMENTS_PER_RECORD = 64


def batch_elements(memory_bytes: int, count: int) -> int:
    """The most elements the reply to a batch of ``count`` records may decode to.

    One value's cap (``wasibox._wire.max_elements``) plus ``ELEMENTS_PER_RECORD`` per
    record: the reply, errors and every record's output together. A batch whose outputs
    are bigger is refused as a whole, and so split and re-run (see wasibox/_transform.py)
    until each part fits, down to one record under one value's cap.
    """
    return max_elements(memory_bytes) + ELEMENTS_PER_RECORD * count


def decode_batch_reply(text: str, count: int, max_bytes: int, elements: int) -> BatchReply:
    """Parse and check the guest's reply to a batch of ``count`` records.

    ``max_bytes`` caps its size in characters, ``elements`` everything it decodes to (see
    ``batch_elements``). Raises ProtocolError when it breaks the contract in any way.
    """
    if len(text) > max_bytes:
        raise ProtocolError(f"the guest's batch reply is larger than {max_bytes} bytes")
    head, _, tail = text.partition("\x00")
    outline, spent = json_outline(head, elements)
    # The reply's own levels ({"values": {"json": [...]}}) above values up to MAX_DEPTH.
    check_json_depth(outline, MAX_DEPTH + 4)
    try:
        message = json.loads(head)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the guest's batch reply is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("the guest's batch reply is not an object")
    if _LONE_SURROGATE_ESCAPE.search(head):
        # json.loads restores a lone surrogate from its escape; values must encode as UTF-8
        # (see wasibox._result). Rare, so the common reply is not walked.
        message = clean_value(message)
    error = _exception(message.get("error"))
    memory_error = message.get("memory_error")
    if type(memory_error) is not bool:
        raise ProtocolError("the guest's batch reply has a malformed memory_error")
    if error is not None:
        return BatchReply(error, memory_error, {}, [None] * count)
    if message.get("count") != count:
        raise ProtocolError(f"the guest answered for {message.get('count')!r} records, "
                            f"not {count}")
    raw_errors = message.get("errors")
    if not isinstance(raw_errors, list):
        raise ProtocolError("the guest's batch reply has malformed errors")
    errors: dict[int, dict[str, str]] = {}
    for item in raw_errors:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and 0 <= item[0] < count):
            raise ProtocolError("the guest's batch reply has a malformed error entry")
        described = _exception(item[1])
        assert described is not None
        errors.setdefault(item[0], described)
    # The packed values and the rows come on top of what the parsed head holds.
    values = _values(message.get("values"), count, errors, tail, elements - spent)
    return BatchReply(None, memory_error, errors, values)


def _exception(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not (isinstance(value, dict)
            and all(type(value.get(key)) is str for key in _EXCEPTION_KEYS)):
        raise ProtocolError("the guest's batch reply has a malformed exception")
    return {key: clean_text(value[key]) for key in _EXCEPTION_KEYS}


def _values(body: Any, count: int, errors: dict[int, dict[str, str]], tail: str,
            room: int) -> list[Any]:
    """The records' values; ``room`` is how many more elements they may decode to."""
    if not isinstance(body, dict):
        raise ProtocolError("the guest's batch reply has no values")
    if "columns" in body:
        return _from_columns(body, count, errors, tail, room)
    if tail:
        raise ProtocolError("the guest's batch reply has bytes after its values")
    plain = body.get("json")
    packed = body.get("packed", {})
    if not isinstance(plain, list) or len(plain) != count or not isinstance(packed, dict):
        raise ProtocolError("the guest's batch reply has malformed values")
    _check_shallow(plain)
    values = plain
    for key, encoded in packed.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < count
                and isinstance(encoded, str)):
            raise ProtocolError("the guest's batch reply has a malformed packed value")
        values[int(key)], used = decode_packed(encoded, "a packed value", room)
        room -= used
    return values


def _from_columns(body: dict[str, Any], count: int, errors: dict[int, dict[str, str]],
                  tail: str, room: int) -> list[Any]:
    keys, columns = body.get("keys"), body.get("columns")
    rows = count - len(errors)
    if not (isinstance(keys, list) and isinstance(columns, list) and len(keys) == len(columns)
            and all(type(key) is str for key in keys) and len(set(keys)) == len(keys)):
        raise ProtocolError("the guest's batch reply has malformed columns")
    # Each row is a dict with one entry per key, each value made from the tail or already
    # counted in the JSON: counted before any row or column is built.
    if rows * (1 + len(keys)) > room:
        raise ProtocolError("the guest's batch reply holds more elements than its cap")
    sizes = [_blob_size(column, rows) for column in columns]
    if len(tail) != sum(sizes):
        raise ProtocolError("the guest's batch reply has column bytes of the wrong length")
    offsets = itertools.accumulate(sizes, initial=0)
    decoded = [_column(column, rows, tail[offset:offset + size])
               for column, offset, size in zip(columns, offsets, sizes, strict=False)]
    if not keys:
        ok: list[Any] = [{} for _ in range(rows)]
    elif len(keys) <= _MAX_BUILT_COLUMNS:
        ok = _row_builder(len(keys))(*keys)(*decoded)
    else:
        ok = list(map(dict, map(zip, itertools.repeat(keys), zip(*decoded, strict=True))))
    if not errors:
        return ok
    values: list[Any] = [None] * count
    filled = iter(ok)
    for position in range(count):
        if position not in errors:
            values[position] = next(filled)
    return values


#: Up to this many columns, rows are built by a generated function (see ``_row_builder``).
_MAX_BUILT_COLUMNS = 64


@functools.lru_cache(maxsize=_MAX_BUILT_COLUMNS)
def _row_builder(width: int) -> Callable[..., Callable[..., list[dict[str, Any]]]]:
    """``make(k0, ..., kN)`` returning ``rows(c0, ..., cN) -> [{k0: v0, ...}, ...]``.

    A comprehension over the columns with a dict display builds rows 2.5x faster than
    ``dict(zip(keys, values))``, and 1.5x faster than calling a function per row. The
    generated source depends only on ``width``: the keys, which come from the guest, are
    passed in as values and never become code.
    """
    names = [f"k{i}" for i in range(width)]
    values = [f"v{i}" for i in range(width)]
    columns = [f"c{i}" for i in range(width)]
    pairs = ", ".join(f"{k}: {v}" for k, v in zip(names, values, strict=True))
    source = (f"def make({', '.join(names)}):\n"
              f"    def rows({', '.join(columns)}):\n"
              f"        return [{{{pairs}}} for {', '.join(values)},\n"
              f"                in zip({', '.join(columns)}, strict=True)]\n"
              f"    return rows\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<wasibox row builder>", "exec"), namespace)
    return namespace["make"]  # type: ignore[no-any-return]


#: Column kinds sent as bytes in the tail: item size, array type code, marshal type code.
#: "i" and "g" are marshal lists of int32s and floats (``[``, the count, then a type code and
#: the value for each item); "q" is little-endian int64s.
_BLOBS = {"i": (4, "i", _INT32), "g": (8, "d", _FLOAT), "q": (8, "q", b"")}


def _blob_size(column: Any, rows: int) -> int:
    """How many tail characters a column takes (0 for a JSON list)."""
    if isinstance(column, list):
        return 0
    if isinstance(column, dict):
        size = column.get("s")
        if len(column) != 1 or type(size) is not int or size < 0:
            raise ProtocolError("the guest's batch reply has a malformed column")
        return size
    if column not in _BLOBS:
        raise ProtocolError("the guest's batch reply has a malformed column")
    size, _, code = _BLOBS[column]
    return (5 + (1 + size) * rows) if code else size * rows


def _column(column: Any, rows: int, blob: str) -> list[Any]:
    if isinstance(column, list):
        if len(column) != rows or not set(map(type, column)) <= _SCALARS:
            raise ProtocolError("the guest's batch reply has a malformed column")
        return column
    if isinstance(column, dict):
        # strs joined by NULs: any text splits into strs, and the reply's text came in as
        # strict UTF-8, so it holds no lone surrogate. The NULs are counted before the
        # split, which would otherwise hold a str for each of them (a reply of NULs alone:
        # 8 bytes of host memory a character) before its length could be checked.
        if (blob.count("\x00") != rows - 1) if rows else blob:
            raise ProtocolError("the guest's batch reply has a malformed str column")
        return blob.split("\x00") if rows else []
    size, typecode, code = _BLOBS[column]
    try:
        data = blob.encode("latin-1")
    except UnicodeEncodeError:
        raise ProtocolError("a column's bytes are not one character per byte") from None
    if code:
        # Checked, never unmarshalled: the list's header, then every item's type code at its
        # fixed place; the values are the bytes between the codes.
        stride = 1 + size
        if (data[:5] != _LIST + _COUNT.pack(rows)
                or data[5::stride] != code * rows):
            raise ProtocolError("the guest's batch reply has a malformed marshalled column")
        packed = bytearray(size * rows)
        for position in range(size):
            packed[position::size] = data[6 + position::stride]
        data = bytes(packed)
    numbers = array.array(typecode)
    if numbers.itemsize != size:
        raise ProtocolError(f"this host has no {size}-byte array type {typecode!r}")
    numbers.frombytes(data)
    if sys.byteorder != "little":  # the guest (WebAssembly) is little-endian
        numbers.byteswap()
    return numbers.tolist()


def _check_shallow(values: list[Any]) -> None:
    """Depth-check values, at C speed when they are scalars or flat dicts/lists of them."""
    kinds = set(map(type, values))
    if kinds <= _SCALARS:
        return
    if kinds <= _SCALARS | {dict}:
        dicts = [value for value in values if type(value) is dict]
        inner = set(map(type, itertools.chain.from_iterable(map(dict.values, dicts))))
        if inner <= _SCALARS:
            return
    for value in values:
        check_depth(value, MAX_DEPTH)
