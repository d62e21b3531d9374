"""``Session``: one live interpreter whose state persists from one call to the next.

A ``Sandbox`` runs every job in a fresh guest. A session keeps one guest (a Wasmtime
instance, or a microVM) for its life, so the globals, imports and open files one call leaves
are there for the next, as in a notebook. What stays the same as for runs:

* each call has its own fuel, timeout, output and host-call budgets (the Sandbox's limits,
  narrowed per call as ``Sandbox.run(limits=...)`` narrows them), and holds one of the
  Sandbox's ``max_concurrency`` slots while it runs; calls of one session run one at a time;
* mounts, HTTP and host functions are exactly the Sandbox's grants;
* ``arun``/``start`` are the async and handle twins, and cancelling behaves as for a run.

What is the session's own: a memory cap for its whole life (the Sandbox's
``memory_bytes``: linear memory never shrinks, so it cannot be narrowed per call), an idle
timeout and a maximum age. A session **ends** when a call exceeds a limit (cancelled
included, once the guest had begun the call), when the guest traps or exits, after the idle
timeout, at its maximum age, or at ``close()``. The call that ended it returns its RunResult
as usual (``limit_exceeded`` or ``error`` says why); every later call raises
``SessionEnded``, saying why. A session is never restarted behind the caller's back.

Files. A session has one view of the Sandbox's mounts for its life, so a file stays open
from one call to the next. Writes to writable mounts are staged, and published when the
session ends without a call being cut short: by ``close()``, the idle timeout or the maximum
age (``Session.files`` then lists them). A session ended by a limit or a trap discards them,
as a failed run's are discarded, since the call that was cut short may have left a file half
written; ``Sandbox.session(publish="always")`` publishes them then too.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ._concurrency import RunHandle
from ._control import RunControl
from ._errors import SandboxClosed, SessionEnded, UsageError, WasiboxError
from ._limits import Limit, Limits
from ._result import FileRecord, RefusedFile, RunResult
from .backends.base import Backend, BackendSession, Job
from .capabilities.files.session import FileSession
from .capabilities.files.staging import QuotaExceeded

if TYPE_CHECKING:
    from ._journal import Journal, Tape
    from ._sandbox import Sandbox

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_AGE_S", "Session", "SessionEnd"]

#: A session with no call for this long ends, freeing its guest (seconds).
DEFAULT_IDLE_TIMEOUT_S = 600.0
#: A session ends this long after it was opened, whatever it does (seconds).
DEFAULT_MAX_AGE_S = 3600.0


class SessionEnd(enum.StrEnum):
    """Why a session ended; the value is what ``SessionEnded.reason`` compares to."""

    LIMIT = "limit"  #: a call exceeded one of its limits (its RunResult says which)
    TRAP = "trap"  #: the guest trapped or exited (os._exit): its interpreter is gone
    IDLE = "idle"  #: no call for the session's idle timeout
    MAX_AGE = "max_age"  #: the session reached its maximum age
    CLOSED = "closed"  #: ``close()`` was called (or the Sandbox was closed)


class Session:
    """One live interpreter for a series of calls; made by ``Sandbox.session()``.

    ``run(code)`` runs ``code`` in the session's namespace and returns its ``RunResult``,
    as ``Sandbox.run`` does. States: live from creation until it ends (see the module
    docstring of ``wasibox._session`` for when); then every call raises SessionEnded and
    ``ended`` says why. ``close()`` is idempotent; ``with``/``async with`` close it.
    """

    def __init__(self, sandbox: Sandbox, backend: Backend, *, idle_timeout_s: float,
                 max_age_s: float, publish: Literal["on_close", "always"] = "on_close",
                 journal: Journal | str | os.PathLike[str] | None = None,
                 restore: bytes | str | os.PathLike[str] | Journal | None = None) -> None:
        """Opened by ``Sandbox.session()``, which documents what it raises."""
        if publish not in ("on_close", "always"):
            raise UsageError(f"publish must be 'on_close' or 'always', not {publish!r}")
        self._publish_always = publish == "always"
        for name, value in (("idle_timeout_s", idle_timeout_s), ("max_age_s", max_age_s)):
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not value > 0 or value == float("inf")):
                raise UsageError(f"{name} must be a positive number of seconds, not {value!r}")
        #: Where the session's calls are recorded (see ``Sandbox.session``), and the file
        #: the journal is written to after each call.
        self._journal, self._journal_path = _session_journal(journal)
        if journal is not None or restore is not None:
            from ._journal import journal_digest

            journal_digest(backend)  # refused before a guest is started for it
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_age_s = float(max_age_s)
        self._sandbox = sandbox
        self._backend = backend
        self._lock = threading.Lock()  # held while a call runs in the guest
        self._state_lock = threading.Lock()
        self._ended: SessionEnded | None = None
        self._calls = 0
        #: Files published by ``close()`` (guest paths), and entries it refused.
        self.files: list[FileRecord] = []
        self.files_refused: list[RefusedFile] = []
        limits = sandbox.limits
        self._files = _open_files(sandbox, limits)
        try:
            self._guest: BackendSession = backend.open_session(limits, sandbox.policy,
                                                               self._files)
        except BaseException:
            if self._files is not None:
                self._files.close()
            raise
        self.opened_at = time.monotonic()
        self._last_used = self.opened_at
        _expiry.watch(self)
        if restore is not None:
            try:
                self._restore(restore)
            except BaseException:
                self.close()
                raise

    # -- the public API ---------------------------------------------------------------------

    @property
    def ended(self) -> SessionEnd | None:
        """Why the session ended, or None while it is live."""
        ended = self._ended
        return None if ended is None else SessionEnd(ended.reason)

    @property
    def calls(self) -> int:
        """Calls that reached the guest so far."""
        return self._calls

    @property
    def backend(self) -> str:
        """The backend that holds the session's guest ("wasm" or "microvm")."""
        return self._backend.name

    def run(self, code: str, *, limits: Mapping[str, Any] | None = None,
            stdin: str | bytes | None = None, argv: Sequence[str] | None = None,
            env: Mapping[str, str] | None = None) -> RunResult:
        """Run ``code`` in the session's interpreter and report what happened.

        The names it defines, the modules it imports and the files it opens stay for the
        next call. ``limits`` narrows this call's limits as in ``Sandbox.run`` (all but
        ``memory_bytes``, which is the session's for its life); ``stdin``, ``argv`` and
        ``env`` are this call's, as in ``Sandbox.run``.

        Never raises for what the guest does. A call that exceeds a limit, or after which
        the guest is gone (a trap, os._exit), ends the session: its result says why, and
        ``ended`` is set. Raises SessionEnded if the session had already ended, Busy as
        ``Sandbox.run`` does, UsageError as ``Sandbox.run`` does (and for a per-call
        ``memory_bytes``), and SandboxClosed after the Sandbox was closed.
        """
        return self._sandbox._runner.run(self._job(code, limits, stdin, argv, env),
                                         self._execute)

    async def arun(self, code: str, *, limits: Mapping[str, Any] | None = None,
                   stdin: str | bytes | None = None, argv: Sequence[str] | None = None,
                   env: Mapping[str, str] | None = None) -> RunResult:
        """``run`` for async code: the call runs on a worker thread.

        Cancelling the awaiting task stops the guest promptly (which ends the session, if
        the guest had begun the call) and then raises CancelledError. Raises what ``run``
        raises.
        """
        return await self.start(code, limits=limits, stdin=stdin, argv=argv, env=env)

    def start(self, code: str, *, limits: Mapping[str, Any] | None = None,
              stdin: str | bytes | None = None, argv: Sequence[str] | None = None,
              env: Mapping[str, str] | None = None) -> RunHandle:
        """Start a call on a worker thread and return its handle at once (see
        ``Sandbox.start``). Raises what ``run`` raises, except what the guest does."""
        return self._sandbox._runner.start(self._job(code, limits, stdin, argv, env),
                                           self._execute)

    def snapshot(self) -> bytes:
        """The session's state as of its last call, to restore with
        ``Sandbox.session(restore=...)``, in this process or another with the same guest.

        Wasmtime cannot capture a component instance's state (its linear memory, globals,
        tables and WASI resources are not reachable through the component API), so a
        snapshot is the session's journal, and restoring it re-executes the calls exactly;
        docs/journal.md says what that costs. It holds what the journal holds (the calls'
        code and input, every value the host handed the guest) and no host paths.

        Raises UsageError if the session was not opened with ``journal=`` (or restored),
        or its journal was truncated; SessionEnded if the session has ended.
        """
        with self._lock:
            self._raise_if_ended()
            if self._journal is None:
                raise UsageError("this session records no journal, so it cannot be "
                                 "snapshotted: open it with Sandbox.session("
                                 "journal=wasibox.Journal())")
            if self._journal.truncated:
                raise UsageError(f"this session's journal passed its bound of "
                                 f"{self._journal.max_bytes} bytes, so it cannot be "
                                 "snapshotted; open it with a larger Journal(max_bytes=...)")
            return self._journal.dumps()

    def _restore(self, snapshot: bytes | str | os.PathLike[str] | Journal) -> None:
        """Bring this new session to ``snapshot``'s state by re-executing its calls."""
        from ._errors import ReplayMismatch
        from ._journal import header_for, journal_digest
        from ._journal_replay import adopt, load_snapshot, replay_into

        journal = load_snapshot(snapshot)
        header = header_for("session", journal_digest(self._backend),
                            self._sandbox.policy, self._sandbox.limits,
                            self._sandbox.python_path, self._sandbox.package_set)
        assert journal.header is not None
        differing = sorted(key for key in header.keys() | journal.header.keys()
                           if header.get(key) != journal.header.get(key))
        if differing:
            raise UsageError(f"this Sandbox is not set up as the one that took the snapshot "
                             f"(it differs in {', '.join(differing)}); restore it in a "
                             "Sandbox with the same settings")
        recording, self._journal = self._journal, None  # the restored calls are recorded
        _, differences = replay_into(journal, self._run_taped, redo_files=True)
        for index, lines in enumerate(differences):
            if lines:
                raise ReplayMismatch(index, "\n".join(lines))
        self._journal = adopt(journal, recording)

    def close(self) -> None:
        """End the session and free its guest; idempotent.

        A session still live publishes its writes to writable mounts first (``files``
        lists them). A call in progress finishes first.
        """
        with self._lock:
            live = self._end(SessionEnd.CLOSED, "it was closed")
            self._release(publish=live)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        import asyncio

        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        state = "live" if self._ended is None else f"ended ({self._ended.reason})"
        return f"<wasibox.Session backend={self.backend} calls={self._calls} {state}>"

    # -- internals --------------------------------------------------------------------------

    def _job(self, code: str, limits: Mapping[str, Any] | None, stdin: str | bytes | None,
             argv: Sequence[str] | None, env: Mapping[str, str] | None) -> Job:
        """Validate one call and turn it into its Job: the one place a call's job is made."""
        self._raise_if_ended()
        if limits is not None and isinstance(limits, Mapping) and "memory_bytes" in limits:
            raise UsageError("a session's memory cap is set for its whole life (its guest's "
                             "memory never shrinks); set memory_bytes on the Sandbox's Limits")
        job = self._sandbox._context_job(code, limits, b"" if stdin is None else stdin, argv,
                                         env)
        job = dataclasses.replace(job, session=True, files=self._files)
        if self._journal is None:
            return job
        tape = self._sandbox._record(job, self._journal, "session", self._backend)
        tape.save_to = self._journal_path
        return dataclasses.replace(job, tape=tape)

    def _run_taped(self, keywords: dict[str, Any], tape: Tape) -> RunResult:
        """Replay one recorded call in this session, ``tape`` serving the boundary."""
        # The memory cap is the session's own (recorded in the journal's header).
        limits = {name: value for name, value in keywords["limits"].items()
                  if name != "memory_bytes"}
        job = self._job(keywords["code"], limits, keywords["stdin"], keywords["argv"],
                        keywords["env"])
        return self._sandbox._runner.run(dataclasses.replace(job, tape=tape), self._execute)

    def _execute(self, job: Job, control: RunControl) -> RunResult:
        """Run one call in the guest; end the session if the call leaves it unusable."""
        with self._lock:
            self._raise_if_ended()
            guest = self._guest
            try:
                outcome = guest.run(job, control)
            except BaseException:
                if job.tape is not None:
                    job.tape.abandon()  # the call never ran: nothing to replay
                if not guest.alive:
                    self._end(SessionEnd.TRAP, "its guest failed")
                    self._release(publish=False)
                raise
            self._calls += 1
            result = self._sandbox._result(outcome, self._backend.name)
            self._last_used = time.monotonic()
            limit = result.limit_exceeded
            if limit is not None and (limit is not Limit.CANCELLED or not guest.alive):
                self._end(SessionEnd.LIMIT, "a call was cancelled while it ran"
                          if limit is Limit.CANCELLED else
                          f"a call exceeded its {limit.value} limit", result)
            elif not guest.alive:
                self._end(SessionEnd.TRAP, "its guest trapped or exited, so its interpreter "
                                           "is gone", result)
            if self._ended is not None:
                self._release(publish=self._publish_always)
        _expiry.touch()
        if job.tape is not None and not job.tape.replaying:
            job.tape.finish(result)
        return result

    def _view(self, guest_path: str) -> Path | None:
        """The host directory holding the live session's view of the writable mount at
        ``guest_path`` (its staging tree), or None once the session has ended."""
        files = self._files
        return None if files is None else files.trees.get(guest_path)

    def _raise_if_ended(self) -> None:
        ended = self._ended
        if ended is not None:
            raise SessionEnded(ended.reason, ended.detail, ended.result)
        if self._sandbox._closed:
            raise SandboxClosed("this session's Sandbox is closed; create a new one")

    def _end(self, reason: SessionEnd, detail: str, result: RunResult | None = None) -> bool:
        """Record that the session ended (the first reason wins); True if it was live."""
        with self._state_lock:
            if self._ended is not None:
                return False
            self._ended = SessionEnded(reason.value, detail, result)
            return True

    def _release(self, *, publish: bool) -> None:
        """Free the guest, then publish or discard the session's staged writes."""
        self._guest.close()
        files, self._files = self._files, None
        if files is None:
            return
        if not publish:
            files.close()
            return
        try:
            self.files, self.files_refused = files.publish()
        except (QuotaExceeded, OSError):
            pass  # the staging is discarded; a run reports it, a closing session cannot
        finally:
            files.close()

    def _expire_if_due(self, now: float) -> float | None:
        """End the session if it is past its idle timeout or age; else when it will be.

        A call in progress is never cut short here: the session is checked again after it.
        """
        if self._ended is not None:
            return None
        if not self._lock.acquire(blocking=False):
            return now + 0.05  # busy: look again soon
        try:
            if now - self.opened_at >= self.max_age_s:
                self._end(SessionEnd.MAX_AGE,
                          f"it reached its maximum age of {self.max_age_s:g} s")
            elif now - self._last_used >= self.idle_timeout_s:
                self._end(SessionEnd.IDLE,
                          f"it had no call for its idle timeout of {self.idle_timeout_s:g} s")
            else:
                return min(self.opened_at + self.max_age_s,
                           self._last_used + self.idle_timeout_s)
            self._release(publish=True)  # no call was cut short: as if it were closed
            return None
        finally:
            self._lock.release()


