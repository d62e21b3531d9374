"""The Wasmtime backend: CPython compiled to WASI 0.2, one fresh instance per run.

This is the only module that imports ``wasmtime``. It owns:

* one ``Engine`` per process (fuel and epoch interruption on; the proposals the guest does
  not need off), with one ticker thread that advances the epoch while runs are active;
* the compiled guest, cached as a ``.cwasm`` keyed by the guest digest, the wasmtime version
  and the engine settings, and loaded with ``Component.deserialize_file`` (~ms, vs ~20 s to
  compile);
* a small pool of instances made ahead of demand on a background thread, so a run pays only
  for its call. Every instance serves exactly one run and is then dropped;
* priming: before an instance serves a run, it runs one fixed, trusted job (``PRIMING_JOB``).
  The first call into a fresh instance spends most of its time in page faults into the
  copy-on-write snapshot and in wasmtime's lazy table initialisation, not in Python;
  priming moves that cost off the request's path when the instance comes from the pool.
  Every instance is primed the same way, pooled or made inline, so fuel stays
  deterministic, and no user code ever ran in it;
* the host side of what every guest gets: its bounded output, its clocks and its entropy.
  ``wasi:clocks/*`` and ``wasi:random/random`` are defined here in full, shadowing
  wasmtime's own, so a guest sees only the virtual clock and seeded entropy unless the
  policy grants the real ones, and so no WASI call can block past the deadline;
* the wiring of the host-call channel (host functions and mediated HTTP). Its checks and
  policy live in ``capabilities/hostcall.py`` and ``capabilities/http.py``, shared by every
  backend.

Two run paths give the same behaviour: the *native* one (the default where it can be built)
makes the guest call and serves the host functions every run uses in C, with the GIL
released (``_native/``); the *Python* one does both through wasmtime-py. Files, host
functions and HTTP are Python on both. ``WASIBOX_RUN_PATH`` or ``WasmBackend(run_path=...)``
choose. Memory slots are reused between instances where that is verified safe
(``_slots.py``).

Wasmtime's own errors are converted to wasibox results in one place, ``_classify``.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import hashlib
import json
import math
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import component as cm

from .._control import RunControl, RunState
from .._errors import GuestBuildError, JournalError, UsageError
from .._events import CapabilityEvent
from .._guest import GuestArtifact, cache_dir, ensure_guest, file_lock, installed_version
from .._limits import Limit, Limits
from .._progress import Reporter, heartbeat, library_reporter
from .._result import GuestException, Outcome
from .._wire import ProtocolError, decode_reply, encode_request, max_elements
from ..capabilities.files.session import FilesError, FileSession, StatInfo
from ..capabilities.hostcall import HostCalls, StopRun
from ..capabilities.http import HttpGate
from ._native import NativeBuild
from ._native import load as load_native
from ._slots import SlotPopulator, SlotReuse, configure_pooling, slot_reuse
from ._stack import call_with_stack
from .base import Backend, BackendSession, Job, Policy

__all__ = ["WasmBackend", "WasmRuntime", "doctor_rows", "runtime"]

WASMTIME_VERSION = installed_version("wasmtime")
WASI_VERSION = "0.2.9"  # the WASI interfaces componentize-py 0.25's guest imports
EPOCH_TICK_S = 0.01
#: How long the epoch ticker goes on ticking after the last run ended (see _Ticker).
TICKER_IDLE_S = 1.0
#: Where the virtual wall clock starts: 2024-01-01T00:00:00Z.
VIRTUAL_EPOCH_S = 1_704_067_200
#: The native stack compiled guest code may use before Wasmtime traps. The guest's CPython
#: raises RecursionError once it has used 128 KiB of its own (shadow) stack in linear memory
#: (guest/build.py fits that limit), and a C frame costs up to ~32 times more native stack
#: than shadow stack (measured on the paths CPython guards: repr, pickle, json, comparisons
#: of nested containers), so 4 MiB would do: 5 MiB leaves room for frames costlier still.
MAX_WASM_STACK = 5 << 20
#: The native stack a run needs: the guest's share, plus room for the host frames around it
#: (host functions called from the deepest guest frame run on the same stack). 7 MiB fits
#: the 8 MiB Linux gives the main thread and every default thread, so runs stay in place;
#: a thread with less runs its guests on a helper thread (see _stack.py).
MIN_HOST_STACK = MAX_WASM_STACK + (2 << 20)
#: The largest entropy request served in one host call. The guest runner asks for 1 MiB at
#: a time; a bigger request is a guest calling the import itself, and would make the host
#: allocate (and the host's lowering copy, several times) up to the guest's memory cap.
MAX_ENTROPY_CALL_BYTES = 1 << 20
#: Where runs execute: "native" (the C extension, see _native/), "python" (wasmtime-py), or
#: "auto" (native where it can be built). Chosen per backend, or for the process by
#: WASIBOX_RUN_PATH.
RunPath = Literal["auto", "native", "python"]
RUN_PATH_ENV = "WASIBOX_RUN_PATH"
#: Engine settings: part of the compiled-guest cache key, and asserted by tests.
ENGINE_SETTINGS: dict[str, Any] = {
    "strategy": "cranelift",
    "cranelift_opt_level": "speed",
    "consume_fuel": True,
    "epoch_interruption": True,
    "max_wasm_stack": MAX_WASM_STACK,
    # Wasmtime 50 refuses a max_wasm_stack above the async stack size (2 MiB by default),
    # even with no async call ever made.
    "async_stack_size": MAX_WASM_STACK,
    "wasm_threads": False,
    "shared_memory": False,
    "wasm_gc": False,
    "wasm_function_references": False,
    "wasm_exceptions": False,
    "wasm_memory64": False,
    "wasm_stack_switching": False,
    # Not wrapped by wasmtime-py's Config (set through its C bindings, see _engine_config);
    # the component-model async ABI is on by default in wasmtime 50 and the guest needs none
    # of it, nor the GC runtime.
    "wasm_component_model_async": False,
    "wasm_component_model_async_stackful": False,
    "wasm_component_model_more_async_builtins": False,
    "concurrency_support": False,
    "gc_support": False,
}
#: The most instances a runtime keeps warm, however large a Sandbox's max_concurrency.
MAX_POOL_SIZE = 64
#: The most used instances waiting for the filler to drop them; past it, runs drop their own.
MAX_DISCARDS = 4
_INSTANTIATION_FUEL = 10**12  # instantiating the snapshot runs no guest code; fuel is reset
#: Compiled programs kept per WasmBackend (so per Sandbox): source plus marshalled code.
COMPILE_CACHE_BYTES = 32 * 2**20
#: A compiled program larger than this is not kept; the run compiles it itself.
MAX_COMPILED_BYTES = 8 * 2**20
#: The compiler instance is replaced after this many compiles, so its heap cannot creep.
COMPILER_RECYCLE_AFTER = 1000
#: ... and as soon as its heap has grown past this, since linear memory never shrinks.
COMPILER_HEAP_BYTES = 64 * 2**20
#: What every instance runs before it serves a run: the paths a typical run takes (load the
#: compiled program, exec, print, call, return a value), so that their pages are already
#: copied. Its code is compiled once per runtime, in a guest (see ``_priming_request``):
#: compiling it in every instance cost a third of a fresh instance's CPU.
PRIMING_JOB = Job(op="call", code="def prime():\n    print('wasibox')\n    return [1]",
                  entry="prime", limits=Limits(), policy=Policy())


class _Run:
    """Per-run state. Only the thread running the guest touches it, through ``_current``."""

    __slots__ = ("job", "store", "limit", "stdout", "stderr", "stdout_truncated",
                 "stderr_truncated", "output_room", "deadline", "cancel", "slept_ns", "rng",
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
        self.cancel = threading.Event()
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
            now: int = _taped(self, "clock.monotonic", (), time.monotonic_ns)
            return now
        return self.clock_base_ns + self.virtual_ns(context)

    def wall_ns(self, context: Any) -> int:
        if self.job.policy.clock == "real":
            now: int = _taped(self, "clock.wall", (), time.time_ns)
            return now
        return VIRTUAL_EPOCH_S * 10**9 + self.clock_base_ns + self.virtual_ns(context)

    def wait(self, context: Any, ns: int) -> None:
        """Block for ``ns`` of guest time, or trap with a timeout at the deadline."""
        if self.job.policy.clock == "real":
            # Journaled, so that a replay neither waits nor ends the run elsewhere.
            _taped(self, "clock.wait", (ns,), lambda: self._wait_real(ns))
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
        text: str = _taped(self, "entropy.bytes", (size,),
                           lambda: os.urandom(size).decode("latin-1"))
        return text.encode("latin-1")

    def random_u64(self) -> int:
        if self.rng:
            return self.rng.getrandbits(64)
        value: int = _taped(self, "entropy.u64", (),
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

        tag, reply_payload = _taped(self, "host.call", (name, payload), answer)
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


class _NativeRun(_Run):
    """A run on the native path: its output, clocks and entropy live in C (``native``);
    what Python still serves (files, host functions, HTTP) uses the fields of ``_Run``."""

    __slots__ = ("module", "native")
    python_entropy = False  # the seeded generator lives in C: no Python Random to make

    def __init__(self, job: Job, store: wasmtime.Store, native: ModuleType) -> None:
        super().__init__(job, store)
        limits, policy = job.limits, job.policy
        self.module = native
        # C takes unsigned 64-bit values; clamping changes nothing a run can reach.
        self.native = native.Run(
            fuel=min(limits.fuel, _U64_MAX), output_bytes=min(limits.output_bytes, _U64_MAX),
            memory_bytes=min(limits.memory_bytes, _U64_MAX),
            timeout_ns=min(int(limits.timeout_s * 1e9), _MAX_TIMEOUT_NS),
            real_clock=policy.clock == "real",
            seed_words=_seed_words(policy.seed) if policy.entropy == "seeded" else None)

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


class _NativeTrap(wasmtime.WasmtimeError):
    """A trap of the native path, shaped as wasmtime-py raises one (``code``: WASI exit)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code  # what _classify reads from wasmtime-py's ExitTrap


