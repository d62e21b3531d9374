"""The wasibox command: exit codes, limits, --json, prepare and doctor."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, child_env

pytestmark = pytest.mark.guest


def wasibox_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "wasibox._cli", *args], input=stdin,
                          capture_output=True, text=True, env=child_env(), timeout=300)


def test_run_code_relays_output_and_exit_code() -> None:
    done = wasibox_cli("run", "-c", "print('hello')")
    assert (done.returncode, done.stdout) == (0, "hello\n")
    failed = wasibox_cli("run", "-c", "import sys\nprint('bad', file=sys.stderr)\nsys.exit(7)")
    assert (failed.returncode, failed.stderr) == (7, "bad\n")


def test_run_file_and_stdin(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print(6 * 7)\n")
    assert wasibox_cli("run", str(script)).stdout == "42\n"
    assert wasibox_cli("run", "-", stdin="print('from stdin')").stdout == "from stdin\n"
    missing = wasibox_cli("run", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_guest_exception_prints_traceback_and_exits_1() -> None:
    done = wasibox_cli("run", "-c", "raise KeyError('k')")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "KeyError: 'k'" in done.stderr


@pytest.mark.parametrize("args, limit", [
    (["--fuel", "1000000", "-c", "while True: pass"], "fuel"),
    (["--timeout", "0.3", "--fuel", "1000000000000", "-c", "while True: pass"], "timeout"),
    (["--memory", "64MiB", "-c", "x = bytearray(10**9)"], "memory"),
    (["--output-bytes", "100", "-c", "print('x' * 1000)"], "output"),
])
def test_limit_exits_124_and_names_it(args: list[str], limit: str) -> None:
    done = wasibox_cli("run", *args)
    assert done.returncode == 124
    assert f"exceeded its {limit} limit" in done.stderr


def test_json_output() -> None:
    code = "import random; print(random.random())"
    done = wasibox_cli("run", "--json", "--seed", "3", "-c", code)
    result = json.loads(done.stdout)
    assert done.returncode == 0
    assert result["ok"] is True and result["backend"] == "wasm"
    assert set(result) >= {"exit_code", "stdout", "stderr", "stdout_truncated", "error",
                           "limit_exceeded", "fuel_used", "memory_peak_bytes", "duration_s"}
    again = json.loads(wasibox_cli("run", "--json", "--seed", "3", "-c", code).stdout)
    assert (again["stdout"], again["fuel_used"]) == (result["stdout"], result["fuel_used"])
    limited = wasibox_cli("run", "--json", "--fuel", "1000000", "-c", "while True: pass")
    assert limited.returncode == 124 and json.loads(limited.stdout)["limit_exceeded"] == "fuel"


def test_bad_arguments_are_explained() -> None:
    done = wasibox_cli("run", "--memory", "lots", "-c", "pass")
    assert done.returncode == 2 and "memory_bytes" in done.stderr
    assert "usage:" in wasibox_cli("run").stderr


def test_help_explains_itself() -> None:
    top = wasibox_cli("--help").stdout
    for word in ("run", "prepare", "doctor"):
        assert word in top
    assert "exit status" in wasibox_cli("run", "--help").stdout


def test_prepare_is_instant_when_cached_and_doctor_reports() -> None:
    prepared = wasibox_cli("prepare")
    assert prepared.returncode == 0 and "guest sha256" in prepared.stdout
    doctor = wasibox_cli("doctor")
    assert doctor.returncode == 0
    for field in ("python", "wasmtime", "componentize-py", "guest", "kvm"):
        assert field in doctor.stdout
    assert "built, sha256" in doctor.stdout
