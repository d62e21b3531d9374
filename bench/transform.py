"""Transform throughput: wasibox.Transform against host CPython on the same function.

Over ``--records`` records (default 100,000) of customers, strings and numbers with a list
of tags (``{"id", "name", "city", "price", "qty", "tags"}``), a function that reads them all,
formats a string and computes a total (``CODE``), prints records/s for host CPython (a plain
list comprehension) and for ``Transform.map`` at several batch sizes, the ratio between them
(target: 8 or less at the default settings), the fuel burnt, and where the wasibox time goes
(host-side encode and decode, measured separately on the same records; the guest's fuel per
record in each phase of a batch). ``--kind numbers`` runs the earlier records of numbers
only (``{"id", "price", "qty"} -> {"id", "total"}``) instead. Medians over ``--repeat``
rounds, all measured in this one process, in wall time and in CPU time (the process's, all
threads; host CPython's thread), which other load on the machine disturbs less; each round
runs host CPython and then the batch size, and a ratio is the median of the rounds' own
ratios. Rounds run back to back; ``--pace 2`` sleeps that many seconds before each
measurement instead, as a map that comes now and then would run (the warm pool refilled,
the worker threads gone). Nothing is asserted.

    python bench/transform.py [--records 100000] [--repeat 3] [--kind mixed|numbers]
                              [--batch-sizes 1000,10000,100000,auto] [--pace 0]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import wasmtime

import wasibox
from wasibox._batch import batch_elements, decode_batch_reply, encode_records
from wasibox._transform import BATCH_REPLY_LIMIT, DEFAULT_BATCH_SIZE
from wasibox.backends.wasm import backend as wasm_backend
from wasibox.backends.wasm.runtime import WasmRuntime

#: Records with strings, numbers and a little nesting, and a function that uses each.
CODE = '''def transform(r):
    return {"id": r["id"], "customer": r["name"].upper(), "where": r["city"] + "/" + r["tags"][0],
            "total": round(r["price"] * r["qty"], 2), "tags": len(r["tags"])}
'''
#: The records of numbers only that this bench measured first.
NUMBERS_CODE = 'def transform(r):\n    return {"id": r["id"], "total": r["price"] * r["qty"]}\n'
CITIES = ["Lisbon", "Osaka", "Nairobi", "Lima", "Montréal"]
TAGS = [["new"], ["returning", "vip"], ["new", "eu", "newsletter"]]
RATIO_TARGET = 8.0

# Where a batch's guest fuel goes: each phase of the runner's batch loop, redone step by step
# in a sandbox on the same payload (fuel is deterministic, so differences are exact). The
# encoding phase calls the runner's own encoder, which the guest program can reach.
PHASES = """
import gc, marshal, sys
runner = sys.modules["wasibox_batch"]
held = []
def measure(payload, upto):
    if upto >= 1:
        gc.disable()
        loaded = marshal.loads(payload)
        gc.enable()
        gc.freeze()
        records = loaded[-1] if type(loaded) is tuple else loaded
        held.append(records)
    if upto >= 2:
        gc.set_threshold(50_000 + 2 * len(records), *gc.get_threshold()[1:])
        values = list(map(transform, records))
        held.append(values)
    if upto >= 3:
        held.append(runner.encode_values(values, []))
    return upto
"""


def records(count: int, kind: str = "mixed") -> list[dict[str, Any]]:
    if kind == "numbers":
        return [{"id": i, "price": 1.25 + i % 97, "qty": i % 13} for i in range(count)]
    return [{"id": i, "name": f"customer-{i}", "city": CITIES[i % len(CITIES)],
             "price": 1.25 + i % 97, "qty": i % 13, "tags": TAGS[i % len(TAGS)]}
            for i in range(count)]


def median_time(function: Callable[[], object], repeat: int,
                clock: Callable[[], float] = time.process_time) -> tuple[float, float, object]:
    """Median wall time and median CPU time (``clock``) of ``function``, and its result."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu, result = timed(function, clock)
        walls.append(wall)
        cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus), result


