"""The public test backend: what it reports, how it cancels, and that its example runs."""

from __future__ import annotations

import doctest
import threading

import pytest

from wasibox import Limit, Sandbox
from wasibox.backends import fake
from wasibox.backends.base import Job, Outcome, RunControl
from wasibox.backends.fake import FakeBackend


def test_the_module_example_runs() -> None:
    assert doctest.testmod(fake, raise_on_error=True).attempted > 0


def test_the_handler_answers_and_results_say_nothing_isolated_them() -> None:
    seen: list[Job] = []

    def handler(job: Job, control: RunControl) -> Outcome:
        seen.append(job)
        return Outcome(stdout=b"out", stderr=b"err", fuel_used=7)

    with Sandbox(backend=FakeBackend(handler, name="echo"), seed=3) as sb:
        result = sb.run("the code")
    assert (result.ok, result.stdout, result.stderr, result.fuel_used) == (True, "out", "err", 7)
    assert (result.backend, result.isolation) == ("echo", "none")
    assert [(job.op, job.code, job.policy.seed) for job in seen] == [("run", "the code", 3)]


def test_a_cancelled_run_reports_cancelled() -> None:
    started = threading.Event()

    def handler(job: Job, control: RunControl) -> Outcome:
        released = threading.Event()
        control.on_cancel(released.set)
        started.set()
        released.wait(60)
        return Outcome()

    with Sandbox(backend=FakeBackend(handler)) as sb:
        handle = sb.start("anything")
        assert started.wait(60)
        handle.cancel()
        assert handle.result().limit_exceeded is Limit.CANCELLED


def test_what_the_handler_raises_reaches_the_caller() -> None:
    def handler(job: Job, control: RunControl) -> Outcome:
        raise LookupError("a bug in the test's handler")

    with Sandbox(backend=FakeBackend(handler)) as sb, pytest.raises(LookupError):
        sb.run("anything")
