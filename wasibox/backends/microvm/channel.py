"""The host end of the guest agent's channel: length-prefixed msgpack frames, size-checked
before they are decoded, and the bounded ring that keeps the VM's serial console."""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack

from ..._wire import unpack

__all__ = ["CONSOLE_RING_BYTES", "MAX_FRAME_BYTES", "MAX_FRAME_DEPTH", "MAX_FRAME_ELEMENTS",
           "Channel", "ChannelClosed", "ConsoleRing"]

CONSOLE_RING_BYTES = 64 * 2**10
#: Largest frame accepted from the guest: the reply limit, base64-encoded, plus framing.
MAX_FRAME_BYTES = 90 * 2**20
#: Most elements one frame from the guest may decode to: a files frame of 1024 entries of at
#: most 5 items each, with room to spare. Checked before the frame is decoded.
MAX_FRAME_ELEMENTS = 8192
#: Deepest nesting of a frame: a files frame's map, its entries, an entry.
MAX_FRAME_DEPTH = 3


class ChannelClosed(Exception):
    """The guest side of the channel went away."""


class Channel:
    """Length-prefixed msgpack frames over a connected stream socket (host side)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def send(self, message: dict[str, Any]) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def feed(self) -> bool:
        """Read what is available into the buffer; False at end of stream."""
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        self._buffer += data
        return True

    def frames(self) -> Iterator[dict[str, Any]]:
        """Decode every complete frame in the buffer; raises ValueError (ProtocolError for
        a frame that is not plain msgpack within ``MAX_FRAME_ELEMENTS`` and
        ``MAX_FRAME_DEPTH``)."""
        while len(self._buffer) >= 4:
            (size,) = struct.unpack(">I", self._buffer[:4])
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"the guest sent a {size}-byte frame (the cap is "
                                 f"{MAX_FRAME_BYTES})")
            if len(self._buffer) < 4 + size:
                return
            raw = bytes(self._buffer[4:4 + size])
            del self._buffer[:4 + size]
            message, _ = unpack(raw, "a frame from the guest", MAX_FRAME_ELEMENTS,
                                MAX_FRAME_DEPTH)
            if not isinstance(message, dict):
                raise ValueError("a frame from the guest is not a map")
            yield message


class ConsoleRing:
    """The VM's serial console: only the last ``size`` bytes are kept."""

    def __init__(self, size: int = CONSOLE_RING_BYTES) -> None:
        self._data: collections.deque[bytes] = collections.deque()
        self._size = size
        self._held = 0

    def append(self, data: bytes) -> None:
        self._data.append(data)
        self._held += len(data)
        while self._held > self._size and len(self._data) > 1:
            self._held -= len(self._data.popleft())

    def text(self) -> str:
        return b"".join(self._data)[-self._size:].decode("utf-8", "replace")
