"""``Sandbox``: the public way to run untrusted Python, and the ``run`` shortcut."""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ._concurrency import RunHandle, Runner
from ._control import RunControl, RunState
from ._errors import GuestError, LimitExceeded, NativeOnlyPackage, SandboxClosed, UsageError
from ._limits import Limit, Limits
from ._packages import Packages, PackageSet, packages_from, resolve
from ._result import GuestException, Outcome, RunResult, build_result
from ._session import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_AGE_S, Session
from .backends.base import Backend, Job, Policy
from .capabilities.files.mount import Mount, check_mounts
from .capabilities.files.session import FileSession
from .capabilities.files.staging import QuotaExceeded
from .capabilities.hostcall import check_functions
from .capabilities.http import HttpPolicy

if TYPE_CHECKING:
    from ._journal import Journal, Tape

__all__ = ["STDIN_LIMIT_FACTOR", "Sandbox", "run"]

#: The guest's reply carries the return value and the error description; this caps it.
REPLY_LIMIT_BYTES = 64 * 2**20


class Sandbox:
    """Runs untrusted Python, each run in a fresh, isolated interpreter.

    The guest gets nothing by default: no files, network, environment or real clock. Runs
    are deterministic unless ``clock="real"`` or ``entropy="real"`` grants the host's.
    One Sandbox may be used from several threads and tasks at once. With
    ``max_concurrency=N``, at most N runs execute at a time, up to ``max_queue`` more wait
    for a slot, and any further run raises Busy at once; the Wasmtime backend then keeps N
    instances warm. ``arun``/``acall`` are the async twins of ``run``/``call``; ``start``
    returns a ``RunHandle`` to await, wait for or cancel.

    States: open from construction until ``close()`` (or the end of a ``with`` block);
    closed afterwards, when every method but ``close`` raises SandboxClosed.

    ``mounts`` grants host directories (see ``wasibox.Mount``); ``workspace`` is shorthand
    for a writable mount at ``/workspace`` whose files persist from one run to the next.
    ``functions`` grants host functions by name (``import host; host.lookup(42)`` in the
    guest), and ``http`` grants mediated HTTP under an ``HttpPolicy``; both are off by
    default, and every decision they make is in ``RunResult.capability_log``.
    ``max_concurrency`` bounds the runs in flight at once (and sizes the warm pool);
    ``max_queue`` more may wait, and past that a run fails fast with Busy.
    ``python_path`` lists guest directories (inside the mounts) put first on ``sys.path``,
    so the program imports its own modules and packages from them as Python would.
    ``packages`` gives the guest third-party pure-Python packages: requirements such as
    ``["pyyaml==6.0.2", "attrs"]``, or a ``wasibox.Packages`` that also says where pip finds
    them (a wheelhouse, an index). They are resolved with pip on the host (wheels only:
    no package code runs on the host) and built into a guest snapshot of their own, once per
    package set, so the first Sandbox with a new set takes a minute or two (``wasibox
    prepare --package ...`` does it ahead); runs then start as fast as without packages.
    ``RunResult.packages`` names the set that ran. Such a sandbox runs on wasm.

    ``backend="auto"`` (the default) runs on wasm unless the code needs a module the wasm
    guest lacks and the microVM image has: decided before the run from a static scan of its
    imports and from ``requires`` (module names, e.g. ``["numpy"]``); a run never runs twice.
    ``"wasm"`` and ``"microvm"`` force one. ``allow_emulation`` (default:
    ``WASIBOX_ALLOW_EMULATION``) lets the microVM run under software emulation (TCG), which
    is not a security boundary; without it such a run raises UsageError.

    Raises UsageError for an unknown backend, clock or entropy setting, a bad mount, a host
    function name that is not an identifier or a value that is not callable, an ``http``
    that is not an ``HttpPolicy``, a bad max_concurrency or max_queue, a
    ``python_path`` entry that is not an absolute guest path, or ``packages`` that pip
    cannot resolve or with a backend other than wasm (or auto); NativeOnlyPackage (a
    UsageError) for a package that has only native wheels; GuestBuildError if the guest
    for the package set cannot be built.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        seed: int = 0,
        clock: Literal["virtual", "real"] = "virtual",
        entropy: Literal["seeded", "real"] = "seeded",
        backend: Literal["auto", "wasm", "microvm"] | Backend = "auto",
        mounts: Sequence[Mount] = (),
        workspace: str | os.PathLike[str] | None = None,
        http: HttpPolicy | None = None,
        functions: Mapping[str, Callable[..., Any]] | None = None,
        allow_emulation: bool | None = None,
        requires: Sequence[str] = (),
        max_concurrency: int | None = None,
        max_queue: int = 0,
        python_path: Sequence[str] = (),
        packages: Sequence[str] | Packages | PackageSet = (),
    ) -> None:
        if limits is not None and not isinstance(limits, Limits):
            raise UsageError(f"limits must be a wasibox.Limits, not {type(limits).__name__}")
        if clock not in ("virtual", "real"):
            raise UsageError(f"clock must be 'virtual' or 'real', not {clock!r}")
        if entropy not in ("seeded", "real"):
            raise UsageError(f"entropy must be 'seeded' or 'real', not {entropy!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UsageError(f"seed must be an int, not {seed!r}")
        if isinstance(mounts, Mount | str) or not isinstance(mounts, Sequence):
            raise UsageError("mounts must be a list of wasibox.Mount")
        table = list(mounts)
        if workspace is not None:
            table.append(Mount(workspace, "/workspace", writable=True))
        if http is not None and not isinstance(http, HttpPolicy):
            raise UsageError(f"http must be a wasibox.HttpPolicy, not {type(http).__name__}")
        self.limits = limits or Limits()
        self.policy = Policy(seed=seed, clock=clock, entropy=entropy,
                             mounts=check_mounts(table),
                             functions=check_functions(functions), http=http)
        if isinstance(requires, str) or not all(
                isinstance(name, str) and name.replace(".", "_").isidentifier()
                for name in requires):
            raise UsageError(f"requires must be a list of module names, not {requires!r}")
        self.requires = tuple(requires)
        self.python_path = _guest_paths(python_path)
        self._allow_emulation = allow_emulation
        self._auto = backend == "auto"
        #: The resolved package set this sandbox's guest has, or None.
        self.package_set = _package_set(packages, backend)
        self._backend = _make_backend("wasm" if self._auto else backend, allow_emulation,
                                      pool_size=max_concurrency, packages=self.package_set)
        self._microvm: Backend | None = None
        self._runner = Runner(self._execute, self._cancelled_result,
                              max_concurrency=max_concurrency, max_queue=max_queue)
        #: The backend's prepared plain runs (see ``_run_plain``), or None.
        self._plain = (self._backend.plain_runs(self.limits, self.policy, self._package_pins())
                       if not self.python_path
                       and not (self._auto and self._wasm_lacks("", self.requires))
                       else None)
        self._closed = False
        self._lock = threading.Lock()
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()

    def session(self, *, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                max_age_s: float = DEFAULT_MAX_AGE_S,
                publish: Literal["on_close", "always"] = "on_close",
                journal: Journal | str | os.PathLike[str] | None = None,
                restore: bytes | str | os.PathLike[str] | Journal | None = None) -> Session:
        """Open a ``Session``: one live interpreter whose globals, imports and open files
        persist from one ``session.run(code)`` to the next.

        Each call has its own limits (this Sandbox's, narrowed per call); the session's
        guest lives under this Sandbox's ``memory_bytes`` for its whole life, and ends after
        ``idle_timeout_s`` without a call or ``max_age_s`` after it opened, whichever comes
        first. With ``backend="auto"`` it runs on wasm, unless ``requires`` names a module
        only the microVM has. Close it (or use ``with``) to free its guest.

        Writes to writable mounts are published when the session closes or expires; with
        ``publish="always"`` also when a limit or a trap ends it (by default those discard
        them, as a failed run's writes are discarded).

        ``journal`` (a new ``wasibox.Journal``, or a file path rewritten after every call)
        records the session's calls, so that ``wasibox.replay`` re-executes them in one new
        session and checks each (see docs/journal.md). Only wasm sessions can be recorded:
        a microVM's runs are not deterministic.

        ``restore`` (what ``Session.snapshot()`` returned, or its file) opens the session in
        the state the snapshot was taken in, by re-executing its calls and checking each; a
        restored session records its calls after those, so it can be snapshotted again. The
        Sandbox must be set up as the one that took the snapshot (seed, clock, entropy,
        limits, grants by name). Raises GuestDigestMismatch if another guest took it,
        JournalError if it cannot be read, ReplayMismatch if a call did not reproduce, and
        UsageError if this Sandbox is set up differently.

        Raises UsageError for a timeout that is not a positive number of seconds, an unknown
        ``publish``, or if the backend keeps no sessions, GuestBuildError if the guest cannot
        be started, and SandboxClosed after ``close()``.
        """
        self._ensure_open()
        session = Session(self, self._session_backend(), idle_timeout_s=idle_timeout_s,
                          max_age_s=max_age_s, publish=publish, journal=journal,
                          restore=restore)
        with self._lock:
            self._sessions.add(session)
        return session

    def run(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None,
            limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
            argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
            filename: str | None = None,
            journal: Journal | str | os.PathLike[str] | None = None) -> RunResult:
        """Run ``code`` in a fresh interpreter and report what happened.

        With ``entry``, the function of that name is then called with ``args`` and
        ``kwargs``, and its return value is ``result.value``. Arguments and return values
        must be msgpack-compatible (None, bool, int, float, str, bytes, and lists and dicts
        of them).

        ``limits`` lowers some of the sandbox's limits for this run only, by field name:
        ``limits={"timeout_s": 1, "fuel": 10**8}``. It never raises one: a value above the
        sandbox's own is a UsageError, as an unknown name is. A fuel derived from the
        timeout is derived again from the lowered timeout.

        The program reads ``stdin`` (str as UTF-8, or bytes; default empty) from
        ``sys.stdin``, sees ``argv`` as the whole of ``sys.argv`` (``argv[0]`` included) and
        ``env`` as ``os.environ``; the host's own environment never reaches it. ``filename``
        is the name tracebacks and ``__file__`` give the code (default ``<sandbox>``): the
        code's guest path when it came from a mounted file.

        ``journal`` (a ``wasibox.Journal``, or a file path written when the run ends) records
        the run so that ``wasibox.replay`` can re-execute it offline and check its outputs
        and fuel (see docs/journal.md). A journaled run never moves to the microVM.

        Never raises for what the guest does: exceptions, exit codes and exceeded limits are
        in the result. Raises UsageError if ``code`` is not a str or is larger than
        ``limits.source_bytes``, if the arguments cannot cross the boundary, for ``limits``
        that would not narrow the sandbox's, if ``stdin`` is larger than
        ``limits.source_bytes`` times 16 (``STDIN_LIMIT_FACTOR``), or if ``argv``, ``env`` or
        ``filename`` are not str (without NUL; env names without ``=``), or if ``journal``
        cannot record on this backend, records another sandbox's runs or is a path that
        cannot be written, Busy if
        ``max_concurrency`` runs are active and ``max_queue`` more wait, and SandboxClosed
        after ``close()``.
        """
        if (self._plain is not None and entry is None and not args and kwargs is None
                and limits is None and stdin is None and argv is None and env is None
                and filename is None and journal is None):
            return self._run_plain(code)
        return self._runner.run(self._job(code, entry, args, kwargs, limits,
                                          _Context(stdin, argv, env, filename), journal))

    async def arun(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
                   kwargs: Mapping[str, Any] | None = None,
                   limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
                   argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                   filename: str | None = None,
                   journal: Journal | str | os.PathLike[str] | None = None) -> RunResult:
        """``run`` for async code: the run executes on a worker thread; the loop never blocks.

        Cancelling the awaiting task stops the guest promptly, frees its instance, and then
        raises CancelledError. Raises Busy if the queue is full, and what ``run`` raises.
        """
        return await self.start(code, entry=entry, args=args, kwargs=kwargs, limits=limits,
                                stdin=stdin, argv=argv, env=env, filename=filename,
                                journal=journal)

    def start(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
              kwargs: Mapping[str, Any] | None = None,
              limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
              argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
              filename: str | None = None,
              journal: Journal | str | os.PathLike[str] | None = None) -> RunHandle:
        """Start a run on a worker thread and return its handle at once.

        ``await handle`` or ``handle.result()`` gives the RunResult; ``handle.cancel()``
        stops it (its result then says ``limit_exceeded == "cancelled"``). Raises Busy if
        the queue is full, and UsageError/SandboxClosed as ``run`` does.
        """
        return self._runner.start(self._job(code, entry, args, kwargs, limits,
                                            _Context(stdin, argv, env, filename), journal))

    def call(self, code: str, entry: str, /, *args: Any,
             limits: Mapping[str, Any] | None = None,
             journal: Journal | str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """Run ``code``, then call its function ``entry`` with the arguments; return its value.

        ``limits`` narrows this run's limits and ``journal`` records the run, as in ``run``
        (so neither is passed on to the function: pass a keyword argument of either name
        with ``run(..., kwargs=...)``). The journal records the call whether it returns or
        raises, so a failed call can be replayed with ``wasibox replay``.
        Raises GuestError if the guest raised or exited non-zero, LimitExceeded if a limit
        was hit, and UsageError as ``run`` does.
        """
        return unwrap(self.run(code, entry=entry, args=args, kwargs=kwargs, limits=limits,
                               journal=journal))

    async def acall(self, code: str, entry: str, /, *args: Any,
                    limits: Mapping[str, Any] | None = None,
                    journal: Journal | str | os.PathLike[str] | None = None,
                    **kwargs: Any) -> Any:
        """``call`` for async code; raises as ``call`` and ``arun`` do."""
        return unwrap(await self.arun(code, entry=entry, args=args, kwargs=kwargs,
                                      limits=limits, journal=journal))

    def close(self) -> None:
        """Close the sandbox; idempotent. Runs already in progress finish normally; runs
        still queued end at once as cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for session in list(self._sessions):
            session.close()
        self._runner.close()
        self._backend.close()
        if self._microvm is not None:
            self._microvm.close()

    def __enter__(self) -> Sandbox:
        self._ensure_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        name = "auto" if self._auto else self._backend.name
        return f"<wasibox.Sandbox backend={name} {state}>"

    # -- internals --------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise SandboxClosed("this Sandbox is closed; create a new one")

    def _check_source(self, code: str, limits: Limits | None = None) -> str:
        self._ensure_open()
        if not isinstance(code, str):
            raise UsageError(f"code must be a str, not {type(code).__name__}")
        size = len(code.encode("utf-8", errors="surrogatepass"))
        cap = (limits or self.limits).source_bytes
        if size > cap:
            raise UsageError(f"the code is {size} bytes, over the source_bytes limit of "
                             f"{cap}; raise Limits.source_bytes to allow it")
        return code

    def _execute_batch(self, code: str, entry: str, records: bytes,
                       star: bool = False) -> Outcome:
        """Call ``entry`` on each marshalled record in one fresh instance (wasibox.Transform).

        Returns what the backend observed; the reply is decoded by wasibox/_batch.py.
        """
        code = self._check_source(code)
        job = Job(op="batch", code=code, limits=self.limits, policy=self.policy, entry=entry,
                  records=records, star=star, python_path=self.python_path)
        if not job.policy.mounts:
            return self._backend.execute(job)
        # Writes are published for a batch that ran to its end; a batch that is split and
        # re-run (see wasibox/_transform.py) publishes from its re-runs instead.
        with FileSession(job.policy.mounts, job.limits.open_files) as session:
            outcome = self._backend.execute(dataclasses.replace(job, files=session))
            if outcome.reply is not None and outcome.limit_exceeded is None:
                session.publish()
        return outcome

    def _job(self, code: str, entry: str | None, args: Sequence[Any],
             kwargs: Mapping[str, Any] | None, narrow: Mapping[str, Any] | None,
             context: _Context | None = None,
             journal: Journal | str | os.PathLike[str] | None = None) -> Job:
        """Validate a request and turn it into a Job (shared by every driver, sync or async)."""
        self._ensure_open()
        limits = self.limits if narrow is None else self.limits.narrow(narrow)
        code = self._check_source(code, limits)
        job = Job(op="run", code=code, limits=limits, policy=self.policy,
                  python_path=self.python_path,
                  **(context or _Context()).fields(limits.source_bytes))
        if entry is None:
            if args or kwargs:
                raise UsageError("args and kwargs need an entry function to pass them to")
        else:
            if not isinstance(entry, str) or not entry.isidentifier():
                raise UsageError(f"entry must name a function, such as 'main', not {entry!r}")
            job = dataclasses.replace(job, op="call", entry=entry, args=tuple(args),
                                      kwargs=dict(kwargs or {}))
        if journal is None:
            return job
        return dataclasses.replace(job, tape=self._record(job, journal))

    def _record(self, job: Job, journal: Journal | str | os.PathLike[str],
                kind: Literal["run", "session"] = "run",
                backend: Backend | None = None) -> Tape:
        """Start recording ``job`` into ``journal``; raises UsageError as ``run`` says."""
        from ._journal import Journal, header_for, journal_digest, request_of

        target = None
        if not isinstance(journal, Journal):
            if not isinstance(journal, str | os.PathLike):
                raise UsageError("journal must be a wasibox.Journal or a file path, not "
                                 f"{type(journal).__name__}")
            target, journal = journal, Journal()
        digest = journal_digest(backend or self._backend)
        try:
            request = request_of(job)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UsageError(f"arguments must be msgpack-compatible values: {exc}") from None
        tape = journal.begin(header_for(kind, digest, self.policy, self.limits,
                                        self.python_path, self.package_set), request)
        tape.save_to = target
        return tape

    def _run_taped(self, keywords: dict[str, Any], tape: Tape) -> RunResult:
        """Replay one recorded run: its request, with ``tape`` serving the boundary."""
        keywords = dict(keywords)
        context = _Context(keywords.pop("stdin"), keywords.pop("argv"), keywords.pop("env"),
                           keywords.pop("filename"))
        job = self._job(keywords.pop("code"), keywords.pop("entry", None),
                        keywords.pop("args", ()), keywords.pop("kwargs", None),
                        keywords.pop("limits"), context)
        return self._runner.run(dataclasses.replace(job, tape=tape))

    def _context_job(self, code: str, narrow: Mapping[str, Any] | None,
                     stdin: str | bytes | None, argv: Sequence[str] | None,
                     env: Mapping[str, str] | None) -> Job:
        """``_job`` for a run with stdin, argv and env (a Session's call); raises as it."""
        return self._job(code, None, (), None, narrow, _Context(stdin, argv, env))

    def _package_pins(self) -> tuple[str, ...]:
        """The package set built into this sandbox's guest, as "name==version" pins."""
        return self.package_set.pins if self.package_set is not None else ()

    def _result(self, outcome: Outcome, backend: str) -> RunResult:
        """The RunResult of what ``backend`` observed (a run's or a Session call's)."""
        return build_result(outcome, backend, REPLY_LIMIT_BYTES,
                            packages=self._package_pins())

    def _run_plain(self, code: str) -> RunResult:
        """``run(code)`` with nothing else set: the same checks, admission and result as
        any run, in fewer steps (a paced warm run's host time was mostly the steps).

        Whatever is not the common case (code that is not a str or may be over the
        source_bytes limit, code that may need the microVM, a run that must queue) goes the
        general way, which raises or queues as ``run`` documents.
        """
        plain, runner = self._plain, self._runner
        assert plain is not None  # see run
        # A str of n characters is at most 4n bytes of UTF-8: under the cap, no need to
        # encode it to know.
        if (type(code) is not str or self._closed
                or len(code) * 4 > self.limits.source_bytes
                or (self._auto and "import" in code and self._wasm_lacks(code))
                or not runner.claim()):
            return self._runner.run(self._job(code, None, (), None, None))
        try:
            outcome = plain(code)
        finally:
            runner.release()
        if isinstance(outcome, RunResult):
            return outcome
        return self._result(outcome, self._backend.name)

    @staticmethod
    def _wasm_lacks(code: str, requires: Sequence[str] = ()) -> bool:
        """Whether ``code`` imports, or ``requires`` names, a module the wasm guest lacks
        (then ``_choose`` decides where the run goes)."""
        from ._select import wasm_lacks

        return bool(wasm_lacks(code, requires))

    def _execute(self, job: Job, control: RunControl | None = None) -> RunResult:
        backend = self._choose(job)
        if control is None and any(mount.c_access for mount in job.policy.mounts):
            control = RunControl()  # so that run_with_files can stop C code over a quota
        try:
            result = run_with_files(job, lambda job: self._result(
                backend.execute(job, control), backend.name), control)
        except BaseException:
            if job.tape is not None:
                job.tape.abandon()  # the call never ran: nothing to replay
            raise
        if job.tape is not None and not job.tape.replaying:
            job.tape.finish(result)
        return result

    def _cancelled_result(self, job: Job) -> RunResult:
        result = self._result(Outcome(limit_exceeded=Limit.CANCELLED), self._backend.name)
        if job.tape is not None and not job.tape.replaying:
            job.tape.finish(result)
        return result

    def _session_backend(self) -> Backend:
        """The backend a session runs on: chosen from ``requires`` alone, since its code
        comes later, one call at a time."""
        if not self._auto:
            return self._backend
        return self._choose(Job(op="run", code="", limits=self.limits, policy=self.policy))

    def _choose(self, job: Job) -> Backend:
        """The backend for this job: decided once, before anything runs."""
        if not self._auto or self.package_set is not None:
            return self._backend  # the microVM does not have the package set
        if job.tape is not None:  # only wasm runs can be replayed
            return self._backend
        from ._select import wasm_lacks

        lacking = wasm_lacks(job.code, self.requires)
        if not lacking:
            return self._backend
        from .backends.microvm.runtime import microvm_available, vm_modules

        if not (microvm_available() and lacking & vm_modules()):
            return self._backend
        with self._lock:
            if self._microvm is None:
                self._microvm = _make_backend("microvm", self._allow_emulation)
            return self._microvm


#: ``stdin`` may be this many times ``Limits.source_bytes``: it is data, not code, but it
#: travels in the request just as the code does.
STDIN_LIMIT_FACTOR = 16


@dataclasses.dataclass(frozen=True)
class _Context:
    """What a run gives the program besides its code: stdin, argv, environment, file name."""

    stdin: str | bytes | None = None
    argv: Sequence[str] | None = None
    env: Mapping[str, str] | None = None
    filename: str | None = None

    def fields(self, source_bytes: int) -> dict[str, Any]:
        """The Job fields, checked; raises UsageError as ``Sandbox.run`` documents."""
        fields: dict[str, Any] = {}
        if self.stdin is not None:
            if isinstance(self.stdin, str):
                try:
                    stdin = self.stdin.encode("utf-8")
                except UnicodeEncodeError:
                    raise UsageError("stdin must be valid UTF-8 text (it holds a lone "
                                     "surrogate); pass bytes instead") from None
            elif isinstance(self.stdin, bytes | bytearray | memoryview):
                stdin = bytes(self.stdin)
            else:
                raise UsageError(f"stdin must be str or bytes, not {type(self.stdin).__name__}")
            if len(stdin) > STDIN_LIMIT_FACTOR * source_bytes:
                raise UsageError(f"stdin is {len(stdin)} bytes, over {STDIN_LIMIT_FACTOR} "
                                 f"times the source_bytes limit of {source_bytes}; raise "
                                 "Limits.source_bytes, or mount the data as a file instead")
            fields["stdin"] = stdin
        if self.argv is not None:
            if isinstance(self.argv, str | bytes) or not isinstance(self.argv, Sequence):
                raise UsageError("argv must be a list of str, such as ['main.py', '--all']")
            fields["argv"] = tuple(_text(arg, "argv items") for arg in self.argv)
        if self.env is not None:
            if not isinstance(self.env, Mapping):
                raise UsageError("env must be a mapping of str to str")
            for name, value in self.env.items():
                if not _text(name, "env names") or "=" in name:
                    raise UsageError(f"env names must be non-empty and hold no '=', "
                                     f"not {name!r}")
                _text(value, "env values")
            fields["env"] = dict(self.env)
        if self.filename is not None:
            if not _text(self.filename, "filename"):
                raise UsageError("filename must not be empty")
            fields["filename"] = self.filename
        return fields


def _text(value: object, what: str) -> str:
    """``value`` if it is a str the guest can hold as an OS string; UsageError otherwise."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be str, not {type(value).__name__}")
    if "\x00" in value:
        raise UsageError(f"{what} must not hold a NUL character: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} must be valid UTF-8 text: {value!r}") from None
    return value


def _guest_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """``python_path`` checked: absolute guest paths; raises UsageError otherwise."""
    if isinstance(paths, str | bytes) or not isinstance(paths, Sequence):
        raise UsageError("python_path must be a list of guest directories, such as ['/src']")
    for path in paths:
        if not _text(path, "python_path entries").startswith("/"):
            raise UsageError(f"python_path entries are absolute guest paths (inside a "
                             f"mount), such as '/src', not {path!r}")
    return tuple(paths)


#: How often the trees of ``c_access`` mounts are measured while a run goes on: C code can
#: write past a quota by what it writes in one interval before the run is stopped.
C_ACCESS_CHECK_S = 0.05


class _CAccessWatch:
    """Measures a run's ``c_access`` trees every C_ACCESS_CHECK_S on a thread of its own, and
    cancels the run through ``control`` once one is over its quotas (``overrun`` says why)."""

    def __init__(self, session: FileSession, control: RunControl) -> None:
        self.overrun: str | None = None
        self._session, self._control = session, control
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="wasibox-c-access-quota",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(C_ACCESS_CHECK_S):
            overrun = self._session.c_access_overrun()
            if overrun is not None:
                self.overrun = overrun
                self._control.cancel()
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def run_with_files(job: Job, execute: Callable[[Job], RunResult],
                   control: RunControl | None = None) -> RunResult:
    """Run ``job`` with a file session for its mounts, then publish (if the result is ok)
    or discard the staging. Without mounts, just runs it.

    With ``control``, a run cancelled before its files are published publishes nothing:
    its staging is discarded and its result says ``cancelled``. Publishing, once begun, is
    atomic and completes.

    A run that ends ok but leaves a writable mount over its quotas (possible only for a
    backend whose guest writes its staging tree itself, such as the microVM's) publishes
    nothing: its result is not ok, with exit status 1 and an ``OSError`` error saying which
    quota, ending "nothing was published". A run with ``c_access`` mounts and a ``control``
    is also stopped (through ``control``) as soon as C code puts one over its quotas, with
    the same kind of result.

    Raises UsageError if a mount's host directory has gone, or cannot hold its staging.
    """
    mounts = job.policy.mounts
    if not mounts:
        return execute(job)
    try:
        session = FileSession(mounts, job.limits.open_files)
    except OSError as exc:
        raise UsageError(f"a mount's host directory cannot be used: {exc.strerror} "
                         f"({exc.filename})") from None
    with session:
        watch = (_CAccessWatch(session, control)
                 if control is not None and any(m.c_access for m in mounts) else None)
        try:
            result = execute(dataclasses.replace(job, files=session))
        finally:
            if watch is not None:
                watch.stop()
        if watch is not None and watch.overrun is not None:
            error = GuestException(type="OSError", traceback="", message=(
                f"{watch.overrun} while the run went on: it was stopped, and nothing was "
                "published"))
            return dataclasses.replace(result, ok=False, exit_code=1, error=error,
                                       limit_exceeded=None)
        if not result.ok:
            return result
        if control is not None:
            control.enter(RunState.PUBLISHING)
            if control.cancelled:
                return dataclasses.replace(result, ok=False, exit_code=1,
                                           limit_exceeded=Limit.CANCELLED)
        try:
            records, refused = session.publish()
        except QuotaExceeded as exc:
            error = GuestException(type="OSError", traceback="",
                                   message=f"{exc}: nothing was published")
            return dataclasses.replace(result, ok=False, exit_code=1, error=error)
        except OSError as exc:
            # The host's disk is full: a guest can fill it up to its quota when the quota is
            # larger than the disk. The staging is gone; the run reports it and does not raise.
            error = GuestException(type="OSError", traceback="", message=(
                f"the run's files could not be published: {exc.strerror or 'host error'}"))
            return dataclasses.replace(result, ok=False, exit_code=1, error=error)
    return dataclasses.replace(result, files=records, files_refused=refused)


def sandbox_for(code: str, limits: Limits | None, **options: Any) -> Sandbox:
    """A Sandbox made to run ``code`` again and again (a Transform's, a fuzzed function's).

    Raises UsageError, at once rather than at the first call, for an option this Sandbox
    does not take and for a source it refuses.
    """
    try:
        sandbox = Sandbox(limits, **options)
    except TypeError as exc:
        raise UsageError(f"this wasibox's Sandbox does not accept that option: {exc}") \
            from None
    sandbox._check_source(code)
    return sandbox


def unwrap(result: RunResult) -> Any:
    """Return a call's value, or raise LimitExceeded / GuestError for a failed call."""
    if result.limit_exceeded is not None:
        raise LimitExceeded(result.limit_exceeded, result)
    if result.error is not None:
        raise GuestError(result.error, result)
    if result.exit_code != 0:
        raise GuestError(GuestException(type="SystemExit", message=str(result.exit_code),
                                        traceback=""), result)
    return result.value


def _package_set(packages: Sequence[str] | Packages | PackageSet,
                 backend: str | Backend) -> PackageSet | None:
    """``packages`` resolved for the wasm guest, or None for none; raises as Sandbox says.

    A PackageSet is taken as it is: ``wasibox.replay`` passes the set a journal recorded,
    found in the package cache, so that nothing is resolved again."""
    wanted = packages if isinstance(packages, PackageSet) else packages_from(packages)
    if wanted is None:
        return None
    if backend not in ("auto", "wasm"):
        raise UsageError("packages= needs backend 'wasm' or 'auto': the microVM does not "
                         "install packages (its image has numpy, pandas and the like "
                         "already)")
    if isinstance(wanted, PackageSet):
        return wanted
    try:
        return resolve(wanted)
    except NativeOnlyPackage as exc:
        from .backends.microvm.runtime import vm_modules

        module = exc.package.lower().replace("-", "_")
        if module in vm_modules():
            raise NativeOnlyPackage(exc.package, f"{exc}. The microVM image has {module} "
                                    "already: leave it out of packages and run on the "
                                    "microVM (backend='microvm', or 'auto')") from None
        raise


def _make_backend(backend: str | Backend, allow_emulation: bool | None = None, *,
                  pool_size: int | None = None, packages: PackageSet | None = None) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend == "wasm":
        from .backends.wasm.backend import WasmBackend
        from .backends.wasm.runtime import runtime

        if packages is not None:
            from ._guest import ensure_guest

            return WasmBackend(runtime(artifact=ensure_guest(packages=packages)),
                               pool_size=pool_size)
        return WasmBackend(pool_size=pool_size)
    if backend == "microvm":
        from .backends.microvm.backend import MicroVMBackend

        return MicroVMBackend(allow_emulation=allow_emulation)
    raise UsageError("backend must be 'auto', 'wasm', 'microvm' or a Backend instance, "
                     f"not {backend!r}")


def run(code: str, *, limits: Limits | None = None, seed: int = 0) -> RunResult:
    """Run ``code`` once in a fresh sandbox with default (or given) limits."""
    with Sandbox(limits, seed=seed) as sandbox:
        return sandbox.run(code)