def _seed_words(seed: int) -> bytes:
    """|seed| as little-endian 32-bit words, as ``random.Random(seed)`` keys its generator."""
    magnitude = abs(seed)
    return magnitude.to_bytes(max(1, (magnitude.bit_length() + 31) // 32) * 4, "little")


def _address(pointer: Any) -> int:
    address: int | None = ctypes.cast(pointer, ctypes.c_void_p).value
    if address is None:
        raise UsageError("a null Wasmtime pointer")
    return address


def _taped(run: _Run, kind: str, args: tuple[Any, ...], produce: Callable[[], Any]) -> Any:
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


_U64_MAX = 2**64 - 1
_MAX_TIMEOUT_NS = 2**62  # ~146 years; keeps the C deadline from overflowing
_current = threading.local()


def _host(function: Any) -> Any:
    """Wrap a host function so that nothing it raises escapes as a Python exception.

    wasmtime-py parks non-WasmtimeError exceptions from callbacks in a process-global and
    re-raises them from whichever call returns next, possibly on another thread. Every
    failure here becomes a WasmtimeError (a trap for this run only) and is recorded on the
    run itself.
    """

    def call(context: Any, *args: Any) -> Any:
        run: _Run | None = getattr(_current, "run", None)
        if run is None:
            raise wasmtime.WasmtimeError("wasibox: host function called outside a run")
        if run.cancelled:
            run.stop(Limit.CANCELLED)
        try:
            return function(run, context._context(), *args)
        except wasmtime.WasmtimeError:
            raise
        except BaseException as exc:  # noqa: BLE001 - see docstring
            run.fault = run.fault or GuestException(
                type="HostError", message=f"host function failed: {type(exc).__name__}",
                traceback="")
            raise wasmtime.WasmtimeError("wasibox: host function failed") from None

    return call


class _DateTime:
    """A wasi:clocks/wall-clock datetime record."""

    __slots__ = ("seconds", "nanoseconds")

    def __init__(self, ns: int) -> None:
        self.seconds, self.nanoseconds = divmod(ns, 10**9)


def _write(run: _Run, context: Any, fd: int, data: str) -> None:
    if run.limit is not None or not run.append(fd, data.encode("latin-1")):
        run.stop(Limit.OUTPUT)


def _sleep(run: _Run, context: Any, ns: int) -> None:
    run.wait(context, ns)


def _start(run: _Run, context: Any) -> None:
    """The program is about to run: meter its fuel from here, so compiling is not counted.

    The runner calls this before any of the program runs; later calls (the program's own)
    are ignored, so a program cannot reset its fuel.
    """
    if run.started:
        return
    run.started = True
    if ffi.wasmtime_context_set_fuel(context, run.job.limits.fuel):
        raise wasmtime.WasmtimeError("wasibox: could not reset the guest's fuel")


def _exit(run: _Run, context: Any, status: int) -> None:
    run.exit_code = status
    raise wasmtime.WasmtimeError(f"wasibox: the guest exited with status {status}")


def _subscribe(run: _Run, context: Any, ns: int) -> None:
    # A WASI pollable would block inside the host, where epochs never tick. The guest runner
    # routes every wait through clock.sleep; whatever still reaches here is refused at once.
    if run.would_block_past_deadline(context, ns):
        run.stop(Limit.TIMEOUT)
    run.fault = GuestException(
        type="BlockingIOError",
        message="the guest tried to wait through WASI poll, which wasibox does not allow; "
                "use time.sleep", traceback="")
    raise wasmtime.WasmtimeError("wasibox: blocking WASI poll refused")


#: The files interface: (WIT name, FileSession method, whether the result is "tagged").
#: wasmtime-py lowers a result as a bare value when its ok and err types have different
#: Python classes, and as a Variant when they share one (string ok + enum err).
_FILE_OPS = (
    ("open", "open", False), ("read", "read", True), ("write", "write", False),
    ("pread", "pread", True), ("pwrite", "pwrite", False), ("dup", "dup", False),
    ("seek", "seek", False), ("truncate", "truncate", False), ("close", "close_fd", False),
    ("fstat", "fstat", True), ("stat", "stat", True), ("readdir", "readdir", True),
    ("mkdir", "mkdir", False), ("unlink", "unlink", False), ("rmdir", "rmdir", False),
    ("rename", "rename", False), ("chmod", "chmod", False), ("utime", "utime", False),
    ("link", "link", False), ("symlink", "symlink", False), ("readlink", "readlink", True),
)
_FD_OPS = frozenset({"read", "write", "pread", "pwrite", "dup", "seek", "truncate", "close_fd",
                     "fstat"})


def _file_op(method: str, tagged: bool) -> Any:
    """A files host function: FilesError becomes the WIT error-code, never a trap."""

    def answer(run: _Run, args: tuple[Any, ...]) -> list[Any]:
        session: FileSession | None = run.job.files
        try:
            if session is None:  # no mounts: nothing exists
                raise FilesError("badf" if method in _FD_OPS else "noent")
            value = getattr(session, method)(*args)
        except FilesError as exc:
            return ["err", exc.code]
        except OSError:  # the host's own disk failed under the operation
            return ["err", "io"]
        return ["ok", value.encode() if isinstance(value, StatInfo) else value]

    kind = f"files.{method}"

    def op(run: _Run, context: Any, *args: Any) -> Any:
        tag, value = (answer(run, args) if run.job.tape is None
                      else _taped(run, kind, args, lambda: answer(run, args)))
        return cm.Variant(tag, value) if tagged else value

    return op


def _define_host(linker: cm.Linker, native: ModuleType | None = None) -> None:
    """Define the guest's capabilities, and shadow WASI clocks and random.

    With ``native``, the host functions every run uses are the C ones of the native run
    path (``_native/wasibox_native.c``, which mirrors ``_define_every_run``); the
    capabilities that need Python (files, host functions, HTTP) are defined here either way.
    """
    linker.allow_shadowing = True
    with linker.root() as root:
        with root.add_instance("wasibox:sandbox/files@0.1.0") as files:
            for name, method, tagged in _FILE_OPS:
                files.add_func(name, _host(_file_op(method, tagged)))
        with root.add_instance("wasibox:sandbox/host@0.1.0") as host:
            host.add_func("call", _host(lambda run, ctx, name, payload:
                                        run.host_call(name, payload)))
        if native is None:
            _define_every_run(root)
    if native is not None:
        native.define(_address(linker.ptr()), WASI_VERSION)


def _define_every_run(root: Any) -> None:
    """The host functions every run uses, in Python: stdio, clocks, entropy, exit, start."""
    with root.add_instance("wasibox:sandbox/runner@0.1.0") as runner:
        runner.add_func("start", _host(_start))
    with root.add_instance("wasibox:sandbox/stdio@0.1.0") as stdio:
        stdio.add_func("write", _host(_write))
    with root.add_instance("wasibox:sandbox/clock@0.1.0") as clock:
        clock.add_func("sleep", _host(_sleep))
    with root.add_instance("wasibox:sandbox/process@0.1.0") as process:
        process.add_func("exit", _host(_exit))
    with root.add_instance("wasibox:sandbox/entropy@0.1.0") as entropy:
        entropy.add_func("random-bytes", _host(
            lambda run, ctx, size: run.random_bytes(size).decode("latin-1")))
    with root.add_instance(f"wasi:clocks/monotonic-clock@{WASI_VERSION}") as monotonic:
        monotonic.add_func("now", _host(lambda run, ctx: run.monotonic_ns(ctx)))
        monotonic.add_func("resolution", _host(lambda run, ctx: 1))
        monotonic.add_func("subscribe-duration", _host(_subscribe))
        monotonic.add_func("subscribe-instant", _host(
            lambda run, ctx, when: _subscribe(run, ctx, max(when - run.monotonic_ns(ctx), 0))))
    with root.add_instance(f"wasi:clocks/wall-clock@{WASI_VERSION}") as wall:
        wall.add_func("now", _host(lambda run, ctx: _DateTime(run.wall_ns(ctx))))
        wall.add_func("resolution", _host(lambda run, ctx: _DateTime(1)))
    with root.add_instance(f"wasi:random/random@{WASI_VERSION}") as wasi_random:
        wasi_random.add_func("get-random-bytes",
                             _host(lambda run, ctx, size: run.random_bytes(size)))
        wasi_random.add_func("get-random-u64", _host(lambda run, ctx: run.random_u64()))


class _OutputSlot:
    """The run a store's C-level output belongs to. Wasmtime calls the WASI stdout/stderr
    callbacks on its own worker threads, where the thread-local ``_current`` is unset."""

    __slots__ = ("run", "__weakref__")

    def __init__(self) -> None:
        self.run: _Run | None = None


#: Each store's output slot, set by ``_call_guest`` for the duration of a call.
_output_slots: weakref.WeakKeyDictionary[wasmtime.Store, _OutputSlot] = (
    weakref.WeakKeyDictionary())


def _c_output(fd: int, slot: _OutputSlot) -> Any:
    """Output written by C code in the guest (not through sys.stdout), into the same sink."""

    def sink(data: bytes) -> int:
        run = slot.run
        if run is not None:
            run.append(fd, data)  # past the cap, the run's limit is already recorded
        return len(data)

    return sink


#: Called by Wasmtime, on the thread running the guest, whenever a store reaches its epoch
#: deadline. Every run's deadline is one tick ahead, so this decides at every tick whether the
#: run goes on (cancellation and the wall-clock limit are checked here) without any other
#: thread touching the Store. Returning an error traps the guest.
_DeadlineCallback = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))
_NO_FINALIZER = ctypes.cast(0, ctypes.CFUNCTYPE(None, ctypes.c_void_p))
_UPDATE_DEADLINE_CONTINUE = 0


