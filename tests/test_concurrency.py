"""The async API, bounded concurrency with back-pressure, and cancellation at every phase."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import Busy, Limit, Limits, RunState, Sandbox
from wasibox.backends.base import Job, Outcome, RunControl
from wasibox.backends.fake import FakeBackend
from wasibox.backends.wasm.backend import WasmBackend
from wasibox.backends.wasm.run import GuestStore
from wasibox.backends.wasm.runtime import WasmRuntime, runtime
from wasibox.capabilities.files.mount import STAGING_DIR

from .conftest import PYTHON, RUN_PATHS, child_env, open_fds

pytestmark = pytest.mark.guest

SPIN = "while True: pass"
#: Long enough that only a cancellation can end these runs while a test watches them.
PATIENT = Limits(fuel=10**15, timeout_s=60)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll until ``condition()`` holds (a bound against hangs, not a timed assertion)."""
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting until {what}")
        time.sleep(0.002)


def run_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wasibox-run")]


def live_stores() -> int:
    gc.collect()
    return sum(isinstance(o, wasmtime.Store) for o in gc.get_objects())


@pytest.fixture
def patient() -> Iterator[Sandbox]:
    with Sandbox(PATIENT, max_concurrency=1, max_queue=1) as sb:
        yield sb


# -- the async twins ----------------------------------------------------------------------

def test_arun_and_acall_match_their_sync_twins(sandbox: Sandbox) -> None:
    async def main() -> tuple[Any, ...]:
        result = await sandbox.arun("print(6 * 7)")
        value = await sandbox.acall("def f(x, *, y):\n    return [x, y]", "f", 1, y="two")
        called = await sandbox.arun("def f(x):\n    return x + 1", entry="f", args=[41])
        return result, value, called

    result, value, called = asyncio.run(main())
    sync = sandbox.run("print(6 * 7)")
    assert (result.ok, result.stdout, result.fuel_used) == (True, "42\n", sync.fuel_used)
    assert value == [1, "two"]
    assert called.value == 42


def test_acall_raises_like_call(sandbox: Sandbox) -> None:
    async def main() -> None:
        with pytest.raises(wasibox.GuestError) as info:
            await sandbox.acall("def f():\n    raise KeyError('k')", "f")
        assert info.value.type == "KeyError"
        with pytest.raises(wasibox.UsageError, match="entry"):
            await sandbox.arun("pass", entry="not a name")

    asyncio.run(main())


def test_many_concurrent_aruns_all_correct() -> None:
    async def main(sb: Sandbox) -> list[wasibox.RunResult]:
        return await asyncio.gather(*(sb.arun(f"print({i} * 2)") for i in range(12)))

    with Sandbox(max_concurrency=3, max_queue=12) as sb:
        results = asyncio.run(main(sb))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(12)]


def test_the_event_loop_keeps_running_during_a_run() -> None:
    async def main(sb: Sandbox) -> int:
        ticks = 0
        task = asyncio.create_task(sb.arun("x = 0\nfor i in range(200_000):\n    x += i"))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        assert (await task).ok
        return ticks

    with Sandbox(max_concurrency=1) as sb:
        assert asyncio.run(main(sb)) > 10


# -- back-pressure -------------------------------------------------------------------------

def test_a_full_queue_fails_fast_with_busy(patient: Sandbox) -> None:
    running = patient.start(SPIN)
    wait_for(lambda: running.state == RunState.RUNNING, "the first run is running")
    queued = patient.start("print('second')")
    assert queued.state == RunState.QUEUED
    with pytest.raises(Busy) as info:
        patient.start("print('third')")
    assert (info.value.max_concurrency, info.value.max_queue) == (1, 1)
    assert isinstance(info.value, wasibox.WasiboxError)
    with pytest.raises(Busy):
        patient.run("print('sync third')")
    with pytest.raises(Busy):
        asyncio.run(patient.arun("print('async third')"))
    # Freeing the slot lets the queued run through, in order.
    assert running.cancel()
    assert running.result().limit_exceeded is Limit.CANCELLED
    assert queued.result().stdout == "second\n"
    assert patient.run("print('again')").ok


def test_sync_callers_queue_for_a_slot() -> None:
    with Sandbox(max_concurrency=1, max_queue=8) as sb:
        results: list[str] = []
        threads = [threading.Thread(target=lambda i=i: results.append(sb.run(f"print({i})").stdout))
                   for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results) == sorted(f"{i}\n" for i in range(6))


