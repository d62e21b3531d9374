"""Deterministic by default: same program, same output and fuel, in every run and process."""

from __future__ import annotations

import json
import subprocess

import pytest

import wasibox
from tests.conftest import PYTHON, child_env

pytestmark = pytest.mark.guest

PROGRAM = """
import random, time, os, uuid, datetime
print(random.random(), random.randint(0, 10**9))
print(time.time(), time.monotonic() > 0, datetime.datetime.now().year)
print(os.urandom(8).hex(), uuid.uuid4())
print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}), hash('abc'))
"""

CHILD = """
import json, sys, wasibox
r = wasibox.Sandbox(seed=int(sys.argv[1])).run(sys.stdin.read())
print(json.dumps({"stdout": r.stdout, "fuel": r.fuel_used, "ok": r.ok}))
"""


def run_in_child(seed: int) -> dict[str, object]:
    out = subprocess.run([PYTHON, "-c", CHILD, str(seed)], input=PROGRAM, capture_output=True,
                         text=True, env=child_env(), timeout=300, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_same_output_and_fuel_across_runs_and_processes() -> None:
    with wasibox.Sandbox() as sb:
        first, second = sb.run(PROGRAM), sb.run(PROGRAM)
    assert first.ok, first.error
    assert (first.stdout, first.fuel_used) == (second.stdout, second.fuel_used)
    assert "1704067200" in first.stdout.splitlines()[1]  # the virtual clock's fixed start
    child_a, child_b = run_in_child(0), run_in_child(0)
    assert child_a == child_b == {"stdout": first.stdout, "fuel": first.fuel_used, "ok": True}


def test_seed_changes_random_but_not_hashing() -> None:
    with wasibox.Sandbox(seed=1) as one, wasibox.Sandbox(seed=2) as two:
        a, b = one.run(PROGRAM), two.run(PROGRAM)
    assert a.stdout.splitlines()[0] != b.stdout.splitlines()[0]
    assert a.stdout.splitlines()[3] == b.stdout.splitlines()[3]  # set order is fixed per guest


def test_real_clock_and_entropy_are_granted_on_request() -> None:
    import time

    with wasibox.Sandbox(clock="real", entropy="real") as sb:
        a, b = sb.run(PROGRAM), sb.run(PROGRAM)
    assert a.ok and a.stdout != b.stdout
    guest_time = float(a.stdout.splitlines()[1].split()[0])
    assert abs(guest_time - time.time()) < 60


def test_busy_wait_on_the_virtual_clock_terminates() -> None:
    # Virtual time advances with the fuel the guest burns, so polling the clock terminates.
    with wasibox.Sandbox() as sb:
        r = sb.run("import time\nend = time.monotonic() + 0.01\nn = 0\n"
                   "while time.monotonic() < end:\n    n += 1\nprint(n > 0)")
    assert r.ok and r.stdout == "True\n"