def _on_epoch_deadline(context: Any, data: Any, delta: Any, kind: Any) -> int:
    run: _Run | None = getattr(_current, "run", None)
    limit = None
    if run is not None:
        if run.cancelled:
            limit = Limit.CANCELLED
        elif time.monotonic() >= run.deadline:
            limit = Limit.TIMEOUT
    if limit is None or run is None:
        delta[0] = 1
        kind[0] = _UPDATE_DEADLINE_CONTINUE
        return 0
    run.limit = run.limit or limit
    error = ffi.wasmtime_error_new(f"wasibox: {limit.value} limit exceeded".encode())
    return ctypes.cast(error, ctypes.c_void_p).value or 0


_ON_EPOCH_DEADLINE = _DeadlineCallback(_on_epoch_deadline)  # kept alive for the process


class _Ticker:
    """Advances the engine's epoch every EPOCH_TICK_S while runs are active, and for
    TICKER_IDLE_S after the last one ended.

    A run never wakes the ticker: it only counts itself in. Waking a waiting thread at the
    start of every run (a condition notify) handed it the GIL just as the run made its own
    ctypes calls, which then waited for the GIL back: ~0.5 ms of a 1 ms warm run on a busy
    machine. Ticking on through idle moments costs one short wake-up per tick instead, off
    any run's path; after TICKER_IDLE_S with no run the thread ends, and the next run
    starts another.
    """

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._active = 0
        self._last_exit = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> None:
        with self._lock:
            self._active += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="wasibox-epoch",
                                                daemon=True)
                self._thread.start()

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            self._last_exit = time.monotonic()

    def _loop(self) -> None:
        while True:
            time.sleep(EPOCH_TICK_S)
            self._engine.increment_epoch()
            with self._lock:
                if self._active == 0 and time.monotonic() - self._last_exit > TICKER_IDLE_S:
                    self._thread = None
                    return


