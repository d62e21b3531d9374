"""Shared fixtures. Tests that need the guest use the process-wide runtime, which `make test`
prepares (built and compiled) before pytest starts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

import wasibox
from wasibox.backends.wasm import WasmBackend


@pytest.fixture(scope="session")
def sandbox() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox() as sb:
        yield sb


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def child_env() -> dict[str, str]:
    """The environment for a child Python process that imports this checkout's wasibox."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


PYTHON = sys.executable


def run_path_backend(path: str) -> WasmBackend:
    """A Wasm backend that runs on ``path`` (the Python run path for now)."""
    assert path == "python"
    return WasmBackend()
