"""The wire format between host and guest, carried as strings.

A request (host to guest) is trusted: the host builds it. A plain run's (the first form
below, with or without ``compiled``) is *flat*::

    "\\x01" seed "\\x00" len(code) "\\x00" code compiled

``seed`` in decimal (empty for None), the length of ``code`` in characters, then the code
and, if the host compiled it, the marshalled code object, one character per byte. Slicing
that cost the guest ~0.8-1.1K less fuel per run than encoding the request to bytes and
unmarshalling a map (``print(1+1)``, ``pass``). A run whose seed is not an int of at most
64 bits, or whose code is not valid Unicode text (a lone surrogate), is sent as a map, as
is every other request: a NUL followed by a ``marshal`` map, one character per byte
(latin-1), because the guest decodes marshal in C, where msgpack's pure-Python decoder
cost more fuel than a small program does (and base64, ~60 fuel per character, cost the
guest more than the map's own decoding). Arguments are passed through msgpack first, so
the guest sees exactly the values msgpack would deliver (tuples become lists, for
instance)::

    {"op": "run", "code": str, "seed": int | None}
    {"op": "call", "code": str, "entry": str, "args": list, "kwargs": map, "seed": int | None}

``seed`` is what ``random.seed`` gets at the start of the run; ``None`` reseeds from the
guest's entropy (which the host decides: seeded or real).

Optional fields, sent only when the caller set them (a plain run's request stays as above)::

    "filename": str       # compile the code under this name, and set __file__ to it
    "argv": [str, ...], "path": [str, ...], "env": {str: str}, "stdin": bytes | None
                          # all four together: sys.argv, the directories put first on
                          # sys.path, os.environ and sys.stdin's bytes (None: left as is)

Every request, ``batch`` included, may carry them. The host's priming request (see
``wasibox/backends/wasm/runtime.py``) also carries ``"prime": True``: the runner then
collects that job's garbage before it replies, so the run that follows the priming in the
same instance need not collect before its program.

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
``entry`` once per record, all in one instance. The request is the same marshalled map, but
base64-encoded (so it starts with no NUL and holds none), with
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
to it (``r`` and the key's index) before its version-2 value. When a column's strs repeat
(each distinct one used twice or more on average), the tuple is ``(keys, shared, records)``:
``shared`` holds each distinct str of those columns once, flagged, in order of first use,
and the records refer to them as to the keys. The host writes these bytes itself
(``wasibox/_batch.py``), from the keys' text and the values alone, so they too are the same
for equal records.

The batch reply is JSON, written by the runner's ``_execute_batch`` and checked on the host by
``wasibox/_batch.py`` (the host never unmarshals guest bytes)::

    {"error": None | exception,       # the code itself failed: every record fails with it
     "memory_error": bool, "count": int,
     "errors": [[position, exception], ...],   # records that raised, by position in the batch
     "values": {"columns": [column, ...], "keys": [str, ...]}      # dicts with equal str keys
             | {"json": [value, ...], "packed": {position: base64(msgpack(value))}}
             | None}

The JSON is followed by a NUL and the raw bytes of the numeric columns, one character per
byte, and the text of the str columns (JSON never contains a raw NUL; escaping or base64
cost more fuel than packing). A
column is ``"i"`` or ``"g"``, the guest's ``marshal.dumps(column, 2)`` of a list of int32s or
of floats (``5 + 5 * rows`` or ``5 + 9 * rows`` bytes: ``[``, the count, then each item's
type code and value), ``"q"`` (little-endian int64s, ``8 * rows`` bytes), ``{"s": length}``
(strs without a NUL, joined by NULs: ``length`` characters, which the host splits), or a JSON
list of scalars; the bytes come next in the tail, in column order, and columns hold the records that
did not fail, in order. The host never unmarshals them: it checks the header and every type
code at its fixed place, then reads the values between the codes as an array. Before
parsing, the host checks the JSON nests no deeper than ``MAX_DEPTH`` plus the reply's own
levels (see ``check_json_depth``). ``json`` holds one value per record (``null`` for failed
and packed ones); a value goes there only if JSON round-trips it exactly, otherwise it is
packed with msgpack (bytes, tuples, non-str keys).

**Bounds.** Every decoder of guest data here is bounded before it builds anything, by the
size of what it decodes (each caller's byte cap) and by an element count derived from the
run's ``Limits``: ``max_elements(memory_bytes)``, one element per scalar, list, map, map key
and string, 1,048,576 at the default 256 MiB. A decoded element costs the host at most 128
bytes (measured: ~110 for maps of one pair nested in each other, the dearest; ~64 for an
empty list), plus up to 4 bytes per byte decoded for the text of strs, so decoding one value
costs the host at most half the guest's own memory cap, whatever the guest claims; nesting
is capped at ``MAX_DEPTH``. msgpack is walked from its declared lengths and counts
before msgpack's C decoder runs (``check_packed``); JSON is outlined with C-speed string
operations and its elements counted before ``json.loads`` runs (``json_outline``). Either
way the work is bounded by the element count, so a decode cannot hold the host (or its GIL)
for long after the run's deadline: at most ~1 s of CPU at the default cap, for the slowest
forgery measured (``python bench/decode.py`` prints the figures).

**Plain values only.** What leaves the guest as a value is None, bool, int, float, str,
bytes, list or dict (tuples arrive as lists), because every msgpack value goes through
``unpack``, which refuses msgpack extension types (``Timestamp``, ``ExtType``) before
decoding; JSON yields nothing else.

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

__all__ = ["BYTES_PER_ELEMENT", "MAX_DEPTH", "MARSHAL_VERSION", "MAX_NUMBER_DIGITS",
           "ProtocolError", "Reply", "as_msgpack_values", "check_depth", "check_json_depth",
           "check_packed", "decode_packed", "decode_reply", "encode_request", "json_outline",
           "max_elements", "MIN_ELEMENTS", "unpack"]

#: Deepest nesting accepted in a value that crosses the boundary. msgpack's own decoder
#: accepts 1024, deep enough to exhaust the host's recursion limit in code that walks it.
MAX_DEPTH = 32
#: Guest memory per element a decoded value may hold: see ``max_elements``.
BYTES_PER_ELEMENT = 256
#: The fewest elements a value may always hold, whatever the memory cap.
MIN_ELEMENTS = 2**16
#: Longest run of digits accepted in guest JSON: CPython's default ``int`` conversion limit.
#: An embedder may lift that limit for itself, and then ``int()`` of a longer run is
#: quadratic: a forged 64 MiB number would hold the host for hours.
MAX_NUMBER_DIGITS = 4300


class ProtocolError(ValueError):
    """A message from the guest broke the wire contract (too big, too deep, wrong shape)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    exit_code: int
    error: dict[str, str] | None
    value: Any
    memory_error: bool
    heap_top: int


