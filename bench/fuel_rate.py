"""Fuel burnt per second of wall-clock time by CPU-bound guest code, against FUEL_PER_SECOND.

``wasibox.Limits`` derives ``fuel`` from ``timeout_s`` when only the timeout is given, at
``FUEL_PER_SECOND``. That rate must be above what any guest code burns on the machines wasibox
runs on, or the fuel would run out before the timeout. This script measures several kinds of
CPU-bound code (each run several times; median and fastest) and prints each rate and its ratio
to ``FUEL_PER_SECOND`` (headroom = FUEL_PER_SECOND / fastest rate; it should stay above 1).

    python bench/fuel_rate.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import wasibox
from wasibox._limits import FUEL_PER_SECOND

PROGRAMS = {
    "integer loop": "x = 0\nfor i in range(3_000_000):\n    x += i * i\n",
    "while counter": "i = 0\nwhile i < 2_000_000:\n    i += 1\n",
    "str and dict": "d = {}\nfor i in range(300_000):\n    d[str(i)] = len(str(i) * 3)\n",
    "float math": "import math\ns = 0.0\nfor i in range(1_000_000):\n    s += math.sin(i) * 1.5\n",
    "list sort": ("import random\nr = random.Random(1)\nfor _ in range(20):\n"
                  "    values = [r.random() for _ in range(50_000)]\n    values.sort()\n"),
    "json round trip": ("import json\nd = [{'a': i, 'b': str(i)} for i in range(20_000)]\n"
                        "for _ in range(10):\n    json.loads(json.dumps(d))\n"),
    # The tightest loops found: the eval loop doing nothing, and C loops over big buffers.
    "empty loop": "for _ in range(20_000_000):\n    pass\n",
    "bigint multiply": "x = 10**200_000\nfor _ in range(20):\n    x * x\n",
    "sha256": "import hashlib\nb = bytes(10**7)\nfor _ in range(10):\n    hashlib.sha256(b)\n",
    "zlib.crc32": ("import zlib\nb = bytes(range(256)) * 40_000\nfor _ in range(200):\n"
                   "    zlib.crc32(b)\n"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per program (default 3)")
    args = parser.parse_args()
    print(f"FUEL_PER_SECOND = {FUEL_PER_SECOND:.3g}")
    fastest_overall = 0.0
    with wasibox.Sandbox(wasibox.Limits(fuel=10**13, timeout_s=600)) as sandbox:
        for name, code in PROGRAMS.items():
            rates = []
            for _ in range(args.runs):
                started = time.perf_counter()
                result = sandbox.run(code)
                elapsed = time.perf_counter() - started
                if not result.ok:
                    raise SystemExit(f"{name}: the run failed: {result.error or result}")
                rates.append(result.fuel_used / elapsed)
            fastest_overall = max(fastest_overall, max(rates))
            print(f"{name:16s} fuel {result.fuel_used:>15,}  median {statistics.median(rates):.3g}"
                  f" fuel/s  fastest {max(rates):.3g} fuel/s  "
                  f"ratio to FUEL_PER_SECOND {max(rates) / FUEL_PER_SECOND:.2f}")
    print(f"headroom (FUEL_PER_SECOND / fastest rate): {FUEL_PER_SECOND / fastest_overall:.2f}")


if __name__ == "__main__":
    main()
