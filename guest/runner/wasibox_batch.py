"""Batch jobs (``wasibox.Transform``, ``wasibox.testing``): the entry function called once per
record, all in one instance of the wasm guest, and the batch's reply.

The records arrive marshalled (the host is trusted; marshal is CPython's fastest built-in
codec); dicts with the same keys arrive "keyed", each key once, interned, and referenced by
every record. The reply is JSON, which the host can decode safely; a batch of dicts with the
same keys and scalar values travels as columns, numbers as marshalled lists that the host
checks byte by byte (it never unmarshals them), strs as one text joined by NULs that the
host splits. Shapes: wasibox/_wire.py.

Fuel, measured per record of {"id": int, "price": float, "qty": int} -> {"id", "total"}:
keyed records cost ~3K to load and call where one marshal list cost ~5K plus a slower call
(each record decoded and hashed its own copy of every key, and the function's lookups
missed the identity check); letting the batch's records and outputs die cost ~3.5K;
checking that every output has the same keys in the same order as one flat key list costs
~0.9K, where a set of key tuples cost ~2.6K; marshal encodes a column and proves its exact
types in one C pass (~0.3K), where a set of types and struct.pack took two (~0.7K).

This file never imports the host package: it is the other side of a trust boundary.
"""

import base64
import builtins
import collections
import functools
import gc
import itertools
import json
import linecache
import marshal
import operator
import struct

import msgpack
import wasibox_files
import wasibox_job

__all__ = ["HELD", "encode_values", "execute_batch"]

_SCALARS = frozenset({str, int, float, bool, type(None)})
_MAKE_ENCODER = json.encoder.c_make_encoder
_ASCII = json.encoder.encode_basestring_ascii
#: json.loads without its Python wrapper (its whitespace regexes): this text is the
#: encoder's own, so it has no whitespace to skip.
_SCAN = json.JSONDecoder().scan_once
_B64 = base64.b64encode
_BATCH_GC_THRESHOLD = 50_000
_PACK = struct.pack
_ITEM = operator.itemgetter
_EXHAUST = functools.partial(collections.deque, maxlen=0)
#: What a batch made, kept to the end of the instance: freeing ~100,000 records and outputs
#: one object at a time cost more fuel than the function did, and the instance dies with it.
HELD = []


def execute_batch(job, records, streams, load):
    """Call the entry function once per record of a batch, in this one instance, and return
    the encoded reply.

    ``records`` are the marshalled bytes that follow the request; ``load(code, compiled,
    filename)`` gives the code object to run (see ``wasibox_job.run_job``). Never raises for
    what the program does.
    """
    code = job["code"]
    filename = job.get("filename", wasibox_job.SOURCE_NAME)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    values = []
    errors = []
    error = None
    memory_error = False
    try:
        exec(load(code, job.get("compiled"), filename), namespace)
        function = namespace.get(job["entry"])
        if not callable(function):
            raise NameError(f"the code defines no callable named {job['entry']!r}")
    except BaseException as exc:  # the code itself failed: every record fails the same way
        memory_error = isinstance(exc, MemoryError)
        error = wasibox_job.describe(exc)
    else:
        # The collector has nothing to find in the records; frozen, it never walks them again.
        collecting = gc.isenabled()  # the program may have turned the collector off
        gc.disable()
        try:
            loaded = marshal.loads(records)
        finally:
            if collecting:
                gc.enable()
        gc.freeze()
        if type(loaded) is tuple:  # keyed: (keys, [shared strs,] records), referred to
            loaded = loaded[-1]
        HELD.append(loaded)
        records = iter(loaded)
        # A star batch's records are tuples of positional arguments: starmap spreads them in
        # C, where a Python frame per record cost fuel (and a partial ~7K per batch).
        mapper = itertools.starmap if job.get("star") else map
        # A young-generation collection every 2,000 allocations spends most of its time
        # walking this batch's records and outputs, which stay alive to the end anyway:
        # collecting 25 times less often saved ~12% of a batch's fuel. Outputs count as
        # allocations too, so the headroom grows by two per record: cyclic garbage still
        # gets 50,000 objects before a collection, and the outputs alone never force one
        # (another 3.5% for 100,000 records). The instance serves this one batch, so the
        # setting dies with it.
        gc.set_threshold(_BATCH_GC_THRESHOLD + 2 * len(loaded), *gc.get_threshold()[1:])
        while True:
            try:
                # The loop runs in C; a record that raises ends this extend, and the next
                # pass resumes with the record after it.
                values.extend(mapper(function, records))
                break
            except BaseException as exc:
                memory_error = memory_error or isinstance(exc, MemoryError)
                errors.append([len(values), wasibox_job.describe(exc)])
                values.append(None)
    try:
        wasibox_files.finish()
    except BaseException as exc:
        error = error or wasibox_job.describe(exc)
    for stream in streams:
        try:
            stream.flush()
        except BaseException:
            pass
    wasibox_job.restore_builtins()
    HELD.append(values)
    body, blobs = encode_values(values, errors) if error is None else ("null", [])
    # The header has a fixed shape, so it is written directly: encoding it as a dict cost
    # ~35K fuel. Raw column bytes follow the JSON after a NUL, which JSON text never
    # contains: escaping (or base64) would cost more fuel than packing the numbers did.
    return "".join([
        '{"error":%s,"memory_error":%s,"count":%d,"errors":%s,"values":' % (
            "null" if error is None else _to_json(error), "true" if memory_error else "false",
            len(values), _to_json(errors) if errors else "[]"),
        body, "}\x00", *blobs])


