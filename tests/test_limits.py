"""Limits: fuel derived from the timeout, the fuel-exceeded message, per-run narrowing."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import subprocess
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wasibox
from wasibox import Limit, Limits
from wasibox._limits import FUEL_PER_SECOND

from .conftest import PYTHON, child_env

# -- fuel from the timeout (host logic) --------------------------------------------------------


def test_fuel_defaults_to_what_the_timeout_can_burn() -> None:
    assert Limits().fuel == 5 * FUEL_PER_SECOND
    assert Limits(timeout_s=30).fuel == 30 * FUEL_PER_SECOND
    assert Limits(timeout_s=0.25).fuel == FUEL_PER_SECOND // 4
    # Given, it is kept whatever the timeout: fuel alone decides a deterministic budget.
    assert Limits(fuel=1000, timeout_s=30).fuel == 1000


def test_replace_derives_the_fuel_again_unless_it_was_given() -> None:
    assert Limits(timeout_s=30).replace(timeout_s=2).fuel == 2 * FUEL_PER_SECOND
    assert Limits(fuel=1000).replace(timeout_s=2).fuel == 1000
    assert Limits(timeout_s=30).replace(fuel=7).fuel == 7
    with pytest.raises(wasibox.UsageError, match="no field 'fule'"):
        Limits().replace(fule=1)


@given(timeout=st.floats(min_value=1e-3, max_value=1e6), fuel=st.none() | st.integers(1, 2**62))
def test_limits_survive_pickling_and_equal_their_explicit_twin(timeout: float,
                                                                fuel: int | None) -> None:
    limits = Limits(timeout_s=timeout, fuel=fuel)
    copy = pickle.loads(pickle.dumps(limits))  # e.g. to a dask worker
    assert copy == limits and copy.fuel == limits.fuel
    assert copy.fuel_from_timeout == (fuel is None)
    assert Limits(timeout_s=timeout, fuel=limits.fuel) == limits


@pytest.mark.parametrize("fuel", [0, -1, True, 1.5, "many"])
def test_bad_fuel_is_a_usage_error(fuel: Any) -> None:
    with pytest.raises(wasibox.UsageError, match="fuel must be a positive int"):
        Limits(fuel=fuel)


# -- narrowing (host logic) --------------------------------------------------------------------

FIELDS = {
    "fuel": st.integers(1, 10**12),
    "timeout_s": st.floats(0.001, 100),
    "memory_bytes": st.integers(2**20, 2**31),
    "output_bytes": st.integers(1, 2**24),
    "source_bytes": st.integers(1, 2**24),
    "open_files": st.integers(1, 1000),
    "host_calls": st.integers(1, 10**5),
    "host_call_bytes": st.integers(1, 2**26),
    "host_total_bytes": st.integers(1, 2**30),
}


@st.composite
def limits_and_changes(draw: st.DrawFn) -> tuple[Limits, dict[str, Any]]:
    base = {name: draw(strategy) for name, strategy in FIELDS.items()
            if draw(st.booleans())}
    changes = {name: draw(strategy) for name, strategy in FIELDS.items()
               if draw(st.booleans())}
    return Limits(**base), changes


@given(limits_and_changes())
def test_narrow_never_raises_a_limit(case: tuple[Limits, dict[str, Any]]) -> None:
    own, changes = case
    try:
        narrowed = own.narrow(changes)
    except wasibox.UsageError as exc:
        assert "never raise them" in str(exc)
        assert any(value > getattr(own, name) for name, value in changes.items())
        return
    for field in dataclasses.fields(Limits):
        value, ceiling = getattr(narrowed, field.name), getattr(own, field.name)
        assert value <= ceiling, field.name
        if field.name in changes:
            assert value == changes[field.name]
        elif field.name != "fuel" or not own.fuel_from_timeout:
            assert value == ceiling, field.name


@pytest.mark.parametrize(("changes", "needle"), [
    ({"fule": 1}, "no field 'fule'"),
    ({"fuel": 0}, "fuel must be a positive int"),
    ({"memory_bytes": "lots"}, "memory_bytes must be a byte count"),
    (["timeout_s"], "must be a mapping"),
])
def test_narrow_refuses_what_it_cannot_apply(changes: Any, needle: str) -> None:
    with pytest.raises(wasibox.UsageError, match=needle):
        Limits().narrow(changes)


# -- real guests -------------------------------------------------------------------------------


@pytest.mark.guest
def test_a_cpu_bound_run_reaches_its_timeout_not_its_fuel() -> None:
    # The issue's case: only a timeout is given; the loop must be stopped by the timeout.
    with wasibox.Sandbox(Limits(timeout_s=1)) as sb:
        result = sb.run("while True: pass")
    assert result.limit_exceeded == Limit.TIMEOUT
    assert result.fuel_used < FUEL_PER_SECOND


@pytest.mark.guest
def test_fuel_exceeded_says_how_much_and_how_to_raise_it() -> None:
    with wasibox.Sandbox(Limits(fuel=5_000_000)) as sb, \
            pytest.raises(wasibox.LimitExceeded) as caught:
        sb.call("def f():\n    while True: pass", "f")
    message = str(caught.value)
    assert caught.value.limit == Limit.FUEL
    assert "5,000,000 units" in message
    assert all(way in message for way in ("Limits(fuel=...)", "--fuel", "limits.fuel"))


@pytest.mark.guest
def test_the_cli_says_how_much_fuel_was_used_and_how_to_raise_it() -> None:
    done = subprocess.run([PYTHON, "-m", "wasibox", "run", "--fuel", "3000000", "-c",
                           "while True: pass"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 124, done.stderr
    assert "exceeded its fuel limit (its deterministic CPU budget) after using 3,000,000 " \
        "units" in done.stderr
    assert "--fuel" in done.stderr
    # Only a timeout: the loop runs until the timeout, the issue's `--timeout 30` case.
    done = subprocess.run([PYTHON, "-m", "wasibox", "run", "--timeout", "1", "-c",
                           "while True: pass"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 124 and "exceeded its timeout limit" in done.stderr, done.stderr


@pytest.mark.guest
def test_per_run_limits_narrow_one_run_only() -> None:
    loop = "def f(n):\n    while True: n += 1"
    with wasibox.Sandbox(Limits(fuel=50_000_000)) as sb:
        result = sb.run(loop, entry="f", args=[0], limits={"fuel": 1_000_000})
        assert (result.limit_exceeded, result.fuel_used) == (Limit.FUEL, 1_000_000)
        # The next run has the sandbox's own limits again.
        assert sb.run(loop, entry="f", args=[0]).fuel_used == 50_000_000
        with pytest.raises(wasibox.LimitExceeded) as caught:
            sb.call(loop, "f", 0, limits={"fuel": 2_000_000})
        assert caught.value.result is not None and caught.value.result.fuel_used == 2_000_000
        sleep = "import time\ntime.sleep(30)"
        assert sb.run(sleep, limits={"timeout_s": 0.2}).limit_exceeded == Limit.TIMEOUT
        with pytest.raises(wasibox.UsageError, match="source_bytes limit of 4"):
            sb.run("print(1)", limits={"source_bytes": 4})

        async def both() -> tuple[wasibox.RunResult, Any]:
            ran = await sb.arun(loop, entry="f", args=[0], limits={"fuel": 3_000_000})
            try:
                await sb.acall(loop, "f", 0, limits={"fuel": 4_000_000})
            except wasibox.LimitExceeded as exc:
                return ran, exc.result
            raise AssertionError("the call was not stopped")

        ran, called = asyncio.run(both())
        assert (ran.fuel_used, called.fuel_used) == (3_000_000, 4_000_000)
        assert sb.start(loop, entry="f", args=[0],
                        limits={"fuel": 5_000_000}).result().fuel_used == 5_000_000


@pytest.mark.guest
@pytest.mark.parametrize("changes", [{"fuel": 50_000_001}, {"timeout_s": 6},
                                     {"memory_bytes": "1GiB"}])
def test_per_run_limits_never_widen(changes: dict[str, Any]) -> None:
    with wasibox.Sandbox(Limits(fuel=50_000_000)) as sb:
        for attempt in (lambda: sb.run("pass", limits=changes),
                        lambda: sb.call("def f(): pass", "f", limits=changes),
                        lambda: sb.start("pass", limits=changes)):
            with pytest.raises(wasibox.UsageError, match="a run may lower its limits, never "
                                                         "raise them"):
                attempt()
        assert sb.run("print('still fine')").stdout == "still fine\n"
