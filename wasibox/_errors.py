"""The one exception tree of wasibox.

::

    WasiboxError                  every error wasibox raises; catch this one
    ├── GuestError                guest code raised (or exited non-zero); carries its traceback
    ├── LimitExceeded             a run hit a limit; ``.limit`` says which, ``.result`` the rest
    ├── GuestBuildError           the guest component could not be built or loaded
    │   └── GuestMismatch         a dask worker's guest differs from the client's
    ├── VMError                   a microVM could not be started or snapshotted
    ├── Busy                      max_concurrency runs are active and max_queue more wait
    └── UsageError                a mistake in the calling code (bad limits, bad arguments)
        ├── SandboxClosed         the Sandbox was used after ``close()``
        ├── ConfigError           a service configuration file is invalid (names the key)
        ├── EmulationRefused      the microVM would need software emulation, not allowed
        └── FunctionRefused       a transform asked a dask worker for a host function it
                                  does not allow

``Sandbox.run`` never raises for what the guest does: a guest exception or an exceeded limit is
part of its ``RunResult``. ``Sandbox.call`` returns a value, so it raises ``GuestError`` or
``LimitExceeded`` instead. Errors from the engine itself are converted to this tree at one
point, in the Wasmtime backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._limits import Limit
    from ._result import GuestException, RunResult

__all__ = [
    "Busy",
    "ConfigError",
    "EmulationRefused",
    "FunctionRefused",
    "GuestBuildError",
    "GuestError",
    "GuestMismatch",
    "LimitExceeded",
    "SandboxClosed",
    "UsageError",
    "VMError",
    "WasiboxError",
    "fuel_advice",
]


class WasiboxError(Exception):
    """The root of every error wasibox raises."""


def _rebuilt(cls: type[BaseException], init: tuple[Any, ...], args: tuple[Any, ...],
             state: dict[str, Any]) -> BaseException:
    """Unpickle an error whose constructor does not take its message (see ``__reduce__``)."""
    error = cls(*init)
    error.args = args
    error.__dict__.update(state)
    return error


class UsageError(WasiboxError):
    """The calling code used wasibox wrongly; the message says how to fix it."""


class SandboxClosed(UsageError):
    """A Sandbox was used after it was closed."""


class ConfigError(UsageError):
    """A service configuration file could not be read or is invalid; the message names
    each bad key (``tenants.alice.limits.fuel: ...``)."""


class EmulationRefused(UsageError):
    """The microVM backend would run under QEMU's software emulation (TCG), because this
    machine has no KVM that can run the guest kernel, and emulation was not allowed.

    ``opt_in`` names how the caller allows it; the message is written for that caller
    (a program, a command line, a service's operator).
    """

    def __init__(self, opt_in: str = "Sandbox(allow_emulation=True) or "
                                      "WASIBOX_ALLOW_EMULATION=1") -> None:
        self.opt_in = opt_in
        super().__init__(
            "the microVM backend would run under QEMU's software emulation (TCG): this "
            "machine has no KVM that can run the guest kernel (`wasibox doctor` says why). "
            "QEMU does not treat TCG as a security boundary, so wasibox refuses it unless "
            f"you opt in with {opt_in} (and accept that guest code is ~15-30x slower and "
            "less strongly isolated)")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), (self.opt_in,), self.args, self.__dict__))


class FunctionRefused(UsageError):
    """A transform asked a dask worker for a host function its configuration does not allow
    (``wasibox.dask.WasiboxPlugin(allow_functions=...)``)."""


class GuestBuildError(WasiboxError):
    """The guest component could not be built, compiled or loaded."""


class GuestMismatch(GuestBuildError):
    """A worker's guest digest differs from the one the client expects; the worker refuses
    to run transforms, because its results could differ."""


class VMError(WasiboxError):
    """A microVM could not be started or snapshotted (not something the guest did)."""


class Busy(WasiboxError):
    """A run was refused at once: the Sandbox already runs ``max_concurrency`` runs and
    ``max_queue`` more are waiting. Nothing was started; retry later (a server answers 429)."""

    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        super().__init__(f"the sandbox is busy: {max_concurrency} runs are active and "
                         f"{max_queue} are queued; retry later")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (message, attributes), e.g. to travel back from a dask worker.
        return (_rebuilt, (type(self), (self.max_concurrency, self.max_queue), self.args,
                           self.__dict__))


class GuestError(WasiboxError):
    """Guest code raised an exception, or exited with a non-zero status.

    ``type``, ``message`` and ``traceback`` describe the guest's exception as the guest saw
    it; the traceback never contains host frames or host paths. ``index`` is the record's
    index when the error comes from one record of a ``wasibox.Transform``, else None.
    """

    index: int | None = None

    def __init__(self, exception: GuestException, result: RunResult | None = None) -> None:
        self.exception = exception
        self.type = exception.type
        self.message = exception.message
        self.traceback = exception.traceback
        self.result = result
        super().__init__(f"{exception.type}: {exception.message}" if exception.message
                         else exception.type)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (message with its record index, attributes), e.g. to travel back
        # from a dask worker.
        return (_rebuilt, (type(self), (self.exception, self.result), self.args,
                           self.__dict__))


def fuel_advice(fuel_used: int) -> str:
    """The words for a run that ran out of fuel: how much it used and how to give it more."""
    return (f"the run exceeded its fuel limit (its deterministic CPU budget) after using "
            f"{fuel_used:,} units; raise it with Limits(fuel=...), --fuel on the command line, "
            "or limits.fuel in a configuration file")


class LimitExceeded(WasiboxError):
    """A run hit one of its limits; ``limit`` names it and ``result`` holds what was kept.

    ``index`` is the record's index when one record of a ``wasibox.Transform`` hit it.
    """

    index: int | None = None

    def __init__(self, limit: Limit, result: RunResult | None = None) -> None:
        self.limit = limit
        self.result = result
        if limit.value == "fuel" and result is not None:
            super().__init__(fuel_advice(result.fuel_used))
        else:
            super().__init__(f"the run exceeded its {limit.value} limit")

    def __reduce__(self) -> tuple[Any, ...]:
        # As GuestError's.
        return (_rebuilt, (type(self), (self.limit, self.result), self.args, self.__dict__))
