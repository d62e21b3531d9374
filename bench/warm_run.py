"""Where a paced warm-pool run's time goes: ``Sandbox.run("print(1+1)")`` taken apart.

Each run finds a primed instance in the warm pool (``--gap-ms`` of idle time before it, as
``latency.py``'s paced figure). For each run, on the calling thread, it measures wall and CPU
time and minor page faults (``getrusage(RUSAGE_THREAD)``) of:

- *host before the call*: ``Sandbox.run`` up to the backend (checks, admission, backend
  choice), then the backend up to the guest call (request, pool take, run state, ticker);
  a plain run such as this one takes the backend's prepared path (``PlainRuns``);
- *the guest call* (``call_guest``; for a plain run, ``native.run_plain``, which also makes
  the run's C state before the call and its RunResult after it, in C): the wasm code, the
  page faults it takes on copy-on-write pages the priming did not touch, and its
  host-function calls;
- *host after the call*: the outcome, releasing the instance, and decoding the reply into the
  RunResult.

Then the guest's work in fuel, split at ``runner.start`` (the host meters a program from
there): the runner's work before the program (taking the request, decoding it, loading the
program) and ``fuel_used`` (the program and the runner's work after it), the call's wall
time per unit of fuel next to a hot loop's, and, for programs that make objects, the whole
run's CPU time and minor page faults on the calling thread; last, the process's CPU per
second while the epoch ticker ticks (the extension's C thread, and the Python one); and
which of the CPU's caches the idle gap empties: the guest call of a freshly primed instance
after nothing, after sleep or a busy loop of 2-100 ms, and after this thread writes buffers
of 256 KiB (the per-core caches) to 64 MiB (past this machine's shared L3). Nothing is
asserted; medians are printed.

    python bench/warm_run.py [--runs 300] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

from wasmtime import _ffi as ffi

import wasibox
from wasibox._limits import Limits
from wasibox._wire import encode_request
from wasibox.backends.base import Job, Policy
from wasibox.backends.wasm import backend as wasm_backend
from wasibox.backends.wasm import host
from wasibox.backends.wasm.compiler import Compiler
from wasibox.backends.wasm.engine import Ticker
from wasibox.backends.wasm.run import NativeRun, Run, call_guest
from wasibox.backends.wasm.runtime import WasmRuntime
from wasibox.backends.wasm.runtime import runtime as wasm_runtime

CODE = "print(1+1)"
LOOP = "x = 0\nfor i in range(3000):\n    x += i\nprint(1+1)"
WARMUP_RUNS = 20

Stamp = tuple[float, float, int]


def stamp() -> Stamp:
    """Wall time, this thread's CPU time and its minor page faults so far."""
    return time.perf_counter(), time.thread_time(), resource.getrusage(
        resource.RUSAGE_THREAD).ru_minflt


