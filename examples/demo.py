"""wasibox demo: a deterministic data transform of a CSV file, run in the sandbox.

The transform below is "untrusted" code: it runs in a fresh CPython-on-WebAssembly instance
with no files, no network and a virtual clock. The host reads the file and passes the rows
in; the guest returns per-customer totals. Running it twice gives the same output and the
same fuel, which is what makes fuel a usable, reproducible cost measure. Then the demo shows
what the sandbox refuses: a file outside its mounts, the cloud metadata address, and a
program that never ends.

Usage: python examples/demo.py examples/data/orders.csv
"""

import csv
import os
import sys

import wasibox

TRANSFORM = '''
from collections import defaultdict
from datetime import datetime
from decimal import Decimal

def transform(rows):
    totals = defaultdict(Decimal)
    orders = defaultdict(int)
    weekdays = defaultdict(set)
    for row in rows:
        amount = Decimal(row["unit_price"]) * int(row["qty"])
        totals[row["customer"]] += amount
        orders[row["customer"]] += 1
        weekdays[row["customer"]].add(datetime.fromisoformat(row["placed_at"]).strftime("%a"))
    return [
        {"customer": name, "orders": orders[name], "total": str(totals[name]),
         "weekdays": sorted(weekdays[name])}
        for name in sorted(totals, key=lambda name: (-totals[name], name))
    ]
'''


def main(path: str) -> None:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    limits = wasibox.Limits(fuel=500_000_000, memory_bytes="128MiB", timeout_s=5)
    with wasibox.Sandbox(limits) as sandbox:
        # Two runs, each in its own fresh interpreter: same input, same output, same fuel.
        runs = [sandbox.run(TRANSFORM, entry="transform", args=[rows]) for _ in range(2)]
    for result in runs:
        if not result.ok:
            sys.exit(f"the transform failed: {result.error or result.limit_exceeded}")
    totals = runs[0].value
    print(f"{len(rows)} orders from {path}, transformed in the sandbox:\n")
    print(f"{'customer':<10} {'orders':>6} {'total':>10}  weekdays")
    for entry in totals:
        print(f"{entry['customer']:<10} {entry['orders']:>6} {entry['total']:>10}  "
              f"{' '.join(entry['weekdays'])}")
    first, second = runs
    print(f"\nfuel used: {first.fuel_used:,} in {first.duration_s * 1000:.1f} ms")
    print(f"second run identical (output and fuel): "
          f"{first.value == second.value and first.fuel_used == second.fuel_used}")
    print(f"guest sha256: {wasibox.guest_digest()}")
    show_refusals(os.path.dirname(os.path.abspath(path)))


#: Untrusted code that tries what it must not, and how each attempt should end.
ATTEMPTS = [
    ("a file outside the mounts", "print(open('/data/../../etc/passwd').read())"),
    ("the cloud metadata address, although the HTTP policy lists it",
     "import urllib.request\n"
     "urllib.request.urlopen('http://169.254.169.254/latest/meta-data/')"),
    ("a program that never ends", "while True:\n    pass"),
]


def show_refusals(data_dir: str) -> None:
    # The guest sees the data directory read-only at /data, and may use HTTP, but only to
    # the address below: mediated HTTP still refuses link-local and metadata addresses.
    policy = wasibox.HttpPolicy(allow=["169.254.169.254"])
    limits = wasibox.Limits(fuel=100_000_000, timeout_s=5)
    with wasibox.Sandbox(limits, mounts=[wasibox.Mount(data_dir, "/data")],
                         http=policy) as sandbox:
        print("\nwhat the sandbox refuses (each a result, never a crash of the host):")
        for what, code in ATTEMPTS:
            result = sandbox.run(code)
            if result.limit_exceeded is not None:
                outcome = (f"stopped by its {result.limit_exceeded} limit after "
                           f"{result.fuel_used:,} fuel")
            elif result.error is not None:
                outcome = f"{result.error.type}: {result.error.message}"
            else:
                outcome = f"NOT REFUSED: {result.stdout[:80]!r}"
            print(f"  {what}: {outcome}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/data/orders.csv")
