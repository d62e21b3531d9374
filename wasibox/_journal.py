"""Journals: a record of runs precise enough to re-execute them offline, and their replay.

A run is deterministic given its code, its request (arguments, stdin, argv, env), its seed,
its limits, the guest that ran it, and the values that crossed the boundary *into* the
guest: what host functions returned, the HTTP responses, what the file operations on its
mounts answered, and, only where the real clock or real entropy was granted, the times and
the random bytes it was served (the virtual clock and seeded entropy are derived from the
seed and the fuel, so they need no record). A journal holds exactly that, plus the outputs
(stdout, stderr, the value or error, the exit status, the limit, the fuel used) to check a
replay against.

**Format** (version 1, documented in docs/journal.md): UTF-8 JSON Lines, one object with
one key per line::

    {"wasibox_journal": 1, "kind": "run", "guest_digest": "...", "seed": 0, ...}
    {"call": {"op": "run", "code": "...", "limits": {...}, ...}}
    {"io": ["files.read", "3f0c...", "ok", ["ok", "file text"]]}
    {"outcome": {"stdout": "...", "fuel_used": 123456, ...}}
    {"truncated": {"max_bytes": 67108864}}          (only when the size bound was reached)

JSON Lines rather than msgpack: a journal is read by the person diagnosing a failure, with
``less``, ``grep`` or ``jq``; every value that crosses into the guest is already text or a
number (the guest interfaces carry bytes as latin-1 strings, one char per byte), so nothing
needs an opaque encoding; and a line-oriented file is decoded one bounded line at a time.
Lines are written as ASCII (other characters as JSON ``\\u`` escapes), so a control
character the guest was handed cannot split a line.

**Bounds.** A journal is at most ``max_bytes`` (``DEFAULT_JOURNAL_BYTES``) as written. A
recording that would pass it stops recording, keeps the run going unchanged, and ends the
journal with a ``truncated`` line; such a journal cannot be replayed (``JournalError`` says
to record again with a larger bound). Reading refuses a file larger than its ``max_bytes``
before decoding any of it, and every line is decoded and checked against the schema before
it is used: a malformed or hostile journal is a ``JournalError``, never a crash.

**Privacy.** A journal holds no host paths (mounts are named by their guest paths; file
operations carry only guest paths) and nothing of the host's environment, which never
reaches the guest. What the guest was given explicitly (``env=``, ``stdin=``, arguments,
host-function results, HTTP responses, file contents read) is recorded, since a replay
needs it: treat a journal as you would the data the guest was allowed to see.

The backend records through a ``Tape`` (one per call), at the host functions that serve
those values (``taped`` in ``backends/wasm/run.py``); on a replay the same tape serves them
back without touching the host, and refuses a call the journal does not hold (the replay
diverged).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgpack

from ._errors import (
    JournalError,
    UsageError,
)
from ._limits import _FIELDS as LIMIT_FIELDS
from ._limits import Limit, Limits
from ._result import RunResult, json_value
from ._version import __version__

if TYPE_CHECKING:
    from ._packages import PackageSet
    from .backends.base import Job, Policy

__all__ = ["DEFAULT_JOURNAL_BYTES", "JOURNAL_VERSION", "Journal", "Tape"]

#: The journal format's version: the value of the header's ``wasibox_journal`` key.
JOURNAL_VERSION = 1
#: How large a journal may grow (as written), and how large a file ``Journal.load`` reads.
DEFAULT_JOURNAL_BYTES = 64 * 2**20
#: Room kept for the ``truncated`` line, so a truncated journal still fits its bound.
_MARKER_RESERVE = 128
#: The statuses of a boundary exchange: it answered, or it ended the run with a limit.
_STATUSES = ("ok", "stop")
OUTCOME_FIELDS = ("ok", "exit_code", "stdout", "stderr", "stdout_truncated",
                   "stderr_truncated", "error", "limit_exceeded", "fuel_used", "value")


def _line(record: Mapping[str, Any]) -> str:
    """One journal line: compact JSON, no NaN, and ASCII only: every other character is a
    ``\\u`` escape, so no byte the guest was handed (a latin-1 NEL, U+2028, a lone
    surrogate) can break a line or the encoding for any tool that reads the file."""
    return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"


def _line_bytes(record: Mapping[str, Any]) -> int:
    return len(_line(record))


def exchange_key(args: Sequence[Any]) -> str:
    """A short digest of a boundary call's arguments, to detect a replay that diverged
    without keeping what the guest sent (a write's data need not be in the journal)."""
    digest = hashlib.blake2b(digest_size=8)
    for arg in args:
        # A str (a payload of up to host_call_bytes) is hashed as it is, not through repr.
        data = (arg.encode("utf-8", errors="surrogatepass") if isinstance(arg, str)
                else repr(arg).encode("ascii", errors="backslashreplace"))
        digest.update(f"{type(arg).__name__}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()


@dataclasses.dataclass
class _Call:
    """One call of a journal: its request, its boundary exchanges, what it produced."""

    request: dict[str, Any]
    events: list[list[Any]] = dataclasses.field(default_factory=list)
    outcome: dict[str, Any] | None = None


class Journal:
    """A recording of runs (or of a session's calls) that ``wasibox.replay`` re-executes.

    Pass one to ``Sandbox.run(..., journal=journal)`` (or a file path, written when the run
    ends), then ``save`` it; ``wasibox replay FILE`` or ``wasibox.replay(FILE)`` re-runs it
    offline and checks that every output and the fuel match. Several runs of one Sandbox
    may share a journal; each is replayed in a fresh interpreter, as it ran. ``max_bytes``
    bounds the journal as written: past it, recording stops, the run goes on unchanged, and
    the journal is marked truncated (and cannot be replayed). ``Journal.load(path)`` reads
    one back; ``dumps()`` gives the file's bytes (the format is in docs/journal.md).

    Raises UsageError for a ``max_bytes`` that is not an int above 128.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_JOURNAL_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) \
                or max_bytes <= _MARKER_RESERVE:
            raise UsageError(f"max_bytes must be an int above {_MARKER_RESERVE}, "
                             f"not {max_bytes!r}")
        self.max_bytes = max_bytes
        #: The journal's first line: the guest, sandbox settings and limits every call shares.
        self.header: dict[str, Any] | None = None
        self._calls: list[_Call] = []
        #: True once a recording passed ``max_bytes``; nothing was recorded after that.
        self.truncated = False
        self._size = 0
        self._lock = threading.Lock()

    @property
    def kind(self) -> Literal["run", "session"] | None:
        """``"run"`` (each call in a fresh interpreter) or ``"session"`` (all in one)."""
        return self.header["kind"] if self.header is not None else None

    @property
    def calls(self) -> int:
        """The number of calls recorded."""
        return len(self._calls)

    # -- recording ---------------------------------------------------------------------------

    def begin(self, header: dict[str, Any], request: dict[str, Any]) -> Tape:
        """Start recording one call (the backend fills its tape); returns the tape.

        Raises UsageError if the journal already records calls of another sandbox or guest.
        """
        with self._lock:
            if self.header is None:
                self.header = header
                self._add(header)
            elif header != self.header:
                raise UsageError("this journal records another sandbox's runs (its guest, "
                                 "settings or limits differ); use one journal per sandbox")
            call = _Call(request)
            self._calls.append(call)
            self._add({"call": request})
        return Tape(self, call, replaying=False)

    def _add(self, record: Mapping[str, Any]) -> bool:
        """Count one line against the bound; False (and truncated) once it does not fit."""
        if self.truncated:
            return False
        size = _line_bytes(record)
        if self._size + size > self.max_bytes - _MARKER_RESERVE:
            self.truncated = True
            return False
        self._size += size
        return True

    # -- writing and reading -----------------------------------------------------------------

    def dumps(self) -> bytes:
        """The journal as its file content (UTF-8 JSON Lines); see docs/journal.md."""
        with self._lock:
            if self.header is None:
                raise UsageError("this journal has recorded nothing yet")
            lines = [_line(self.header)]
            size = len(lines[0])
            for call in self._calls:
                for record in ({"call": call.request}, *({"io": e} for e in call.events),
                               *(({"outcome": call.outcome},) if call.outcome else ())):
                    line = _line(record)
                    size += len(line)
                    if size > self.max_bytes - _MARKER_RESERVE:
                        break
                    lines.append(line)
                else:
                    continue
                break
            if self.truncated:
                lines.append(_line({"truncated": {"max_bytes": self.max_bytes}}))
        return "".join(lines).encode("ascii")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the journal to ``path`` (replaced atomically).

        Raises UsageError if nothing was recorded, OSError if the file cannot be written.
        """
        data = self.dumps()
        target = Path(path)
        # Runs on worker threads may save one journal at once: one staging file each.
        staged = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        staged.write_bytes(data)
        os.replace(staged, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *,
             max_bytes: int = DEFAULT_JOURNAL_BYTES) -> Journal:
        """Read a journal file, refusing one larger than ``max_bytes`` before decoding it.

        Raises JournalError for a file that is too large or is not a valid journal (the
        message names the line), OSError if it cannot be read.
        """
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
        return cls.loads(data, max_bytes=max_bytes)

    @classmethod
    def loads(cls, data: bytes, *, max_bytes: int = DEFAULT_JOURNAL_BYTES) -> Journal:
        """A journal from its file content; raises JournalError as ``load`` does."""
        if len(data) > max_bytes:
            raise JournalError(f"the journal is larger than {max_bytes} bytes; pass a larger "
                               "max_bytes (--max-bytes) if you trust it")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JournalError(f"the journal is not UTF-8 text (byte {exc.start})") from None
        journal = cls(max_bytes=max(max_bytes, _MARKER_RESERVE + 1))
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines:
            raise JournalError("the journal is empty")
        for number, line in enumerate(lines, start=1):
            journal._read_line(number, _decode_line(number, line))
        if journal.header is None:
            raise JournalError("line 1: the journal has no header")
        return journal

    def _read_line(self, number: int, record: Any) -> None:
        where = f"line {number}"
        if not isinstance(record, dict) or len(record) == 0:
            raise JournalError(f"{where}: expected a JSON object")
        if number == 1:
            self.header = _check_header(record)
            return
        if self.truncated:
            raise JournalError(f"{where}: nothing may follow the truncation marker")
        if len(record) != 1:
            raise JournalError(f"{where}: expected one key, one of call, io, outcome, "
                               "truncated")
        key, value = next(iter(record.items()))
        if key == "call":
            self._calls.append(_Call(_check_request(value, where)))
            return
        if key == "truncated":
            self.truncated = True
            return
        if not self._calls or self._calls[-1].outcome is not None:
            raise JournalError(f"{where}: {key!r} outside a call")
        call = self._calls[-1]
        if key == "io":
            call.events.append(_check_event(value, where))
        elif key == "outcome":
            call.outcome = _check_outcome(value, where)
        else:
            raise JournalError(f"{where}: unknown record {key[:40]!r}")


class Tape:
    """The boundary exchanges of one call, recorded as they happen or served on a replay.

    A backend calls ``record`` (or, when ``replaying``, ``serve``) for every value that
    crosses into the guest. Only the thread running the call touches a tape.
    """

    def __init__(self, journal: Journal, call: _Call, *, replaying: bool) -> None:
        self._journal = journal
        self._call = call
        self.replaying = replaying
        self._cursor = 0
        #: Why the replay left the journal's path, if it did (the first time).
        self.diverged: str | None = None
        #: Where ``finish`` writes the journal (``Sandbox.run(journal=path)``).
        self.save_to: str | os.PathLike[str] | None = None
        #: Replaying to restore a session: file operations are performed again on the
        #: session's mounts (so its open files, their positions and its unpublished writes
        #: are as they were), while the guest is still handed the recorded answers.
        self.redo_files = False

    def record(self, kind: str, args: Sequence[Any], status: str, value: Any) -> None:
        """Keep one exchange: the guest called ``kind`` with ``args`` and got ``value``
        (``status`` "ok") or the call ended the run with the limit ``value`` ("stop")."""
        event = [kind, exchange_key(args), status, value]
        with self._journal._lock:
            if self._journal._add({"io": event}):
                self._call.events.append(event)

    def serve(self, kind: str, args: Sequence[Any]) -> tuple[str, Any]:
        """The recorded answer to the next exchange, as ``(status, value)``.

        Raises JournalError (and remembers it in ``diverged``) if the guest's next call is
        not the one the journal holds: the replay left the recorded path.
        """
        events = self._call.events
        if self._cursor >= len(events):
            self._diverge(f"the guest made boundary call {self._cursor + 1} ({kind}), but "
                          f"the journal holds only {len(events)}")
        recorded_kind, recorded_key, status, value = events[self._cursor]
        if recorded_kind != kind or recorded_key != exchange_key(args):
            self._diverge(f"boundary call {self._cursor + 1} was {recorded_kind} "
                          f"({recorded_key}) when recorded, but {kind} "
                          f"({exchange_key(args)}) on replay")
        self._cursor += 1
        return status, (Limit(value) if status == "stop" else value)

    def refuse(self, kind: str, value: Any) -> None:
        """Raise JournalError: the journal's answer to ``kind`` is not one it can have."""
        self._diverge(f"boundary call {self._cursor} ({kind}) has an answer of the wrong "
                      f"shape in the journal: {clip(value)}")

    def check_redone(self, kind: str, recorded: Any, redone: Any) -> None:
        """A file operation performed again must succeed or fail as it did (the same
        descriptor, for one that opens); raises JournalError if the mounts changed so that
        it does not."""
        same = (recorded == redone if kind in ("files.open", "files.dup")
                else recorded[0] == redone[0])
        if not same:
            self._diverge(f"the mounted files changed since the snapshot: {kind} answered "
                          f"{clip(recorded)} then, {clip(redone)} now")

    def _diverge(self, message: str) -> None:
        self.diverged = self.diverged or message
        raise JournalError(message)

    def finish(self, result: RunResult) -> None:
        """Record what the call produced, and write the journal if it goes to a file.

        Raises UsageError if that file cannot be written.
        """
        outcome = outcome_of(result)
        with self._journal._lock:
            if self._journal._add({"outcome": outcome}):
                self._call.outcome = outcome
        if self.save_to is not None:
            try:
                self._journal.save(self.save_to)
            except OSError as exc:
                raise UsageError(f"the journal cannot be written to {self.save_to}: "
                                 f"{exc.strerror}") from None

    def abandon(self) -> None:
        """Forget the call: it raised before the guest ran it, so there is nothing to replay."""
        if self.replaying:
            return
        with self._journal._lock:
            if self._call in self._journal._calls:
                self._journal._calls.remove(self._call)

    def unserved(self) -> int:
        """How many recorded exchanges a replayed call did not ask for."""
        return len(self._call.events) - self._cursor


# -- what a journal holds ----------------------------------------------------------------------

def journal_digest(backend: object) -> str:
    """The guest digest a journal of ``backend``'s runs records; raises UsageError for a
    backend whose runs cannot be replayed (the microVM's are not deterministic)."""
    digest = getattr(backend, "guest_digest", None)
    if not isinstance(digest, str):
        raise UsageError(f"the {getattr(backend, 'name', 'given')} backend does not record "
                         "journals: only the deterministic wasm backend can be replayed")
    return digest


def header_for(kind: Literal["run", "session"], guest_digest: str, policy: Policy,
               limits: Limits, python_path: Sequence[str],
               packages: PackageSet | None) -> dict[str, Any]:
    """The header of a journal of ``policy``'s runs: no host paths, no host function code."""
    header: dict[str, Any] = {
        "wasibox_journal": JOURNAL_VERSION,
        "kind": kind,
        "guest_digest": guest_digest,
        "wasibox": __version__,
        "seed": policy.seed,
        "clock": policy.clock,
        "entropy": policy.entropy,
        "limits": limits_of(limits),
        # What was granted, by guest path and by name: informative; a replay serves the
        # recorded answers and grants nothing.
        "mounts": [{"path": mount.guest_path, "writable": mount.writable}
                   for mount in policy.mounts],
        "functions": sorted(policy.functions),
        "http": policy.http is not None,
        "python_path": list(python_path),
        # The package set built into the guest ("name==version" pins), or none.
        "packages": list(packages.pins) if packages is not None else [],
    }
    if packages is not None:
        # Its exact wheels (file name and sha256), so that a replay rebuilds that very guest
        # from the package cache; absent without packages, as in journals from before.
        header["wheels"] = packages.records()
    return header


def limits_of(limits: Limits) -> dict[str, Any]:
    return {name: getattr(limits, name) for name in LIMIT_FIELDS}


def request_of(job: Job) -> dict[str, Any]:
    """A call's request as journal data: everything the guest was handed with its code."""
    request: dict[str, Any] = {"op": job.op, "code": job.code, "limits": limits_of(job.limits)}
    if job.entry is not None:
        request["entry"] = job.entry
        # msgpack, as the guest receives them: exact (bytes stay bytes), one char per byte.
        request["args"] = msgpack.packb([list(job.args), job.kwargs],
                                        use_bin_type=True).decode("latin-1")
    if job.filename != "<sandbox>":
        request["filename"] = job.filename
    if job.argv is not None:
        request["argv"] = list(job.argv)
    if job.env:
        request["env"] = dict(job.env)  # given explicitly by the caller; never the host's
    if job.stdin is not None:
        request["stdin"] = job.stdin.decode("latin-1")
    return request


def outcome_of(result: RunResult) -> dict[str, Any]:
    """What a replay must reproduce: every output, and the fuel."""
    return {
        "ok": result.ok,
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "error": (None if result.error is None else
                  {"type": result.error.type, "message": result.error.message,
                   "traceback": result.error.traceback}),
        "limit_exceeded": result.limit_exceeded.value if result.limit_exceeded else None,
        "fuel_used": result.fuel_used,
        "value": json_value(result.value),
    }


# -- decoding, checked -------------------------------------------------------------------------

def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _decode_line(number: int, line: str) -> Any:
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except RecursionError:
        raise JournalError(f"line {number}: nested too deeply") from None
    except ValueError as exc:
        raise JournalError(f"line {number}: not valid JSON ({str(exc)[:200]})") from None


def _want(record: Mapping[str, Any], name: str, kinds: type | tuple[type, ...],
          where: str, *, optional: bool = False) -> Any:
    if name not in record:
        if optional:
            return None
        raise JournalError(f"{where}: missing {name!r}")
    value = record[name]
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple)
                                                else (kinds,)):
        raise JournalError(f"{where}: {name!r} has the wrong type")
    if not isinstance(value, kinds):
        raise JournalError(f"{where}: {name!r} has the wrong type")
    return value


