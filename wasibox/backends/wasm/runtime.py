"""The per-process runtime: engine, compiled guest, linkers and the warm instance pool.

``runtime()`` gives the process-wide runtime of the built guest (or of a guest derived for a
package set). Its pool makes and primes instances ahead of demand on a filler thread, and
drops used ones there too, so that a run pays only for its call.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal

import wasmtime
from wasmtime import component as cm

from ..._batch import use_native_encoder
from ..._errors import GuestBuildError, UsageError
from ..._guest import GuestArtifact, ensure_guest
from ..._limits import Limits
from ..._progress import Reporter, library_reporter
from ..._wire import encode_request
from ..base import Job, Policy
from .compiler import compile_in
from .engine import (
    EPOCH_TICK_S,
    INSTANTIATION_FUEL,
    MIN_HOST_STACK,
    TICKER_IDLE_S,
    Ticker,
    compiled_path,
    engine_config,
    load_compiled,
)
from .host import define_host
from .native import NativeBuild
from .native import load as load_native
from .run import GuestStore, NativeRun, Run, address_of, c_output, call_guest
from .slots import SlotPopulator, SlotReuse, configure_pooling, slot_reuse
from .stack import call_with_stack

__all__ = ["MAX_DISCARDS", "MAX_POOL_SIZE", "PRIMING_JOB", "RUN_PATH_ENV", "RunPath",
           "WasmRuntime", "checked_run_path", "doctor_rows", "runtime"]

#: Where runs execute: "native" (the C extension, see native/), "python" (wasmtime-py), or
#: "auto" (native where it can be built). Chosen per backend, or for the process by
#: WASIBOX_RUN_PATH.
RunPath = Literal["auto", "native", "python"]
RUN_PATH_ENV = "WASIBOX_RUN_PATH"
#: The most instances a runtime keeps warm, however large a Sandbox's max_concurrency.
MAX_POOL_SIZE = 64
#: The most used instances waiting for the filler to drop them; past it, runs drop their own.
MAX_DISCARDS = 4
#: What every instance runs before it serves a run: the paths a typical run takes (load the
#: compiled program, exec, print, call, return a value), so that their pages are already
#: copied. Its code is compiled once per runtime, in a guest (see ``_priming_request``):
#: compiling it in every instance cost a third of a fresh instance's CPU.
PRIMING_JOB = Job(op="call", code="def prime():\n    print('wasibox')\n    return [1]",
                  entry="prime", limits=Limits(), policy=Policy())


class WasmRuntime:
    """The per-process part of the backend: engine, compiled guest, linker, instance pool."""

    def __init__(self, artifact: GuestArtifact | None = None, *, pool_size: int = 1,
                 progress: Reporter | None = None, run_path: RunPath | None = None,
                 reuse_slots: bool = True) -> None:
        """``run_path`` as WasmBackend's; ``reuse_slots=False`` keeps Wasmtime's default
        allocator (benchmarks compare with it). Raises UsageError if ``run_path`` is
        "native" and the extension is unavailable, GuestBuildError if the guest cannot
        be built or compiled."""
        requested = checked_run_path(run_path)
        self.artifact = artifact or ensure_guest(progress)
        config = engine_config()
        #: Whether memory slots are reused between instances, and why (see slots.py).
        self.slot_reuse: SlotReuse = (configure_pooling(config) if reuse_slots else
                                      SlotReuse(False, "turned off for this runtime"))
        self.engine = wasmtime.Engine(config)
        self.component, self.min_memory_bytes = load_compiled(
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
            # A transform's records encode in C from now on (the same bytes as in Python).
            use_native_encoder(self.native.module.encode_keyed)
            self._native_linker = cm.Linker(self.engine)
            self._native_linker.add_wasip2()
            define_host(self._native_linker, self.native.module)
        self._slots = (SlotPopulator(compiled_path(self.artifact).resolve())
                       if self.slot_reuse.enabled else None)
        self.linker = cm.Linker(self.engine)
        self.linker.add_wasip2()
        define_host(self.linker)
        #: Advances the engine's epoch while runs are active: the extension's (a thread that
        #: never takes the GIL) where it loaded, else the same in Python.
        self.ticker: Ticker | Any = (
            Ticker(self.engine) if self.native.module is None
            else self.native.module.Ticker(self.engine, address_of(self.engine.ptr()),
                                           EPOCH_TICK_S, TICKER_IDLE_S))
        self._priming_request = _priming_request(self)
        _runtimes.add(self)
        self._pool: collections.deque[tuple[GuestStore, Any]] = collections.deque()
        self._pool_size = pool_size
        self._base_pool_size = pool_size
        self._pool_requests: dict[object, int] = {}
        #: Used instances the filler drops (see ``release``).
        self._discards: collections.deque[object] = collections.deque()
        self._pool_lock = threading.RLock()
        #: Wakes the filler: a run's release puts a token, the filler takes them. A
        #: Condition's notify is Python code (~30 steps), which a paced run executed cold
        #: after its call, ~20 us; a SimpleQueue's put is one C call. A token is only a
        #: hint: the filler checks the pool under the lock each time it wakes.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._filler: threading.Thread | None = None
        self._closed = False

    def instantiate(self, run_path: Literal["native", "python"] | None = None,
                    preopens: Sequence[tuple[str, str]] = ()) -> tuple[GuestStore, Any]:
        """A fresh, primed store and instance of the guest for ``run_path`` (by default this
        runtime's), and its ``execute`` export. ``preopens`` are (host directory, guest
        path) pairs the guest's C code sees, writable (``FileSession.preopens``)."""
        native = self.native.module if (run_path or self.run_path) == "native" else None
        store, execute = self._new_instance(native, preopens)
        _prime(store, execute, native, self._priming_request)
        return store, execute

    def _new_instance(self, native: ModuleType | None,
                      preopens: Sequence[tuple[str, str]] = ()) -> tuple[GuestStore, Any]:
        """A fresh store and instance (not primed) for the native path if ``native``, else
        for the Python path, with ``preopens`` as ``instantiate``'s; raises GuestBuildError
        if the guest exports no ``execute``."""
        linker = self._native_linker if native is not None else self.linker
        assert linker is not None
        store = GuestStore(self.engine)
        wasi = wasmtime.WasiConfig()
        wasi.stdout_custom = c_output(1, store.output)
        wasi.stderr_custom = c_output(2, store.output)
        for host, guest in preopens:
            wasi.preopen_dir(host, guest, True)
        store.set_wasi(wasi)
        store.set_fuel(INSTANTIATION_FUEL)
        store.set_epoch_deadline(2**62)
        instance = linker.instantiate(store, self.component)
        if self._slots is not None:
            self._slots.track(store)
        execute = instance.get_func(store, "execute")
        if execute is None:
            raise GuestBuildError("the guest component exports no `execute` function; "
                                  "rebuild it with `wasibox prepare`")
        if native is not None:
            native.arm(address_of(store.ptr()))  # the epoch deadline, decided in C
            store.bind(execute)
        return store, execute

    def take(self) -> tuple[GuestStore, Any]:
        """A pre-made instance if one is ready, else a new one.

        Taking a pre-made instance does not start its replacement: the caller calls
        ``release`` once its run is over. Making an instance takes several milliseconds of
        CPU and of the GIL, which the run would otherwise compete for (every ctypes call and
        host callback of the run waits for the GIL): that doubled the p90 latency of a run.
        """
        try:
            return self._pool.popleft()  # atomic: the filler appends under the lock
        except IndexError:
            pass
        with self._pool_lock:
            self._wake.put(None)  # the pool is behind: refill it while this run waits
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
        with self._pool_lock:
            if self._pool_size > 0 and not self._closed and len(self._discards) < MAX_DISCARDS:
                self._discards.append(tuple(used))
                used.clear()
            if self._discards or len(self._pool) < self._pool_size:
                self._wake.put(None)
                if self._filler is None:  # not a call per run: it ends only when idle
                    self._start_filler()

    def request_pool_size(self, size: int) -> Callable[[], None]:
        """Keep up to ``size`` instances warm (the largest request wins, capped at
        MAX_POOL_SIZE) until the returned function is called; it is idempotent."""
        key = object()
        with self._pool_lock:
            self._pool_requests[key] = min(max(size, 0), MAX_POOL_SIZE)
            self._resize_pool()

        def release() -> None:
            with self._pool_lock:
                if self._pool_requests.pop(key, None) is not None:
                    self._resize_pool()

        return release

    def pool_status(self) -> tuple[int, int]:
        """(instances ready in the warm pool, instances it aims to keep ready)."""
        with self._pool_lock:
            return len(self._pool), self._pool_size

    def _resize_pool(self) -> None:
        self._pool_size = max([self._base_pool_size, *self._pool_requests.values()])
        while len(self._pool) > self._pool_size:
            self._pool.pop()  # an unused instance is dropped with its store
        self._wake.put(None)
        self._start_filler()

    def _start_filler(self) -> None:
        # ``_filler`` is None once the filler ends, however it ends (see ``_fill``): no
        # ``is_alive()`` on every run's release.
        if self._pool_size > 0 and self._filler is None:
            self._filler = threading.Thread(target=self._fill, name="wasibox-pool", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        try:
            self._fill_until_idle()
        finally:
            with self._pool_lock:
                if self._filler is threading.current_thread():
                    self._filler = None  # ended or failed: the next release starts another

    def _has_work(self) -> bool:
        """With the lock held: whether the filler has something to do."""
        return self._closed or bool(self._discards) or len(self._pool) < self._pool_size

    def _fill_until_idle(self) -> None:
        while True:
            with self._pool_lock:
                idle = not self._has_work()
            if idle:
                try:
                    self._wake.get(timeout=5.0)
                except queue.Empty:
                    with self._pool_lock:
                        if not self._has_work():  # five idle seconds: end (see _start_filler)
                            self._filler = None
                            return
                continue
            with self._pool_lock:
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
            with self._pool_lock:
                if self._closed:
                    return
                self._pool.append(slot)

    def close(self, *, wait_s: float = 0.0) -> None:
        """Drop the pool and stop the filler; wait up to ``wait_s`` for it to end."""
        with self._pool_lock:
            self._closed = True
            self._pool.clear()
            self._discards.clear()
            self._wake.put(None)
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
    # "prime": the runner collects the priming job's garbage before it returns, off the
    # run's path (see wasibox/_wire.py).
    fields = dict(PRIMING_JOB.request(), prime=True)
    store, execute = runtime_._new_instance(None)
    compiled, _ = compile_in(runtime_, store, execute, PRIMING_JOB)
    if compiled is not None:
        fields["compiled"] = compiled
    return encode_request(fields)


def _prime(store: wasmtime.Store, execute: Any, native: ModuleType | None,
           request: str) -> None:
    """Run ``PRIMING_JOB`` (``request``) in a new instance; its output and reply are
    dropped."""
    run = Run(PRIMING_JOB, store) if native is None else NativeRun(PRIMING_JOB, store, native)
    call_with_stack(lambda: call_guest(run, execute, request), MIN_HOST_STACK)


_runtime: WasmRuntime | None = None
_derived_runtimes: dict[str, WasmRuntime] = {}  # by guest digest: guests with packages
_runtime_lock = threading.Lock()


def doctor_rows() -> list[tuple[str, str]]:
    """What ``wasibox doctor`` reports about this backend, without starting an engine."""
    reuse = slot_reuse()
    try:
        requested = checked_run_path(None)
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


def checked_run_path(run_path: RunPath | None) -> RunPath:
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