def timed(function: Callable[[], object],
          clock: Callable[[], float]) -> tuple[float, float, object]:
    """Wall time and CPU time (``clock``) of one call of ``function``, and its result."""
    started, cpu = time.perf_counter(), clock()
    result = function()
    return time.perf_counter() - started, clock() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pace", type=float, default=0.0,
                        help="seconds to sleep before each measurement (default 0: back to back)")
    parser.add_argument("--batch-sizes", default="1000,10000,100000,auto",
                        help="comma-separated record counts, or 'auto' (the default size)")
    parser.add_argument("--kind", choices=["mixed", "numbers"], default="mixed",
                        help="records of strings, numbers and tags (default), or numbers only")
    args = parser.parse_args()
    code = CODE if args.kind == "mixed" else NUMBERS_CODE
    data = records(args.records, args.kind)
    sizes: list[int | Literal["auto"]] = [
        "auto" if size == "auto" else int(size) for size in args.batch_sizes.split(",")]

    namespace: dict[str, Any] = {}
    exec(code, namespace)  # the benchmark's own, trusted copy of the function, for the baseline
    host_function = namespace["transform"]

    def host() -> list[Any]:
        return [host_function(r) for r in data]

    expected = host()
    paced = f", paced {args.pace:g} s" if args.pace else ", back to back"
    print(f"transform throughput, {args.records:,} records ({args.kind}{paced}), "
          f"guest {wasibox.guest_digest()[:12]}")

    results = {}
    host_walls: list[float] = []
    host_cpus: list[float] = []
    # Limits apply to a whole batch: give a 100,000-record batch room to finish.
    limits = wasibox.Limits(fuel=10**12, timeout_s=300, memory_bytes="2GiB")
    with wasibox.Transform(code, limits=limits) as t:
        t.map(data[:2000], batch_size=1000, progress=False)  # warm the runtime
        for size in sizes:
            fuel_before, batches_before = t.fuel_used, t.batches_run
            rounds = []
            for _ in range(args.repeat):
                # Host CPython and wasibox alternate, round by round, and each ratio is of
                # one round's pair: a change in the machine's load moves both sides alike.
                # Each side's outputs are dropped before the other runs, so that both build
                # theirs in the memory the last round freed (or neither does).
                time.sleep(args.pace)
                host_wall, host_cpu, _ = timed(host, time.thread_time)
                _ = None
                time.sleep(args.pace)
                elapsed, cpu, out = timed(
                    lambda s=size: t.map(data, batch_size=s, progress=False),
                    time.process_time)
                if out != expected:
                    raise SystemExit(f"batch size {size}: outputs differ from host CPython")
                del out
                host_walls.append(host_wall)
                host_cpus.append(host_cpu)
                rounds.append((elapsed, cpu, elapsed / host_wall, cpu / host_cpu))
            elapsed, cpu, wall_ratio, cpu_ratio = (statistics.median(column)
                                                   for column in zip(*rounds, strict=True))
            fuel = (t.fuel_used - fuel_before) // args.repeat
            batches = (t.batches_run - batches_before) // args.repeat
            results[size] = (wall_ratio, cpu_ratio)
            print(f"  wasibox batch_size={size:<7} {args.records / elapsed:>12,.0f} records/s "
                  f"({elapsed * 1e3:.0f} ms) ratio {wall_ratio:5.1f}x, CPU "
                  f"{cpu * 1e3:.0f} ms ratio {cpu_ratio:5.1f}x  fuel {fuel:,} "
                  f"({fuel / args.records:,.0f}/record) in {batches} instances")
        one = t.fuel_used
        t(data[1])
        print(f"  fixed cost of one instance: {t.fuel_used - one:,} fuel (a 1-record batch)")
        breakdown(lambda: t.map(data, progress=False), args.repeat)
    host_s, host_cpu = statistics.median(host_walls), statistics.median(host_cpus)
    print(f"  host CPython              {args.records / host_s:>12,.0f} records/s "
          f"({host_s * 1e3:.0f} ms, {host_cpu * 1e3:.0f} ms CPU; median of every round, "
          f"each ratio above is of its own round's)")

    # Where the time goes, for the largest batch size.
    size = max(size for size in sizes if size != "auto") if sizes != ["auto"] else args.records
    batch = data[:size]
    _, encode_cpu, payload = median_time(lambda: encode_records(batch), args.repeat)
    with wasibox.Sandbox(limits) as sandbox:
        outcome = sandbox._execute_batch(code, "transform", payload)  # type: ignore[arg-type]
    assert outcome.reply is not None
    _, decode_cpu, _ = median_time(
        lambda: decode_batch_reply(outcome.reply, len(batch), BATCH_REPLY_LIMIT,  # type: ignore[arg-type]
                                   batch_elements(limits.memory_bytes, len(batch))),
        args.repeat)
    print(f"  of a {size:,}-record batch: host encode {encode_cpu * 1e3:.0f} ms CPU, guest "
          f"{outcome.duration_s * 1e3:.0f} ms, host decode {decode_cpu * 1e3:.0f} ms CPU")
    guest_phases(code, payload, size, limits, outcome.fuel_used)
    # The target is for what users get, the default batch size; the best size is context.
    wall = min(wall for wall, _ in results.values())
    cpu = min(cpu for _, cpu in results.values())
    print(f"  best of the sizes measured: {wall:.1f}x wall, {cpu:.1f}x CPU")
    if DEFAULT_BATCH_SIZE not in results:
        print(f"summary: the default batch size ({DEFAULT_BATCH_SIZE}) was not measured; "
              f"the target applies to it")
        return
    wall, cpu = results[DEFAULT_BATCH_SIZE]
    verdict = "met" if max(wall, cpu) <= RATIO_TARGET else (
        "met on wall time, MISSED on CPU" if wall <= RATIO_TARGET else "MISSED")
    print(f"summary: at the default batch size ({DEFAULT_BATCH_SIZE}) {wall:.1f}x host "
          f"CPython's wall time, {cpu:.1f}x its CPU (target <= {RATIO_TARGET:.0f}x: {verdict}; "
          f"the CPU ratio is the steadier one on a busy machine)")


