"""Every example in examples/ runs as its docstring says (the demo is what `make demo` runs)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PYTHON, child_env

pytestmark = pytest.mark.guest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(*command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True,
                          env={**child_env(), **env}, timeout=300, cwd=ROOT)


def test_demo_is_deterministic_and_shows_what_the_sandbox_refuses() -> None:
    done = run(PYTHON, str(EXAMPLES / "demo.py"), str(EXAMPLES / "data" / "orders.csv"))
    assert done.returncode == 0, done.stderr
    assert "40 orders" in done.stdout
    assert "second run identical (output and fuel): True" in done.stdout
    assert "fuel used:" in done.stdout and "guest sha256:" in done.stdout
    refusals = done.stdout.split("what the sandbox refuses", 1)[1]
    assert "a file outside the mounts: FileNotFoundError" in refusals
    assert "lists it: CapabilityDenied" in refusals
    assert "never ends: stopped by its fuel limit after 100,000,000 fuel" in refusals
    assert "NOT REFUSED" not in refusals


def test_multi_file_project_imports_its_modules_from_the_mount() -> None:
    done = run(PYTHON, str(EXAMPLES / "multi_file" / "run.py"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # initech's 10% discount lives in the project's pricing/rules.py.
    assert "initech        159.41" in lines and "acme           500.63" in lines


@pytest.mark.skipif(importlib.util.find_spec("mcp") is None,
                    reason="the mcp package (the 'mcp' extra) is not installed")
def test_mcp_agent_uses_the_tools_and_sees_refusals() -> None:
    done = run(PYTHON, str(EXAMPLES / "mcp_agent" / "agent.py"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "tools: list_files, read_file, reset, run_python, write_file" in out
    assert "read_file total.txt -> 12" in out
    assert "next call -> 24" in out
    assert "metadata URL -> status: error: CapabilityDenied" in out
    assert "endless loop -> status: stopped" in out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_service_call_with_curl() -> None:
    command = f"{sys.executable} -m wasibox"
    done = run("sh", str(EXAMPLES / "service_curl" / "call.sh"), WASIBOX=command,
               PORT=str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"stdout":"45\\n"' in done.stdout and '"value":42' in done.stdout
    assert done.stdout.rstrip().endswith("without a token:\n401")


def test_fuzz_test_under_pytest_passes() -> None:
    done = run(PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--hypothesis-profile=wasibox-quick", str(EXAMPLES / "fuzz_under_pytest"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
