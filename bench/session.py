"""Session benchmark: a session's per-call latency next to a fresh run, and restoring a
session's snapshot next to replaying its journal.

What it measures (everything is printed; nothing is asserted):

1. Per-call latency, in interleaved rounds so load on the machine hits each alike:
   - *fresh run*: ``Sandbox.run`` of a small program that first rebuilds the state it needs
     (each run is a fresh interpreter);
   - *session call*: ``Session.run`` of the same step on the state the earlier calls left;
   - *journaled session call*: the same, in a session that records its journal.
   Medians and p90 over ``--calls`` calls each, and the ratio of each to the fresh run.
2. For sessions of N calls (``--sizes``): the time to run the N calls live, to take a
   snapshot (``Session.snapshot()``) and its size, to restore it in a new session
   (``Sandbox.session(restore=...)``), and to replay its journal (``wasibox.replay``), each
   the median of ``--repeats``. Wasmtime cannot capture a component instance's memory,
   globals and tables, so a snapshot is journal-backed and restoring it re-executes the
   calls: restore costs about what replay costs. For scale, the time to make one fresh,
   primed guest instance is printed too: what restoring a captured memory image would
   cost at the least.

Run it directly:

    python bench/session.py [--calls 300] [--sizes 10,100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import wasibox
from wasibox.backends.wasm.runtime import runtime

#: One step of a notebook-like session: it reads and extends the state earlier steps left.
STEP = "rows.append(sum(range(200)) + len(rows))\nprint(len(rows))"
#: The state a fresh run must rebuild before the same step.
SETUP = "rows = [0] * 10\n"


def _ms(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return (statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.9)] * 1e3)


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def per_call(calls: int) -> None:
    print(f"1. per-call latency ({calls} calls each, interleaved)")
    with wasibox.Sandbox() as sandbox, sandbox.session() as session, \
            sandbox.session(journal=wasibox.Journal(max_bytes=1 << 30)) as journaled:
        for live in (session, journaled):
            assert live.run(SETUP).ok
        samples: dict[str, list[float]] = {"fresh run": [], "session call": [],
                                           "journaled session call": []}
        for _ in range(10):  # warm-up: the pool, the compile cache
            sandbox.run(SETUP + STEP)
            session.run(STEP)
            journaled.run(STEP)
        for _ in range(calls):
            samples["fresh run"].append(_timed(lambda: sandbox.run(SETUP + STEP)))
            samples["session call"].append(_timed(lambda: session.run(STEP)))
            samples["journaled session call"].append(_timed(lambda: journaled.run(STEP)))
    base = statistics.median(samples["fresh run"])
    for name, values in samples.items():
        median, p90 = _ms(values)
        print(f"   {name:<24} median {median:7.3f} ms   p90 {p90:7.3f} ms   "
              f"ratio to a fresh run {statistics.median(values) / base:5.2f}")


def restore_vs_replay(sizes: list[int], repeats: int) -> None:
    print(f"\n2. snapshot restore vs journal replay (median of {repeats})")
    rt = runtime()
    # What an instance of the guest component gives the host: its exports' kinds. A memory,
    # global or table of the core instances inside is not among them (nor reachable through
    # the C API), so there is no memory image to capture.
    exports = rt.component.type.exports(rt.engine)
    print("   the component's exports: " + ", ".join(
        f"{name} ({type(item.ty).__name__})" for name, item in exports.items()))
    instantiate = statistics.median(_timed(lambda: rt.instantiate("python"))
                                    for _ in range(max(repeats, 5)))
    print(f"   one fresh primed instance (the floor of a memory-image restore): "
          f"{instantiate * 1e3:.2f} ms")
    header = (f"   {'calls':>6} {'live':>10} {'snapshot':>10} {'size':>10} {'restore':>10} "
              f"{'replay':>10} {'restore/replay':>15}")
    print(header)
    with wasibox.Sandbox() as sandbox:
        for size in sizes:
            live_times, snapshot_times, restore_times, replay_times = [], [], [], []
            snapshot = b""
            for _ in range(repeats):
                started = time.perf_counter()
                with sandbox.session(journal=wasibox.Journal(max_bytes=1 << 30)) as session:
                    session.run(SETUP)
                    for _ in range(size - 1):
                        session.run(STEP)
                    live_times.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    snapshot = session.snapshot()
                    snapshot_times.append(time.perf_counter() - started)
                started = time.perf_counter()
                with sandbox.session(restore=snapshot) as restored:
                    restore_times.append(time.perf_counter() - started)
                    assert restored.run("print(len(rows))").stdout == f"{size + 9}\n"
                journal = wasibox.Journal.loads(snapshot, max_bytes=1 << 30)
                replay_times.append(_timed(functools.partial(wasibox.replay, journal)))
            live, snap, restore, replay = (statistics.median(values) * 1e3 for values in (
                live_times, snapshot_times, restore_times, replay_times))
            print(f"   {size:>6} {live:>8.1f}ms {snap:>8.2f}ms {len(snapshot) / 1024:>7.1f}KiB "
                  f"{restore:>8.1f}ms {replay:>8.1f}ms {restore / replay:>15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--sizes", default="10,100",
                        help="session lengths for restore vs replay, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runtime()  # build and load the guest before anything is timed
    per_call(args.calls)
    restore_vs_replay([int(size) for size in args.sizes.split(",")], args.repeats)


if __name__ == "__main__":
    main()