def max_elements(memory_bytes: int) -> int:
    """The most elements one decoded value (or reply) from a run may hold.

    An element is a scalar, a list, a map, a map key or a string. The cap is the run's
    ``Limits.memory_bytes`` divided by ``BYTES_PER_ELEMENT`` (1,048,576 at the default
    256 MiB), at least ``MIN_ELEMENTS``: a guest that needs bigger values can be given more
    memory, and the host never spends more on a decode than a fraction of what it already
    grants the guest.
    """
    return max(memory_bytes // BYTES_PER_ELEMENT, MIN_ELEMENTS)


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
    flat = _flat_run(fields)
    if flat is not None:
        return flat
    for key in ("args", "kwargs"):
        if fields.get(key):
            fields[key] = as_msgpack_values(fields[key])
    for key, value in fields.items():
        fields[key] = _unshared(value)
    return "\x00" + marshal.dumps(fields, MARSHAL_VERSION).decode("latin-1")


#: The fields a plain run's request may hold to be sent flat (see the module docstring).
_FLAT_RUN_FIELDS = frozenset({"op", "code", "seed", "compiled"})


def _flat_run(fields: dict[str, Any]) -> str | None:
    """A plain run's request in the flat form, or None if ``fields`` needs the map: another
    op or field, a seed that is not an int of at most 64 bits, or code that is not valid
    Unicode text (a lone surrogate, which marshal carries and the string crossing does not).
    """
    code, seed = fields.get("code"), fields.get("seed")
    if (fields.get("op") != "run" or not fields.keys() <= _FLAT_RUN_FIELDS
            or type(code) is not str
            or not (seed is None or (type(seed) is int and seed.bit_length() <= 64))):
        return None
    if not code.isascii():
        try:
            code.encode("utf-8")
        except UnicodeEncodeError:
            return None
    compiled: bytes = fields.get("compiled") or b""
    return (f"\x01{'' if seed is None else seed}\x00{len(code)}\x00{code}"
            + compiled.decode("latin-1"))


def _unshared(value: Any) -> Any:
    """``value`` with each str (in it, or in its lists and dict values) a fresh copy.

    marshal writes an interned str with its own type code, and an object referenced more
    than once as a back-reference; the guest's loads pays differently for each. Whether the
    caller's ``"main"`` was interned (a literal) or not (read from a file) must not change
    the fuel a run uses, or a replayed run would not use the fuel it was recorded with. A
    fresh copy is never interned and is referenced once. (Empty and one-character strs are
    shared singletons in every process, so they are written the same way every time.)
    """
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")
    if isinstance(value, list):
        return [_unshared(item) for item in value]
    if isinstance(value, dict):
        return {_unshared(key): _unshared(item) for key, item in value.items()}
    return value


#: A reply holds at most this many strings and values: it is a flat map of a few fields.
_REPLY_ELEMENTS = 64


#: The reply of most runs, exactly as the runner writes it: no error, no value. Its digit
#: counts are bounded, so a match costs the same whatever the guest sends.
_PLAIN_REPLY = re.compile(r'\{"exit_code":(0|[1-9][0-9]{0,2}),"memory_error":(true|false),'
                          r'"heap_top":(0|[1-9][0-9]{0,19})\}')


def decode_reply(text: str, max_bytes: int, elements: int) -> Reply:
    """Decode and check the guest's reply; raises ProtocolError when it breaks the contract.

    ``max_bytes`` caps the reply's decoded size, ``elements`` its value (see
    ``max_elements``). The plain reply of most runs is read without the JSON parser, in a
    third of the time; anything else goes through it.
    """
    plain = _PLAIN_REPLY.fullmatch(text)
    if plain is not None and int(plain[1]) <= 255:
        return Reply(int(plain[1]), None, None, plain[2] == "true", int(plain[3]))
    return _decode_json_reply(text, max_bytes, elements)


def _decode_json_reply(text: str, max_bytes: int, elements: int) -> Reply:
    """``decode_reply`` for any reply: the JSON parser's path, with every check."""
    if len(text) > (max_bytes * 4) // 3 + 4096:
        raise ProtocolError(f"the guest's reply is larger than {max_bytes} bytes")
    # A reply is flat: at most two objects ({..., "error": {...}}), no arrays and a few
    # fields. Checked before parsing, because json.loads recurses in C once per level, up
    # to the host's recursion limit: a forged '[' * 10**6 crashed a host that had raised it.
    outline, _ = json_outline(text, _REPLY_ELEMENTS)
    if "[" in outline or outline.count("{") > 2:
        raise ProtocolError("the guest's reply nests deeper than a reply can")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the guest's reply is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("the guest's reply is not a map")
    value = _decode_value(message.get("value"), elements)
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


def _decode_value(encoded: Any, elements: int) -> Any:
    if encoded is None:
        return None
    if type(encoded) is not str:
        raise ProtocolError("the guest's reply has a malformed value")
    return decode_packed(encoded, "the guest's return value", elements)[0]


def decode_packed(encoded: str, what: str, elements: int) -> tuple[Any, int]:
    """One base64-msgpack value from the guest, through ``unpack``: the value and how many
    elements it holds. Raises ProtocolError naming ``what``."""
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"{what} is not valid msgpack: {exc}") from None
    return unpack(data, what, elements)


