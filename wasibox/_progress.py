"""Progress for long one-off work (building and compiling the guest), so no wait is silent."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Reporter", "heartbeat", "library_reporter", "silent", "stderr_reporter"]

#: The logger every library message goes to (the server's per-run lines use ``wasibox.serve``).
log = logging.getLogger("wasibox")

#: Receives one human-readable line per step or heartbeat.
Reporter = Callable[[str], None]


def silent(message: str) -> None:
    """A reporter that discards everything."""


def stderr_reporter(stream: TextIO | None = None, min_interval_s: float = 2.0) -> Reporter:
    """Report to stderr: one updating line on a terminal, throttled lines otherwise.

    On a terminal each message replaces the last; in a log, a repeated heartbeat of the same
    step prints at most once per ``min_interval_s`` so logs stay readable.
    """
    out = stream if stream is not None else sys.stderr
    tty = out.isatty()
    last: dict[str, float] = {}

    def report(message: str) -> None:
        step = message.split(" (", 1)[0]
        now = time.monotonic()
        if not tty and step in last and now - last[step] < min_interval_s:
            return
        last[step] = now
        if tty:
            out.write(f"\r\x1b[2Kwasibox: {message}")
            if message.startswith(("built", "compiled", "ready")):
                out.write("\n")
        else:
            out.write(f"wasibox: {message}\n")
        out.flush()

    return report


def library_reporter() -> Reporter:
    """The reporter library code uses when its caller passed none.

    Messages go to the ``wasibox`` logger at INFO once the application has configured
    logging (a handler on it or on an ancestor), and to stderr otherwise, so that building
    the guest (tens of seconds, once) is never silent by default.
    """
    fallback = stderr_reporter()

    def report(message: str) -> None:
        if log.hasHandlers():
            log.info("%s", message)
        else:
            fallback(message)

    return report


@contextmanager
def heartbeat(report: Reporter, label: str, interval_s: float = 1.0) -> Iterator[None]:
    """Report ``label`` now and then every ``interval_s`` with the elapsed time, until done."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(interval_s):
            report(f"{label} ({time.monotonic() - started:.0f}s)")

    report(label)
    thread = threading.Thread(target=beat, name="wasibox-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
