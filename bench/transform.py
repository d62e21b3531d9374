"""Transform throughput: wasibox.Transform against host CPython on the same function.

For ``def transform(r): return {"id": r["id"], "total": r["price"] * r["qty"]}`` over
``--records`` records (default 100,000), prints records/s for host CPython (a plain list
comprehension) and for ``Transform.map`` at several batch sizes, the ratio between them
(target: 8 or less), the fuel burnt, and where the wasibox time goes (host-side encode and
decode, measured separately on the same records). Medians over ``--repeat`` runs, all
measured in this one process, back to back. Nothing is asserted.

    python bench/transform.py [--records 100000] [--repeat 3] [--batch-sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import wasibox
from wasibox._batch import decode_batch_reply, encode_records
from wasibox._transform import BATCH_REPLY_LIMIT

CODE = 'def transform(r):\n    return {"id": r["id"], "total": r["price"] * r["qty"]}\n'
RATIO_TARGET = 8.0


def records(count: int) -> list[dict[str, Any]]:
    return [{"id": i, "price": 1.25 + i % 97, "qty": i % 13} for i in range(count)]


def median_time(function: Callable[[], object], repeat: int) -> tuple[float, object]:
    samples, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1000,10000,100000")
    args = parser.parse_args()
    data = records(args.records)
    sizes = [int(size) for size in args.batch_sizes.split(",")]

    namespace: dict[str, Any] = {}
    exec(CODE, namespace)  # the benchmark's own, trusted copy of the function, for the baseline
    host_function = namespace["transform"]
    host_s, expected = median_time(lambda: [host_function(r) for r in data], args.repeat)
    print(f"transform throughput, {args.records:,} records, guest {wasibox.guest_digest()[:12]}")
    print(f"  host CPython              {args.records / host_s:>12,.0f} records/s "
          f"({host_s * 1e3:.0f} ms)")

    results = {}
    # Limits apply to a whole batch: give a 100,000-record batch room to finish.
    limits = wasibox.Limits(fuel=10**12, timeout_s=300, memory_bytes="2GiB")
    with wasibox.Transform(CODE, limits=limits) as t:
        t.map(data[:2000], batch_size=1000, progress=False)  # warm the runtime
        for size in sizes:
            fuel_before, batches_before = t.fuel_used, t.batches_run
            elapsed, out = median_time(lambda s=size: t.map(data, batch_size=s, progress=False),
                                       args.repeat)
            if out != expected:
                raise SystemExit(f"batch size {size}: outputs differ from host CPython")
            fuel = (t.fuel_used - fuel_before) // args.repeat
            batches = (t.batches_run - batches_before) // args.repeat
            results[size] = elapsed
            print(f"  wasibox batch_size={size:<7,} {args.records / elapsed:>12,.0f} records/s "
                  f"({elapsed * 1e3:.0f} ms) ratio {elapsed / host_s:5.1f}x  "
                  f"fuel {fuel:,} ({fuel / args.records:,.0f}/record) in {batches} instances")
        one = t.fuel_used
        t({"id": 1, "price": 1.0, "qty": 1})
        print(f"  fixed cost of one instance: {t.fuel_used - one:,} fuel (a 1-record batch)")

    # Where the host's share goes, for the largest batch size.
    size = max(sizes)
    batch = data[:size]
    encode_s, payload = median_time(lambda: encode_records(batch), args.repeat)
    with wasibox.Sandbox(limits) as sandbox:
        outcome = sandbox._execute_batch(CODE, "transform", payload)  # type: ignore[arg-type]
    assert outcome.reply is not None
    decode_s, _ = median_time(
        lambda: decode_batch_reply(outcome.reply, len(batch), BATCH_REPLY_LIMIT),  # type: ignore[arg-type]
        args.repeat)
    print(f"  of a {size:,}-record batch: host encode {encode_s * 1e3:.0f} ms, guest "
          f"{outcome.duration_s * 1e3:.0f} ms, host decode {decode_s * 1e3:.0f} ms")
    best = min(results.values())
    ratio = best / host_s
    print(f"summary: best ratio to host CPython {ratio:.1f}x (target <= {RATIO_TARGET:.0f}x: "
          f"{'met' if ratio <= RATIO_TARGET else 'MISSED'})")


if __name__ == "__main__":
    main()