#: The steps of a map whose CPU ``breakdown`` measures: (owner, attribute, what it does).
STEPS = [
    (wasibox._transform, "encode_records", "host: encode the records"),
    (wasibox._transform, "decode_batch_reply", "host: check and decode the replies"),
    (wasm_backend, "call_guest", "the guest's call (the request and reply crossing included)"),
    (WasmRuntime, "instantiate", "making and priming instances"),
    (wasmtime.Store, "_delete", "dropping instances (their memory's reset)"),
]


def breakdown(run_map: Callable[[], object], repeat: int) -> None:
    """Print where the CPU of a map at the default batch size goes, step by step (user and
    system time, and page faults, of the thread each step runs on).

    Each step is wrapped while ``run_map`` runs ``repeat`` times; the rest is the process's
    CPU that no step accounts for (the worker and pool threads' hand-offs, admission, the
    outcome, the map's own loop).
    """
    spent: dict[str, list[float]] = {label: [0.0, 0.0, 0] for *_, label in STEPS}

    def wrap(function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            before = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return function(*args, **kwargs)
            finally:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                totals = spent[label]
                totals[0] += after.ru_utime - before.ru_utime
                totals[1] += after.ru_stime - before.ru_stime
                totals[2] += after.ru_minflt - before.ru_minflt
        return step

    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in STEPS]
    for (owner, name, function), (*_, label) in zip(originals, STEPS, strict=True):
        setattr(owner, name, wrap(function, label))
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(repeat):
            run_map()
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"  CPU of a map at the default batch size, by step (mean of {repeat}; "
          f"{total / repeat * 1e3:.0f} ms in all):")
    for label, (user, system, faults) in spent.items():
        print(f"    {label:<62} {(user + system) / repeat * 1e3:5.0f} ms "
              f"(system {system / repeat * 1e3:3.0f} ms, {faults / repeat:6,.0f} page faults)")
    rest = total - sum(user + system for user, system, _ in spent.values())
    print(f"    {'the rest (threads, admission, outcomes, the loop)':<62} "
          f"{rest / repeat * 1e3:5.0f} ms")


def guest_phases(code: str, payload: bytes, count: int, limits: wasibox.Limits,
                 total: int) -> None:
    """Print the guest fuel per record of each phase of one batch of ``count`` records."""
    fuel = []
    with wasibox.Sandbox(limits) as sandbox:
        for upto in range(4):
            fuel.append(sandbox.run(code + PHASES, entry="measure",
                                    args=[payload, upto]).fuel_used)
    names = ["load the records (marshal)", "call the function", "encode the outputs"]
    parts = [(name, (fuel[i + 1] - fuel[i]) / count) for i, name in enumerate(names)]
    rest = total / count - sum(per for _, per in parts)
    print(f"  guest fuel per record, by phase ({total / count:,.0f} in all):")
    for name, per in [*parts, ("the rest (request and reply across the boundary, setup)",
                               rest)]:
        print(f"    {name:<56} {per:>7,.0f}")


if __name__ == "__main__":
    main()
