"""One run's host-side state, and the call into the guest.

A ``Run`` holds what the host decides for one call into an instance: its output under the
output cap, its clocks (virtual unless the policy grants the real ones), its entropy (seeded
unless the policy grants the host's), its host-call channel and the limit or fault that ended
it. ``NativeRun`` is the same for the native run path, where output, clocks and entropy live
in C. ``taped`` passes every value handed to the guest through the run's journal tape, and
checks what a replayed journal serves before the guest sees it. ``call_guest`` makes the call
with the run bound to the calling thread (``current``) and to the store's C-level output.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import random
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import component as cm

from ..._errors import JournalError, UsageError
from ..._events import CapabilityEvent
from ..._limits import Limit
from ..._result import GuestException, RunResult
from ...capabilities.hostcall import HostCalls, StopRun
from ...capabilities.http import HttpGate
from ..base import Job

__all__ = ["MAX_ENTROPY_CALL_BYTES", "VIRTUAL_EPOCH_S", "NativeRun", "NativeTrap", "OutputSlot",
           "Run", "address_of", "adopted_run", "c_output", "call_guest", "current",
           "GuestStore", "native_state", "plain_config", "taped"]

#: Where the virtual wall clock starts: 2024-01-01T00:00:00Z.
VIRTUAL_EPOCH_S = 1_704_067_200
#: The largest entropy request served in one host call. The guest runner asks for 1 MiB at
#: a time; a bigger request is a guest calling the import itself, and would make the host
#: allocate (and the host's lowering copy, several times) up to the guest's memory cap.
MAX_ENTROPY_CALL_BYTES = 1 << 20
_U64_MAX = 2**64 - 1
_MAX_TIMEOUT_NS = 2**62  # ~146 years; keeps the C deadline from overflowing
current = threading.local()


#: Guards the making of a run's ``cancel`` Event (see ``Run.cancel``).
_CANCEL_EVENT_LOCK = threading.Lock()


class Run:
    """Per-run state. Only the thread running the guest touches it, through ``current``."""

    __slots__ = ("job", "store", "limit", "stdout", "stderr", "stdout_truncated",
                 "stderr_truncated", "output_room", "deadline", "_cancel", "slept_ns", "rng",
                 "fault", "exit_code", "started", "log", "host_calls", "cancelled",
                 "clock_base_ns")
    #: Whether Python serves this run's entropy (seeded by ``rng``); the native path's is C's.
    python_entropy = True

    def __init__(self, job: Job, store: wasmtime.Store) -> None:
        self.job = job
        self.store = store
        self.limit: Limit | None = None
        self.fault: GuestException | None = None
        self.exit_code: int | None = None
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.stdout_truncated = False
        self.stderr_truncated = False
        self.output_room = job.limits.output_bytes
        self.deadline = math.inf
        self._cancel: threading.Event | None = None
        #: Set (with ``cancel``) by ``interrupt``, from any thread, when the caller cancels.
        self.cancelled = False
        self.slept_ns = 0
        #: Virtual time that passed before this run: a session's earlier calls, so that its
        #: clocks never go back from one call to the next.
        self.clock_base_ns = 0
        self.started = False
        policy = job.policy
        self.rng = (random.Random(policy.seed)
                    if policy.entropy == "seeded" and self.python_entropy else None)
        #: The run's capability log, shared by every capability.
        self.log: list[CapabilityEvent] = []
        self.host_calls: HostCalls | None = None

    @property
    def cancel(self) -> threading.Event:
        """Set when the run is cancelled: host waits (a real sleep, a host function) end on it.

        Made on first use, as few runs wait in the host: an Event per run was a measurable
        share of a warm run's host CPU. Made under a lock, and set at once if ``interrupt``
        came first, so a waiter and ``interrupt`` on another thread always share one Event.
        """
        if self._cancel is None:
            with _CANCEL_EVENT_LOCK:
                if self._cancel is None:
                    event = threading.Event()
                    if self.cancelled:
                        event.set()
                    self._cancel = event
        return self._cancel

    # -- output ---------------------------------------------------------------------------
    def append(self, fd: int, data: bytes) -> bool:
        """Keep what fits under the output cap; return False once the cap is exceeded."""
        sink = self.stderr if fd == 2 else self.stdout
        if len(data) <= self.output_room:
            sink += data
            self.output_room -= len(data)
            return True
        sink += data[: self.output_room]
        self.output_room = 0
        if fd == 2:
            self.stderr_truncated = True
        else:
            self.stdout_truncated = True
        self.limit = self.limit or Limit.OUTPUT
        return False

    # -- time -----------------------------------------------------------------------------
    def fuel_used(self, context: Any) -> int:
        remaining = ctypes.c_uint64(0)
        if ffi.wasmtime_context_get_fuel(context, ctypes.byref(remaining)):
            return self.job.limits.fuel
        return self.job.limits.fuel - remaining.value

    def virtual_ns(self, context: Any) -> int:
        """Virtual time: one nanosecond per unit of fuel burnt, plus the time slept."""
        return self.fuel_used(context) + self.slept_ns

    def monotonic_ns(self, context: Any) -> int:
        if self.job.policy.clock == "real":
            now: int = taped(self, "clock.monotonic", (), time.monotonic_ns)
            return now
        return self.clock_base_ns + self.virtual_ns(context)

    def wall_ns(self, context: Any) -> int:
        if self.job.policy.clock == "real":
            now: int = taped(self, "clock.wall", (), time.time_ns)
            return now
        return VIRTUAL_EPOCH_S * 10**9 + self.clock_base_ns + self.virtual_ns(context)

    def wait(self, context: Any, ns: int) -> None:
        """Block for ``ns`` of guest time, or trap with a timeout at the deadline."""
        if self.job.policy.clock == "real":
            # Journaled, so that a replay neither waits nor ends the run elsewhere.
            taped(self, "clock.wait", (ns,), lambda: self._wait_real(ns))
            return
        self.slept_ns += ns
        if self.virtual_ns(context) > self.job.limits.timeout_s * 1e9:
            self.stop(Limit.TIMEOUT)

    def _wait_real(self, ns: int) -> None:
        """Wait ``ns`` of real time, cut short (and the run stopped) by the deadline or a
        cancel."""
        remaining = self.deadline - time.monotonic()
        if ns / 1e9 >= remaining:
            self.cancel.wait(max(remaining, 0.0))
            self.stop(Limit.CANCELLED if self.cancelled else Limit.TIMEOUT)
        if self.cancel.wait(ns / 1e9) and self.cancelled:
            self.stop(Limit.CANCELLED)

    def would_block_past_deadline(self, context: Any, ns: int) -> bool:
        if self.job.policy.clock == "real":
            return ns / 1e9 >= self.deadline - time.monotonic()
        return self.virtual_ns(context) + ns > self.job.limits.timeout_s * 1e9

    # -- entropy --------------------------------------------------------------------------
    def random_bytes(self, size: int) -> bytes:
        if size > self.job.limits.memory_bytes:
            # More than the guest could hold: refuse before the host allocates it.
            self.stop(Limit.MEMORY)
        if size > MAX_ENTROPY_CALL_BYTES:
            self.fault = GuestException(
                type="OSError", traceback="",
                message=f"an entropy request is limited to {MAX_ENTROPY_CALL_BYTES} bytes")
            raise wasmtime.WasmtimeError("wasibox: oversized entropy request refused")
        if self.rng:
            return self.rng.randbytes(size)
        text: str = taped(self, "entropy.bytes", (size,),
                           lambda: os.urandom(size).decode("latin-1"))
        return text.encode("latin-1")

    def random_u64(self) -> int:
        if self.rng:
            return self.rng.getrandbits(64)
        value: int = taped(self, "entropy.u64", (),
                            lambda: int.from_bytes(os.urandom(8), "little"))
        return value

    # -- host functions and HTTP ---------------------------------------------------------
    def host_call(self, name: str, payload: str) -> cm.Variant:
        """One call through the host channel (guest/wit/host.wit)."""
        if self.host_calls is None:
            policy = self.job.policy
            self.host_calls = HostCalls(
                functions=policy.functions, limits=self.job.limits,
                http=HttpGate(policy.http) if policy.http is not None else None,
                cancel=self.cancel, log=self.log)
        calls = self.host_calls

        def answer() -> list[Any]:
            try:
                reply = calls.handle(name, payload, self.deadline)
            except StopRun as stop:  # a host function's wait is cut short by a cancel too
                self.stop(Limit.CANCELLED if self.cancelled else stop.limit)
            return ["ok" if reply.ok else "err", reply.payload]

        tag, reply_payload = taped(self, "host.call", (name, payload), answer)
        return cm.Variant(tag, reply_payload)

    # -- stopping -------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Cancel the run from any thread: wake any host wait; the guest traps within a tick."""
        self.cancelled = True
        self.cancel.set()

    def stop(self, limit: Limit) -> None:
        """End the run now: record why, then trap out of the guest."""
        self.limit = self.limit or limit
        raise wasmtime.WasmtimeError(f"wasibox: {limit.value} limit exceeded")