def _latin1(value: str, name: str, where: str) -> str:
    if any(ord(char) > 0xFF for char in value):
        raise JournalError(f"{where}: {name!r} must hold one char per byte")
    return value


def _text_list(value: Any, name: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise JournalError(f"{where}: {name!r} must be a list of strings")
    return value


#: The largest limit a journal may ask for: what the engine takes (a u64, with room).
_MAX_LIMIT = 2**62


def _check_limits(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(LIMIT_FIELDS):
        raise JournalError(f"{where}: 'limits' must name exactly {', '.join(LIMIT_FIELDS)}")
    if not all(isinstance(number, int | float) and number <= _MAX_LIMIT
               for number in value.values()):
        raise JournalError(f"{where}: every limit must be a number up to {_MAX_LIMIT}")
    try:
        Limits(**value)
    except (UsageError, TypeError) as exc:
        raise JournalError(f"{where}: invalid limits: {exc}") from None
    return value


def _check_header(record: dict[str, Any]) -> dict[str, Any]:
    where = "line 1 (header)"
    version = record.get("wasibox_journal")
    if version != JOURNAL_VERSION or isinstance(version, bool):
        raise JournalError(f"{where}: not a wasibox journal of version {JOURNAL_VERSION} "
                           f"(found {str(version)[:40]!r})")
    if _want(record, "kind", str, where) not in ("run", "session"):
        raise JournalError(f"{where}: 'kind' must be 'run' or 'session'")
    _want(record, "guest_digest", str, where)
    _want(record, "wasibox", str, where)
    _want(record, "seed", int, where)
    if _want(record, "clock", str, where) not in ("virtual", "real"):
        raise JournalError(f"{where}: 'clock' must be 'virtual' or 'real'")
    if _want(record, "entropy", str, where) not in ("seeded", "real"):
        raise JournalError(f"{where}: 'entropy' must be 'seeded' or 'real'")
    _check_limits(record.get("limits"), where)
    _text_list(_want(record, "python_path", list, where), "python_path", where)
    _text_list(_want(record, "functions", list, where), "functions", where)
    _want(record, "http", bool, where)
    _want(record, "mounts", list, where)
    pins = _text_list(_want(record, "packages", list, where), "packages", where)
    if "wheels" in record:
        from ._packages import recorded_set

        try:
            recorded = recorded_set(record["wheels"])
        except ValueError as exc:
            raise JournalError(f"{where}: {exc}") from None
        if list(recorded.pins) != pins:
            raise JournalError(f"{where}: 'wheels' are not the package set 'packages' names")
    return record


def _check_request(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JournalError(f"{where}: 'call' must be an object")
    if _want(value, "op", str, where) not in ("run", "call"):
        raise JournalError(f"{where}: 'op' must be 'run' or 'call'")
    _want(value, "code", str, where)
    _check_limits(value.get("limits"), where)
    if value["op"] == "call":
        if not _want(value, "entry", str, where).isidentifier():
            raise JournalError(f"{where}: 'entry' must be an identifier")
        _latin1(_want(value, "args", str, where), "args", where)
    for name in ("filename", "stdin"):
        _want(value, name, str, where, optional=True)
    if "stdin" in value:
        _latin1(value["stdin"], "stdin", where)
    if "argv" in value:
        _text_list(value["argv"], "argv", where)
    env = _want(value, "env", dict, where, optional=True)
    if env is not None and not all(isinstance(item, str) for item in env.values()):
        raise JournalError(f"{where}: 'env' must map strings to strings")
    return value


def _check_event(value: Any, where: str) -> list[Any]:
    if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
            and isinstance(value[1], str) and value[2] in _STATUSES):
        raise JournalError(f"{where}: 'io' must be [kind, key, status, value]")
    if value[2] == "stop" and value[3] not in {limit.value for limit in Limit}:
        raise JournalError(f"{where}: a stop must name a limit")
    return value


def _check_outcome(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(OUTCOME_FIELDS):
        raise JournalError(f"{where}: 'outcome' must name exactly "
                           f"{', '.join(OUTCOME_FIELDS)}")
    for name in ("stdout", "stderr"):
        _want(value, name, str, where)
    for name in ("ok", "stdout_truncated", "stderr_truncated"):
        _want(value, name, bool, where)
    for name in ("exit_code", "fuel_used"):
        _want(value, name, int, where)
    return value


def clip(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 300 else text[:300] + f"... ({len(text):,} characters)"