def stamped(marks: dict[str, Stamp], before: str, after: str,
            function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, recording a stamp in ``marks`` before and after each call."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        marks[before] = stamp()
        try:
            return function(*args, **kwargs)
        finally:
            marks[after] = stamp()
    return wrapper


def phases(runs: int, gap_s: float) -> None:
    marks: dict[str, Stamp] = {}
    # A plain run (nothing but the code set) takes the backend's prepared path, PlainRuns;
    # any other run takes WasmBackend.execute. Both are stamped, so either way is split.
    wasm_backend.call_guest = stamped(marks, "call", "called", wasm_backend.call_guest)
    native = wasm_runtime().native.module
    if native is not None:
        native.run_plain = stamped(marks, "call", "called", native.run_plain)
    wasm_backend.WasmBackend.execute = stamped(  # type: ignore[method-assign]
        marks, "backend", "backend done", wasm_backend.WasmBackend.execute)
    wasm_backend.PlainRuns.__call__ = stamped(  # type: ignore[method-assign]
        marks, "backend", "backend done", wasm_backend.PlainRuns.__call__)
    rows = []
    with wasibox.Sandbox() as sandbox:
        for index in range(runs + WARMUP_RUNS):
            time.sleep(gap_s)
            started = stamp()
            result = sandbox.run(CODE)
            ended = stamp()
            if result.stdout != "2\n":
                raise SystemExit(f"bench: the run printed {result.stdout!r}: {result}")
            if index >= WARMUP_RUNS:
                rows.append([started, marks["backend"], marks["call"], marks["called"],
                             marks["backend done"], ended])
    labels = ["Sandbox.run to the backend", "backend to the guest call", "the guest call",
              "after the call, in the backend", "after the backend (the RunResult)"]
    print(f"  {'phase':<36} {'wall ms':>9} {'CPU ms':>9} {'faults':>7}   (medians of {runs}; "
          "faults: mean)")
    for index, label in enumerate([*labels, "total"]):
        first, last = (0, 5) if label == "total" else (index, index + 1)
        wall, cpu = (statistics.median(row[last][part] - row[first][part] for row in rows)
                     for part in range(2))
        faults = statistics.mean(row[last][2] - row[first][2] for row in rows)
        print(f"  {label:<36} {wall * 1e3:>9.3f} {cpu * 1e3:>9.3f} {faults:>7.1f}")


def fuel_split() -> None:
    """The guest's fuel before ``runner.start`` and after it, on the Python run path (where
    the host's ``start`` is Python, so the fuel left can be read before it is reset)."""
    before_start: list[int] = []
    start = host._start

    def recording_start(run: Run, context: Any) -> None:
        if not run.started:
            left = ctypes.c_uint64(0)
            ffi.wasmtime_context_get_fuel(context, ctypes.byref(left))
            before_start.append(run.job.limits.fuel - left.value)
        start(run, context)

    host._start = recording_start  # read when the runtime below defines its host functions
    runtime = WasmRuntime(run_path="python", pool_size=0)
    with wasibox.Sandbox(backend=wasm_backend.WasmBackend(runtime)) as sandbox:
        for code in (CODE, "pass"):
            result = sandbox.run(code)
            print(f"  {code!r:<14} runner before the program {before_start[-1]:>9,}   "
                  f"fuel_used {result.fuel_used:>9,}   whole call "
                  f"{before_start[-1] + result.fuel_used:>9,}")
    host._start = start


def call_rate(runs: int, gap_s: float) -> None:
    """The guest call's wall time per unit of fuel: ``print(1+1)`` against a hot loop."""
    figures = {}
    with wasibox.Sandbox() as sandbox:
        for code in (CODE, LOOP):
            durations, fuel = [], 0
            for index in range(runs + WARMUP_RUNS):
                time.sleep(gap_s)
                result = sandbox.run(code)
                fuel = result.fuel_used
                if index >= WARMUP_RUNS:
                    durations.append(result.duration_s)
            figures[code] = statistics.median(durations), fuel
    (small_s, small_fuel), (loop_s, loop_fuel) = figures[CODE], figures[LOOP]
    print(f"  print(1+1): backend duration {small_s * 1e3:.3f} ms for {small_fuel:,} fuel")
    print(f"  a hot loop's extra fuel runs at "
          f"{(loop_s - small_s) * 1e9 / (loop_fuel - small_fuel):.2f} ns per unit")


#: Programs that make objects: each new object is a chunk of the guest's C heap (this
#: CPython has no small-object allocator on WASI), so these show where the heap hands out
#: memory from, in page faults.
OBJECT_PROGRAMS = [
    "x = [i * i for i in range(1000)]\nprint(sum(x))",
    "d = {str(i): i for i in range(300)}\nprint(len(d))",
    "import json\nprint(json.dumps({'a': list(range(200)), 'b': 'x' * 3000}))",
]


def object_programs(runs: int, gap_s: float) -> None:
    """Paced runs of ``OBJECT_PROGRAMS``: the calling thread's CPU and minor page faults."""
    with wasibox.Sandbox() as sandbox:
        for code in OBJECT_PROGRAMS:
            cpu, faults, fuel = [], [], 0
            for index in range(runs + WARMUP_RUNS):
                time.sleep(gap_s)
                _, cpu_before, faults_before = stamp()
                result = sandbox.run(code)
                _, cpu_after, faults_after = stamp()
                fuel = result.fuel_used
                if index >= WARMUP_RUNS:
                    cpu.append(cpu_after - cpu_before)
                    faults.append(faults_after - faults_before)
            print(f"  {statistics.median(cpu) * 1e3:6.3f} ms CPU {statistics.mean(faults):6.1f} "
                  f"faults {fuel:>11,} fuel   {code.splitlines()[0][:40]!r}")


def ticker_cost(seconds: float = 3.0) -> None:
    """The process's CPU per second while the epoch ticker ticks and nothing else runs: the
    runtime's (the extension's C thread where it loads) and the Python one, on one engine."""
    rt = wasm_runtime()
    kinds = {"the runtime's": rt.ticker, "Python (engine.Ticker)": Ticker(rt.engine)}
    for name, ticker in kinds.items():
        with ticker:
            time.sleep(0.2)
            cpu = time.process_time()
            time.sleep(seconds)
            used = time.process_time() - cpu
        kind = f"{type(ticker).__module__}.{type(ticker).__name__}"
        print(f"  {name:<24} {kind:<40} {used / seconds * 1e3:6.2f} ms of CPU per second "
              "of ticking")
        while ticker.running:  # let it end, so the next one ticks alone
            time.sleep(0.05)


def _spin(seconds: float) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass


def _write_lines(buffer: bytearray) -> None:
    """Write one byte in each 64-byte line of ``buffer``."""
    buffer[::64] = bytes(len(range(0, len(buffer), 64)))


def gap_contents(runs: int) -> None:
    """The guest call of a primed instance (made just before, in this thread) after each of
    several things filling the gap, the variants taken in turn within each round."""
    rt = WasmRuntime(pool_size=0)
    native = rt.native.module
    if native is None:
        print(f"  skipped: the native run path is unavailable ({rt.native.reason})")
        return
    job = Job(op="run", code=CODE, limits=Limits(), policy=Policy())
    fields = job.request()
    fields["compiled"] = Compiler(rt).compile(job)  # as a Sandbox's plain runs send it
    request = encode_request(fields)
    buffers = {size: bytearray(size) for size in (256 << 10, 4 << 20, 16 << 20, 64 << 20)}
    gaps: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "2 ms of sleep": lambda: time.sleep(0.002),
        "2 ms of busy loop": lambda: _spin(0.002),
        "20 ms of sleep": lambda: time.sleep(0.02),
        "20 ms of busy loop": lambda: _spin(0.02),
        "100 ms of sleep": lambda: time.sleep(0.1),
        **{f"writing {size >> 10:,} KiB": functools.partial(_write_lines, buffer)
           for size, buffer in buffers.items()},
    }
    timings: dict[str, list[float]] = {name: [] for name in gaps}
    for _ in range(runs):
        for name, gap in gaps.items():
            store, execute = rt.instantiate()
            run = NativeRun(job, store, native)
            gap()
            started = time.perf_counter()
            reply = call_guest(run, execute, request, arm=True)
            timings[name].append(time.perf_counter() - started)
            run.collect()
            if reply is None or '"error"' in reply or bytes(run.stdout) != b"2\n":
                raise SystemExit(f"bench: the call replied {reply!r}, printed {run.stdout!r}")
            del run, store, execute
    for name, durations in timings.items():
        print(f"  after {name:<24} {statistics.median(durations) * 1e3:7.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    options = parser.parse_args()
    gap_s = options.gap_ms / 1e3
    print(f"== a paced warm-pool run of {CODE!r}, {options.gap_ms:.0f} ms apart ==")
    phases(options.runs, gap_s)
    print("\n== the guest's fuel, split at runner.start ==")
    fuel_split()
    print("\n== the guest call's time per unit of fuel ==")
    call_rate(max(options.runs // 3, 50), gap_s)
    print("\n== programs that make objects: the whole run, CPU (median) and faults (mean) ==")
    object_programs(max(options.runs // 3, 50), gap_s)
    print("\n== the epoch ticker's own cost ==")
    ticker_cost()
    print("\n== which caches the gap empties: the guest call after ... (medians) ==")
    gap_contents(max(options.runs // 5, 30))


if __name__ == "__main__":
    main()
