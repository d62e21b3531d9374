"""How the wasm backend classifies an engine error: from Wasmtime's own signals only.

Each case hands ``classify`` an error worded exactly as Wasmtime words a trap in a component
call (the real engine's store; only the error's text is chosen here), so the rules can be
checked for traps a Python program cannot provoke on demand, such as an allocation failure
inside the component's Rust glue.
"""

from __future__ import annotations

import time

import pytest
import wasmtime

from wasibox import Limit
from wasibox.backends.wasm.run import Run
from wasibox.backends.wasm.runtime import PRIMING_JOB, runtime
from wasibox.backends.wasm.traps import classify

pytestmark = pytest.mark.guest


def _error(description: str, *frames: str) -> wasmtime.WasmtimeError:
    trace = "".join(f"   {i}: 0x1d4bc93 - {frame}\n" for i, frame in enumerate(frames))
    return wasmtime.WasmtimeError("error while executing at wasm backtrace:\n" + trace
                                  + f"\nCaused by:\n    wasm trap: {description}\n")


def _classify(error: wasmtime.WasmtimeError) -> Run:
    store = wasmtime.Store(runtime().engine)
    store.set_fuel(1000)  # fuel left: only the trap can say it ran out
    run = Run(PRIMING_JOB, store)
    run.deadline = time.monotonic() + 60
    assert classify(run, store, error) is None
    return run


def test_an_allocation_failure_in_the_glue_is_the_memory_limit() -> None:
    run = _classify(_error("wasm `unreachable` instruction executed",
                           "componentize_py_runtime.wasm!__rust_alloc_error_handler",
                           "componentize_py_runtime.wasm!alloc::alloc::handle_alloc_error"))
    assert (run.limit, run.fault) == (Limit.MEMORY, None)


def test_other_unreachable_traps_are_faults_naming_the_kind_and_frame() -> None:
    run = _classify(_error("wasm `unreachable` instruction executed", "libc.so!abort",
                           "libpython3.14.so!os_abort"))
    assert run.limit is None and run.fault is not None
    assert run.fault.message == "the guest trapped: unreachable in libc.so!abort"


def test_stack_exhaustion_is_a_recursion_error_saying_stack_overflow() -> None:
    run = _classify(_error("call stack exhausted", "libpython3.14.so!list_repr"))
    assert run.fault is not None and run.fault.type == "RecursionError"
    assert run.fault.message.startswith("stack overflow")


def test_the_engines_fuel_trap_is_the_fuel_limit() -> None:
    assert _classify(_error("all fuel consumed by WebAssembly")).limit is Limit.FUEL


def test_an_out_of_bounds_access_is_named() -> None:
    run = _classify(_error("out of bounds memory access", "libpython3.14.so!PyObject_Repr"))
    assert run.fault is not None
    assert run.fault.message == ("the guest trapped: out-of-bounds memory access in "
                                 "libpython3.14.so!PyObject_Repr")
