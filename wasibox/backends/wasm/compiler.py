"""Programs compiled once per Sandbox, in a long-lived guest instance, and kept by source."""

from __future__ import annotations

import collections
import math
import threading
from typing import TYPE_CHECKING, Any

import wasmtime

from ..._wire import ProtocolError, decode_reply, encode_request, max_elements
from ..base import Job
from .engine import EPOCH_TICK_S, MIN_HOST_STACK
from .run import Run, call_guest
from .stack import call_with_stack

if TYPE_CHECKING:
    from .runtime import WasmRuntime

__all__ = ["COMPILER_HEAP_BYTES", "COMPILER_RECYCLE_AFTER", "COMPILE_CACHE_BYTES",
           "MAX_COMPILED_BYTES", "Compiler", "compile_in"]

#: Compiled programs kept per WasmBackend (so per Sandbox): source plus marshalled code.
COMPILE_CACHE_BYTES = 32 * 2**20
#: A compiled program larger than this is not kept; the run compiles it itself.
MAX_COMPILED_BYTES = 8 * 2**20
#: The compiler instance is replaced after this many compiles, so its heap cannot creep.
COMPILER_RECYCLE_AFTER = 1000
#: ... and as soon as its heap has grown past this, since linear memory never shrinks.
COMPILER_HEAP_BYTES = 64 * 2**20


class Compiler:
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
        compiled, reusable = compile_in(self._runtime, store, execute, job)
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


def compile_in(runtime_: WasmRuntime, store: wasmtime.Store, execute: Any,
                job: Job) -> tuple[bytes | None, bool]:
    """Compile ``job.code`` in the Python-path instance ``execute``, under ``job.limits``.

    Returns the marshalled code object (None if it does not compile), and whether the
    instance may compile again: not after a trap, nor once its heap has grown past
    COMPILER_HEAP_BYTES (linear memory never shrinks). Never raises for the guest's doing.
    """
    run = Run(job, store)  # for its limits; compiling writes no output
    request = encode_request({"op": "compile", "code": job.code, "seed": 0,
                              **({"filename": job.filename}
                                 if job.filename != "<sandbox>" else {})})
    store.set_fuel(job.limits.fuel)
    store.set_limits(memory_size=job.limits.memory_bytes)
    with runtime_.ticker:
        store.set_epoch_deadline(math.ceil(job.limits.timeout_s / EPOCH_TICK_S) + 1)
        try:
            # Compiling a hostile source recurses too: the same stack rule as a run.
            text = call_with_stack(lambda: call_guest(run, execute, request),
                                   MIN_HOST_STACK)
            reply = decode_reply(text or "", MAX_COMPILED_BYTES,
                                 max_elements(job.limits.memory_bytes))
        except (wasmtime.WasmtimeError, wasmtime.Trap, ProtocolError):
            return None, False  # an instance that trapped is never used again
    reusable = reply.heap_top <= COMPILER_HEAP_BYTES
    if reply.error is not None or type(reply.value) is not bytes:
        return None, reusable
    return reply.value, reusable
