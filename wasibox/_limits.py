"""Per-run limits, and the names of the limits a run can exceed."""

from __future__ import annotations

import dataclasses
import enum
import math
import re

from ._errors import UsageError

__all__ = ["Limit", "Limits"]


class Limit(enum.StrEnum):
    """A limit a run can exceed; the value is what ``RunResult.limit_exceeded`` compares to."""

    FUEL = "fuel"  #: deterministic CPU budget (wasm instructions, roughly)
    TIMEOUT = "timeout"  #: wall-clock time, including time spent sleeping
    MEMORY = "memory"  #: the guest's linear memory
    OUTPUT = "output"  #: bytes written to stdout and stderr together
    HOST_CALLS = "host_calls"  #: calls to host functions (and HTTP): their number and bytes
    #: the caller cancelled the run (``RunHandle.cancel()`` or cancelling the awaiting task)
    CANCELLED = "cancelled"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: int | str, name: str) -> int:
    """Normalise a byte count given as an int or as shorthand such as ``"256MiB"``.

    Raises UsageError for anything else, naming the field.
    """
    if isinstance(value, bool):
        raise UsageError(f"{name} must be a byte count, not {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        unit = (match.group(2) or "").lower().removesuffix("b")
        number = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise UsageError(f"{name} must be a byte count such as 1048576 or '1MiB', not {value!r}")
    if number <= 0:
        raise UsageError(f"{name} must be positive, not {value!r}")
    return number


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What one run may use. Every field is enforced on every run.

    Sizes accept ints or shorthand (``memory_bytes="256MiB"``), normalised here, once.
    Raises UsageError for a value that is not positive or not a number.
    """

    #: CPU budget in fuel units. Deterministic: the same program uses the same fuel.
    fuel: int = 2_000_000_000
    #: Cap on the guest's linear memory. Growth past it gives the guest a MemoryError.
    memory_bytes: int = 256 * 2**20
    #: Wall-clock budget in seconds, enforced by epoch interruption and by every host wait.
    timeout_s: float = 5.0
    #: Cap on stdout and stderr together; the run stops when it is exceeded.
    output_bytes: int = 2**20
    #: Cap on the size of submitted code, checked before any instance is made.
    source_bytes: int = 2**20
    #: Files and directories one run may hold open on its mounts; past it, EMFILE.
    open_files: int = 64
    #: Calls the guest may make to host functions and HTTP in one run.
    host_calls: int = 10_000
    #: Cap on one host call's payload, each way (arguments in, result out), checked from its
    #: length before it is decoded.
    host_call_bytes: int = 16 * 2**20
    #: Cap on all host calls' payloads in one run, both ways together.
    host_total_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "output_bytes", "source_bytes", "host_call_bytes",
                     "host_total_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        for name in ("fuel", "host_calls", "open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UsageError(f"{name} must be a positive int, not {value!r}")
        timeout = self.timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not math.isfinite(timeout) or timeout <= 0):
            raise UsageError(f"timeout_s must be a positive number of seconds, not {timeout!r}")
        object.__setattr__(self, "timeout_s", float(timeout))

    def replace(self, **changes: object) -> Limits:
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
