"""The wire format between host and guest, carried as ASCII strings.

A request (host to guest) is trusted: the host builds it. It is a base64-encoded ``marshal``
map, because the guest decodes marshal in C, where msgpack's pure-Python decoder cost more
fuel than a small program does. Arguments are passed through msgpack first, so the guest sees
exactly the values msgpack would deliver (tuples become lists, for instance)::

    {"op": "run" | "call", "code": str, "entry": str | None, "args": list, "kwargs": map,
     "seed": int | None}

``seed`` is what ``random.seed`` gets at the start of the run; ``None`` reseeds from the
guest's entropy (which the host decides: seeded or real).

Optional fields, sent only when the caller set them (a plain run's request stays as above)::

    "filename": str       # compile the code under this name, and set __file__ to it
    "argv": [str, ...], "path": [str, ...], "env": {str: str}, "stdin": bytes | None
                          # all four together: sys.argv, the directories put first on
                          # sys.path, os.environ and sys.stdin's bytes (None: left as is)

Every request, ``batch`` included, may carry them.

A ``run`` or ``call`` request may also carry ``"compiled": bytes``, the marshalled code object
of ``code``; the runner then loads it instead of compiling. A ``compile`` request
(``{"op": "compile", "code": str, "seed": 0}``) runs none of the code: its reply's value is
that marshalled code object, or its error the SyntaxError.

A reply (guest to host) is **untrusted**: the guest program shares an interpreter with the
runner and can forge it. It is a JSON object (the guest encodes JSON in C), whose ``value``, if
present, is base64-encoded msgpack, so that values keep msgpack's exact types. It is
size-checked before it is decoded, and depth- and shape-checked after, and it only ever
describes the guest's own outcome; everything the host measures (fuel, time, output, limits)
comes from the host::

    {"exit_code": int, "error": None | {"type": str, "message": str, "traceback": str},
     "value": absent | None | base64 msgpack, "memory_error": bool, "heap_top": int}

**Batches** (``op="batch"``, used by ``wasibox.Transform`` and ``wasibox.testing``) call
``entry`` once per record, all in one instance. The request is the same marshalled map, with
the records marshalled on their own with version 2 of the format, which has no
back-references or interning flags, so equal records always give the same bytes (and so the
same fuel)::

    {"op": "batch", "code": str, "entry": str, "seed": int | None,
     "star": bool}       # each record is a tuple of positional arguments

followed by a NUL and then the records, one character per byte (base64 cost the guest ~50
fuel per character to decode). Records are plain data; tuples are kept. Either
``marshal(list of records, 2)``, or, when every record is a dict with the same str keys in
the same order, the *keyed* form: the marshal bytes of a tuple ``(keys, records)`` in which
each key is written once, interned and flagged as a back-reference, and every record refers
to it (``r`` and the key's index) before its version-2 value. The host writes these bytes
itself (``wasibox/_batch.py``), from the keys' text and the values alone, so they too are
the same for equal records.

The batch reply is JSON, written by the runner's ``_execute_batch`` and checked on the host by
``wasibox/_batch.py`` (the host never unmarshals guest bytes)::

    {"error": None | exception,       # the code itself failed: every record fails with it
     "memory_error": bool, "count": int,
     "errors": [[position, exception], ...],   # records that raised, by position in the batch
     "values": {"columns": [column, ...], "keys": [str, ...]}      # dicts with equal str keys
             | {"json": [value, ...], "packed": {position: base64(msgpack(value))}}
             | None}

The JSON is followed by a NUL and the raw bytes of the numeric columns, one character per
byte (JSON never contains a raw NUL; escaping or base64 cost more fuel than packing). A
column is ``"i"`` or ``"g"``, the guest's ``marshal.dumps(column, 2)`` of a list of int32s or
of floats (``5 + 5 * rows`` or ``5 + 9 * rows`` bytes: ``[``, the count, then each item's
type code and value), ``"q"`` (little-endian int64s, ``8 * rows`` bytes), or a JSON list of
scalars; the bytes come next in the tail, in column order, and columns hold the records that
did not fail, in order. The host never unmarshals them: it checks the header and every type
code at its fixed place, then reads the values between the codes as an array. Before
parsing, the host checks the JSON nests no deeper than ``MAX_DEPTH`` plus the reply's own
levels (see ``check_json_depth``). ``json`` holds one value per record (``null`` for failed
and packed ones); a value goes there only if JSON round-trips it exactly, otherwise it is
packed with msgpack (bytes, tuples, non-str keys).

The reply is checked by hand rather than with pydantic: importing pydantic costs more than
the whole cold start budget of a run (measured 80-190 ms), and the shape is small.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import marshal
import re
from typing import Any

import msgpack

__all__ = ["MAX_DEPTH", "MARSHAL_VERSION", "ProtocolError", "Reply", "as_msgpack_values",
           "check_depth", "check_json_depth", "decode_packed", "decode_reply",
           "encode_request"]

#: Deepest nesting accepted in a value that crosses the boundary. msgpack's own decoder
#: accepts 1024, deep enough to exhaust the host's recursion limit in code that walks it.
MAX_DEPTH = 32


class ProtocolError(ValueError):
    """A message from the guest broke the wire contract (too big, too deep, wrong shape)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    exit_code: int
    error: dict[str, str] | None
    value: Any
    memory_error: bool
    heap_top: int


