"""``WasmBackend``: the seam (``backends/base.py``) for Wasmtime, and its sessions.

Each run gets a fresh instance (from the runtime's pool when it can), one call under the
job's fuel, memory, output and time limits, and an ``Outcome`` measured by the host. A
session keeps one instance for its calls instead. ``PlainRuns`` is the same for a Sandbox's
plain runs (``run(code)`` and nothing else), with what does not change between them made once.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Any, Literal

import wasmtime
from wasmtime import _ffi as ffi

from ..._control import RunControl, RunState
from ..._errors import GuestBuildError, UsageError
from ..._limits import Limit, Limits
from ..._result import GuestException, Outcome, RunResult
from ..._wire import encode_request
from ...capabilities.files.session import FileSession
from ..base import Backend, BackendSession, Job, Policy
from .compiler import Compiler
from .engine import MIN_HOST_STACK
from .host import NO_FINALIZER, ON_EPOCH_DEADLINE
from .run import NativeRun, NativeTrap, Run, call_guest, native_state, plain_config
from .runtime import RunPath, WasmRuntime, checked_run_path, runtime
from .stack import call_with_stack
from .traps import classify

__all__ = ["PLAIN_REQUEST_CACHE_BYTES", "PlainRuns", "WasmBackend"]


class WasmBackend(Backend):
    """Runs each job in a fresh instance of the CPython guest under Wasmtime."""

    name = "wasm"

    def __init__(self, runtime_: WasmRuntime | None = None, *,
                 pool_size: int | None = None, run_path: RunPath | None = None) -> None:
        """``run_path`` picks the native or the Python run path (default: the runtime's).

        Raises UsageError if ``run_path`` is "native" and the extension is unavailable.
        """
        self._runtime = runtime_ or runtime()
        chosen = checked_run_path(run_path) if run_path is not None else "auto"
        if chosen == "native" and self._runtime.native.module is None:
            raise UsageError(
                f"the native run path is unavailable: {self._runtime.native.reason}")
        #: The run path of this backend's runs.
        self.run_path: Literal["native", "python"] = (
            self._runtime.run_path if chosen == "auto" else chosen)
        self._compiler = Compiler(self._runtime)
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
        run = Run(job, store) if native is None else NativeRun(job, store, native)
        if native is None:  # the native path's call sets it (see _call)
            store.set_limits(memory_size=job.limits.memory_bytes)
        outcome = _call(rt, run, execute, request, control, started)
        used: list[object] = [store, execute, run]
        del store, execute, run
        # Last: making an instance would slow this run's remaining ctypes calls.
        rt.release(used)
        return outcome

    def plain_runs(self, limits: Limits, policy: Policy,
                   packages: tuple[str, ...]) -> PlainRuns | None:
        """The plain runs of a Sandbox with ``limits`` and ``policy`` (and the package set
        ``packages`` in its results), prepared: on the native path, with no mounts, host
        functions or HTTP granted; else None."""
        rt = self._runtime
        if (self.run_path != "native" or rt.run_path != "native" or policy.mounts
                or policy.functions or policy.http is not None
                or limits.memory_bytes < rt.min_memory_bytes):
            return None
        return PlainRuns(self, limits, policy, packages)

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


#: Encoded requests a PlainRuns keeps, by source, least recently added out first: a
#: service, a transform or a fuzzer runs the same few sources again and again.
PLAIN_REQUEST_CACHE_BYTES = 4 * 2**20


class PlainRuns:
    """A Sandbox's plain runs (``run(code)`` with nothing else set), prepared once.

    Each run still gets a fresh pooled instance, under the Sandbox's fuel, memory, output
    and time limits, with its reply left to the Sandbox to decode as untrusted. What a
    warm run on a paced service spent its host time on was Python, run cold (its code and
    data out of the CPU's caches after the idle gap): about 25 steps between
    ``Sandbox.run`` and the guest call and back, each of 1-40 us. So what does not change
    between runs is made once here (the C-side run state with the limits and the seeded
    generator, copied per run by ``native.Run.fresh``; the result's fixed fields; the
    encoded request of recent sources), and the run itself, from its fresh state to its
    RunResult, is one C call (``native.run_plain``), which makes no Python ``Run`` unless
    the guest calls a host function written in Python. A trap, an exit or a limit goes
    through the same ``classify`` as any run.
    """

    def __init__(self, backend: WasmBackend, limits: Limits, policy: Policy,
                 packages: tuple[str, ...]) -> None:
        self._backend = backend
        self._runtime = backend._runtime
        native = backend._runtime.native.module
        assert native is not None  # see WasmBackend.plain_runs
        self._native = native
        self._job = Job(op="run", code="", limits=limits, policy=policy)
        #: What every run shares, for ``native.run_plain`` (see its comment for the order):
        #: the C-side run state with the limits and the seeded generator (never run: each
        #: run's is a copy), the RunResult's fixed fields, and the limits.
        self._config = plain_config(
            native_state(native, self._job), self._runtime.ticker, self._adopt,
            fuel=limits.fuel, memory_floor=self._runtime.min_memory_bytes,
            memory_limit=limits.memory_bytes, timeout_s=limits.timeout_s,
            backend=backend.name, packages=packages)
        self._requests: dict[str, bytes] = {}
        self._requests_bytes = 0
        self._lock = threading.Lock()

    def __call__(self, code: str) -> RunResult | Outcome:
        """Run ``code``: its RunResult when the guest gave the plain reply (no error, no
        value) and no fault or limit ended it, as most runs end; else the Outcome, for the
        caller's ``build_result``. Raises GuestBuildError if no instance can be made."""
        request = self._requests.get(code)
        if request is None:
            request = self._request(code)
        rt = self._runtime
        started = time.perf_counter()
        try:
            store, execute = rt.take()
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise GuestBuildError(f"wasmtime could not instantiate the guest: {exc}") from None
        answer = self._native.run_plain(self._config, code, request, store, started,
                                        MIN_HOST_STACK)
        if answer is None:  # this thread's stack is too small for the guest: never entered
            answer = call_with_stack(self._native.run_plain, MIN_HOST_STACK, self._config,
                                     code, request, store, started, 0)
        if type(answer) is RunResult:
            used: list[object] = [store, execute]
            del store, execute
            rt.release(used)
            return answer
        (reply, message, status, stdout, stderr, stdout_cut, stderr_cut, limit, fault, _,
         fuel_left, plain, run, adopt) = answer
        limits = self._job.limits
        result: Outcome
        if run is None and message is None:
            result = Outcome(
                reply=reply, plain_reply=plain, stdout=stdout, stderr=stderr,
                stdout_truncated=stdout_cut, stderr_truncated=stderr_cut,
                limit_exceeded=None if limit is None else Limit(limit),
                fault=(GuestException(type=fault[0], message=fault[1], traceback="")
                       if fault is not None and limit is None else None),
                fuel_used=limits.fuel - fuel_left,
                memory_peak_bytes=rt.min_memory_bytes, memory_limit_bytes=limits.memory_bytes,
                duration_s=time.perf_counter() - started)
        else:  # a trap, an exit, or a host function in Python was called: as any run
            adopted = run if isinstance(run, NativeRun) else adopt()
            adopted.collect()
            exit_code = (None if message is None
                         else classify(adopted, store, NativeTrap(message, status)))
            result = _outcome(rt, adopted, None if message is not None else reply, exit_code,
                              time.perf_counter() - started)
            run = adopted
        used = [store, execute, run, adopt]
        del store, execute, run, adopt
        rt.release(used)
        return result

    def _adopt(self, code: str, store: wasmtime.Store, state: Any,
               deadline: float) -> NativeRun:
        """The Python side of a plain run, made when it is needed."""
        run = NativeRun(dataclasses.replace(self._job, code=code), store, self._native, state)
        run.deadline = deadline
        return run

    def _request(self, code: str) -> bytes:
        """``code``'s encoded request, kept if its program compiled."""
        job = dataclasses.replace(self._job, code=code)
        fields = job.request()
        compiled = self._backend._compiler.compile(job)
        if compiled is not None:
            fields["compiled"] = compiled
        request = encode_request(fields).encode()
        if compiled is None or len(request) + len(code) > PLAIN_REQUEST_CACHE_BYTES // 4:
            return request
        with self._lock:
            if code not in self._requests:
                self._requests[code] = request
                self._requests_bytes += len(request) + len(code)
            while self._requests_bytes > PLAIN_REQUEST_CACHE_BYTES:
                old_code, old_request = next(iter(self._requests.items()))
                del self._requests[old_code]
                self._requests_bytes -= len(old_request) + len(old_code)
        return request


def _call(rt: WasmRuntime, run: Run, execute: Any, request: str, control: RunControl,
          started: float) -> Outcome:
    """Make one call into an instance under ``run.job``'s limits, and measure it.

    A native run's store gets its memory cap, fuel and epoch deadline in the C call itself
    (``call_guest``'s ``arm``), where a session's call (always on the Python path) gets
    them here; the memory cap of other runs is set by ``WasmBackend.execute``.
    """
    job, store = run.job, run.store
    native = isinstance(run, NativeRun)
    if not native:
        store.set_fuel(job.limits.fuel)
    reply: str | None = None
    exit_code: int | None = None
    control.enter(RunState.RUNNING)
    detach = control.on_cancel(run.interrupt)
    with rt.ticker:
        if not native:  # the native path's C callback was set when made, its deadline by C
            ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), ON_EPOCH_DEADLINE,
                                                       None, NO_FINALIZER)
            store.set_epoch_deadline(1)  # _on_epoch_deadline checks the deadline every tick
        run.deadline = time.monotonic() + job.limits.timeout_s
        try:
            if run.cancelled:  # cancelled while instantiating: skip the guest entirely
                run.stop(Limit.CANCELLED)
            # Not a closure: the store must be dropped by whoever ``release`` hands it to.
            reply = call_with_stack(call_guest, MIN_HOST_STACK, run, execute, request, native)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            exit_code = classify(run, store, exc)
        finally:
            detach()
    return _outcome(rt, run, reply, exit_code, time.perf_counter() - started)


def _outcome(rt: WasmRuntime, run: Run, reply: str | None, exit_code: int | None,
             duration: float) -> Outcome:
    """What the host measured of ``run``'s call, which ended with ``reply`` (or trapped)."""
    job, store = run.job, run.store
    if isinstance(run, NativeRun):
        fuel_used = job.limits.fuel - run.native.fuel_left
    else:
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
        run = Run(job, store)
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
