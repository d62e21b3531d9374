"""The audit record of a run: one ``CapabilityEvent`` per decision a capability made."""

from __future__ import annotations

import dataclasses

__all__ = ["CapabilityEvent"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CapabilityEvent:
    """One decision a capability made during a run, allowed or denied.

    ``capability`` names it (``"function"``, ``"http"``, ...); ``action`` is what was asked
    (``"call"``, an HTTP method); ``target`` what it was asked of (a function name, a URL).
    ``bytes_sent`` and ``bytes_received`` count payload bytes from the guest and back to it
    (for HTTP: the request body and the decoded response body). ``reason`` says why a request
    was denied or failed; it is for the host's operator and is never shown to the guest.
    """

    capability: str
    action: str
    target: str
    allowed: bool
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0
    reason: str | None = None