class WasmRuntime:
    """The per-process part of the backend: engine, compiled guest, linker, instance pool."""

    def __init__(self, artifact: GuestArtifact | None = None, *, pool_size: int = 1,
                 progress: Reporter | None = None, run_path: RunPath | None = None,
                 reuse_slots: bool = True) -> None:
        """``run_path`` as WasmBackend's; ``reuse_slots=False`` keeps Wasmtime's default
        allocator (benchmarks compare with it). Raises UsageError if ``run_path`` is
        "native" and the extension is unavailable, GuestBuildError if the guest cannot
        be built or compiled."""
        requested = _checked_run_path(run_path)
        self.artifact = artifact or ensure_guest(progress)
        config = _engine_config()
        #: Whether memory slots are reused between instances, and why (see _slots.py).
        self.slot_reuse: SlotReuse = (configure_pooling(config) if reuse_slots else
                                      SlotReuse(False, "turned off for this runtime"))
        self.engine = wasmtime.Engine(config)
        self.component, self.min_memory_bytes = _load_compiled(
            self.engine, self.artifact, progress or library_reporter())
        #: The native extension, or why there is none (shown by ``wasibox doctor``).
        self.native: NativeBuild = (
            load_native(progress or library_reporter()) if requested != "python"
            else NativeBuild(None, f"the Python run path was chosen ({RUN_PATH_ENV}=python)"))
        if requested == "native" and self.native.module is None:
            raise UsageError(f"the native run path is unavailable: {self.native.reason}")
        #: The path this runtime's pooled instances are made for.
        self.run_path: Literal["native", "python"] = (
            "native" if self.native.module is not None else "python")
        self._native_linker: cm.Linker | None = None
        if self.native.module is not None:
            self._native_linker = cm.Linker(self.engine)
            self._native_linker.add_wasip2()
            _define_host(self._native_linker, self.native.module)
        self._slots = (SlotPopulator(_compiled_path(self.artifact).resolve())
                       if self.slot_reuse.enabled else None)
        self.linker = cm.Linker(self.engine)
        self.linker.add_wasip2()
        _define_host(self.linker)
        self.ticker = _Ticker(self.engine)
        self._priming_request = _priming_request(self)
        _runtimes.add(self)
        self._pool: collections.deque[tuple[wasmtime.Store, Any]] = collections.deque()
        self._pool_size = pool_size
        self._base_pool_size = pool_size
        self._pool_requests: dict[object, int] = {}
        #: Used instances the filler drops (see ``release``).
        self._discards: collections.deque[object] = collections.deque()
        self._pool_cond = threading.Condition()
        self._filler: threading.Thread | None = None
        self._closed = False

    def instantiate(self, run_path: Literal["native", "python"] | None = None,
                    preopens: Sequence[tuple[str, str]] = ()) -> tuple[wasmtime.Store, Any]:
        """A fresh, primed store and instance of the guest for ``run_path`` (by default this
        runtime's), and its ``execute`` export. ``preopens`` are (host directory, guest
        path) pairs the guest's C code sees, writable (``FileSession.preopens``)."""
        native = self.native.module if (run_path or self.run_path) == "native" else None
        store, execute = self._new_instance(native, preopens)
        _prime(store, execute, native, self._priming_request)
        return store, execute

    def _new_instance(self, native: ModuleType | None,
                      preopens: Sequence[tuple[str, str]] = ()) -> tuple[wasmtime.Store, Any]:
        """A fresh store and instance (not primed) for the native path if ``native``, else
        for the Python path, with ``preopens`` as ``instantiate``'s; raises GuestBuildError
        if the guest exports no ``execute``."""
        linker = self._native_linker if native is not None else self.linker
        assert linker is not None
        store = wasmtime.Store(self.engine)
        wasi = wasmtime.WasiConfig()
        slot = _output_slots[store] = _OutputSlot()
        wasi.stdout_custom = _c_output(1, slot)
        wasi.stderr_custom = _c_output(2, slot)
        for host, guest in preopens:
            wasi.preopen_dir(host, guest, True)
        store.set_wasi(wasi)
        store.set_fuel(_INSTANTIATION_FUEL)
        store.set_epoch_deadline(2**62)
        instance = linker.instantiate(store, self.component)
        if self._slots is not None:
            self._slots.track(store)
        execute = instance.get_func(store, "execute")
        if execute is None:
            raise GuestBuildError("the guest component exports no `execute` function; "
                                  "rebuild it with `wasibox prepare`")
        if native is not None:
            native.arm(_address(store.ptr()))  # the epoch deadline, decided in C
        return store, execute

    def take(self) -> tuple[wasmtime.Store, Any]:
        """A pre-made instance if one is ready, else a new one.

        Taking a pre-made instance does not start its replacement: the caller calls
        ``release`` once its run is over. Making an instance takes several milliseconds of
        CPU and of the GIL, which the run would otherwise compete for (every ctypes call and
        host callback of the run waits for the GIL): that doubled the p90 latency of a run.
        """
        with self._pool_cond:
            if self._pool:
                return self._pool.popleft()
            self._pool_cond.notify()  # the pool is behind: refill it while this run waits
            self._start_filler()
        return self.instantiate()

    def release(self, used: list[object]) -> None:
        """Hand a finished run's instance (``used`` holds everything that refers to its
        store; it is emptied) to the filler thread to drop, and top the pool up.

        Dropping a store resets the memory its instance dirtied, ~1 ms: on the filler, that
        is off the path of the next run, which a caller running back to back (fuzzing, a
        transform's batches) is already waiting to start. Without a pool, or when the
        filler is MAX_DISCARDS behind, the store is dropped here, as the caller returns.
        """
        with self._pool_cond:
            if self._pool_size > 0 and not self._closed and len(self._discards) < MAX_DISCARDS:
                self._discards.append(tuple(used))
                used.clear()
            if self._discards or len(self._pool) < self._pool_size:
                self._pool_cond.notify()
                self._start_filler()

    def request_pool_size(self, size: int) -> Callable[[], None]:
        """Keep up to ``size`` instances warm (the largest request wins, capped at
        MAX_POOL_SIZE) until the returned function is called; it is idempotent."""
        key = object()
        with self._pool_cond:
            self._pool_requests[key] = min(max(size, 0), MAX_POOL_SIZE)
            self._resize_pool()

        def release() -> None:
            with self._pool_cond:
                if self._pool_requests.pop(key, None) is not None:
                    self._resize_pool()

        return release

    def pool_status(self) -> tuple[int, int]:
        """(instances ready in the warm pool, instances it aims to keep ready)."""
        with self._pool_cond:
            return len(self._pool), self._pool_size

    def _resize_pool(self) -> None:
        self._pool_size = max([self._base_pool_size, *self._pool_requests.values()])
        while len(self._pool) > self._pool_size:
            self._pool.pop()  # an unused instance is dropped with its store
        self._pool_cond.notify_all()
        self._start_filler()

    def _start_filler(self) -> None:
        if self._pool_size > 0 and (self._filler is None or not self._filler.is_alive()):
            self._filler = threading.Thread(target=self._fill, name="wasibox-pool", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        while True:
            with self._pool_cond:
                if not self._pool_cond.wait_for(
                        lambda: (self._closed or bool(self._discards)
                                 or len(self._pool) < self._pool_size), timeout=5.0):
                    self._filler = None
                    return
                if self._closed:
                    return
                used = list(self._discards)
                self._discards.clear()
                wanted = len(self._pool) < self._pool_size
            # Dropped first, outside the lock: the next instance can then reuse the slot.
            del used
            if not wanted:
                continue
            slot = self.instantiate()
            with self._pool_cond:
                if self._closed:
                    return
                self._pool.append(slot)

    def close(self, *, wait_s: float = 0.0) -> None:
        """Drop the pool and stop the filler; wait up to ``wait_s`` for it to end."""
        with self._pool_cond:
            self._closed = True
            self._pool.clear()
            self._discards.clear()
            self._pool_cond.notify_all()
            filler = self._filler
        if filler is not None and filler is not threading.current_thread():
            filler.join(wait_s)


#: Every runtime made in this process, for ``_stop_fillers``.
_runtimes: weakref.WeakSet[WasmRuntime] = weakref.WeakSet()


@atexit.register
def _stop_fillers() -> None:
    """Stop every pool filler before the interpreter finalizes.

    During finalization CPython ends a daemon thread that takes the GIL with pthread_exit.
    The filler makes, primes and drops instances, and inside Wasmtime those call back into
    Python (host functions, wasmtime-py's output callbacks and their finalizers): ended
    there, the thread would unwind through Wasmtime's Rust frames, which aborts the process.
    """
    for each in list(_runtimes):
        each.close(wait_s=5.0)


def _priming_request(runtime_: WasmRuntime) -> str:
    """The request every instance of ``runtime_`` is primed with: ``PRIMING_JOB`` with its
    code compiled, in a fresh instance of the guest made for that alone (the marshalled code
    is data a guest made, and only guests load it). Should that compile fail, the source
    alone: every instance is still primed the same way."""
    fields = PRIMING_JOB.request()
    store, execute = runtime_._new_instance(None)
    compiled, _ = _compile_in(runtime_, store, execute, PRIMING_JOB)
    if compiled is not None:
        fields["compiled"] = compiled
    return encode_request(fields)


def _prime(store: wasmtime.Store, execute: Any, native: ModuleType | None,
           request: str) -> None:
    """Run ``PRIMING_JOB`` (``request``) in a new instance; its output and reply are
    dropped."""
    run = _Run(PRIMING_JOB, store) if native is None else _NativeRun(PRIMING_JOB, store, native)
    call_with_stack(lambda: _call_guest(run, execute, request), MIN_HOST_STACK)


_runtime: WasmRuntime | None = None
_derived_runtimes: dict[str, WasmRuntime] = {}  # by guest digest: guests with packages
_runtime_lock = threading.Lock()


def doctor_rows() -> list[tuple[str, str]]:
    """What ``wasibox doctor`` reports about this backend, without starting an engine."""
    reuse = slot_reuse()
    try:
        requested = _checked_run_path(None)
    except UsageError as exc:
        return [("slot reuse", f"{'on' if reuse.enabled else 'off'}: {reuse.reason}"),
                ("run path", f"misconfigured: {exc}")]
    if requested == "python":
        run_path = f"python: chosen by {RUN_PATH_ENV}=python"
    else:
        native = load_native(lambda message: None, build=False)
        run_path = (f"native: {native.reason}" if native.module is not None
                    else f"python: the native path is unavailable: {native.reason}")
    return [("slot reuse", f"{'on' if reuse.enabled else 'off'}: {reuse.reason}"),
            ("run path", run_path)]


def _checked_run_path(run_path: RunPath | None) -> RunPath:
    """``run_path``, or WASIBOX_RUN_PATH's, or "auto"; UsageError if it is none of them."""
    chosen = run_path or os.environ.get(RUN_PATH_ENV) or "auto"
    if chosen not in ("auto", "native", "python"):
        raise UsageError(f"the run path must be 'auto', 'native' or 'python', not {chosen!r}"
                         + ("" if run_path else f" (from {RUN_PATH_ENV})"))
    return chosen  # type: ignore[return-value]


def runtime(progress: Reporter | None = None,
            artifact: GuestArtifact | None = None) -> WasmRuntime:
    """The process-wide runtime, made on first use (building the guest if needed).

    With ``artifact`` (a guest derived for a package set), the process-wide runtime of that
    guest: each guest has its own engine, compiled component and warm pool.
    """
    global _runtime
    with _runtime_lock:
        if artifact is not None:
            derived = _derived_runtimes.get(artifact.digest)
            if derived is None:
                derived = _derived_runtimes[artifact.digest] = WasmRuntime(
                    artifact, progress=progress)
            return derived
        if _runtime is None:
            _runtime = WasmRuntime(progress=progress)
        return _runtime


class WasmBackend(Backend):
    """Runs each job in a fresh instance of the CPython guest under Wasmtime."""

    name = "wasm"

    def __init__(self, runtime_: WasmRuntime | None = None, *,
                 pool_size: int | None = None, run_path: RunPath | None = None) -> None:
        """``run_path`` picks the native or the Python run path (default: the runtime's).

        Raises UsageError if ``run_path`` is "native" and the extension is unavailable.
        """
        self._runtime = runtime_ or runtime()
        chosen = _checked_run_path(run_path) if run_path is not None else "auto"
        if chosen == "native" and self._runtime.native.module is None:
            raise UsageError(
                f"the native run path is unavailable: {self._runtime.native.reason}")
        #: The run path of this backend's runs.
        self.run_path: Literal["native", "python"] = (
            self._runtime.run_path if chosen == "auto" else chosen)
        self._compiler = _Compiler(self._runtime)
        #: With pool_size, the runtime keeps that many instances warm until ``close``.
        self._release_pool = (self._runtime.request_pool_size(pool_size)
                              if pool_size is not None else None)

    def close(self) -> None:
        self._compiler.close()
        if self._release_pool is not None:
            self._release_pool()

    @property
    def min_memory_bytes(self) -> int:
        return self._runtime.min_memory_bytes

    @property
    def guest_digest(self) -> str:
        """The digest of the guest this backend runs: a journal's replay needs the same."""
        return self._runtime.artifact.digest

    def execute(self, job: Job, control: RunControl | None = None) -> Outcome:
        rt = self._runtime
        control = control or RunControl()
        self._check_memory(job.limits)
        started = time.perf_counter()
        control.enter(RunState.INSTANTIATING)
        request = self._request(job)
        preopens = job.files.preopens() if job.files is not None else []
        # A journaled run granted the real clock or entropy takes the Python path, where
        # those values are served by Python and so can be taped (the native path's are C's).
        run_path = ("python" if job.tape is not None and not job.policy.deterministic
                    else self.run_path)
        try:
            # The pool holds instances for the runtime's own path, without preopens, only.
            store, execute = (rt.take() if run_path == rt.run_path and not preopens
                              else rt.instantiate(run_path, preopens))
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise GuestBuildError(f"wasmtime could not instantiate the guest: {exc}") from None
        native = rt.native.module if run_path == "native" else None
        run = _Run(job, store) if native is None else _NativeRun(job, store, native)
        store.set_limits(memory_size=job.limits.memory_bytes)
        outcome = _call(rt, run, execute, request, control, started)
        used: list[object] = [store, execute, run]
        del store, execute, run
        # Last: making an instance would slow this run's remaining ctypes calls.
        rt.release(used)
        return outcome

    def open_session(self, limits: Limits, policy: Policy,
                     files: FileSession | None) -> BackendSession:
        """One instance kept for a session's calls, on the Python run path (the native path
        is built around fresh instances); raises UsageError for a memory cap below the
        guest's minimum, GuestBuildError if the guest cannot be instantiated."""
        self._check_memory(limits)
        return _WasmSession(self, limits, policy)

    def _check_memory(self, limits: Limits) -> None:
        minimum = self._runtime.min_memory_bytes
        if limits.memory_bytes < minimum:
            raise UsageError(
                f"memory_bytes={limits.memory_bytes} is below the guest's minimum of "
                f"{minimum} bytes ({minimum / 2**20:.1f} MiB)")

    def _request(self, job: Job) -> str:
        """The job's encoded request, with its compiled program when it compiles."""
        fields = job.request()
        compiled = self._compiler.compile(job)
        if compiled is not None:
            fields["compiled"] = compiled
        try:
            return encode_request(fields)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UsageError(f"arguments must be msgpack-compatible values: {exc}") from None


def _call(rt: WasmRuntime, run: _Run, execute: Any, request: str, control: RunControl,
          started: float) -> Outcome:
    """Make one call into an instance under ``run.job``'s limits, and measure it."""
    job, store = run.job, run.store
    store.set_fuel(job.limits.fuel)
    reply: str | None = None
    exit_code: int | None = None
    control.enter(RunState.RUNNING)
    detach = control.on_cancel(run.interrupt)
    with rt.ticker:
        if not isinstance(run, _NativeRun):  # the native path's C callback was set when made
            ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _ON_EPOCH_DEADLINE,
                                                       None, _NO_FINALIZER)
        store.set_epoch_deadline(1)  # _on_epoch_deadline checks the deadline at every tick
        run.deadline = time.monotonic() + job.limits.timeout_s
        try:
            if run.cancelled:  # cancelled while instantiating: skip the guest entirely
                run.stop(Limit.CANCELLED)
            # Not a closure: the store must be dropped by whoever ``release`` hands it to.
            reply = call_with_stack(functools.partial(_call_guest, run, execute, request),
                                    MIN_HOST_STACK)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            exit_code = _classify(run, store, exc)
        finally:
            detach()
    duration = time.perf_counter() - started
    try:
        fuel_used = job.limits.fuel - store.get_fuel()
    except wasmtime.WasmtimeError:
        fuel_used = job.limits.fuel
    return Outcome(
        reply=reply,
        stdout=bytes(run.stdout),
        stderr=bytes(run.stderr),
        stdout_truncated=run.stdout_truncated,
        stderr_truncated=run.stderr_truncated,
        limit_exceeded=run.limit,
        fault=run.fault if run.limit is None else None,
        exit_code=exit_code,
        fuel_used=fuel_used,
        memory_peak_bytes=rt.min_memory_bytes,
        memory_limit_bytes=job.limits.memory_bytes,
        duration_s=duration,
        capability_log=tuple(run.log),
    )


