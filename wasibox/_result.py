"""What a run produced: ``RunResult``, built by the same code for every backend."""

from __future__ import annotations

import dataclasses
import html
from typing import TYPE_CHECKING, Any

from ._events import CapabilityEvent
from ._limits import Limit
from ._wire import ProtocolError, decode_reply

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

    @property
    def _status(self) -> str:
        """One line: ``ok``, the limit exceeded, the guest's exception or its exit status."""
        if self.limit_exceeded is not None:
            return f"exceeded its {self.limit_exceeded.value} limit"
        if self.error is not None:
            return _clip(f"{self.error.type}: {self.error.message}", 120)
        return "ok" if self.ok else f"exited with status {self.exit_code}"

    def __repr__(self) -> str:
        """A short summary; every field is an attribute (``to_dict()`` gives them all)."""
        parts = [self._status, f"fuel_used={self.fuel_used:,}",
                 f"duration_s={self.duration_s:.4f}"]
        for name in ("stdout", "stderr"):
            text = getattr(self, name)
            if text:
                parts.append(f"{name}={_clip(text, 40)!r}")
        if self.value is not None:
            parts.append(f"value={_clip(repr(self.value), 60)}")
        if self.files:
            parts.append(f"files={len(self.files)}")
        return f"<RunResult {' '.join(parts)}>"

    def _repr_html_(self) -> str:
        """A small table for Jupyter; guest text is escaped and clipped to 2,000 characters."""
        rows = [("status", self._status), ("exit code", str(self.exit_code)),
                ("fuel used", f"{self.fuel_used:,}"),
                ("memory peak", f"{self.memory_peak_bytes / 2**20:,.1f} MiB"),
                ("duration", f"{self.duration_s * 1000:,.1f} ms"),
                ("backend", f"{self.backend} ({self.isolation})")]
        for name in ("stdout", "stderr"):
            text = getattr(self, name)
            if text:
                truncated = " (truncated by the output limit)" \
                    if getattr(self, f"{name}_truncated") else ""
                rows.append((name + truncated, _clip(text, 2000)))
        if self.value is not None:
            rows.append(("value", _clip(repr(self.value), 2000)))
        if self.files:
            rows.append(("files", "\n".join(f"{f.path} ({f.size:,} bytes)"
                                             for f in self.files[:20])))
        body = "".join(f"<tr><th style=\"text-align:left\">{html.escape(name)}</th>"
                       f"<td style=\"text-align:left\"><pre style=\"margin:0\">"
                       f"{html.escape(value)}</pre></td></tr>" for name, value in rows)
        return f"<table>{body}</table>"


def _clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


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
            reply = decode_reply(outcome.reply, reply_limit)
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
