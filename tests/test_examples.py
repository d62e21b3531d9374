"""The demo that `make demo` runs works, and shows determinism."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PYTHON, child_env

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_and_is_deterministic() -> None:
    done = subprocess.run([PYTHON, str(ROOT / "examples" / "demo.py"),
                           str(ROOT / "examples" / "data" / "orders.csv")],
                          capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "40 orders" in done.stdout
    assert "second run identical (output and fuel): True" in done.stdout
    assert "fuel used:" in done.stdout and "guest sha256:" in done.stdout