class _WasmSession(BackendSession):
    """One instance serving a session's calls, each under its own fuel and deadline.

    The store's memory cap is the session's, for its whole life (linear memory never
    shrinks). The virtual clock and the seeded entropy stream run on from one call to the
    next, as they would in one long program. Any call that does not return normally (a trap,
    an exit, a limit enforced by trapping, a cancel) leaves the instance unusable: wasmtime
    refuses to re-enter it, so the session is over.
    """

    def __init__(self, backend: WasmBackend, limits: Limits, policy: Policy) -> None:
        self._backend = backend
        self._runtime = backend._runtime
        self._store: wasmtime.Store | None
        try:
            self._store, self._execute = self._runtime.instantiate("python")
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise GuestBuildError(f"wasmtime could not instantiate the guest: {exc}") from None
        self._store.set_limits(memory_size=limits.memory_bytes)
        self._rng = random.Random(policy.seed) if policy.entropy == "seeded" else None
        self._clock_ns = 0

    @property
    def alive(self) -> bool:
        return self._store is not None

    def run(self, job: Job, control: RunControl | None = None) -> Outcome:
        control = control or RunControl()
        started = time.perf_counter()
        store = self._store
        if store is None:
            raise UsageError("this session's guest is gone; open a new session")
        if control.cancelled:
            return Outcome(limit_exceeded=Limit.CANCELLED)
        request = self._backend._request(job)
        run = _Run(job, store)
        run.rng = self._rng
        run.clock_base_ns = self._clock_ns
        outcome = _call(self._runtime, run, self._execute, request, control, started)
        self._clock_ns += outcome.fuel_used + run.slept_ns
        if outcome.reply is None:
            self.close()  # trapped or exited: wasmtime will not enter this instance again
        return outcome

    def close(self) -> None:
        # Dropping the references frees the instance (and its memory slot) with its store.
        self._store = self._execute = None


