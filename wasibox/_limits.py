"""Per-run limits, and the names of the limits a run can exceed.

Fuel and time. Fuel is the deterministic CPU budget: the same program uses the same fuel on
every machine, so fuel is always a fixed number derived from the limits, never from a clock.
When ``fuel`` is not given it is ``ceil(timeout_s * FUEL_PER_SECOND)``, enough for the guest to
compute for the whole timeout, so a ``timeout_s`` means what it says and fuel only decides
when it is given.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping
from typing import ClassVar

from ._errors import UsageError

__all__ = ["FUEL_PER_SECOND", "Limit", "Limits"]

#: Fuel per second of wall-clock time, used to derive ``fuel`` from ``timeout_s`` when only
#: the timeout is given. It must stay above what any guest code burns, or the fuel runs out
#: first and a timeout does not mean what it says. Measured on an idle 2-core machine
#: (``python bench/fuel_rate.py``): interpreted Python burns 3.4e9 (sorting, str and dict
#: work) to 1.1e10 fuel/s (``while True: pass``), and tight C loops more: 1.6e10 for bigint
#: multiplication, 1.9e10 for sha256, 3.4e10 for zlib.crc32. 1e10, the rate before, ran out
#: before the timeout on that machine; this is about three times the fastest.
FUEL_PER_SECOND = 10**11
#: The wall-clock limit when none is given, in seconds.
DEFAULT_TIMEOUT_S = 5.0


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


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class Limits:
    """What one run may use. Every field is enforced on every run.

    Sizes accept ints or shorthand (``memory_bytes="256MiB"``), normalised here, once.
    ``fuel`` not given (or None) is derived from ``timeout_s``: ``ceil(timeout_s *
    FUEL_PER_SECOND)``, so ``Limits(timeout_s=30)`` may compute for 30 s.
    Raises UsageError for a value that is not positive or not a number.
    """

    #: CPU budget in fuel units. Deterministic: the same program uses the same fuel.
    #: Default: ``timeout_s * FUEL_PER_SECOND`` (500 billion for the default 5 s).
    fuel: int
    #: Cap on the guest's linear memory. Growth past it gives the guest a MemoryError.
    memory_bytes: int = 256 * 2**20
    #: Wall-clock budget in seconds, enforced by epoch interruption and by every host wait.
    timeout_s: float = DEFAULT_TIMEOUT_S
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
    #: Whether ``fuel`` was derived from ``timeout_s``: an attribute of each instance, set by
    #: the constructor; not a field, so ``asdict``, equality and the repr leave it out.
    _fuel_from_timeout: ClassVar[bool] = False

    def __init__(self, *, fuel: int | None = None, memory_bytes: int | str = 256 * 2**20,
                 timeout_s: float = DEFAULT_TIMEOUT_S, output_bytes: int | str = 2**20,
                 source_bytes: int | str = 2**20, open_files: int = 64,
                 host_calls: int = 10_000, host_call_bytes: int | str = 16 * 2**20,
                 host_total_bytes: int | str = 256 * 2**20) -> None:
        # Written out (not generated) so that ``fuel`` may be omitted while the attribute is
        # always an int.
        values = {"memory_bytes": memory_bytes, "timeout_s": timeout_s,
                  "output_bytes": output_bytes, "source_bytes": source_bytes,
                  "open_files": open_files, "host_calls": host_calls,
                  "host_call_bytes": host_call_bytes, "host_total_bytes": host_total_bytes}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_fuel_from_timeout", fuel is None)
        object.__setattr__(self, "fuel", 1 if fuel is None else fuel)
        self.__post_init__()

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
        if self._fuel_from_timeout:
            object.__setattr__(self, "fuel", math.ceil(self.timeout_s * FUEL_PER_SECOND))

    @property
    def fuel_from_timeout(self) -> bool:
        """True when ``fuel`` was not given and so was derived from ``timeout_s``."""
        return self._fuel_from_timeout

    def replace(self, **changes: object) -> Limits:
        """A copy with some fields changed (validated like the constructor).

        A fuel that was derived from the timeout is derived again from the new timeout.
        Raises UsageError for an unknown field or an invalid value.
        """
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise UsageError(f"Limits has no field {unknown[0]!r}; the fields are "
                             f"{', '.join(_FIELDS)}")
        values: dict[str, object] = {name: getattr(self, name) for name in _FIELDS}
        if self._fuel_from_timeout:
            values["fuel"] = None
        values.update(changes)
        return Limits(**values)  # type: ignore[arg-type]

    def narrow(self, changes: Mapping[str, object]) -> Limits:
        """A copy with the limits ``changes`` names lowered, for one run; never raised.

        Keys are field names (``{"timeout_s": 1, "fuel": 10**8}``), values as the
        constructor takes them. Raises UsageError for an unknown key, an invalid value, or a
        value above this Limits' own (a run may lower its limits, never raise them).
        """
        if not isinstance(changes, Mapping):
            raise UsageError("per-run limits must be a mapping such as {'timeout_s': 1}, not "
                             f"{type(changes).__name__}")
        narrowed = self.replace(**{str(name): value for name, value in changes.items()})
        for name in changes:
            own, wanted = getattr(self, name), getattr(narrowed, name)
            if wanted > own:
                raise UsageError(f"{name}={wanted} is above this sandbox's limit of {own}; "
                                 "a run may lower its limits, never raise them")
        return narrowed


#: The fields a caller sets, in order.
_FIELDS = ("fuel", "memory_bytes", "timeout_s", "output_bytes", "source_bytes", "open_files",
           "host_calls", "host_call_bytes", "host_total_bytes")