#: A JSON string literal, escapes included (unrolled, so it runs in linear time).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)

#: The marshal format version requests use: every CPython since 3.4 reads it.
MARSHAL_VERSION = 4


def as_msgpack_values(value: Any) -> Any:
    """``value`` as msgpack would deliver it; raises TypeError/ValueError/OverflowError."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False,
                           strict_map_key=False)


def encode_request(fields: dict[str, Any]) -> str:
    """Encode a request for the guest runner; raises TypeError for non-msgpack arguments."""
    fields = dict(fields)
    if fields.get("op") == "batch":
        # The records follow a NUL, one character per byte: base64 cost the guest ~50 fuel
        # per character to decode, more than the records' own marshal.loads.
        records: bytes = fields.pop("records")
        return (base64.b64encode(marshal.dumps(fields, MARSHAL_VERSION)).decode("ascii")
                + "\x00" + records.decode("latin-1"))
    for key in ("args", "kwargs"):
        if fields.get(key):
            fields[key] = as_msgpack_values(fields[key])
    return base64.b64encode(marshal.dumps(fields, MARSHAL_VERSION)).decode("ascii")


def decode_reply(text: str, max_bytes: int) -> Reply:
    """Decode and check the guest's reply; raises ProtocolError when it breaks the contract."""
    if len(text) > (max_bytes * 4) // 3 + 4096:
        raise ProtocolError(f"the guest's reply is larger than {max_bytes} bytes")
    # A reply is flat: at most two objects ({..., "error": {...}}) and no arrays. Checked
    # before parsing, because json.loads recurses in C once per level, up to the host's
    # recursion limit: a forged '[' * 10**6 crashed a host that had raised that limit.
    if "[" in text or text.count("{") > 2:  # else trivially flat; strings are slower to skip
        structure = _JSON_STRING.sub("", text)
        if "[" in structure or structure.count("{") > 2:
            raise ProtocolError("the guest's reply nests deeper than a reply can")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the guest's reply is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("the guest's reply is not a map")
    check_depth(message, MAX_DEPTH + 1)
    value = _decode_value(message.get("value"))
    exit_code = message.get("exit_code")
    error = message.get("error")
    memory_error = message.get("memory_error", False)
    heap_top = message.get("heap_top", 0)
    if type(exit_code) is not int or not 0 <= exit_code <= 255:
        raise ProtocolError("the guest's reply has no valid exit_code")
    if error is not None and not (
            isinstance(error, dict)
            and all(type(error.get(key)) is str for key in ("type", "message", "traceback"))):
        raise ProtocolError("the guest's reply has a malformed error")
    if type(memory_error) is not bool or type(heap_top) is not int:
        raise ProtocolError("the guest's reply has malformed memory fields")
    if error is not None:
        error = {key: error[key] for key in ("type", "message", "traceback")}
    return Reply(exit_code, error, value, memory_error, max(heap_top, 0))


def _decode_value(encoded: Any) -> Any:
    if encoded is None:
        return None
    if type(encoded) is not str:
        raise ProtocolError("the guest's reply has a malformed value")
    return decode_packed(encoded, "the guest's return value")


def decode_packed(encoded: str, what: str) -> Any:
    """One base64-msgpack value from the guest, depth-checked; ProtocolError names ``what``."""
    try:
        value = msgpack.unpackb(base64.b64decode(encoded, validate=True), raw=False,
                                strict_map_key=False)
    except (binascii.Error, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"{what} is not valid msgpack: {exc}") from None
    check_depth(value)
    return value


def check_json_depth(text: str, limit: int) -> None:
    """Raise ProtocolError if JSON ``text`` nests deeper than ``limit``, without parsing it.

    json.loads recurses in C once per level, up to the host's recursion limit, so a forged
    ``'[' * 10**6`` must be refused before it is parsed. Strings are removed, then the
    innermost empty brackets, level by level: each pass is one C-speed scan.
    """
    structure = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    for _ in range(limit):
        if not structure:
            return
        structure = structure.replace("[]", "").replace("{}", "")
    if structure:
        raise ProtocolError(f"the guest's reply nests deeper than {limit} levels")


#: Runs of characters that are not brackets.
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ProtocolError if ``value`` nests lists or maps deeper than ``limit``.

    Iterative, so a hostile value cannot exhaust the host's stack while being checked.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list | tuple):
            children: Any = item
        elif isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        else:
            continue
        if depth > limit:
            raise ProtocolError(f"a value nests deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)