class NativeRun(Run):
    """A run on the native path: its output, clocks and entropy live in C (``native``);
    what Python still serves (files, host functions, HTTP) uses the fields of ``Run``."""

    __slots__ = ("module", "native")
    python_entropy = False  # the seeded generator lives in C: no Python Random to make

    def __init__(self, job: Job, store: wasmtime.Store, native: ModuleType,
                 state: Any = None) -> None:
        """``state``: the C side, when it was made first (a plain run's); by default, one is
        made from ``job``."""
        super().__init__(job, store)
        self.module = native
        self.native = state if state is not None else native_state(native, job)

    def append(self, fd: int, data: bytes) -> bool:
        fits: bool = self.native.append(fd, data)
        return fits

    def interrupt(self) -> None:
        super().interrupt()
        self.native.interrupt()

    def collect(self) -> None:
        """Take what the C side recorded; the first limit and fault recorded win."""
        (self.stdout, self.stderr, self.stdout_truncated, self.stderr_truncated, limit,
         fault, exit_code) = self.native.outcome()
        if limit is not None:
            self.limit = self.limit or Limit(limit)
        if fault is not None:
            self.fault = self.fault or GuestException(type=fault[0], message=fault[1],
                                                      traceback="")
        if exit_code is not None:
            self.exit_code = exit_code


