"""What a backend sees of one run while it executes: the phase it is in, and cancellation.

``RunControl`` is the small, thread-safe object that crosses the backend seam with a job. The
backend reports the phase it enters (``enter``) and registers what stops the run early
(``on_cancel``); the caller's side (``RunHandle``, the async API) calls ``cancel`` from any
thread. It holds no engine objects and does no I/O.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

__all__ = ["RunControl", "RunState"]


class RunState(enum.StrEnum):
    """Where a run is in its life; the value is what ``RunHandle.state`` compares to."""

    QUEUED = "queued"  #: admitted, waiting for one of the Sandbox's max_concurrency slots
    INSTANTIATING = "instantiating"  #: taking a fresh guest instance (from the warm pool)
    RUNNING = "running"  #: guest code is executing (or waiting in a host call)
    PUBLISHING = "publishing"  #: the guest finished; the host is publishing its results
    DONE = "done"  #: finished; the result is ready (whatever the guest did)
    CANCELLED = "cancelled"  #: cancelled by the caller; the result says ``cancelled``


class RunControl:
    """The cancellation and phase of one run, shared by the caller and the backend.

    Thread-safe. ``cancel`` is idempotent and returns whether it changed anything: it has no
    effect once the run is done. Callbacks registered with ``on_cancel`` run on the thread
    that cancels, at most once each, so they must be quick and must not raise.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = RunState.QUEUED
        self._cancelled = False
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_key = 0

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def enter(self, state: RunState) -> None:
        """Record the phase the run is entering (a cancelled run stays cancelled)."""
        with self._lock:
            if self._state not in (RunState.DONE, RunState.CANCELLED):
                self._state = state

    def finish(self, cancelled: bool | None = None) -> None:
        """Record that the run is over: ``cancelled`` says whether its result is a
        cancellation (a cancel that came too late to stop it leaves it done); by default,
        whether ``cancel`` was called."""
        with self._lock:
            if cancelled is None:
                cancelled = self._cancelled
            self._state = RunState.CANCELLED if cancelled else RunState.DONE
            self._callbacks.clear()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the run is cancelled (now, if it already is).

        Returns a function that unregisters it; call it when the phase it guards is over.
        """
        with self._lock:
            if not self._cancelled:
                key = self._next_key
                self._next_key += 1
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback()
        return _nothing

    def cancel(self) -> bool:
        """Ask the run to stop as soon as possible; False if it had already finished."""
        with self._lock:
            if self._cancelled or self._state in (RunState.DONE, RunState.CANCELLED):
                return False
            self._cancelled = True
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            callback()
        return True

    def _forget(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)


def _nothing() -> None:
    return None
