"""Admission, queueing and cancellation of runs: one implementation for sync and async.

A ``Sandbox`` hands every prepared job to its ``Runner``. The runner admits it if fewer than
``max_concurrency`` runs are active, queues it if fewer than ``max_queue`` are waiting, and
otherwise refuses it at once with ``Busy``: nothing ever queues without bound. A slot freed by
a finished run passes straight to the oldest waiting run.

Three drivers share that logic and differ only in where they wait:

* ``Runner.run`` (``Sandbox.run``) executes on the calling thread, waiting for a slot on a
  ``threading.Event`` if it was queued;
* ``Runner.start`` (``Sandbox.start``) returns a ``RunHandle`` at once; granted runs execute on
  the runner's worker threads (at most ``max_concurrency``), and queued ones hold no thread;
* ``await handle`` (``Sandbox.arun``) waits for that handle without blocking the event loop.
  Cancelling the awaiting task cancels the run and waits (briefly: the guest stops within an
  epoch tick) until its instance is freed, then re-raises ``CancelledError``.

Cancellation goes through ``RunControl``: a queued run is removed from the queue; an active
one is stopped by its backend. Either way the run's result says ``Limit.CANCELLED``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Generator
from typing import Any

from ._control import RunControl, RunState
from ._errors import Busy, SandboxClosed, UsageError
from ._limits import Limit
from ._result import RunResult
from .backends.base import Job

__all__ = ["RunHandle", "Runner"]

#: Worker threads for ``Sandbox.start`` when the Sandbox sets no max_concurrency.
DEFAULT_WORKERS = 32


class RunHandle:
    """One run started with ``Sandbox.start``: its state, a way to cancel it, its result.

    ``await handle`` gives the ``RunResult`` in async code; ``handle.result()`` blocks for it
    in sync code. ``handle.cancel()`` (from any thread) stops the run promptly, wherever it
    is; a cancelled run's result has ``limit_exceeded == "cancelled"``. Awaiting or calling
    ``result()`` raises only what ``Sandbox.run`` would (UsageError for arguments that cannot
    cross into the guest).
    """

    def __init__(self, control: RunControl, future: concurrent.futures.Future[RunResult]) -> None:
        self._control = control
        self._future = future

    @property
    def state(self) -> RunState:
        """Where the run is: queued, instantiating, running, publishing, done or cancelled."""
        return self._control.state

    def cancel(self) -> bool:
        """Stop the run as soon as possible; False if it had already finished."""
        return self._control.cancel()

    def done(self) -> bool:
        """Whether the result is ready."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends and return its result.

        Raises TimeoutError if ``timeout`` seconds pass first (the run goes on).
        """
        return self._future.result(timeout)

    def __await__(self) -> Generator[Any, None, RunResult]:
        return self._wait().__await__()

    async def _wait(self) -> RunResult:
        import asyncio  # here, not at the top: importing asyncio costs most of a cold start

        waiting = asyncio.wrap_future(self._future)
        try:
            # Shielded so that cancelling the awaiting task does not cancel the future itself:
            # the run is cancelled through its control instead, below.
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            self.cancel()
            try:
                await asyncio.shield(waiting)  # the guest stops within a tick; wait for it
            except asyncio.CancelledError:
                pass  # cancelled twice: stop waiting; the worker thread still cleans up
            except Exception:  # noqa: BLE001 - the run's own outcome no longer matters
                pass
            raise

    def __repr__(self) -> str:
        return f"<wasibox.RunHandle {self.state.value}>"


class _Ticket:
    """One admitted run, while the runner tracks it."""

    __slots__ = ("job", "control", "future", "detached", "has_slot", "granted",
                 "forget_queue_cancel", "execute")

    def __init__(self, job: Job, detached: bool,
                 execute: Callable[[Job, RunControl], RunResult] | None) -> None:
        self.job = job
        self.execute = execute  # None: the runner's own
        self.control = RunControl()
        self.detached = detached  # True: runs on a worker thread; False: on its caller's
        # A run on its caller's thread that gets a slot at once needs neither a future nor an
        # event (``queue`` makes them if it waits): making them was a measurable share of a
        # warm run's host CPU.
        self.future: concurrent.futures.Future[RunResult] | None = (
            concurrent.futures.Future() if detached else None)
        self.has_slot = False
        self.granted: threading.Event | None = None
        self.forget_queue_cancel: Callable[[], None] | None = None

    def queue(self) -> None:
        """Make what a waiting run is woken and answered through."""
        self.granted = threading.Event()
        if self.future is None:
            self.future = concurrent.futures.Future()


class Runner:
    """Admits, queues, executes and cancels runs for one Sandbox. Thread-safe.

    ``execute(job, control)`` runs one job to its result; ``cancelled(job)`` makes the result
    of a job cancelled before it started. ``max_concurrency=None`` admits every run at once.
    Raises UsageError for a max_concurrency or max_queue that is not a non-negative int.
    """

    def __init__(self, execute: Callable[[Job, RunControl], RunResult],
                 cancelled: Callable[[Job], RunResult], *,
                 max_concurrency: int | None, max_queue: int) -> None:
        if max_concurrency is not None and (
                isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                or max_concurrency < 1):
            raise UsageError(f"max_concurrency must be a positive int or None, "
                             f"not {max_concurrency!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise UsageError(f"max_queue must be a non-negative int, not {max_queue!r}")
        if max_concurrency is None and max_queue:
            raise UsageError("max_queue needs max_concurrency: without a cap on concurrent "
                             "runs, nothing ever waits in a queue")
        self._execute_job = execute
        self._cancelled_result = cancelled
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._active = 0
        self._waiting: collections.deque[_Ticket] = collections.deque()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def active(self) -> int:
        """Runs holding a slot (instantiating, running or publishing)."""
        return self._active

    @property
    def queued(self) -> int:
        """Runs waiting for a slot."""
        return len(self._waiting)

    def run(self, job: Job,
            execute: Callable[[Job, RunControl], RunResult] | None = None) -> RunResult:
        """Execute ``job`` on this thread once it has a slot. Raises Busy if it cannot queue.

        ``execute`` replaces the runner's own for this job (a Session's call runs in its
        session's guest, but holds one of the Sandbox's slots like any run).
        """
        ticket = self._admit(job, detached=False, execute=execute)
        if not ticket.has_slot:
            assert ticket.granted is not None and ticket.future is not None  # see _admit
            try:
                ticket.granted.wait()
            except BaseException:
                # Interrupted while queued (KeyboardInterrupt): leave no trace in the queue.
                ticket.control.cancel()
                with self._lock:
                    owns_slot = ticket.has_slot
                if owns_slot:
                    self.release()
                raise
            if ticket.future.done():  # cancelled while queued (the Sandbox was closed)
                return ticket.future.result()
        return self._execute(ticket)

    def start(self, job: Job,
              execute: Callable[[Job, RunControl], RunResult] | None = None) -> RunHandle:
        """Admit ``job`` and return its handle; it executes on a worker thread.

        ``execute`` as for ``run``. Raises Busy if the queue is full, SandboxClosed after
        ``close``.
        """
        ticket = self._admit(job, detached=True, execute=execute)
        if ticket.has_slot:
            self._submit(ticket)
        assert ticket.future is not None  # a detached ticket has one from the start
        return RunHandle(ticket.control, ticket.future)

    def claim(self) -> bool:
        """Take a slot for a run on this thread if one is free now, with no ticket: the run
        cannot be cancelled, and nothing is queued. False if it would have to wait (use
        ``run``); raises SandboxClosed after ``close``. Call ``release`` when it ends."""
        with self._lock:
            return self._take_free_slot()

    def release(self) -> None:
        """Free a slot taken by ``claim`` (or by any finished run): give it to the oldest
        waiting run, or free it."""
        with self._lock:
            if not self._waiting:
                self._active -= 1
                return
            ticket = self._waiting.popleft()
            ticket.has_slot = True
            forget = ticket.forget_queue_cancel
        if forget is not None:
            forget()
        if ticket.detached:
            self._submit(ticket)
        else:
            assert ticket.granted is not None  # it was queued
            ticket.granted.set()

    def close(self) -> None:
        """Refuse new runs and cancel queued ones; active runs finish on their own."""
        with self._lock:
            self._closed = True
            queued = list(self._waiting)
            executor, self._executor = self._executor, None
        for ticket in queued:
            ticket.control.cancel()
        if executor is not None:
            executor.shutdown(wait=False)

    # -- internals ------------------------------------------------------------------------

    def _admit(self, job: Job, *, detached: bool,
               execute: Callable[[Job, RunControl], RunResult] | None) -> _Ticket:
        ticket = _Ticket(job, detached, execute)
        with self._lock:
            if self._take_free_slot():
                ticket.has_slot = True
                return ticket
            assert self.max_concurrency is not None  # unlimited: a slot is always free
            if len(self._waiting) >= self.max_queue:
                raise Busy(self.max_concurrency, self.max_queue)
            ticket.queue()
            self._waiting.append(ticket)
            ticket.forget_queue_cancel = ticket.control.on_cancel(
                lambda: self._cancel_queued(ticket))
        return ticket

    def _take_free_slot(self) -> bool:
        """With the lock held: take a slot if one is free and nobody queues before this run.
        Raises SandboxClosed after ``close``."""
        if self._closed:
            raise SandboxClosed("this Sandbox is closed; create a new one")
        if self.max_concurrency is None or (
                self._active < self.max_concurrency and not self._waiting):
            self._active += 1
            return True
        return False

    def _cancel_queued(self, ticket: _Ticket) -> None:
        with self._lock:
            try:
                self._waiting.remove(ticket)
            except ValueError:
                return  # already granted a slot: the backend sees the cancellation
        assert ticket.future is not None and ticket.granted is not None  # it was queued
        ticket.control.finish()
        ticket.future.set_result(self._cancelled_result(ticket.job))
        ticket.granted.set()

    def _submit(self, ticket: _Ticket) -> None:
        with self._lock:
            if self._executor is None and not self._closed:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrency or DEFAULT_WORKERS,
                    thread_name_prefix="wasibox-run")
            executor = self._executor
        try:
            if executor is None:
                raise RuntimeError("closed")
            executor.submit(self._execute, ticket)
        except RuntimeError:  # closed concurrently: the executor takes no more work
            assert ticket.future is not None  # only detached tickets are submitted
            ticket.control.cancel()
            ticket.control.finish()
            ticket.future.set_result(self._cancelled_result(ticket.job))
            self.release()

    def _execute(self, ticket: _Ticket) -> RunResult:
        """Execute a ticket that holds a slot; always frees the slot and settles the future
        (if it has one: see ``_Ticket``)."""
        try:
            result = (ticket.execute or self._execute_job)(ticket.job, ticket.control)
        except BaseException as exc:
            ticket.control.finish()
            self.release()
            if ticket.future is not None:
                ticket.future.set_exception(exc)
            if ticket.detached:
                return self._cancelled_result(ticket.job)  # the handle holds the exception
            raise
        ticket.control.finish(cancelled=result.limit_exceeded is Limit.CANCELLED)
        self.release()
        if ticket.future is not None:
            ticket.future.set_result(result)
        return result
