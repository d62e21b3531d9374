"""The wire format between host and guest: base64-encoded msgpack maps.

A request (host to guest) is trusted: the host builds it::

    {"op": "run" | "call", "code": str, "entry": str | None, "args": list, "kwargs": map,
     "seed": int | None}

``seed`` is what ``random.seed`` gets at the start of the run; ``None`` reseeds from the
guest's entropy (which the host decides: seeded or real).

A reply (guest to host) is **untrusted**: the guest program shares an interpreter with the
runner and can forge it. It is size-checked before it is decoded, and depth- and shape-checked
after, and it only ever describes the guest's own outcome; everything the host measures (fuel,
time, output, limits) comes from the host::

    {"exit_code": int, "error": None | {"type": str, "message": str, "traceback": str},
     "value": any msgpack value, "memory_error": bool, "heap_top": int}

The reply is checked by hand rather than with pydantic: importing pydantic costs more than
the whole cold start budget of a run (measured 80-190 ms), and the shape is small.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

import msgpack

__all__ = ["MAX_DEPTH", "ProtocolError", "Reply", "decode_reply", "encode_request",
           "check_depth"]

#: Deepest nesting accepted in a value that crosses the boundary. msgpack's own decoder
#: accepts 1024, deep enough to exhaust the host's recursion limit in code that walks it.
MAX_DEPTH = 32


class ProtocolError(ValueError):
    """A message from the guest broke the wire contract (too big, too deep, wrong shape)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    exit_code: int
    error: dict[str, str] | None
    value: Any
    memory_error: bool
    heap_top: int


def encode_request(fields: dict[str, Any]) -> str:
    """Encode a request for the guest runner; raises TypeError for non-msgpack values."""
    return base64.b64encode(msgpack.packb(fields, use_bin_type=True)).decode("ascii")


def decode_reply(text: str, max_bytes: int) -> Reply:
    """Decode and check the guest's reply; raises ProtocolError when it breaks the contract."""
    if len(text) > (max_bytes * 4) // 3 + 4:
        raise ProtocolError(f"the guest's reply is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(text, validate=True)
        message = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (binascii.Error, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"the guest's reply is not valid msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("the guest's reply is not a map")
    check_depth(message, MAX_DEPTH + 1)
    exit_code = message.get("exit_code")
    error = message.get("error")
    memory_error = message.get("memory_error", False)
    heap_top = message.get("heap_top", 0)
    if type(exit_code) is not int or not 0 <= exit_code <= 255:
        raise ProtocolError("the guest's reply has no valid exit_code")
    if error is not None and not (
            isinstance(error, dict)
            and all(type(error.get(key)) is str for key in ("type", "message", "traceback"))):
        raise ProtocolError("the guest's reply has a malformed error")
    if type(memory_error) is not bool or type(heap_top) is not int:
        raise ProtocolError("the guest's reply has malformed memory fields")
    if error is not None:
        error = {key: error[key] for key in ("type", "message", "traceback")}
    return Reply(exit_code, error, message.get("value"), memory_error, max(heap_top, 0))


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ProtocolError if ``value`` nests lists or maps deeper than ``limit``.

    Iterative, so a hostile value cannot exhaust the host's stack while being checked.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list | tuple):
            children: Any = item
        elif isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        else:
            continue
        if depth > limit:
            raise ProtocolError(f"a value nests deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)
