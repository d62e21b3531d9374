"""Guest output relayed by the CLI to a terminal cannot drive the terminal.

Guest output is untrusted text: escape sequences could clear the screen, retitle the
window, write the clipboard (OSC 52) or fake a prompt. On a terminal the CLI makes them
inert; through a pipe (a program reading the output) the bytes pass unchanged.
"""

from __future__ import annotations

import os
import pty
import subprocess

import pytest

from tests.conftest import PYTHON, child_env
from wasibox._terminal import inert

pytestmark = pytest.mark.guest

HOSTILE = ("import sys\n"
           "print('\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\x00\\r\\x08ok')\n"
           "sys.stderr.write('\\x1b[8m hidden\\n')\n"
           "raise ValueError('\\x1b[1A')")


def run_cli_on_a_terminal(code: str) -> bytes:
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run([PYTHON, "-m", "wasibox._cli", "run", "-c", code],
                              stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                              env=child_env(), timeout=120)
        assert done.returncode == 1
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


def test_escape_sequences_reach_a_terminal_inert() -> None:
    seen = run_cli_on_a_terminal(HOSTILE)
    assert b"ok" in seen and b"hidden" in seen and b"ValueError" in seen
    text = seen.decode("utf-8")
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert b"\\x1b]52;c;ZXZpbA==\\x07" in seen


def test_output_to_a_pipe_is_relayed_unchanged() -> None:
    done = subprocess.run([PYTHON, "-m", "wasibox._cli", "run", "-c", HOSTILE],
                          capture_output=True, env=child_env(), timeout=120)
    assert b"\x1b]52;c;ZXZpbA==\x07" in done.stdout


def test_inert_keeps_newlines_and_tabs_and_marks_every_other_control() -> None:
    assert inert("a\tb\nc") == "a\tb\nc"
    assert inert("\x1b[31m\r\x00\x7f\x9b") == "\\x1b[31m\\x0d\\x00\\x7f\\x9b"
