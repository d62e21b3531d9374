"""Exit statuses: a run reports the status a Linux parent sees from a native CPython.

The reference is this machine's own CPython, run as a real subprocess for every case, so the
table states no expected numbers: each is measured. The same table runs on the wasm guest and
on the microVM (whose job loop is a separate copy of the runner's).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import Limits

#: Programs that end with a status: every shape CPython's SystemExit handling and os._exit's
#: C int conversion distinguish (fits a byte, wraps, fits a C int, fits a long long, does
#: not, not an int at all).
CASES = [
    "sys.exit(0)", "sys.exit(3)", "sys.exit(255)", "sys.exit(256)", "sys.exit(257)",
    "sys.exit(-1)", "sys.exit(-256)", "sys.exit(2**31 - 1)", "sys.exit(2**31)",
    "sys.exit(2**32 + 3)", "sys.exit(2**40)", "sys.exit(-2**40)", "sys.exit(2**63 - 1)",
    "sys.exit(2**63)", "sys.exit(2**70)", "sys.exit(-2**70)", "sys.exit(True)",
    "sys.exit(None)", "sys.exit()", "sys.exit('message')", "sys.exit(3.5)",
    "raise SystemExit(1, 2)", "raise SystemExit", "sys.exit(type('I', (int,), {})(300))",
    "os._exit(0)", "os._exit(7)", "os._exit(256)", "os._exit(257)", "os._exit(-1)",
    "os._exit(2**31 - 1)", "os._exit(2**31)", "os._exit(2**40)", "os._exit(True)",
    "os._exit(3.0)", "os._exit('1')",
]


def _program(case: str) -> str:
    return f"import os, sys\n{case}\n"


def _host_status(case: str) -> int:
    done = subprocess.run([sys.executable, "-c", _program(case)], capture_output=True,
                          timeout=60, check=False)
    return done.returncode


@pytest.fixture(scope="module")
def reference() -> dict[str, int]:
    return {case: _host_status(case) for case in CASES}


def _check(sandbox: wasibox.Sandbox, reference: dict[str, int]) -> None:
    mismatches = {}
    for case in CASES:
        result = sandbox.run(_program(case))
        if result.exit_code != reference[case]:
            mismatches[case] = (result.exit_code, reference[case])
        assert result.limit_exceeded is None, case
    assert mismatches == {}, "case: (sandbox, native CPython)"


@pytest.mark.guest
def test_exit_statuses_match_native_cpython_on_wasm(reference: dict[str, int]) -> None:
    with wasibox.Sandbox(backend="wasm") as sandbox:
        _check(sandbox, reference)


@pytest.mark.guest
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status=st.integers() | st.integers(-2**70, 2**70) | st.integers(-300, 300),
       how=st.sampled_from(["sys.exit({})", "os._exit({})", "raise SystemExit({})"]))
def test_any_int_status_matches_native_cpython(sandbox: wasibox.Sandbox, status: int,
                                               how: str) -> None:
    case = how.format(status)
    assert sandbox.run(_program(case)).exit_code == _host_status(case), case


@pytest.mark.guest
def test_a_non_int_exit_code_is_printed_as_cpython_does(sandbox: wasibox.Sandbox) -> None:
    result = sandbox.run(_program("sys.exit('bye')"))
    assert (result.exit_code, result.stderr, result.ok) == (1, "bye\n", False)


@pytest.fixture(scope="module")
def vm() -> Iterator[wasibox.Sandbox]:
    from wasibox.backends.microvm.image import cached_image_state

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("QEMU is not installed (apt-get install qemu-system-x86)")
    if not cached_image_state().startswith("built"):
        pytest.skip("the microVM image is not built (wasibox microvm build)")
    with wasibox.Sandbox(Limits(timeout_s=60.0, fuel=60 * 10**9), backend="microvm",
                         allow_emulation=True) as sandbox:
        yield sandbox


@pytest.mark.microvm
def test_exit_statuses_match_native_cpython_on_the_microvm(
        vm: wasibox.Sandbox, reference: dict[str, int]) -> None:
    _check(vm, reference)
