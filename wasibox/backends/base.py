"""The one seam between the Sandbox and an engine: run one job, close.

A backend needs only the names here: it gets a ``Job`` (and a ``RunControl`` to report its
phases and hear cancellation) and returns an ``Outcome``. ``backends/fake.py`` is the
smallest complete one.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .._control import RunControl
from .._limits import Limits
from .._result import Outcome
from ..capabilities.http import HttpPolicy

if TYPE_CHECKING:
    from .._files import FileSession, Mount

__all__ = ["Backend", "Job", "Outcome", "Policy", "RunControl"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """What the guest is granted besides CPU and memory.

    ``clock="virtual"`` gives a clock that starts at a fixed instant and advances only with
    the fuel the guest burns and the time it sleeps; ``"real"`` grants the host's clocks.
    ``entropy="seeded"`` serves wasi:random from a stream seeded by ``seed``; ``"real"``
    grants the host's OS entropy.
    ``functions`` are the host functions the guest may call by name, and ``http`` the policy
    of its mediated HTTP client (None: no HTTP); every backend carries both over its own
    channel to the same host-side code (``wasibox/capabilities/hostcall.py``,
    ``wasibox/capabilities/http.py``).
    """

    seed: int = 0
    clock: Literal["virtual", "real"] = "virtual"
    entropy: Literal["seeded", "real"] = "seeded"
    #: Host directories the guest sees (wasibox.Mount); nothing else exists for it.
    mounts: tuple[Mount, ...] = ()
    functions: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict,
                                                                    compare=False)
    http: HttpPolicy | None = None

    @property
    def deterministic(self) -> bool:
        return self.clock == "virtual" and self.entropy == "seeded"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One unit of work for a backend: run ``code``, then maybe call ``entry``."""

    op: Literal["run", "call", "batch"]
    code: str
    limits: Limits
    policy: Policy
    entry: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The run's view of ``policy.mounts`` (made by the Sandbox for each run, None without
    #: mounts); a backend serves the guest's file operations from it.
    files: FileSession | None = None
    #: For ``op="batch"`` (wasibox.Transform): the records, marshalled (see wasibox/_wire.py).
    records: bytes = b""
    #: For ``op="batch"``: each record is a tuple of positional arguments.
    star: bool = False
    #: The name tracebacks and ``__file__`` give the code: its guest path if it came from a
    #: file (``wasibox run script.py``), else ``<sandbox>``.
    filename: str = "<sandbox>"
    #: Guest directories put first on ``sys.path`` (``Sandbox(python_path=...)``).
    python_path: tuple[str, ...] = ()
    #: The guest's ``sys.argv`` (None: the default), ``os.environ`` and ``sys.stdin`` bytes
    #: (None: empty). Nothing of the host's own reaches the guest.
    argv: tuple[str, ...] | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    stdin: bytes | None = None

    def request(self) -> dict[str, Any]:
        """The wire request for the guest runner (see wasibox/_wire.py)."""
        return {
            "op": self.op,
            "code": self.code,
            "entry": self.entry,
            "args": list(self.args),
            "kwargs": self.kwargs,
            # With seeded entropy the random module starts from the seed; with real entropy
            # it reseeds itself from the host's OS entropy.
            "seed": self.policy.seed if self.policy.entropy == "seeded" else None,
            **({"records": self.records, "star": self.star} if self.op == "batch" else {}),
            **({"filename": self.filename} if self.filename != "<sandbox>" else {}),
            # Sent only when set, so a plain run's request (and fuel) stays as it was.
            **({"argv": list(self.argv if self.argv is not None else [""]),
                "path": list(self.python_path), "env": dict(self.env), "stdin": self.stdin}
               if self.argv is not None or self.python_path or self.env
               or self.stdin is not None else {}),
        }


class Backend(abc.ABC):
    """An engine that runs jobs in fresh, isolated guests.

    ``execute`` must be safe to call from several threads at once, must give every job a
    fresh guest, and must never raise for anything the guest does: guest faults and limits
    are part of the ``Outcome``. ``close`` is idempotent.
    """

    name: str

    @abc.abstractmethod
    def execute(self, job: Job, control: RunControl | None = None) -> Outcome:
        """Run ``job`` in a fresh guest and report what happened.

        With ``control``, report each phase entered (``control.enter``) and stop the guest
        promptly when it is cancelled (``control.on_cancel``), reporting
        ``Limit.CANCELLED``; the guest instance is discarded either way.
        """

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing
        """Release the backend's resources. Safe to call more than once."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
