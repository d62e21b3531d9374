"""Fuzz throughput: hypothesis examples per second with a fresh sandbox per example.

For a trivial guest function (``def inc(x: int) -> int: return x + 1``), prints:

1. one ``GuestFunction.run`` per call, no hypothesis (the floor: one fresh instance each);
2. hypothesis ``@given`` driving one ``run`` per example (target: 300 examples/s), and the
   same ``@given`` with no run, for hypothesis's own share of an example;
3. ``wasibox.testing.fuzz``, which runs every example twice (nondeterminism check) and
   targets fuel;
4. for reference, ``Sandbox.call`` per call;

then the fuel ratio ``fuzz`` reaches on a planted quadratic function, with and without fuel
targeting. Medians where repeated. Nothing is asserted.

Each figure is measured for three configurations, each in its own child process (the run
path and slot reuse are chosen per process): *baseline* (the Python run path, Wasmtime's
default allocator: before issue 17), *python* (with memory-slot reuse) and *native* (the C
run path with slot reuse, if it is built here); a table compares them at the end.

    python bench/fuzz.py [--examples 300] [--config baseline|python|native]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import hypothesis
from hypothesis import given

import wasibox
import wasibox.testing as wt

TRIVIAL = "def inc(x: int) -> int:\n    return x + 1\n"
QUADRATIC = """\
def nesting(s: str) -> int:
    deepest = 0
    for i, c in enumerate(s):
        if c == "(":
            depth = 0
            for d in s[:i]:
                if d == "(":
                    depth += 1
                elif d == ")":
                    depth -= 1
            deepest = max(deepest, depth + 1)
    return deepest
"""
TARGET_PER_S = 300.0
#: The environment of each configuration's child process.
CONFIGS = {
    "baseline": {"WASIBOX_RUN_PATH": "python", "WASIBOX_SLOT_REUSE": "0"},
    "python": {"WASIBOX_RUN_PATH": "python", "WASIBOX_SLOT_REUSE": "1"},
    "native": {"WASIBOX_RUN_PATH": "native", "WASIBOX_SLOT_REUSE": "1"},
}


def rate(label: str, count: int, elapsed: float) -> float:
    per_s = count / elapsed
    print(f"  {label:<44} {per_s:>7,.0f}/s ({elapsed / count * 1e3:.2f} ms each)")
    return per_s


def measure(n: int) -> dict[str, float]:
    """Every figure, in this process's configuration; printed, and returned by name."""
    print(f"fuzz throughput, trivial guest function, guest {wasibox.guest_digest()[:12]}")
    inc = wt.guest_function(TRIVIAL, "inc")
    for i in range(20):
        inc.run(i)

    samples = []
    for i in range(n):
        started = time.perf_counter()
        inc.run(i)
        samples.append(time.perf_counter() - started)
    print(f"  GuestFunction.run median {statistics.median(samples) * 1e3:.2f} ms, fuel "
          f"{inc.run(1).fuel_used:,}")
    run_rate = rate("GuestFunction.run, back to back", n, sum(samples))

    @hypothesis.settings(wt.settings_profiles()["wasibox"], max_examples=n, database=None)
    @given(inc.strategy())
    def one_run(arguments: tuple[int]) -> None:
        inc.run(*arguments)

    @hypothesis.settings(wt.settings_profiles()["wasibox"], max_examples=n, database=None)
    @given(inc.strategy())
    def no_run(arguments: tuple[int]) -> None:
        pass

    # Where an example's time goes: hypothesis's own share (drawing, bookkeeping), then the
    # whole example; the CPU is this thread's (the pool's filler works on another).
    started, cpu = time.perf_counter(), time.thread_time()
    no_run()
    alone_cpu = time.thread_time() - cpu
    rate("hypothesis @given alone (no run)", n, time.perf_counter() - started)
    started, cpu = time.perf_counter(), time.thread_time()
    one_run()
    given_cpu = time.thread_time() - cpu
    given_rate = rate("hypothesis @given, one fresh run per example", n,
                      time.perf_counter() - started)
    print(f"  of an example's CPU on this thread ({given_cpu / n * 1e3:.2f} ms), hypothesis "
          f"alone {alone_cpu / n * 1e3:.2f} ms")

    report = wt.fuzz(TRIVIAL, "inc", max_examples=n)
    fuzz_rate = rate("wt.fuzz (two runs per example, fuel target)", report.examples,
                     report.elapsed_s)

    with wasibox.Sandbox() as sandbox:
        started = time.perf_counter()
        for i in range(n):
            sandbox.call(TRIVIAL, "inc", i)
        call_rate = rate("Sandbox.call, for reference", n, time.perf_counter() - started)

    print("planted quadratic path (nesting), 100 examples:")
    for target in (True, False):
        found = wt.fuzz(QUADRATIC, "nesting", max_examples=100, target_fuel=target,
                        check_determinism=False)
        print(f"  target_fuel={target!s:<5} max/min fuel {found.fuel_ratio:6.1f}x "
              f"(max {found.max_fuel:,}, min {found.min_fuel:,})")
    return {"run": run_rate, "given": given_rate, "fuzz": fuzz_rate, "call": call_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--config", choices=sorted(CONFIGS),
                        help="measure only this configuration, in this process")
    args = parser.parse_args()
    if args.config is not None:
        os.environ.update(CONFIGS[args.config])
        print(json.dumps(measure(args.examples)))
        return
    results: dict[str, dict[str, float]] = {}
    for name in CONFIGS:
        print(f"\n== {name} ==", flush=True)
        child = subprocess.run(
            [sys.executable, __file__, "--examples", str(args.examples), "--config", name],
            stdout=subprocess.PIPE, text=True, check=False)
        lines = child.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if child.returncode != 0 or not lines:
            print(f"  {name}: the child failed (exit {child.returncode}); see its stderr")
            continue
        results[name] = json.loads(lines[-1])
    print("\nsummary (per second; fresh sandbox per example):")
    print(f"  {'':<10} {'run':>8} {'@given':>8} {'fuzz':>8} {'call':>8}")
    for name, row in results.items():
        print(f"  {name:<10} {row['run']:>8,.0f} {row['given']:>8,.0f} {row['fuzz']:>8,.0f} "
              f"{row['call']:>8,.0f}")
    if results:
        best = max(results, key=lambda name: results[name]["given"])
        given_rate = results[best]["given"]
        baseline = results.get("baseline", {}).get("given", float("nan"))
        print(f"  {given_rate:,.0f} examples/s on {best} ({given_rate / baseline:.2f}x baseline; "
              f"target >= {TARGET_PER_S:.0f}: "
              f"{'met' if given_rate >= TARGET_PER_S else 'MISSED'})")


if __name__ == "__main__":
    main()