def _session_journal(journal: Journal | str | os.PathLike[str] | None,
                     ) -> tuple[Journal | None, str | os.PathLike[str] | None]:
    """The journal a session records into, and the file it is written to (if any).

    A session records into a journal of its own; raises UsageError for a Journal that has
    recorded something already, or for a value that is neither a Journal nor a path.
    """
    from ._journal import Journal

    if journal is None:
        return None, None
    if isinstance(journal, Journal):
        if journal.header is not None:
            raise UsageError("a session records into a journal of its own: pass a new "
                             "wasibox.Journal (or a file path)")
        return journal, None
    if not isinstance(journal, str | os.PathLike):
        raise UsageError("journal must be a wasibox.Journal or a file path, not "
                         f"{type(journal).__name__}")
    return Journal(), journal


def _open_files(sandbox: Sandbox, limits: Limits) -> FileSession | None:
    mounts = sandbox.policy.mounts
    if not mounts:
        return None
    try:
        return FileSession(mounts, limits.open_files)
    except OSError as exc:
        raise UsageError(f"a mount's host directory cannot be used: {exc.strerror} "
                         f"({exc.filename})") from None


class _Expiry:
    """One daemon thread that ends sessions at their idle timeout or maximum age, so an
    abandoned session frees its guest on time even if no call ever comes."""

    def __init__(self) -> None:
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, session: Session) -> None:
        with self._cond:
            self._sessions.add(session)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="wasibox-sessions",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def touch(self) -> None:
        """A deadline may have moved: look again."""
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            with self._cond:
                sessions = list(self._sessions)
            wake = now + 60.0
            done = []
            for session in sessions:
                try:
                    due = session._expire_if_due(now)
                except WasiboxError:
                    due = None
                if due is None:
                    done.append(session)
                else:
                    wake = min(wake, due)
            with self._cond:
                for session in done:
                    self._sessions.discard(session)
                if not self._sessions:
                    self._thread = None
                    return
                self._cond.wait(max(wake - time.monotonic(), 0.01))


_expiry = _Expiry()
