"""The one exception tree of wasibox.

::

    WasiboxError                  every error wasibox raises; catch this one
    ├── GuestError                guest code raised (or exited non-zero); carries its traceback
    ├── LimitExceeded             a run hit a limit; ``.limit`` says which, ``.result`` the rest
    ├── GuestBuildError           the guest component could not be built or loaded
    │   └── GuestMismatch         a dask worker's guest differs from the client's
    ├── VMError                   a microVM could not be started or snapshotted
    ├── Busy                      max_concurrency runs are active and max_queue more wait
    ├── JournalError              a journal cannot be read or replayed (names the line)
    │   ├── GuestDigestMismatch   the journal was recorded by another guest (names both)
    │   └── ReplayMismatch        the replay's outputs differ from the journal's; ``.diff``
    ├── SessionEnded              a Session was used after it ended; ``.reason`` says why
    └── UsageError                a mistake in the calling code (bad limits, bad arguments)
        ├── SandboxClosed         the Sandbox was used after ``close()``
        ├── ConfigError           a service configuration file is invalid (names the key)
        ├── EmulationRefused      the microVM would need software emulation, not allowed
        ├── FunctionRefused       a transform asked a dask worker for a host function it
        │                         does not allow
        └── NativeOnlyPackage     a requested package has no pure-Python wheel for wasm

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
    "GuestDigestMismatch",
    "GuestError",
    "JournalError",
    "GuestMismatch",
    "LimitExceeded",
    "NativeOnlyPackage",
    "ReplayMismatch",
    "SandboxClosed",
    "SessionEnded",
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


class NativeOnlyPackage(UsageError):
    """A package asked for with ``packages=`` has only native wheels (extension modules),
    and the wasm guest runs pure-Python wheels only. ``package`` names it."""

    def __init__(self, package: str, message: str) -> None:
        self.package = package
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), (self.package, self.args[0]), self.args, self.__dict__))


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


class SessionEnded(WasiboxError):
    """A call was made to a ``wasibox.Session`` that has ended; nothing ran.

    ``reason`` is why it ended: ``"limit"`` (a call exceeded one of its limits, named by
    ``result.limit_exceeded``), ``"trap"`` (the guest trapped or exited, so its interpreter
    is gone), ``"idle"`` (no call for the session's idle timeout), ``"max_age"`` (it reached
    its maximum age) or ``"closed"``. ``result`` is the RunResult of the call that ended it,
    when a call did. A session is never restarted behind the caller's back: open a new one
    and run its setup again.
    """

    def __init__(self, reason: str, detail: str, result: RunResult | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.result = result
        super().__init__(f"this session has ended ({detail}); its variables, imports and open "
                         "files are gone. Open a new session (Sandbox.session()) and run its "
                         "setup again")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), (self.reason, self.detail, self.result), self.args,
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


class JournalError(WasiboxError):
    """A journal could not be read or replayed: it is malformed, of an unknown version,
    larger than the size it may be read at, or was truncated when it was recorded. The
    message names the line and says what to do."""


class GuestDigestMismatch(JournalError):
    """A journal was recorded by another guest than this installation's; a replay must run
    the very guest that recorded it. ``recorded`` and ``current`` are the two digests."""

    def __init__(self, recorded: str, current: str) -> None:
        self.recorded = recorded
        self.current = current
        super().__init__(f"the journal was recorded by guest {recorded}, but this wasibox "
                         f"runs guest {current}; replay it with the wasibox version that "
                         "recorded it (`wasibox doctor` shows the guest digest)")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), (self.recorded, self.current), self.args,
                           self.__dict__))


class ReplayMismatch(JournalError):
    """A replay ran, but what it produced differs from what the journal recorded.

    ``diff`` says, call by call and field by field, what was recorded and what the replay
    gave; ``call`` is the index of the first call that differed.
    """

    def __init__(self, call: int, diff: str) -> None:
        self.call = call
        self.diff = diff
        super().__init__(f"the replay differs from the journal at call {call}:\n{diff}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), (self.call, self.diff), self.args, self.__dict__))