class _Compiler:
    """Compiles programs for one WasmBackend (one Sandbox), and keeps what it compiled.

    Compiling is most of a small run's work, and services, transforms and fuzzing run the
    same source again and again. So the source is compiled in a separate, long-lived guest
    instance, which compiles and never runs anything, and the marshalled code object is kept
    by source text (least recently used out first). Every run then *loads* its program, the
    same way whether the code was cached or not, so fuel and output stay deterministic.

    Kept per Sandbox, so a program cannot learn from timing what another Sandbox ran. If
    compiling fails (a SyntaxError, or a source too big for the limits) the result is not
    kept and the run compiles the source itself, and reports the failure as it always would.
    """

    def __init__(self, runtime_: WasmRuntime) -> None:
        self._runtime = runtime_
        self._cache: collections.OrderedDict[tuple[str, str], bytes] = \
            collections.OrderedDict()
        self._cache_bytes = 0
        self._instance: tuple[wasmtime.Store, Any] | None = None
        self._compiles = 0
        self._lock = threading.Lock()
        self._closed = False

    def compile(self, job: Job) -> bytes | None:
        """The marshalled code object of ``job.code``, or None if it does not compile."""
        with self._lock:
            if self._closed:
                return None
            # The file name is part of the code object (tracebacks name it).
            key = (job.filename, job.code)
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(job)
            if compiled is not None:
                self._keep(key, compiled)
            return compiled

    def _compile(self, job: Job) -> bytes | None:
        if self._instance is None or self._compiles >= COMPILER_RECYCLE_AFTER:
            # Made here, not taken from the pool: pooled instances are for runs.
            self._instance, self._compiles = self._runtime.instantiate("python"), 0
        store, execute = self._instance
        self._compiles += 1
        compiled, reusable = _compile_in(self._runtime, store, execute, job)
        if not reusable:
            self._instance = None
        return compiled


    def close(self) -> None:
        """Drop the compiler instance and the cache, for good: a run still finishing after
        the Sandbox closed compiles its source itself, and no store outlives the Sandbox."""
        with self._lock:
            self._closed = True
            self._instance = None
            self._cache.clear()
            self._cache_bytes = 0

    def _keep(self, key: tuple[str, str], compiled: bytes) -> None:
        cost = len(key[0]) + len(key[1]) + len(compiled)
        if cost > COMPILE_CACHE_BYTES:
            return
        self._cache[key] = compiled
        self._cache_bytes += cost
        while self._cache_bytes > COMPILE_CACHE_BYTES:
            (old_name, old_code), old_compiled = self._cache.popitem(last=False)
            self._cache_bytes -= len(old_name) + len(old_code) + len(old_compiled)