def unpack(data: bytes, what: str, elements: int,
           max_depth: int = MAX_DEPTH) -> tuple[Any, int]:
    """Decode one msgpack value from the guest: the one way guest msgpack becomes values.

    Returns the value and how many elements it holds. ``check_packed`` walks it first, so
    the decode builds at most ``elements`` elements, nested at most ``max_depth`` deep, of
    the plain types only (None, bool, int, float, str, bytes, list, dict). Raises
    ProtocolError, naming ``what``, for anything else: extension types (``Timestamp``,
    ``ExtType``), malformed or truncated data, invalid UTF-8 in a str, an unhashable map
    key, too many elements or too deep a nesting.
    """
    used = check_packed(data, elements, max_depth, what)
    size = len(data)
    try:
        # The C decoder's own caps, again: no container or string larger than the data.
        return msgpack.unpackb(data, raw=False, strict_map_key=False, max_str_len=size,
                               max_bin_len=size, max_array_len=size, max_map_len=size,
                               max_ext_len=0), used
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"{what} is not valid msgpack: {exc}") from None


def check_packed(data: bytes, elements: int, max_depth: int = MAX_DEPTH,
                 what: str = "the payload") -> int:
    """Check that ``data`` is exactly one msgpack value of plain types, within the caps;
    return how many elements it holds.

    Walks the encoding without building any value. Every declared length (of a string, a
    binary, an array, a map) is checked against the bytes that remain, and every declared
    element count is added to the value's element total, which may not pass ``elements``,
    before anything after the header is read: so the walk and the decode that follows do
    at most ``elements`` steps and allocate no more than the data and the elements need.
    Runs of fixed-size scalars (small ints, floats, nil, booleans) are skipped at C speed.
    Extension types and the unused byte 0xc1 are refused. Raises ProtocolError naming
    ``what``.
    """
    size = len(data)
    position = 0
    total = 1  # elements declared so far: the value itself, then every container's members
    if total > elements:
        raise ProtocolError(f"{what} holds more than {elements} elements")
    pending = [1]  # values still expected at each open nesting level
    while pending:
        left = pending[-1]
        if left == 0:
            pending.pop()
            continue
        if position >= size:
            raise ProtocolError(f"{what} ends in the middle of a value")
        byte = data[position]
        width = _RUN_WIDTHS.get(byte, 0) if left > 1 else 0
        if (width and position + width < size
                and _RUN_WIDTHS.get(data[position + width]) == width):
            # A run of same-size values (a list of numbers, of None, of empty lists) is
            # skipped at C speed; tried only when the next value is of the same size too, so
            # that values of alternating kinds cost one step each, not two.
            if width == 1:
                # Empty containers may join the run only where one more level is allowed.
                pattern = _FLAT_RUN if len(pending) <= max_depth else _SCALAR_RUN
                match = pattern.match(data, position, min(size, position + left))
                run = match.end() - position if match else 0
            else:
                # Every width-th byte from here is a type byte while the run lasts.
                types = data[position:position + min(left, (size - position) // width) * width
                             :width]
                run = len(types) - len(types.lstrip(types[:1]))
            if run:
                pending[-1] = left - run
                position += run * width
                continue
        pending[-1] = left - 1
        skip = _SKIP[byte]
        if skip:  # a scalar or a fixstr: its size is in its first byte
            position += skip
            if position > size:
                raise ProtocolError(f"{what} ends in the middle of a value")
            continue
        count = _FIX_COUNT[byte]  # a fixarray's or fixmap's element count, else -1
        if count >= 0:
            position += 1
        elif byte in _SIZED:
            width = _SIZED[byte]
            length = (data[position + 1] if width == 1 and position + 1 < size
                      else int.from_bytes(data[position + 1:position + 1 + width], "big"))
            if position + 1 + width > size or length > size:
                raise ProtocolError(f"a string in {what} is longer than {what}")
            position += 1 + width + length
        elif byte in _CONTAINERS:
            width, pairs = _CONTAINERS[byte]
            if position + 1 + width > size:
                raise ProtocolError(f"{what} ends in the middle of a value")
            count = int.from_bytes(data[position + 1:position + 1 + width], "big") * pairs
            position += 1 + width
        else:
            raise ProtocolError(
                f"{what} is not plain data: it uses msgpack type 0x{byte:02x} (only None, "
                "bool, int, float, str, bytes, lists and dicts may cross; extension types "
                "such as Timestamp and ExtType are refused)")
        if position > size:
            raise ProtocolError(f"{what} ends in the middle of a value")
        if count >= 0:
            # Every element takes at least one byte: a count larger than what is left is a lie.
            if count > size - position:
                raise ProtocolError(f"a container in {what} declares more elements than "
                                    f"{what} holds")
            total += count
            if total > elements:
                raise ProtocolError(f"{what} holds more than {elements} elements")
            pending.append(count)
            if len(pending) - 1 > max_depth:
                raise ProtocolError(f"{what} nests deeper than {max_depth} levels")
    if position != size:
        raise ProtocolError(f"{what} has bytes after its value")
    return total


# msgpack type byte -> bytes that follow it (floats, ints).
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
# msgpack type byte -> its value's whole size, for scalars and fixstrs (else 0).
_SKIP = tuple(1 if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3)
              else 1 + (byte & 0x1F) if 0xA0 <= byte <= 0xBF
              else 1 + _FIXED.get(byte, -1) for byte in range(256))