def _not_json(value):
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _to_json(value):
    """``value`` as compact ASCII JSON, NaN and infinities allowed, as ``json.dumps`` writes it.

    Raises TypeError for a value JSON cannot carry, ValueError for a circular one. The C
    encoder is called directly: ``json.dumps`` spent ~25K fuel in its Python wrapper, more
    than encoding a small value costs. Each call gets new circular-reference markers,
    because the encoder leaves its entries behind when it fails.
    """
    return _MAKE_ENCODER({}, _not_json, _ASCII, None, ":", ",", False, False, True)(value, 0)[0]


def _utf8(text):
    """Whether ``text`` encodes as UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _exact(text, value):
    """Whether ``text``, the JSON of ``value``, decodes back to an equal value."""
    return _SCAN(text, 0)[0] == value


wasibox_job.hide_from_warnings(execute_batch)


def encode_values(values, errors):
    """JSON for the batch's values and raw column blobs; adds records that cannot cross to
    ``errors``."""
    failed = {position for position, _ in errors}
    ok = [v for i, v in enumerate(values) if i not in failed] if failed else values
    try:
        columns = _columns(ok)
    except (TypeError, ValueError, OverflowError):
        columns = None
    if columns is not None:
        return _to_json({"columns": columns[0], "keys": columns[1]}), columns[2]
    try:
        text = _to_json(values)
        exact = _exact(text, values)
    except (TypeError, ValueError, OverflowError, RecursionError):
        exact = False
    if exact:
        return '{"json":' + text + "}", []
    # Some value does not survive JSON exactly (a bytes, a tuple, a non-str key, ...): send
    # each such value with msgpack instead, and fail the records no format can carry.
    plain, packed = [], {}
    for position, value in enumerate(values):
        try:
            if position not in failed:
                if _exact(_to_json(value), value):
                    plain.append(value)
                    continue
        except (TypeError, ValueError, OverflowError, RecursionError):
            pass
        plain.append(None)
        if position in failed:
            continue
        try:
            packed[str(position)] = _B64(msgpack.packb(value, use_bin_type=True)).decode()
        except BaseException as exc:
            errors.append([position, {
                "type": "TypeError", "traceback": "",
                "message": f"the return value is not JSON- or msgpack-compatible: {exc}"}])
    return _to_json({"json": plain, "packed": packed}), []


def _columns(ok):
    """Dicts with the same str keys, in the same order, and scalar values, as one column per
    key; else None.

    Each column is "i" or "g" (its marshal bytes: all int32s or all floats, which the tags
    prove), "q" (little-endian int64s), {"s": length} (strs joined by NULs) or a JSON list of
    scalars.
    """
    rows = len(ok)
    if not ok or type(ok[0]) is not dict or set(map(type, ok)) != {dict}:
        return None
    keys = list(ok[0])
    # Every dict's keys, one after the other, are the first dict's, repeated: no dict can hold
    # a key twice, so each has exactly these keys, in this order. list.extend reads a dict's
    # keys without making an iterator: ~0.9K fuel a record, where itertools.chain took ~1.4K.
    every = []
    _EXHAUST(map(every.extend, ok))
    if set(map(type, keys)) - {str} or every != keys * rows:
        return None
    columns, blobs = [], []
    for key in keys:
        # An itemgetter per column: one flat list of every dict's values, cut by strided
        # slices, cost ~250 fuel a record less for 5 columns but ~700 more for 2.
        column = list(map(_ITEM(key), ok))
        HELD.append(column)
        if type(column[0]) is str:
            # join refuses anything but strs (a subclass's text is what JSON would carry):
            # proving the types with a set first cost ~410 fuel a record a column more.
            try:
                text = "\x00".join(column)
            except TypeError:
                text = None
            # No string held a NUL, and the text crosses as UTF-8 (no lone surrogate): the
            # host splits it at C speed. ~0.3K fuel a column of 10-character strings, where
            # marshal (to find it is not numbers) and escaped JSON cost ~3.5K.
            if (text is not None and text.count("\x00") == rows - 1
                    and (text.isascii() or _utf8(text))):
                columns.append({"s": len(text)})
                blobs.append(text)
                continue
        try:
            data = marshal.dumps(column, 2)
        except ValueError:  # an object marshal refuses: the generic path decides
            return None
        if len(data) == 5 + 5 * rows and data[5::5] == b"i" * rows:
            columns.append("i")
        elif len(data) == 5 + 9 * rows and data[5::9] == b"g" * rows:
            columns.append("g")
        else:
            kinds = set(map(type, column))
            if not kinds <= _SCALARS:
                return None
            try:
                if kinds != {int}:
                    raise struct.error
                data = _PACK(f"<{rows}q", *column)
            except struct.error:  # not all ints, or an int outside int64
                columns.append(column)
                continue
            columns.append("q")
        blobs.append(data.decode("latin-1"))
    return columns, keys, blobs

