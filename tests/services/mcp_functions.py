"""Host functions that the MCP tests' policy grants by import path
(``tests.services.mcp_functions:add``)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    This second paragraph is not part of the summary a model reads.
    """
    return a + b


def greet(name: str, *, excited: bool = False) -> dict[str, str]:
    """Greet someone by name."""
    return {"greeting": f"Hello, {name}{'!' if excited else '.'}"}


def fail(reason: str) -> None:
    """Always raise ValueError (its message names a host path, which must not leak)."""
    raise ValueError(f"cannot open /srv/private/{reason}.db: {reason}")


def repeat(text: str, times: int) -> str:
    """Return ``text`` repeated ``times`` times."""
    return text * times


def nap(seconds: float) -> str:
    """Sleep for ``seconds`` seconds, then return 'awake'."""
    time.sleep(seconds)
    return "awake"


def raw(size: int) -> bytes:
    """Return ``size`` zero bytes."""
    return bytes(size)