def _compile_in(runtime_: WasmRuntime, store: wasmtime.Store, execute: Any,
                job: Job) -> tuple[bytes | None, bool]:
    """Compile ``job.code`` in the Python-path instance ``execute``, under ``job.limits``.

    Returns the marshalled code object (None if it does not compile), and whether the
    instance may compile again: not after a trap, nor once its heap has grown past
    COMPILER_HEAP_BYTES (linear memory never shrinks). Never raises for the guest's doing.
    """
    run = _Run(job, store)  # for its limits; compiling writes no output
    request = encode_request({"op": "compile", "code": job.code, "seed": 0,
                              **({"filename": job.filename}
                                 if job.filename != "<sandbox>" else {})})
    store.set_fuel(job.limits.fuel)
    store.set_limits(memory_size=job.limits.memory_bytes)
    with runtime_.ticker:
        store.set_epoch_deadline(math.ceil(job.limits.timeout_s / EPOCH_TICK_S) + 1)
        try:
            # Compiling a hostile source recurses too: the same stack rule as a run.
            text = call_with_stack(lambda: _call_guest(run, execute, request),
                                   MIN_HOST_STACK)
            reply = decode_reply(text or "", MAX_COMPILED_BYTES,
                                 max_elements(job.limits.memory_bytes))
        except (wasmtime.WasmtimeError, wasmtime.Trap, ProtocolError):
            return None, False  # an instance that trapped is never used again
    reusable = reply.heap_top <= COMPILER_HEAP_BYTES
    if reply.error is not None or type(reply.value) is not bytes:
        return None, reusable
    return reply.value, reusable


