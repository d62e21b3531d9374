"""Fuzz throughput: hypothesis examples per second with a fresh sandbox per example.

For a trivial guest function (``def inc(x: int) -> int: return x + 1``), prints:

1. one ``GuestFunction.run`` per call, no hypothesis (the floor: one fresh instance each);
2. hypothesis ``@given`` driving one ``run`` per example (target: 300 examples/s);
3. ``wasibox.testing.fuzz``, which runs every example twice (nondeterminism check) and
   targets fuel;
4. for reference, ``Sandbox.call`` per call;

then the fuel ratio ``fuzz`` reaches on a planted quadratic function, with and without fuel
targeting. Medians where repeated; all in this one process. Nothing is asserted.

    python bench/fuzz.py [--examples 300]
"""

from __future__ import annotations

import argparse
import statistics
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


def rate(label: str, count: int, elapsed: float) -> float:
    per_s = count / elapsed
    print(f"  {label:<44} {per_s:>7,.0f}/s ({elapsed / count * 1e3:.2f} ms each)")
    return per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args()
    n = args.examples
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
    rate("GuestFunction.run, back to back", n, sum(samples))

    @hypothesis.settings(wt.settings_profiles()["wasibox"], max_examples=n, database=None)
    @given(inc.strategy())
    def one_run(arguments: tuple[int]) -> None:
        inc.run(*arguments)

    started = time.perf_counter()
    one_run()
    given_rate = rate("hypothesis @given, one fresh run per example", n,
                      time.perf_counter() - started)

    report = wt.fuzz(TRIVIAL, "inc", max_examples=n)
    rate("wt.fuzz (two runs per example, fuel target)", report.examples, report.elapsed_s)

    with wasibox.Sandbox() as sandbox:
        started = time.perf_counter()
        for i in range(n):
            sandbox.call(TRIVIAL, "inc", i)
        rate("Sandbox.call, for reference", n, time.perf_counter() - started)

    print("planted quadratic path (nesting), 100 examples:")
    for target in (True, False):
        found = wt.fuzz(QUADRATIC, "nesting", max_examples=100, target_fuel=target,
                        check_determinism=False)
        print(f"  target_fuel={target!s:<5} max/min fuel {found.fuel_ratio:6.1f}x "
              f"(max {found.max_fuel:,}, min {found.min_fuel:,})")
    print(f"summary: {given_rate:,.0f} examples/s with a fresh sandbox per example "
          f"(target >= {TARGET_PER_S:.0f}: {'met' if given_rate >= TARGET_PER_S else 'MISSED'})")


if __name__ == "__main__":
    main()
