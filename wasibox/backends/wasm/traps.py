"""Wasmtime's errors turned into wasibox results, in one place (``classify``).

The decision uses only what the host and the engine know (a limit a host function enforced,
the fuel left, the deadline, the trap Wasmtime describes), never what the guest printed.
"""

from __future__ import annotations

import re
import time

import wasmtime

from ..._limits import Limit
from ..._result import GuestException
from .run import Run

__all__ = ["TRAP_KINDS", "classify", "trap_kind"]

#: Wasmtime's description of a trap (the last line of its error, after "wasm trap: "), by
#: the kind wasibox reports. For a component call this text is the only form the trap code
#: takes: wasmtime-py 50 gives component errors as a plain WasmtimeError, with no Trap object
#: and so no ``trap_code``. Wasmtime writes it, never the guest.
TRAP_KINDS = {
    "call stack exhausted": "stack overflow",
    "out of bounds memory access": "out-of-bounds memory access",
    "wasm `unreachable` instruction executed": "unreachable",
    "undefined element: out of bounds table access": "out-of-bounds table access",
    "uninitialized element": "uninitialized table element",
    "indirect call type mismatch": "indirect call type mismatch",
    "integer overflow": "integer overflow",
    "integer divide by zero": "integer division by zero",
    "invalid conversion to integer": "invalid conversion to integer",
    "all fuel consumed by WebAssembly": "out of fuel",
    "interrupt": "interrupt",
}
#: Frames (in Wasmtime's backtrace of the trap) that only an allocation the guest could not
#: get reaches: an `unreachable` under one of them is the memory limit, not a fault.
_OUT_OF_MEMORY_FRAMES = ("handle_alloc_error", "alloc_error_handler", "rust_oom")
_FRAME = re.compile(r"^\s*\d+: (?:0x[0-9a-f]+ - )?(.+)$")


def trap_kind(message: str) -> tuple[str | None, tuple[str, ...]]:
    """The trap kind of a Wasmtime error's message (a ``TRAP_KINDS`` value, or None if it is
    not a trap Wasmtime describes) and the function names of its wasm backtrace."""
    head, _, cause = message.partition("\nCaused by:")
    lines = [line.strip() for line in cause.strip().splitlines()] if cause else []
    last = lines[-1] if lines else message.strip().rpartition("\n")[2].strip()
    description = last.removeprefix("wasm trap: ")
    kind = TRAP_KINDS.get(description)
    frames = tuple(match.group(1) for line in head.splitlines()
                   if (match := _FRAME.match(line)))
    return kind, frames


def classify(run: Run, store: wasmtime.Store, exc: Exception) -> int | None:
    """Turn a wasmtime error into the run's limit or fault; return an exit status if any.

    The single choke point where wasmtime's exceptions become wasibox's vocabulary. It
    decides from what the host and the engine know (a limit a host function enforced, the
    fuel left, the deadline, the trap Wasmtime reports), never from what the guest printed:
    a guest's output must not change how its run is classified.
    """
    if run.limit is not None:
        return None
    if run.exit_code is not None:
        return run.exit_code
    code = getattr(exc, "code", None)
    if isinstance(code, int):  # WASI exit (ok or error): the guest runner uses process.exit
        return code & 0xFF
    kind, frames = trap_kind(str(exc))
    try:
        out_of_fuel = store.get_fuel() == 0
    except wasmtime.WasmtimeError:
        out_of_fuel = True
    if out_of_fuel or kind == "out of fuel":
        run.limit = Limit.FUEL
    elif kind == "interrupt" or time.monotonic() >= run.deadline:
        run.limit = Limit.TIMEOUT
    elif run.fault is not None:
        pass  # a host function refused the guest and said why
    elif kind == "unreachable" and any(marker in frame for frame in frames
                                        for marker in _OUT_OF_MEMORY_FRAMES):
        run.limit = Limit.MEMORY  # an allocation failed where the guest could not raise
    elif kind == "stack overflow":
        run.fault = GuestException(
            type="RecursionError",
            message="stack overflow: maximum recursion depth exceeded "
                    "(the guest's WebAssembly stack is exhausted)",
            traceback="")
    else:
        where = f" in {frames[0]}" if frames else ""
        run.fault = GuestException(
            type="Trap", message=f"the guest trapped: {kind or 'unknown trap'}{where}",
            traceback="")
    return None