# msgpack type byte -> the element count of a fixmap (2 per pair) or fixarray (else -1).
_FIX_COUNT = tuple(2 * (byte & 0x0F) if 0x80 <= byte <= 0x8F
                   else byte & 0x0F if 0x90 <= byte <= 0x9F else -1 for byte in range(256))
# msgpack type byte -> width of the length that follows (str8/16/32, bin8/16/32).
_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
# msgpack type byte -> (width of the count, values per counted element): arrays and maps.
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
# One-byte values: positive and negative fixints, nil, false, true (and empty containers).
_SCALAR_RUN = re.compile(rb"[\x00-\x7f\xc0\xc2\xc3\xe0-\xff]+")
_FLAT_RUN = re.compile(rb"[\x00-\x7f\x80\x90\xc0\xc2\xc3\xe0-\xff]+")
# type byte -> bytes per value, for the values that may be skipped in runs.
_RUN_WIDTHS = {**dict.fromkeys([*range(0x80), 0x80, 0x90, 0xC0, 0xC2, 0xC3,
                                *range(0xE0, 0x100)], 1),
               **{byte: 1 + width for byte, width in _FIXED.items()}}


def json_outline(text: str, elements: int) -> tuple[str, int]:
    """The structure of JSON ``text`` without its strings, and how many elements it holds
    at most, once that is known to be safe to parse.

    Raises ProtocolError, before anything is parsed, if the text holds more than
    ``elements`` elements (strings, numbers, literals, arrays, objects; each key counts) or
    a number longer than ``MAX_NUMBER_DIGITS`` digits. Only C-speed string operations run,
    and no more objects are made than the element cap allows: a regular expression that
    matched each string took 45 s over 256 MiB of empty strings.

    For valid JSON the outline is exact. For invalid JSON, everything a parser would build
    before it meets the first error is outlined exactly, and so bounded too.
    """
    # Escaped backslashes, then escaped quotes: every '"' left delimits a string.
    plain = text.replace("\\\\", "").replace('\\"', "") if "\\" in text else text
    strings = plain.count('"') // 2
    if strings > elements:
        raise ProtocolError(f"the guest's reply holds more than {elements} elements")
    outline = "".join(plain.split('"')[::2])
    # A non-empty array of k values holds k - 1 commas; a non-empty object of k members,
    # 2k values, k - 1 commas and k colons. So this bounds the values a parser makes.
    found = (1 + sum(map(outline.count, (",", ":", "[", "{")))
             - outline.count("[]") - outline.count("{}"))
    if found > elements:
        raise ProtocolError(f"the guest's reply holds more than {elements} elements")
    if _LONG_NUMBER.search(outline):
        raise ProtocolError(f"the guest's reply has a number longer than {MAX_NUMBER_DIGITS} "
                            "digits")
    return outline, found


#: A run of digits longer than MAX_NUMBER_DIGITS; the lookbehind keeps the search linear.
_LONG_NUMBER = re.compile(rf"(?<![0-9])[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")


def check_json_depth(outline: str, limit: int) -> None:
    """Raise ProtocolError if the JSON of ``outline`` (see ``json_outline``) nests deeper
    than ``limit``, without parsing it.

    json.loads recurses in C once per level, up to the host's recursion limit, so a forged
    ``'[' * 10**6`` must be refused before it is parsed. The innermost empty brackets are
    removed level by level: each pass is one C-speed scan.
    """
    structure = _NOT_BRACKETS.sub("", outline)
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