def native_state(native: ModuleType, job: Job) -> Any:
    """A new C-side run state (``native.Run``) for ``job``'s limits and policy."""
    limits, policy = job.limits, job.policy
    # C takes unsigned 64-bit values; clamping changes nothing a run can reach.
    return native.Run(
        fuel=min(limits.fuel, _U64_MAX), output_bytes=min(limits.output_bytes, _U64_MAX),
        memory_bytes=min(limits.memory_bytes, _U64_MAX),
        timeout_ns=min(int(limits.timeout_s * 1e9), _MAX_TIMEOUT_NS),
        real_clock=policy.clock == "real",
        seed_words=_seed_words(policy.seed) if policy.entropy == "seeded" else None)


class NativeTrap(wasmtime.WasmtimeError):
    """A trap of the native path, shaped as wasmtime-py raises one (``code``: WASI exit)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code  # what classify reads from wasmtime-py's ExitTrap


def _seed_words(seed: int) -> bytes:
    """|seed| as little-endian 32-bit words, as ``random.Random(seed)`` keys its generator."""
    magnitude = abs(seed)
    return magnitude.to_bytes(max(1, (magnitude.bit_length() + 31) // 32) * 4, "little")


def address_of(pointer: Any) -> int:
    address: int | None = ctypes.cast(pointer, ctypes.c_void_p).value
    if address is None:
        raise UsageError("a null Wasmtime pointer")
    return address


def taped(run: Run, kind: str, args: tuple[Any, ...], produce: Callable[[], Any]) -> Any:
    """``produce()``: a value handed to the guest, through the run's journal tape if any.

    Recording, the value (or the limit that ``produce`` stopped the run with) is taped; on a
    replay the taped answer is served and ``produce`` never runs, so the host is not asked,
    except that a restored session performs its file operations again (``redo_files``).
    A replay whose guest asks for something else than the journal holds traps, with a
    ``ReplayDiverged`` fault saying where.
    """
    tape = run.job.tape
    if tape is None:
        return produce()
    if tape.replaying:
        try:
            status, value = tape.serve(kind, args)
            if status == "ok" and not _servable(kind, value):
                # Checked here: a value wasmtime-py cannot lower would fail inside its
                # trampoline, whose error is parked in a process-global (see _host).
                tape.refuse(kind, value)
            if tape.redo_files and kind.startswith("files.") and status == "ok":
                tape.check_redone(kind, value, produce())
        except JournalError as exc:
            run.fault = run.fault or GuestException(type="ReplayDiverged", message=str(exc),
                                                    traceback="")
            raise wasmtime.WasmtimeError("wasibox: the replay left its journal") from None
        if status == "stop":
            run.stop(value)
        return value
    try:
        value = produce()
    except wasmtime.WasmtimeError:
        if run.limit is not None:
            tape.record(kind, args, "stop", run.limit.value)
        raise
    tape.record(kind, args, "ok", value)
    return value


#: The WIT error-code names of the files interface (capabilities/files/files.wit).
_FILE_ERRORS = frozenset({
    "noent", "exist", "notdir", "isdir", "notempty", "loop", "acces", "perm", "rofs", "xdev",
    "inval", "badf", "mfile", "nospc", "dquot", "nametoolong", "io", "nxio", "fbig"})
#: What each files operation answers when it succeeds: a descriptor or a count (int), text
#: (str), or nothing.
_FILE_RESULTS: dict[str, type] = {
    "open": int, "dup": int, "write": int, "pwrite": int, "seek": int,
    "read": str, "pread": str, "fstat": str, "stat": str, "readdir": str, "readlink": str}


def _servable(kind: str, value: Any) -> bool:
    """Whether a journal's ``value`` is what the boundary call ``kind`` hands the guest."""
    def word(number: Any) -> bool:
        return type(number) is int and 0 <= number <= _U64_MAX

    if kind in ("clock.monotonic", "clock.wall", "entropy.u64"):
        return word(value)
    if kind == "clock.wait":
        return value is None
    if kind == "entropy.bytes":
        return type(value) is str and all(ord(char) <= 0xFF for char in value)
    if not (type(value) is list and len(value) == 2 and value[0] in ("ok", "err")):
        return False
    tag, payload = value
    if kind == "host.call":
        return type(payload) is str
    method = kind.removeprefix("files.")
    if tag == "err":
        return payload in _FILE_ERRORS
    wanted = _FILE_RESULTS.get(method)
    if wanted is int:
        return word(payload) and (method not in ("open", "dup", "write", "pwrite")
                                  or payload <= 0xFFFFFFFF)
    return payload is None if wanted is None else type(payload) is wanted


