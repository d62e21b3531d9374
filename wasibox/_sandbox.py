"""``Sandbox``: the public way to run untrusted Python, and the ``run`` shortcut."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from ._concurrency import RunHandle, Runner
from ._control import RunControl, RunState
from ._errors import GuestError, LimitExceeded, SandboxClosed, UsageError
from ._files import FileSession, Mount, QuotaExceeded, check_mounts
from ._limits import Limit, Limits
from ._result import GuestException, Outcome, RunResult, build_result
from .backends.base import Backend, Job, Policy
from .capabilities.hostcall import check_functions
from .capabilities.http import HttpPolicy

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

    ``backend="auto"`` (the default) runs on wasm unless the code needs a module the wasm
    guest lacks and the microVM image has: decided before the run from a static scan of its
    imports and from ``requires`` (module names, e.g. ``["numpy"]``); a run never runs twice.
    ``"wasm"`` and ``"microvm"`` force one. ``allow_emulation`` (default:
    ``WASIBOX_ALLOW_EMULATION``) lets the microVM run under software emulation (TCG), which
    is not a security boundary; without it such a run raises UsageError.

    Raises UsageError for an unknown backend, clock or entropy setting, a bad mount, a host
    function name that is not an identifier or a value that is not callable, an ``http``
    that is not an ``HttpPolicy``, a bad max_concurrency or max_queue, or a
    ``python_path`` entry that is not an absolute guest path.
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
        self._backend = _make_backend("wasm" if self._auto else backend, allow_emulation,
                                      pool_size=max_concurrency)
        self._microvm: Backend | None = None
        self._runner = Runner(self._execute, self._cancelled_result,
                              max_concurrency=max_concurrency, max_queue=max_queue)
        self._closed = False
        self._lock = threading.Lock()

    def run(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None,
            limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
            argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
            filename: str | None = None) -> RunResult:
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

        Never raises for what the guest does: exceptions, exit codes and exceeded limits are
        in the result. Raises UsageError if ``code`` is not a str or is larger than
        ``limits.source_bytes``, if the arguments cannot cross the boundary, for ``limits``
        that would not narrow the sandbox's, if ``stdin`` is larger than
        ``limits.source_bytes`` times 16 (``STDIN_LIMIT_FACTOR``), or if ``argv``, ``env`` or
        ``filename`` are not str (without NUL; env names without ``=``), Busy if
        ``max_concurrency`` runs are active and ``max_queue`` more wait, and SandboxClosed
        after ``close()``.
        """
        return self._runner.run(self._job(code, entry, args, kwargs, limits,
                                          _Context(stdin, argv, env, filename)))

    async def arun(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
                   kwargs: Mapping[str, Any] | None = None,
                   limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
                   argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                   filename: str | None = None) -> RunResult:
        """``run`` for async code: the run executes on a worker thread; the loop never blocks.

        Cancelling the awaiting task stops the guest promptly, frees its instance, and then
        raises CancelledError. Raises Busy if the queue is full, and what ``run`` raises.
        """
        return await self.start(code, entry=entry, args=args, kwargs=kwargs, limits=limits,
                                stdin=stdin, argv=argv, env=env, filename=filename)

    def start(self, code: str, *, entry: str | None = None, args: Sequence[Any] = (),
              kwargs: Mapping[str, Any] | None = None,
              limits: Mapping[str, Any] | None = None, stdin: str | bytes | None = None,
              argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
              filename: str | None = None) -> RunHandle:
        """Start a run on a worker thread and return its handle at once.

        ``await handle`` or ``handle.result()`` gives the RunResult; ``handle.cancel()``
        stops it (its result then says ``limit_exceeded == "cancelled"``). Raises Busy if
        the queue is full, and UsageError/SandboxClosed as ``run`` does.
        """
        return self._runner.start(self._job(code, entry, args, kwargs, limits,
                                            _Context(stdin, argv, env, filename)))

    def call(self, code: str, entry: str, /, *args: Any,
             limits: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Run ``code``, then call its function ``entry`` with the arguments; return its value.

        ``limits`` narrows this run's limits as in ``run`` (so it is not passed on to the
        function: pass a keyword argument named ``limits`` with ``run(..., kwargs=...)``).
        Raises GuestError if the guest raised or exited non-zero, LimitExceeded if a limit
        was hit, and UsageError as ``run`` does.
        """
        return unwrap(self.run(code, entry=entry, args=args, kwargs=kwargs, limits=limits))

    async def acall(self, code: str, entry: str, /, *args: Any,
                    limits: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """``call`` for async code; raises as ``call`` and ``arun`` do."""
        return unwrap(await self.arun(code, entry=entry, args=args, kwargs=kwargs,
                                      limits=limits))

    def close(self) -> None:
        """Close the sandbox; idempotent. Runs already in progress finish normally; runs
        still queued end at once as cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
             context: _Context | None = None) -> Job:
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
            return job
        if not isinstance(entry, str) or not entry.isidentifier():
            raise UsageError(f"entry must name a function, such as 'main', not {entry!r}")
        return dataclasses.replace(job, op="call", entry=entry, args=tuple(args),
                                   kwargs=dict(kwargs or {}))

    def _execute(self, job: Job, control: RunControl | None = None) -> RunResult:
        backend = self._choose(job)
        return run_with_files(job, lambda job: build_result(
            backend.execute(job, control), backend.name, REPLY_LIMIT_BYTES),
            control)

    def _cancelled_result(self, job: Job) -> RunResult:
        return build_result(Outcome(limit_exceeded=Limit.CANCELLED), self._backend.name,
                            REPLY_LIMIT_BYTES)

    def _choose(self, job: Job) -> Backend:
        """The backend for this job: decided once, before anything runs."""
        if not self._auto:
            return self._backend
        from ._select import wasm_lacks

        lacking = wasm_lacks(job.code, self.requires)
        if not lacking:
            return self._backend
        from .backends.microvm.backend import microvm_available, vm_modules

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
    quota, ending "nothing was published".

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
        result = execute(dataclasses.replace(job, files=session))
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


def _make_backend(backend: str | Backend, allow_emulation: bool | None = None, *,
                  pool_size: int | None = None) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend == "wasm":
        from .backends.wasm import WasmBackend

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
