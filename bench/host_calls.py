"""Host-call benchmark: round trips per second, and MB/s with 64 KiB payloads.

What it measures (everything is printed; nothing is asserted). Each figure is timed inside
the guest (with ``clock="real"``), over ``--calls`` calls in one run, as the median of
``--repeats`` runs:

1. Small calls: ``host.ping()``, a host function that takes and returns nothing: calls/s
   and the median microseconds per round trip.
2. 64 KiB round trips: ``host.echo(data)`` sends 64 KiB and gets the same 64 KiB back;
   MB/s counts both directions. Two payloads, because the channel carries bytes one char
   per byte (latin-1) in a WIT string, which the canonical ABI stores as UTF-8: ASCII bytes
   cross as one byte each, bytes >= 0x80 as two. ``random`` is the worst case (half the
   bytes are >= 0x80), ``ascii`` the best.
3. The alternative encoding, base64, on the same channel: the guest base64-encodes the
   64 KiB into a str argument and decodes the str it gets back (so the bytes on the wire
   are 4/3 as many and all ASCII), plus the host's own base64 encode+decode of 64 KiB,
   measured separately and added. The ratio against latin-1 is printed.

For comparison, docs (DESIGN.md) measured a 64 KiB round trip as a ``list<u8>`` at ~130 ms:
wasmtime-py lowers lists one element at a time.

Run it with ``python bench/host_calls.py [--calls 2000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import time

import wasibox

PAYLOAD = 64 * 1024

SMALL = """\
import host, time
def f(n):
    host.ping()
    started = time.perf_counter()
    for _ in range(n):
        host.ping()
    return time.perf_counter() - started
"""

ECHO = """\
import host, time
def f(n, data):
    host.echo(data)
    started = time.perf_counter()
    for _ in range(n):
        back = host.echo(data)
    assert back == data
    return time.perf_counter() - started
"""

ECHO_BASE64 = """\
import base64, host, time
def f(n, data):
    started = time.perf_counter()
    for _ in range(n):
        back = base64.b64decode(host.echo(base64.b64encode(data).decode('ascii')))
    assert back == data
    return time.perf_counter() - started
"""


def ping() -> None:
    return None


def echo(value: object) -> object:
    return value


def median_seconds(sb: wasibox.Sandbox, code: str, repeats: int, *args: object) -> float:
    return statistics.median(sb.call(code, "f", *args) for _ in range(repeats))


def host_base64_seconds(data: bytes, rounds: int = 200) -> float:
    """The host's share of a base64 round trip: decode what came in, encode what goes out."""
    text = base64.b64encode(data).decode("ascii")
    started = time.perf_counter()
    for _ in range(rounds):
        base64.b64encode(base64.b64decode(text)).decode("ascii")
    return (time.perf_counter() - started) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="small calls per run")
    parser.add_argument("--big-calls", type=int, default=100, help="64 KiB round trips per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    options = parser.parse_args()

    limits = wasibox.Limits(host_calls=max(options.calls, options.big_calls) + 10,
                            host_total_bytes="4GiB", timeout_s=120, fuel=10**13)
    with wasibox.Sandbox(limits, clock="real",
                         functions={"ping": ping, "echo": echo}) as sb:
        small = median_seconds(sb, SMALL, options.repeats, options.calls)
        print(f"small calls:            {options.calls / small:10.0f} calls/s  "
              f"({small / options.calls * 1e6:.1f} us per round trip)")

        n = options.big_calls
        ascii_data = bytes(range(32, 127)) * (PAYLOAD // 95) + b"x" * (PAYLOAD % 95)
        random_data = os.urandom(PAYLOAD)
        results = {}
        for label, data in (("latin-1, ascii bytes", ascii_data),
                            ("latin-1, random bytes", random_data)):
            seconds = median_seconds(sb, ECHO, options.repeats, n, data)
            results[label] = seconds / n
            print(f"64 KiB {label + ':':24s}{2 * PAYLOAD * n / seconds / 1e6:8.1f} MB/s  "
                  f"({seconds / n * 1e3:.3f} ms per round trip)")
        seconds = median_seconds(sb, ECHO_BASE64, options.repeats, n, random_data) / n
        seconds += host_base64_seconds(random_data)
        print(f"64 KiB {'base64, random bytes:':24s}{2 * PAYLOAD / seconds / 1e6:8.1f} MB/s  "
              f"({seconds * 1e3:.3f} ms per round trip, host base64 included)")
        ratio = seconds / results["latin-1, random bytes"]
        print(f"base64 / latin-1 time per 64 KiB round trip (random bytes): {ratio:.2f}x")


if __name__ == "__main__":
    main()
