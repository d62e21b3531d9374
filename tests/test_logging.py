"""Library messages go through the standard ``logging`` module, under the ``wasibox`` logger."""

from __future__ import annotations

import logging
import subprocess

import pytest

from tests.conftest import PYTHON, child_env
from wasibox._progress import library_reporter

REPORT = "from wasibox._progress import library_reporter; library_reporter()('building x')"


def test_messages_go_to_the_wasibox_logger_once_logging_is_configured(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.INFO, logger="wasibox"):
        library_reporter()("building the guest")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("wasibox", logging.INFO, "building the guest")]
    assert capsys.readouterr().err == ""


def test_without_logging_configured_messages_reach_stderr() -> None:
    plain = subprocess.run([PYTHON, "-c", REPORT], capture_output=True, text=True,
                           env=child_env(), timeout=60)
    assert plain.stderr == "wasibox: building x\n"
    configured = subprocess.run(
        [PYTHON, "-c", "import logging, sys; logging.basicConfig(stream=sys.stdout, "
                       "level=logging.INFO, format='%(name)s %(levelname)s %(message)s'); "
                       + REPORT], capture_output=True, text=True, env=child_env(), timeout=60)
    assert configured.stdout == "wasibox INFO building x\n" and configured.stderr == ""
