"""Decode benchmark: what a forged value at the element cap costs the host.

Every value a guest hands back is walked from its declared counts and lengths before
msgpack's C decoder builds it (``wasibox._wire.unpack``), and every JSON reply is outlined
before ``json.loads`` parses it (``wasibox._wire.json_outline``). Both are bounded by the
element cap, ``max_elements(Limits.memory_bytes)`` (1,048,576 at the default 256 MiB).
This prints, for hand-forged values of exactly that many elements, each the dearest of its
kind for the host:

* the median CPU seconds of the bounded decode (walk + C decode) over ``--repeats`` runs,
  and its ratio to msgpack's C decoder alone on the same bytes (which, unbounded, is what a
  forged value of tens of millions of elements used to cost, times ten or more);
* the peak host memory of the decode (tracemalloc, measured once, in a separate pass: it
  slows the decode) and that peak per element, against the documented 128 bytes (plus 4
  per byte of strs).

CPU seconds (``time.process_time``), not wall time, so that other processes on a shared
machine do not inflate the figures. Nothing is asserted.

Run it with ``python bench/decode.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack

import wasibox
from wasibox._wire import json_outline, max_elements, unpack

CAP = max_elements(wasibox.Limits().memory_bytes)


def _array(unit: bytes, elements: int, members: int = 1) -> bytes:
    """An array of ``unit`` repeated, ``unit`` being ``members`` members of ``elements``
    elements in all, with as many as the cap allows."""
    count = (CAP - 1) // elements
    return b"\xdd" + (count * members).to_bytes(4, "big") + unit * count


MSGPACK = {
    "nil": _array(b"\xc0", 1),
    "floats": _array(b"\xcb" + b"\x01" * 8, 1),
    "empty lists": _array(b"\x90", 1),
    "empty maps": _array(b"\x80", 1),
    "one-pair maps": _array(b"\x81\x00\x90", 3),
    "two-character strs": _array(b"\xa2ab", 1),
    "one-byte bins": _array(b"\xc4\x01x", 1),
    "empty lists and strs, alternating": _array(b"\x90\xa1a", 2, 2),
    "one-pair maps nested 30 deep": _array(b"\x81\xa2ab" * 30 + b"\x80", 61),
    "one key repeated": b"\xdf" + ((CAP - 1) // 2).to_bytes(4, "big") + b"\xa1k\x90" * (
        (CAP - 1) // 2),
}
JSON = {
    "JSON empty lists": "[" + ",".join(["[]"] * (CAP - 2)) + "]",
    "JSON one-key objects": "[" + ",".join(['{"a":0}'] * ((CAP - 2) // 3)) + "]",
    "JSON two-character strs": "[" + ",".join(['"ab"'] * (CAP - 2)) + "]",
}


def _cpu(work: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        work()
        times.append(time.process_time() - started)
    return statistics.median(times)


def _peak(work: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"element cap at the default memory limit: {CAP:,}")
    print(f"{'forged value':36s} {'bytes':>10s} {'bounded s':>10s} {'C alone s':>10s} "
          f"{'ratio':>6s} {'peak MiB':>9s} {'B/elt':>6s}")
    for name, data in MSGPACK.items():
        bounded = _cpu(lambda data=data: unpack(data, "a value", CAP), repeats)
        alone = _cpu(lambda data=data: msgpack.unpackb(data, strict_map_key=False), repeats)
        peak = _peak(lambda data=data: unpack(data, "a value", CAP))
        print(f"{name:36s} {len(data):>10,} {bounded:>10.3f} {alone:>10.3f} "
              f"{bounded / alone:>6.1f} {peak / 2**20:>9.1f} {peak / CAP:>6.1f}")
    for name, text in JSON.items():
        bounded = _cpu(lambda text=text: (json_outline(text, CAP), json.loads(text)),
                       repeats)
        alone = _cpu(lambda text=text: json.loads(text), repeats)
        peak = _peak(lambda text=text: (json_outline(text, CAP), json.loads(text)))
        print(f"{name:36s} {len(text):>10,} {bounded:>10.3f} {alone:>10.3f} "
              f"{bounded / alone:>6.1f} {peak / 2**20:>9.1f} {peak / CAP:>6.1f}")


if __name__ == "__main__":
    main()