def test_close_cancels_queued_runs_and_refuses_new_ones() -> None:
    sb = Sandbox(PATIENT, max_concurrency=1, max_queue=2)
    running = sb.start(SPIN)
    queued = sb.start("print('never')")
    sb.close()
    assert queued.result().limit_exceeded is Limit.CANCELLED
    assert queued.state == RunState.CANCELLED
    with pytest.raises(wasibox.SandboxClosed):
        sb.start("pass")
    running.cancel()
    assert running.result().limit_exceeded is Limit.CANCELLED


@pytest.mark.parametrize("kwargs, field", [
    ({"max_concurrency": 0}, "max_concurrency"), ({"max_concurrency": 1.5}, "max_concurrency"),
    ({"max_concurrency": 1, "max_queue": -1}, "max_queue"),
    ({"max_queue": 3}, "max_queue needs max_concurrency"),
])
def test_bad_concurrency_settings_are_usage_errors(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(wasibox.UsageError, match=field):
        Sandbox(**kwargs)


# -- cancellation at each phase -------------------------------------------------------------

def test_cancel_while_queued(patient: Sandbox) -> None:
    running = patient.start(SPIN)
    queued = patient.start("print('never')")
    assert queued.state == RunState.QUEUED
    assert queued.cancel() and not queued.cancel()
    result = queued.result()
    assert (result.ok, result.limit_exceeded, result.stdout) == (False, Limit.CANCELLED, "")
    assert queued.state == RunState.CANCELLED
    # The queue slot is free again at once.
    again = patient.start("print('next')")
    running.cancel()
    assert again.result().stdout == "next\n"


class GatedRuntime(WasmRuntime):
    """A real WasmRuntime whose ``take`` waits for the test, to hold a run while it
    instantiates."""

    def __init__(self) -> None:
        super().__init__(pool_size=0)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def take(self) -> tuple[GuestStore, Any]:
        self.entered.set()
        self.gate.wait()
        return super().take()


def test_cancel_while_instantiating() -> None:
    gated = GatedRuntime()
    gated.gate.set()
    with Sandbox(PATIENT, backend=WasmBackend(gated), max_concurrency=1) as sb:
        # Compile (and cache) the program first: the compiler takes instances too.
        assert sb.run("print('never')").ok
        gated.gate.clear()
        gated.entered.clear()
        handle = sb.start("print('never')")
        try:
            assert gated.entered.wait(60)
            assert handle.state == RunState.INSTANTIATING
            assert handle.cancel()
        finally:
            gated.gate.set()  # never leave a worker thread blocked
        result = handle.result()
    assert (result.limit_exceeded, result.stdout) == (Limit.CANCELLED, "")
    assert handle.state == RunState.CANCELLED


def test_cancel_while_running_stops_the_guest(patient: Sandbox) -> None:
    handle = patient.start("print('started', flush=True)\n" + SPIN)
    wait_for(lambda: handle.state == RunState.RUNNING, "the run is running")
    time.sleep(0.05)
    assert handle.cancel()
    result = handle.result()
    assert result.limit_exceeded is Limit.CANCELLED and not result.ok
    assert result.stdout == "started\n"  # output up to the cancellation is kept
    assert result.duration_s < PATIENT.timeout_s  # ended by the cancel, not the limit
    with pytest.raises(wasibox.LimitExceeded) as info:
        wasibox._sandbox.unwrap(result)
    assert info.value.limit is Limit.CANCELLED


def test_cancel_inside_a_blocking_host_call() -> None:
    with Sandbox(PATIENT, clock="real", max_concurrency=1) as sb:
        handle = sb.start("import time\nprint('sleeping', flush=True)\ntime.sleep(50)")
        wait_for(lambda: handle.state == RunState.RUNNING, "the run is running")
        time.sleep(0.1)
        handle.cancel()
        result = handle.result()
    assert result.limit_exceeded is Limit.CANCELLED
    assert result.duration_s < PATIENT.timeout_s


def test_cancelling_the_awaiting_task_stops_the_guest_and_frees_it() -> None:
    async def main(sb: Sandbox) -> None:
        task = asyncio.create_task(sb.arun(SPIN))
        await asyncio.to_thread(wait_for, lambda: sb._runner.active == 1, "the run is active")
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # By the time CancelledError arrives, the guest has stopped and its slot is free.
        assert sb._runner.active == 0
        assert (await sb.arun("print('after')")).stdout == "after\n"

    with Sandbox(PATIENT, max_concurrency=1) as sb:
        asyncio.run(main(sb))


def test_cancelling_a_queued_task_frees_its_queue_place() -> None:
    async def main(sb: Sandbox) -> None:
        first = sb.start(SPIN)
        task = asyncio.create_task(sb.arun("print('never')"))
        await asyncio.to_thread(wait_for, lambda: sb._runner.queued == 1, "the task is queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sb._runner.queued == 0
        first.cancel()
        assert (await first).limit_exceeded is Limit.CANCELLED

    with Sandbox(PATIENT, max_concurrency=1, max_queue=1) as sb:
        asyncio.run(main(sb))


def test_cancel_after_the_run_is_a_no_op(sandbox: Sandbox) -> None:
    handle = sandbox.start("print(1)")
    result = handle.result()
    assert not handle.cancel()
    assert result.ok and handle.state == RunState.DONE and handle.done()


def test_cancellations_leak_no_threads_stores_or_fds() -> None:
    with Sandbox(max_concurrency=2) as warm:  # warm everything up before the baseline
        warm.run("pass")
    threads = set(run_threads())  # other open Sandboxes' workers (the session fixture's)
    pool = runtime()._pool
    fds, loose_stores = open_fds(), live_stores() - len(pool)

    async def main(sb: Sandbox) -> None:
        for _ in range(10):
            tasks = [asyncio.create_task(sb.arun(SPIN)) for _ in range(4)]
            await asyncio.sleep(0.02)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        handles = [sb.start(SPIN) for _ in range(4)]
        for handle in handles:
            handle.cancel()
        assert {h.result().limit_exceeded for h in handles} == {Limit.CANCELLED}

    with Sandbox(PATIENT, max_concurrency=2, max_queue=4) as sb:
        asyncio.run(main(sb))
    wait_for(lambda: set(run_threads()) <= threads, "the Sandbox's worker threads end")
    # Stores outside the warm pool are all released. The pool refills in the background, and
    # an instance the filler is still making (and priming) is live but not yet in the pool:
    # wait for the count to settle rather than read it at one instant.
    wait_for(lambda: live_stores() - len(pool) <= loose_stores,
             "every store outside the warm pool is released")
    assert open_fds() <= fds


@pytest.mark.parametrize("run_path", RUN_PATHS)
def test_a_process_exits_cleanly_while_the_pool_fills(run_path: str) -> None:
    # Exiting at once leaves the filler making (and priming) instances and dropping used
    # ones, all of which call back into Python from inside Wasmtime; the exit must still be
    # a clean one (a thread ended there during finalization would abort the process).
    code = ("import wasibox\nsb = wasibox.Sandbox(max_concurrency=8)\n"
            "for _ in range(3):\n    assert sb.run('print(1)').stdout == '1\\n'\n")
    for _ in range(3):
        child = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                               timeout=120, env={**child_env(), "WASIBOX_RUN_PATH": run_path},
                               check=False)
        assert (child.returncode, child.stderr) == (0, "")


def test_the_epoch_ticker_ends_when_idle_and_the_next_run_starts_it_again() -> None:
    # Runs never wake the ticker; it ticks on for a while after the last run, then ends.
    # A run after that must start a new one, or it would never reach its deadline.
    ticker = runtime().ticker
    with Sandbox(Limits(timeout_s=0.3, fuel=10**11)) as sb:  # without ticks: fuel, later
        assert sb.run("while True: pass").limit_exceeded == Limit.TIMEOUT
        wait_for(lambda: not ticker.running, "the idle ticker ends")
        assert sb.run("while True: pass").limit_exceeded == Limit.TIMEOUT
        assert ticker.running


def test_the_warm_pool_is_sized_from_max_concurrency() -> None:
    rt = runtime()
    before = rt._pool_size
    with Sandbox(max_concurrency=4):
        assert rt._pool_size == max(before, 4)
        wait_for(lambda: len(rt._pool) == rt._pool_size, "the pool fills")
    assert rt._pool_size == before


# -- the admission logic, against a model --------------------------------------------------------

class Gates:
    """Answers the jobs of a FakeBackend: each job "runs" until the test releases it or it is
    cancelled; its output is its code. Records the order in which jobs started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def handle(self, job: Job, control: RunControl) -> Outcome:
        gate = threading.Event()
        with self.lock:
            self.gates[job.code] = gate
            self.started.append(job.code)
        detach = control.on_cancel(gate.set)
        gate.wait()
        detach()
        # Cancelled: the FakeBackend reports it; a cancelled run produced nothing.
        return Outcome() if control.cancelled else Outcome(stdout=job.code.encode())

    def release(self, code: str) -> None:
        wait_for(lambda: code in self.gates, f"{code} starts")
        self.gates[code].set()


@settings(max_examples=40, deadline=None)
@given(max_concurrency=st.integers(1, 3), max_queue=st.integers(0, 3),
       ops=st.lists(st.one_of(st.just(("start", 0)), st.tuples(st.just("cancel"),
                                                               st.integers(0, 20)),
                              st.just(("finish", 0))), max_size=30))
def test_admission_matches_a_model(max_concurrency: int, max_queue: int,
                                   ops: list[tuple[str, int]]) -> None:
    backend = Gates()
    sb = Sandbox(backend=FakeBackend(backend.handle), max_concurrency=max_concurrency,
                 max_queue=max_queue)
    handles: dict[str, wasibox.RunHandle] = {}
    running: list[str] = []  # the model: admission order of runs holding a slot
    queued: list[str] = []
    expected: dict[str, str] = {}  # code -> "done" or "cancelled"
    for number, (op, arg) in enumerate(ops):
        if op == "start":
            code = f"job{number + 1000}"
            if len(running) < max_concurrency and not queued:
                running.append(code)
            elif len(queued) < max_queue:
                queued.append(code)
            else:
                with pytest.raises(Busy):
                    sb.start(code)
                continue
            handles[code] = sb.start(code)
        elif op == "cancel" and handles:
            code = sorted(handles)[arg % len(handles)]
            if code in expected:
                continue
            handles[code].cancel()
            expected[code] = "cancelled"
            if code in queued:
                queued.remove(code)
                assert handles[code].result().limit_exceeded is Limit.CANCELLED
            else:
                running.remove(code)
                handles[code].result()
                if queued:
                    running.append(queued.pop(0))
        elif op == "finish" and running:
            code = running.pop(0)
            backend.release(code)
            assert handles[code].result().stdout == code
            expected[code] = "done"
            if queued:
                running.append(queued.pop(0))
        assert (sb._runner.active, sb._runner.queued) == (len(running), len(queued))
    for code in running:
        backend.release(code)
        expected[code] = "done"
    for code in queued:
        handles[code].cancel()
        expected[code] = "cancelled"
    for code, handle in handles.items():
        result = handle.result()
        assert (result.stdout == code) == (expected[code] == "done"), code
        assert handle.state == (RunState.DONE if expected[code] == "done"
                                else RunState.CANCELLED)
    # Runs started in admission order (FIFO), skipping those cancelled while queued.
    assert backend.started == sorted(backend.started, key=lambda c: int(c[3:]))
    sb.close()


def test_cancel_while_publishing_discards_the_staged_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered = RunControl.enter

    def cancel_on_publishing(self: RunControl, state: RunState) -> None:
        entered(self, state)
        if state == RunState.PUBLISHING:
            self.cancel()  # the caller cancels just as the files are about to be published

    monkeypatch.setattr(RunControl, "enter", cancel_on_publishing)
    with Sandbox(mounts=[wasibox.Mount(tmp_path, "/out", writable=True)],
                 max_concurrency=1) as sb:
        handle = sb.start("open('/out/report.txt', 'w').write('draft')")
        result = handle.result()
    assert (result.ok, result.limit_exceeded, result.files) == (False, Limit.CANCELLED, [])
    assert handle.state == RunState.CANCELLED
    assert [p.name for p in tmp_path.iterdir()] in ([], [STAGING_DIR])  # nothing published
    staged = [p.name for p in (tmp_path / STAGING_DIR).glob("run-*")]
    assert staged == []  # and the run's staging is gone


def test_cancel_inside_a_blocking_host_function() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_lookup(key: int) -> int:
        entered.set()
        release.wait(60)
        return key

    with Sandbox(PATIENT, functions={"lookup": slow_lookup}, max_concurrency=1) as sb:
        handle = sb.start("import host\nprint('asking', flush=True)\nhost.lookup(1)")
        try:
            assert entered.wait(60)
            assert handle.state == RunState.RUNNING
            handle.cancel()
            result = handle.result()  # returns while the host function still blocks
        finally:
            release.set()
    assert result.limit_exceeded is Limit.CANCELLED
    assert result.stdout == "asking\n"
    assert result.duration_s < PATIENT.timeout_s


def test_plain_runs_past_max_concurrency_queue_or_are_refused() -> None:
    """A plain ``run(code)`` holds a slot as any run does: with every slot taken it queues
    (up to ``max_queue``) and past that raises Busy."""
    results: list[wasibox.RunResult] = []
    with wasibox.Sandbox(max_concurrency=1, max_queue=1) as sb:
        spinner = sb.start("while True: pass")
        wait_for(lambda: spinner.state == RunState.RUNNING, "the first run is running")
        queued = threading.Thread(target=lambda: results.append(sb.run("print(1)")))
        queued.start()
        wait_for(lambda: sb._runner.queued == 1, "the plain run is queued")
        with pytest.raises(wasibox.Busy):
            sb.run("print(2)")
        spinner.cancel()
        queued.join()
        assert spinner.result().limit_exceeded == wasibox.Limit.CANCELLED
        assert results[0].stdout == "1\n" and sb._runner.active == 0