def _call_guest(run: _Run, execute: Any, request: str) -> str | None:
    """Call the guest's ``execute`` on this thread, with ``run`` as its host state.

    On the native path the call is made in C with the GIL released; a trap comes back as
    its message (and WASI exit status), raised here as wasmtime-py would raise it.
    """
    _current.run = run
    slot = _output_slots.get(run.store)
    if slot is not None:
        slot.run = run
    try:
        if isinstance(run, _NativeRun):
            try:
                reply, message, status = run.module.call(
                    ctypes.addressof(execute._func), _address(run.store._context()),
                    request.encode(), run.native)
            finally:
                run.collect()
            if message is not None:
                raise _NativeTrap(message, status)
            return str(reply)
        python_reply: str | None = execute(run.store, request)
        return python_reply
    finally:
        _current.run = None
        if slot is not None:
            slot.run = None


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


def _classify(run: _Run, store: wasmtime.Store, exc: Exception) -> int | None:
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


# -- the compiled guest ------------------------------------------------------------------------

def _engine_config() -> wasmtime.Config:
    config = wasmtime.Config()
    for name, value in ENGINE_SETTINGS.items():
        if hasattr(wasmtime.Config, name):
            setattr(config, name, value)
        else:
            getattr(ffi, f"wasmtime_config_{name}_set")(config.ptr(), value)
    config.parallel_compilation = True
    return config


def _compiled_path(artifact: GuestArtifact) -> Path:
    settings = json.dumps(ENGINE_SETTINGS, sort_keys=True).encode()
    key = hashlib.sha256(settings).hexdigest()[:12]
    return (cache_dir() / "compiled"
            / f"{artifact.digest[:24]}-wasmtime-{WASMTIME_VERSION}-{key}.cwasm")


def _load_compiled(engine: wasmtime.Engine, artifact: GuestArtifact,
                   progress: Reporter) -> tuple[cm.Component, int]:
    """Load the compiled guest from the cache, compiling it first if needed."""
    path = _compiled_path(artifact)
    meta_path = path.with_suffix(".json")
    component = _deserialize(engine, path, meta_path)
    if component is None:
        with file_lock(path.with_suffix(".lock")):
            component = _deserialize(engine, path, meta_path)
            if component is None:
                component = _compile(engine, artifact, path, meta_path, progress)
    meta = json.loads(meta_path.read_text())
    return component, int(meta["min_memory_bytes"])


def _deserialize(engine: wasmtime.Engine, path: Path, meta_path: Path) -> cm.Component | None:
    if not (path.is_file() and meta_path.is_file()):
        return None
    try:
        return cm.Component.deserialize_file(engine, str(path))
    except wasmtime.WasmtimeError:
        return None  # stale or damaged: compile again


def _compile(engine: wasmtime.Engine, artifact: GuestArtifact, path: Path, meta_path: Path,
             progress: Reporter) -> cm.Component:
    with heartbeat(progress, f"compiling the guest for wasmtime {WASMTIME_VERSION}"):
        try:
            component = cm.Component.from_file(engine, str(artifact.path))
        except wasmtime.WasmtimeError as exc:
            raise GuestBuildError(f"wasmtime could not compile the guest: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + f".{os.getpid()}.tmp")
    staged.write_bytes(component.serialize())
    os.replace(staged, path)
    min_memory = _measure_min_memory(engine, component)
    staged_meta = meta_path.with_name(meta_path.name + f".{os.getpid()}.tmp")
    staged_meta.write_text(json.dumps({"min_memory_bytes": min_memory,
                                       "guest_digest": artifact.digest}))
    os.replace(staged_meta, meta_path)
    progress(f"compiled the guest ({path.stat().st_size / 2**20:.1f} MiB, cached)")
    return component


def _measure_min_memory(engine: wasmtime.Engine, component: cm.Component) -> int:
    """The smallest memory cap the snapshot can be instantiated under (64 KiB pages)."""
    linker = cm.Linker(engine)
    linker.add_wasip2()
    _define_host(linker)
    page = 1 << 16

    def fits(pages: int) -> bool:
        store = wasmtime.Store(engine)
        store.set_wasi(wasmtime.WasiConfig())
        store.set_fuel(_INSTANTIATION_FUEL)
        store.set_epoch_deadline(2**62)
        store.set_limits(memory_size=pages * page)
        try:
            linker.instantiate(store, component)
        except (wasmtime.WasmtimeError, wasmtime.Trap):
            return False
        return True

    low, high = 1, 1 << 14  # 64 KiB .. 1 GiB
    if not fits(high):
        raise GuestBuildError("the guest does not instantiate even with 1 GiB of memory")
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low * page
