"""A plain run's RunResult, made in C (``native.run_plain``), against ``build_result``.

A plain run's RunResult is made without its Outcome when the guest gave the plain reply and
no fault, limit or Python host function was involved (``PlainRuns``); it must be the
RunResult ``build_result`` makes of that Outcome, field for field, for any output bytes
(invalid UTF-8 included), exit status, heap top and limits.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wasibox import RunResult
from wasibox._result import Outcome, build_result
from wasibox.backends.wasm.run import plain_config
from wasibox.backends.wasm.runtime import runtime

pytestmark = pytest.mark.guest  # the extension comes with the runtime, which builds one

REPLY_LIMIT = 2**20
U64 = 2**64 - 1


@given(exit_code=st.integers(0, 255), memory_error=st.booleans(),
       heap_top=st.integers(0, U64), stdout=st.binary(max_size=64),
       stderr=st.binary(max_size=64), stdout_cut=st.booleans(), stderr_cut=st.booleans(),
       fuel=st.integers(0, 10**12), fuel_left=st.integers(0, 10**12),
       floor=st.integers(0, 2**32), memory_limit=st.integers(0, 2**32),
       duration=st.floats(0, 10), packages=st.lists(st.text(max_size=8), max_size=2).map(tuple))
def test_a_plain_result_is_what_build_result_makes_of_its_outcome(
        exit_code: int, memory_error: bool, heap_top: int, stdout: bytes, stderr: bytes,
        stdout_cut: bool, stderr_cut: bool, fuel: int, fuel_left: int, floor: int,
        memory_limit: int, duration: float, packages: tuple[str, ...]) -> None:
    rt = runtime()
    native = rt.native.module
    if native is None:
        pytest.skip(f"the native extension is unavailable: {rt.native.reason}")
    reply = (f'{{"exit_code":{exit_code},"memory_error":{str(memory_error).lower()},'
             f'"heap_top":{heap_top}}}')
    outcome = Outcome(reply=reply, plain_reply=(exit_code, memory_error, heap_top),
                      stdout=stdout, stderr=stderr, stdout_truncated=stdout_cut,
                      stderr_truncated=stderr_cut, fuel_used=fuel - fuel_left,
                      memory_peak_bytes=floor, memory_limit_bytes=memory_limit,
                      duration_s=duration)
    expected = build_result(outcome, "wasm", REPLY_LIMIT, packages=packages)
    state = native.Run(fuel=fuel, output_bytes=1, memory_bytes=1, timeout_ns=1, real_clock=False,
                       seed_words=None)
    config = plain_config(state, rt.ticker, lambda *args: None, fuel=fuel, memory_floor=floor,
                          memory_limit=memory_limit, timeout_s=1.0, backend="wasm",
                          packages=packages)
    made = native.plain_result(config, exit_code, heap_top, stdout, stderr, stdout_cut,
                               stderr_cut, fuel_left, duration)
    assert type(made) is RunResult
    assert vars(made) == vars(expected)
    assert list(vars(made)) == [field.name for field in dataclasses.fields(RunResult)]
    assert made == RunResult(**{field.name: getattr(made, field.name)
                                for field in dataclasses.fields(RunResult)})
