"""A backend that runs no guest, for tests of the code above the seam.

``FakeBackend(handler)`` is to ``Backend`` what httpx's ``MockTransport`` is to a transport:
a real backend with an honest name whose jobs are answered by ``handler``, a host function
that gets each ``Job`` with its ``RunControl`` and returns the ``Outcome``. It lets a test
(yours, or wasibox's own) drive admission, queueing, cancellation and result building
without a guest, and shows a third-party backend everything it has to do.

>>> from wasibox import Sandbox
>>> from wasibox.backends.base import Outcome
>>> from wasibox.backends.fake import FakeBackend
>>> echo = FakeBackend(lambda job, control: Outcome(stdout=job.code.encode()))
>>> with Sandbox(backend=echo) as sb:
...     sb.run("hello").stdout
'hello'

It isolates nothing, since ``handler`` is host code, so every result it makes says
``isolation="none"``. It is never chosen unless passed as ``Sandbox(backend=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._control import RunState
from .._limits import Limit
from .base import Backend, Job, Outcome, RunControl

__all__ = ["FakeBackend", "Handler"]

#: Answers one job: gets the job and its control, returns what the run produced. It may block
#: (a run is in flight until it returns) and should end promptly once ``control.cancelled``
#: (register a wake-up with ``control.on_cancel``).
Handler = Callable[[Job, RunControl], Outcome]


class FakeBackend(Backend):
    """A backend whose jobs are answered by ``handler`` instead of a guest.

    ``execute`` enters ``RunState.RUNNING``, then calls ``handler(job, control)``; a job
    cancelled before that, or while the handler ran, reports ``Limit.CANCELLED``. Whatever
    the handler raises reaches the caller unchanged (a backend for real guests never
    raises for what the guest does; a handler is test code, so its errors should show).
    """

    def __init__(self, handler: Handler, *, name: str = "fake") -> None:
        self.name = name
        self._handler = handler

    def execute(self, job: Job, control: RunControl | None = None) -> Outcome:
        control = control if control is not None else RunControl()
        control.enter(RunState.RUNNING)
        if control.cancelled:
            return Outcome(limit_exceeded=Limit.CANCELLED, isolation="none")
        outcome = self._handler(job, control)
        if control.cancelled and outcome.limit_exceeded is None:
            outcome = dataclasses.replace(outcome, limit_exceeded=Limit.CANCELLED)
        return dataclasses.replace(outcome, isolation="none")
