"""Shared fixtures. Tests that need the guest use the process-wide runtime, which `make test`
prepares (built and compiled) before pytest starts."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

import wasibox
from wasibox.backends.wasm.backend import WasmBackend
from wasibox.backends.wasm.runtime import runtime

# Hypothesis's per-example deadline and its too-slow health check are timing assertions: on
# a loaded 2-core machine a guest run can take many times its usual time. Speed is measured
# in bench/, never asserted in tests, so the suite's default profile turns both off (a
# test's own @settings still sets its examples and database).
settings.register_profile("wasibox-suite", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("wasibox-suite")


@pytest.fixture(scope="session")
def sandbox() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox() as sb:
        yield sb


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``seconds`` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def child_env() -> dict[str, str]:
    """The environment for a child Python process that imports this checkout's wasibox."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


PYTHON = sys.executable


#: The run paths of the Wasm backend; run-path-sensitive tests run on each.
RUN_PATHS = ("python", "native")


def run_path_backend(path: str) -> WasmBackend:
    """A Wasm backend on ``path``; skips if the native path is unavailable here, saying why."""
    if path == "native":
        native = runtime().native
        if native.module is None:
            pytest.skip(f"the native run path is unavailable: {native.reason}")
    return WasmBackend(run_path=path)  # type: ignore[arg-type]


@pytest.fixture(params=RUN_PATHS)
def run_path_sandbox(request: pytest.FixtureRequest) -> Iterator[wasibox.Sandbox]:
    """A Sandbox on each run path in turn."""
    with wasibox.Sandbox(backend=run_path_backend(request.param)) as sb:
        yield sb
