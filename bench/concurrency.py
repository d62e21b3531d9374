"""Latency percentiles with and without the warm pool, async throughput, cancel latency.

What it measures (everything is printed; nothing is asserted):

1. ``Sandbox.run("print(1+1)")`` p50/p99 over ``--runs`` sequential runs, with the warm pool
   (the default runtime) and without one (``WasmRuntime(pool_size=0)``), in the same process,
   interleaved in blocks so both see the same machine load; and their ratio.
2. ``arun`` throughput and p50/p99 with ``max_concurrency`` 1, 2 and 4 (``--runs`` runs
   gathered at once, queue large enough for all).
3. Cancel latency, p50/p99 over ``--cancels`` cancellations: from ``handle.cancel()`` to the
   result being ready, for a guest spinning in wasm (epoch interruption) and for a guest
   blocked in a host call (``time.sleep`` with the real clock). Target: p99 under 1 s.

    python bench/concurrency.py [--runs 300] [--cancels 50]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import wasibox
from wasibox import Limit, RunState
from wasibox.backends.wasm.backend import WasmBackend
from wasibox.backends.wasm.runtime import WasmRuntime

CODE = "print(1+1)"
BLOCK = 25
CANCEL_TARGET_S = 1.0


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(label: str, samples: list[float]) -> str:
    return (f"  {label:<34} p50 {pct(samples, 0.5) * 1e3:8.2f} ms   "
            f"p99 {pct(samples, 0.99) * 1e3:8.2f} ms   (n={len(samples)})")


def timed_run(sandbox: wasibox.Sandbox) -> float:
    started = time.perf_counter()
    result = sandbox.run(CODE)
    elapsed = time.perf_counter() - started
    if result.stdout != "2\n":
        raise SystemExit(f"unexpected result: {result}")
    return elapsed


def bench_pool(runs: int) -> None:
    print(f"\n== sequential Sandbox.run({CODE!r}): warm pool vs none ==", flush=True)
    pooled = wasibox.Sandbox()
    bare = wasibox.Sandbox(backend=WasmBackend(WasmRuntime(pool_size=0)))
    for sandbox in (pooled, bare):
        for _ in range(10):
            timed_run(sandbox)
    with_pool: list[float] = []
    without: list[float] = []
    while len(with_pool) < runs:
        for _ in range(BLOCK):
            with_pool.append(timed_run(pooled))
            # Give the pool's refill thread the time a request gap would give it.
            time.sleep(0.002)
        for _ in range(BLOCK):
            without.append(timed_run(bare))
            time.sleep(0.002)
    print(row("warm pool", with_pool))
    print(row("no pool (instantiate per run)", without))
    print(f"  ratio pool/no pool: p50 {pct(with_pool, .5) / pct(without, .5):.2f}x, "
          f"p99 {pct(with_pool, .99) / pct(without, .99):.2f}x")
    pooled.close()
    bare.close()


def bench_async(runs: int) -> None:
    print(f"\n== arun({CODE!r}) x {runs}, gathered at once ==", flush=True)

    async def batch(sandbox: wasibox.Sandbox) -> tuple[list[float], float]:
        async def one() -> float:
            started = time.perf_counter()
            result = await sandbox.arun(CODE)
            assert result.stdout == "2\n", result
            return time.perf_counter() - started

        started = time.perf_counter()
        latencies = await asyncio.gather(*(one() for _ in range(runs)))
        return list(latencies), time.perf_counter() - started

    for concurrency in (1, 2, 4):
        with wasibox.Sandbox(max_concurrency=concurrency, max_queue=runs) as sandbox:
            asyncio.run(batch(sandbox))  # warm the pool and the worker threads
            latencies, elapsed = asyncio.run(batch(sandbox))
        print(row(f"max_concurrency={concurrency}", latencies)
              + f"   {runs / elapsed:6.0f} runs/s")


def bench_cancel(cancels: int) -> None:
    print("\n== cancel latency: handle.cancel() -> result ready ==", flush=True)
    limits = wasibox.Limits(fuel=10**15, timeout_s=120)
    cases = [("spinning in wasm", "virtual", "while True: pass"),
             ("blocked in a host call (sleep)", "real", "import time\ntime.sleep(100)")]
    for label, clock, code in cases:
        samples: list[float] = []
        with wasibox.Sandbox(limits, clock=clock, max_concurrency=1) as sandbox:  # type: ignore[arg-type]
            for _ in range(cancels):
                handle = sandbox.start(code)
                while handle.state != RunState.RUNNING:
                    time.sleep(0.001)
                time.sleep(0.02)  # well inside the guest
                started = time.perf_counter()
                handle.cancel()
                result = handle.result()
                samples.append(time.perf_counter() - started)
                assert result.limit_exceeded is Limit.CANCELLED, result
        verdict = "met" if pct(samples, 0.99) < CANCEL_TARGET_S else "MISSED"
        print(row(label, samples) + f"   (target p99 < {CANCEL_TARGET_S:.0f} s: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--cancels", type=int, default=50)
    args = parser.parse_args()
    bench_pool(args.runs)
    bench_async(args.runs)
    bench_cancel(args.cancels)


if __name__ == "__main__":
    main()
