"""Make guest text inert before it reaches a terminal.

Threat: guest output is untrusted text. Relayed raw to a terminal, escape and control
sequences can rewrite what the user sees, set the window title, write the clipboard (OSC 52),
or on some terminals inject input. Wasmtime's CLI filters guest output bound for a terminal
for the same reason. ``inert`` replaces every C0 and C1 control character except newline and
tab with a visible escape, so a sequence prints as text and does nothing.
"""

from __future__ import annotations

import re

__all__ = ["inert"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """``text`` with control characters (but newline and tab) shown as ``\\xNN`` escapes."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
