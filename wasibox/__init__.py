"""wasibox: run untrusted Python in a CPython interpreter compiled to WebAssembly.

>>> import wasibox
>>> wasibox.run("print(1 + 1)").stdout
'2\\n'
"""

from ._concurrency import RunHandle
from ._control import RunState
from ._errors import (
    Busy,
    ConfigError,
    EmulationRefused,
    FunctionRefused,
    GuestBuildError,
    GuestDigestMismatch,
    GuestError,
    GuestMismatch,
    JournalError,
    LimitExceeded,
    NativeOnlyPackage,
    ReplayMismatch,
    SandboxClosed,
    SessionEnded,
    UsageError,
    VMError,
    WasiboxError,
)
from ._events import CapabilityEvent
from ._journal import Journal
from ._journal_replay import ReplayReport
from ._limits import Limit, Limits
from ._packages import Packages, guest_digest
from ._replay import replay
from ._result import FileRecord, GuestException, RefusedFile, RunResult
from ._sandbox import Sandbox, run
from ._session import Session, SessionEnd
from ._transform import Failed, FailedRecord, Transform, TransformProgress, TransformSpec
from ._version import __version__ as __version__
from .capabilities.files.mount import Mount
from .capabilities.http import HttpPolicy

__all__ = [
    "Busy",
    "CapabilityEvent",
    "ConfigError",
    "EmulationRefused",
    "Failed",
    "FailedRecord",
    "FileRecord",
    "FunctionRefused",
    "GuestBuildError",
    "GuestDigestMismatch",
    "GuestError",
    "GuestException",
    "GuestMismatch",
    "HttpPolicy",
    "Journal",
    "JournalError",
    "Limit",
    "LimitExceeded",
    "Limits",
    "Mount",
    "NativeOnlyPackage",
    "Packages",
    "RefusedFile",
    "ReplayMismatch",
    "ReplayReport",
    "RunHandle",
    "RunResult",
    "RunState",
    "Sandbox",
    "SandboxClosed",
    "Session",
    "SessionEnd",
    "SessionEnded",
    "Transform",
    "TransformProgress",
    "TransformSpec",
    "UsageError",
    "VMError",
    "WasiboxError",
    "guest_digest",
    "replay",
    "run",
]

# Public names say where users find them, so tracebacks and reprs read `wasibox.Sandbox`.
for _name in __all__:
    _obj = globals()[_name]
    if hasattr(_obj, "__module__"):
        try:
            _obj.__module__ = "wasibox"
        except (AttributeError, TypeError):
            pass
del _name, _obj
