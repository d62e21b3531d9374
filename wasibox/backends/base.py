"""The one seam between the Sandbox and an engine: run one job, close.

A backend needs only the names here: it gets a ``Job`` (and a ``RunControl`` to report its
phases and hear cancellation) and returns an ``Outcome``. ``backends/fake.py`` is the
smallest complete one.

A backend that can keep one guest alive across calls (``wasibox.Session``) also implements
``open_session``, which returns a ``BackendSession``: the same ``run(job, control) ->
Outcome``, each call in the *same* guest, until ``close``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .._control import RunControl
from .._errors import UsageError
from .._limits import Limits
from .._result import Outcome, RunResult
from ..capabilities.http import HttpPolicy

if TYPE_CHECKING:
    from .._journal import Tape
    from ..capabilities.files.mount import Mount
    from ..capabilities.files.session import FileSession

__all__ = ["Backend", "BackendSession", "Job", "Outcome", "Policy", "RunControl"]


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
    #: The journal tape of this call (``Sandbox.run(journal=...)``, ``wasibox.replay``), or
    #: None. A backend that supports journals records every value it hands the guest on it
    #: or, when the tape is replaying, serves the recorded value instead of asking the host.
    tape: Tape | None = dataclasses.field(default=None, compare=False, repr=False)
    #: A call of a ``wasibox.Session``: the guest runs ``code`` in the namespace the
    #: session's earlier calls left (the first call makes it), and leaves its files open.
    session: bool = False

    def request(self) -> dict[str, Any]:
        """The wire request for the guest runner (see wasibox/_wire.py)."""
        return {
            "op": self.op,
            "code": self.code,
            # A run calls nothing: leaving these out saved ~8K of the guest's fuel per run.
            **({"entry": self.entry, "args": list(self.args), "kwargs": self.kwargs}
               if self.op != "run" else {}),
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
            **({"session": True} if self.session else {}),
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

    def plain_runs(self, limits: Limits, policy: Policy, packages: tuple[str, ...]
                   ) -> Callable[[str], RunResult | Outcome] | None:
        """Optionally, a function that runs a *plain* job, ``Job(op="run", code=code,
        limits=limits, policy=policy)`` and nothing else set, as ``execute`` would, with
        what does not change between such jobs prepared once. It returns the Outcome, or
        for the common ending the RunResult ``build_result`` would make of it (with
        ``packages`` and this backend's name). A Sandbox asks once and uses it for every
        ``run(code)`` that sets nothing else. None (the default): every run goes through
        ``execute``.
        """
        return None

    def open_session(self, limits: Limits, policy: Policy,
                     files: FileSession | None) -> BackendSession:
        """Start one guest that will serve every call of a ``wasibox.Session``.

        ``limits.memory_bytes`` caps the guest's memory for its whole life; ``files`` is
        the session's view of ``policy.mounts`` (None without mounts), used by every call.
        Raises UsageError if this backend keeps no sessions (the default).
        """
        raise UsageError(f"the {self.name} backend cannot keep a session's guest alive; "
                         "use the wasm or microvm backend")

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing
        """Release the backend's resources. Safe to call more than once."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BackendSession(abc.ABC):
    """One guest kept alive for the calls of a ``wasibox.Session``, one call at a time.

    ``run`` has ``Backend.execute``'s contract, except that every job (each with
    ``job.session`` set) runs in the same guest, which keeps its state between calls. It is
    called from one thread at a time. ``alive`` turns False, for good, once the guest can
    take no further call (it trapped, exited, was interrupted mid-call, or was closed);
    ``close`` is idempotent and frees the guest.
    """

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the guest can take another call."""

    @abc.abstractmethod
    def run(self, job: Job, control: RunControl | None = None) -> Outcome:
        """Run ``job`` in the session's guest and report what happened.

        Never raises for what the guest does. A job cancelled before the guest began it
        reports ``Limit.CANCELLED`` and leaves the guest ``alive``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Free the guest. Safe to call more than once."""
