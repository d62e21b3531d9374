"""Run a multi-file project (a module and a package) in the sandbox.

The project directory is mounted read-only at /project; the guest puts it on ``sys.path``
and imports its modules from there, read through the same files capability as any other
file (nothing outside the mounts can be imported). The host passes the orders in and gets
the totals back.

Usage: python examples/multi_file/run.py [examples/data/orders.csv]
"""

import csv
import pathlib
import sys

import wasibox

HERE = pathlib.Path(__file__).resolve().parent
ENTRY = "import sys\nsys.path.insert(0, '/project')\nfrom report import report\n"


def main(orders: str) -> None:
    with open(orders, newline="") as handle:
        rows = list(csv.DictReader(handle))
    project = wasibox.Mount(HERE / "project", "/project")  # read-only
    with wasibox.Sandbox(wasibox.Limits(fuel=500_000_000), mounts=[project]) as sandbox:
        result = sandbox.run(ENTRY, entry="report", args=[rows])
    if not result.ok:
        sys.exit(f"the project failed: {result.error or result.limit_exceeded}")
    for customer, total in result.value.items():
        print(f"{customer:<10} {total:>10}")
    print(f"fuel used: {result.fuel_used:,}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent / "data" / "orders.csv"))
