"""What a run produced: ``RunResult``, built by the same code for every backend."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ._events import CapabilityEvent
from ._limits import Limit
from ._wire import ProtocolError, decode_reply, max_elements

if TYPE_CHECKING:
    from ._files import FileRecord, RefusedFile

__all__ = ["GuestException", "Outcome", "RunResult", "build_result"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuestException:
    """An exception raised by guest code, as the guest saw it (no host frames or paths)."""

    type: str
    message: str
    traceback: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """Everything one run produced.

    ``ok`` is True iff the run exited 0, raised nothing and exceeded no limit.
    """

    ok: bool
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: GuestException | None
    limit_exceeded: Limit | None
    fuel_used: int
    memory_peak_bytes: int
    duration_s: float
    backend: str
    #: The entry function's return value, for ``call``; None for ``run``.
    value: Any = None
    #: Files the run wrote under writable mounts, as published (only when ``ok``).
    files: list[FileRecord] = dataclasses.field(default_factory=list)
    #: Entries of the run's staging that were not published (symlinks, FIFOs, devices,
    #: hard links), with the reason; see wasibox.Mount.
    files_refused: list[RefusedFile] = dataclasses.field(default_factory=list)
    #: Every decision a capability made during the run (host calls, HTTP), in order.
    capability_log: tuple[CapabilityEvent, ...] = ()
    #: What isolated the guest: "wasm" (Wasmtime), or for the microVM "kvm" (hardware
    #: virtualization) or "tcg" (QEMU's software emulation, not a security boundary).
    isolation: str = "wasm"

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON-compatible data (``value`` included as is)."""
        data = dataclasses.asdict(self)
        data["limit_exceeded"] = self.limit_exceeded.value if self.limit_exceeded else None
        return data


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """What a backend observed while running one job; ``build_result`` turns it into a result.

    Everything here is measured by the host, except ``reply``, the guest's own (untrusted)
    account of how its code ended, still encoded.
    """

    reply: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    limit_exceeded: Limit | None = None
    #: A fault the guest caused that is not a limit (a trap, an os._exit), described for it.
    fault: GuestException | None = None
    #: The status passed to os._exit, when the guest ended that way.
    exit_code: int | None = None
    fuel_used: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    duration_s: float = 0.0
    #: Every decision a capability made during the run, in order.
    capability_log: tuple[CapabilityEvent, ...] = ()
    isolation: str = "wasm"


def build_result(outcome: Outcome, backend: str, reply_limit: int) -> RunResult:
    """Combine a backend's measurements with the guest's decoded reply."""
    exit_code = outcome.exit_code
    error = outcome.fault
    value = None
    limit = outcome.limit_exceeded
    memory_peak = outcome.memory_peak_bytes
    if outcome.reply is not None and limit is None:
        try:
            reply = decode_reply(outcome.reply, reply_limit,
                                 max_elements(outcome.memory_limit_bytes))
        except ProtocolError as exc:
            error = GuestException(type="ProtocolError", message=str(exc), traceback="")
            exit_code = 1
        else:
            exit_code = reply.exit_code if exit_code is None else exit_code
            value = reply.value
            if reply.error is not None:
                error = GuestException(**reply.error)
            memory_peak = max(memory_peak, min(reply.heap_top, outcome.memory_limit_bytes))
            if (reply.memory_error and error is not None and error.type == "MemoryError"
                    and not error.message):
                # The allocation that failed was the one that would have crossed the cap.
                # (An allocator failure raises a bare MemoryError; one with a message, such
                # as the parser's "too complex to parse", is a guest error, not the cap.)
                limit = Limit.MEMORY
                memory_peak = max(memory_peak, outcome.memory_limit_bytes)
    if limit is Limit.MEMORY:
        memory_peak = max(memory_peak, outcome.memory_limit_bytes)
    if exit_code is None:
        exit_code = 1 if (limit is not None or error is not None) else 0
    return RunResult(
        ok=exit_code == 0 and error is None and limit is None,
        exit_code=exit_code,
        stdout=outcome.stdout.decode("utf-8", errors="replace"),
        stderr=outcome.stderr.decode("utf-8", errors="replace"),
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        error=error,
        limit_exceeded=limit,
        fuel_used=outcome.fuel_used,
        memory_peak_bytes=memory_peak,
        duration_s=outcome.duration_s,
        backend=backend,
        value=value,
        capability_log=outcome.capability_log,
        isolation=outcome.isolation,
    )