class OutputSlot:
    """The run a store's C-level output belongs to. Wasmtime calls the WASI stdout/stderr
    callbacks on its own worker threads, where the thread-local ``current`` is unset."""

    __slots__ = ("run", "__weakref__")

    def __init__(self) -> None:
        #: A ``Run``, or a plain run's ``native.Run``: either keeps output under the cap.
        self.run: Run | Any = None


class GuestStore(wasmtime.Store):
    """A store of the guest, with what its calls need at hand: its output slot (set by
    ``call_guest`` and ``native.run_plain`` for the duration of a call) and, once its instance is
    made, the addresses the native path calls with. Looking these up per run (a weak
    dictionary, two ctypes casts) was a measurable share of a paced warm run's host time."""

    def __init__(self, engine: wasmtime.Engine) -> None:
        super().__init__(engine)
        self.output = OutputSlot()
        #: (its ``execute`` function, its context, the store), as C pointers.
        self.addresses: tuple[int, int, int] | None = None

    def bind(self, execute: Any) -> None:
        """Record the addresses of ``execute`` (this store's instance's) and the store."""
        self.addresses = (ctypes.addressof(execute._func), address_of(self._context()),
                          address_of(self.ptr()))


def c_output(fd: int, slot: OutputSlot) -> Any:
    """Output written by C code in the guest (not through sys.stdout), into the same sink."""

    def sink(data: bytes) -> int:
        run = slot.run
        if run is not None:
            run.append(fd, data)  # past the cap, the run's limit is already recorded
        return len(data)

    return sink


def adopted_run() -> Run | None:
    """The Python side of a plain run whose guest call this thread is making, made now (see
    ``native.run_plain``), or None outside a plain run."""
    adopt: Callable[[], Run] | None = getattr(current, "adopt", None)
    if adopt is None:
        return None
    run = current.run = adopt()
    return run


def plain_config(state: Any, ticker: Any, adopt: Callable[..., Run], *, fuel: int,
                 memory_floor: int, memory_limit: int, timeout_s: float, backend: str,
                 packages: tuple[str, ...]) -> tuple[Any, ...]:
    """What ``native.run_plain`` needs for every plain run, in the order of its ``PLAIN_*``
    names: ``state``, the C-side run state (``native_state``) every run's is a copy of; this
    module's ``current``; ``adopt(code, store, state, deadline)``, which makes the Python
    ``Run`` when the guest calls a host function written in Python (see ``adopted_run``);
    the runtime's ``ticker``; the RunResult's fields, those no run changes with their
    values; and the limits (``memory_floor``: the guest's minimum memory)."""
    fields: dict[str, Any] = dict.fromkeys(field.name for field in dataclasses.fields(RunResult))
    fields.update(error=None, limit_exceeded=None, value=None, capability_log=(),
                  isolation="wasm", backend=backend, packages=packages)
    return (state, current, adopt, functools.partial, ticker, RunResult, fields, fuel,
            min(memory_floor, _U64_MAX), min(memory_limit, _U64_MAX), float(timeout_s))


def call_guest(run: Run, execute: Any, request: str, arm: bool = False) -> str | None:
    """Call the guest's ``execute`` on this thread, with ``run`` as its host state.

    On the native path the call is made in C with the GIL released; a trap comes back as
    its message (and WASI exit status), raised here as wasmtime-py would raise it.
    """
    current.run = run
    slot: OutputSlot | None = getattr(run.store, "output", None)
    if slot is not None:
        slot.run = run
    try:
        if isinstance(run, NativeRun):
            try:
                reply, message, status = run.module.call(
                    ctypes.addressof(execute._func), address_of(run.store._context()),
                    request.encode(), run.native,
                    *((address_of(run.store.ptr()),) if arm else ()))
            finally:
                run.collect()
            if message is not None:
                raise NativeTrap(message, status)
            return str(reply)
        python_reply: str | None = execute(run.store, request)
        return python_reply
    finally:
        current.run = None
        if slot is not None:
            slot.run = None
