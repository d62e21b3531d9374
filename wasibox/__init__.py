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
    GuestBuildError,
    GuestDigestMismatch,
    GuestError,
    JournalError,
    LimitExceeded,
    ReplayMismatch,
    SandboxClosed,
    SessionEnded,
    UsageError,
    WasiboxError,
)
from ._events import CapabilityEvent
from ._files import FileRecord, Mount, RefusedFile
from ._guest import guest_digest
from ._http import HttpPolicy
from ._journal import Journal, ReplayReport, replay
from ._limits import Limit, Limits
from ._result import GuestException, RunResult
from ._sandbox import Sandbox, run
from ._session import Session, SessionEnd
from ._transform import Failed, Transform, TransformProgress, TransformSpec
from ._version import __version__ as __version__

__all__ = [
    "Busy",
    "CapabilityEvent",
    "ConfigError",
    "EmulationRefused",
    "Failed",
    "FileRecord",
    "GuestBuildError",
    "GuestDigestMismatch",
    "GuestError",
    "GuestException",
    "HttpPolicy",
    "Journal",
    "JournalError",
    "Limit",
    "LimitExceeded",
    "Limits",
    "Mount",
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
