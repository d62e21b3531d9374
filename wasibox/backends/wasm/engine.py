"""The Wasmtime engine and the compiled guest.

One ``Engine`` per runtime, with fuel and epoch interruption on and every proposal the guest
does not need off (``ENGINE_SETTINGS``, asserted by ``tests/security/test_engine.py``); the
``Ticker`` that advances its epoch while runs are active; and the compiled guest, cached as a
``.cwasm`` keyed by the guest digest, the wasmtime version and the engine settings, so a
process loads it in milliseconds instead of compiling it for ~20 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import component as cm

from ..._errors import GuestBuildError
from ..._guest import GuestArtifact, cache_dir, file_lock, installed_version
from ..._progress import Reporter, heartbeat
from .host import define_host

__all__ = ["ENGINE_SETTINGS", "EPOCH_TICK_S", "INSTANTIATION_FUEL", "MAX_WASM_STACK",
           "MIN_HOST_STACK", "TICKER_IDLE_S", "WASMTIME_VERSION", "Ticker", "compiled_path",
           "engine_config", "load_compiled"]

WASMTIME_VERSION = installed_version("wasmtime")
EPOCH_TICK_S = 0.01
#: How long the epoch ticker goes on ticking after the last run ended (see Ticker).
TICKER_IDLE_S = 1.0
#: The native stack compiled guest code may use before Wasmtime traps. The guest's CPython
#: raises RecursionError once it has used 128 KiB of its own (shadow) stack in linear memory
#: (guest/build.py fits that limit), and a C frame costs up to ~32 times more native stack
#: than shadow stack (measured on the paths CPython guards: repr, pickle, json, comparisons
#: of nested containers), so 4 MiB would do: 5 MiB leaves room for frames costlier still.
MAX_WASM_STACK = 5 << 20
#: The native stack a run needs: the guest's share, plus room for the host frames around it
#: (host functions called from the deepest guest frame run on the same stack). 7 MiB fits
#: the 8 MiB Linux gives the main thread and every default thread, so runs stay in place;
#: a thread with less runs its guests on a helper thread (see stack.py).
MIN_HOST_STACK = MAX_WASM_STACK + (2 << 20)
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
    # Not wrapped by wasmtime-py's Config (set through its C bindings, see engine_config);
    # the component-model async ABI is on by default in wasmtime 50 and the guest needs none
    # of it, nor the GC runtime.
    "wasm_component_model_async": False,
    "wasm_component_model_async_stackful": False,
    "wasm_component_model_more_async_builtins": False,
    "concurrency_support": False,
    "gc_support": False,
}
INSTANTIATION_FUEL = 10**12  # instantiating the snapshot runs no guest code; fuel is reset


class Ticker:
    """Advances the engine's epoch every EPOCH_TICK_S while runs are active, and for
    TICKER_IDLE_S after the last one ended.

    A run never wakes the ticker: it only counts itself in. Waking a waiting thread at the
    start of every run (a condition notify) handed it the GIL just as the run made its own
    ctypes calls, which then waited for the GIL back: ~0.5 ms of a 1 ms warm run on a busy
    machine. Ticking on through idle moments costs one short wake-up per tick instead, off
    any run's path; after TICKER_IDLE_S with no run the thread ends, and the next run
    starts another.

    This one serves where the native extension is unavailable; the extension's
    ``Ticker`` does the same on a C thread that never takes the GIL (see
    ``WasmRuntime.ticker``).
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
            # ``_thread`` is None once the loop ends, however it ends (see ``_loop``): no
            # ``is_alive()``, whose Python-level steps cost a paced warm run ~10 us.
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="wasibox-epoch",
                                                daemon=True)
                self._thread.start()

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            self._last_exit = time.monotonic()

    @property
    def running(self) -> bool:
        """Whether a thread is ticking now."""
        return self._thread is not None

    def _loop(self) -> None:
        try:
            while True:
                time.sleep(EPOCH_TICK_S)
                self._engine.increment_epoch()
                with self._lock:
                    if (self._active == 0
                            and time.monotonic() - self._last_exit > TICKER_IDLE_S):
                        self._thread = None
                        return
        finally:
            # Should the loop fail, the next run starts another: a run never waits on a
            # ticker that is gone (its timeout would never fire).
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None


def engine_config() -> wasmtime.Config:
    config = wasmtime.Config()
    for name, value in ENGINE_SETTINGS.items():
        if hasattr(wasmtime.Config, name):
            setattr(config, name, value)
        else:
            getattr(ffi, f"wasmtime_config_{name}_set")(config.ptr(), value)
    config.parallel_compilation = True
    return config


def compiled_path(artifact: GuestArtifact) -> Path:
    settings = json.dumps(ENGINE_SETTINGS, sort_keys=True).encode()
    key = hashlib.sha256(settings).hexdigest()[:12]
    return (cache_dir() / "compiled"
            / f"{artifact.digest[:24]}-wasmtime-{WASMTIME_VERSION}-{key}.cwasm")


def load_compiled(engine: wasmtime.Engine, artifact: GuestArtifact,
                   progress: Reporter) -> tuple[cm.Component, int]:
    """Load the compiled guest from the cache, compiling it first if needed.

    A guest compiled here is loaded back from the file it was cached in, as every later
    process loads it: only then is its memory image a mapping of that file. Compiled in
    memory, Wasmtime keeps the image in an anonymous memfd, which the slot populator (see
    slots.py) does not find, so no slot was populated and every reset copied the whole
    image back: a no-pool run in the runtime that compiled the guest cost 1.4-1.5x the CPU
    of one in a runtime that loaded it (4.58 vs 3.32 ms). Loading it back costs ~60 ms, once.
    """
    path = compiled_path(artifact)
    meta_path = path.with_suffix(".json")
    component = _deserialize(engine, path, meta_path)
    if component is None:
        with file_lock(path.with_suffix(".lock")):
            component = _deserialize(engine, path, meta_path)
            if component is None:
                compiled = _compile(engine, artifact, path, meta_path, progress)
                component = _deserialize(engine, path, meta_path)
                if component is None:  # the file cannot be read back: correct, resets cost more
                    component = compiled
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
    define_host(linker)
    page = 1 << 16

    def fits(pages: int) -> bool:
        store = wasmtime.Store(engine)
        store.set_wasi(wasmtime.WasiConfig())
        store.set_fuel(INSTANTIATION_FUEL)
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
