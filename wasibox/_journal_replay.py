"""Replaying a journal: loading it for a replay, re-running its calls against their tapes,
and comparing each result with what was recorded.

The journal format itself (``Journal``, ``Tape`` and the checks on every record it reads)
is ``_journal.py``; this module is the other side, used by ``wasibox.replay`` and by a
session restored from its snapshot. It imports neither the Sandbox nor the Session: they
hand it the call to make.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack

from ._errors import (
    GuestDigestMismatch,
    JournalError,
    SessionEnded,
    UsageError,
)
from ._journal import DEFAULT_JOURNAL_BYTES, OUTCOME_FIELDS, Journal, Tape, clip, outcome_of
from ._result import RunResult

if TYPE_CHECKING:
    from ._packages import PackageSet

__all__ = ["ReplayReport", "adopt", "compare", "load_for_replay", "load_snapshot",
           "replay_into", "replay_request", "replay_tape"]


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """What a replay did: each call's result next to what the journal recorded."""

    #: The replayed results, one per recorded call.
    results: tuple[RunResult, ...]
    #: For each call, its differences (empty when it matched), one line each.
    differences: tuple[tuple[str, ...], ...]

    @property
    def ok(self) -> bool:
        """True iff every call reproduced its recorded outputs and fuel."""
        return not any(self.differences)

    def diff(self) -> str:
        """The differences, call by call, as text for a person."""
        return "\n".join(f"call {index}: {line}" for index, lines in
                         enumerate(self.differences) for line in lines)


def load_snapshot(snapshot: Journal | bytes | str | os.PathLike[str]) -> Journal:
    """A session snapshot (``Session.snapshot()``'s bytes, its file, or a Journal) checked
    to be restorable here; raises as ``load_for_replay`` does, and JournalError for a
    journal of runs rather than of a session."""
    if isinstance(snapshot, bytes | bytearray):
        snapshot = Journal.loads(bytes(snapshot))
    journal, _ = load_for_replay(snapshot, DEFAULT_JOURNAL_BYTES)
    if journal.kind != "session":
        raise JournalError("this journal records runs, not a session: only a session's "
                           "snapshot can be restored (replay it with wasibox.replay)")
    return journal


def load_for_replay(journal: Journal | str | os.PathLike[str], max_bytes: int,
                    ) -> tuple[Journal, PackageSet | None]:
    """The journal, read if it is a path, and checked to be replayable here; with the
    package set its guest was built with (None for none).

    A package set is found in the package cache only, never fetched, and its guest is built
    from it if this machine has not built it yet. Raises JournalError for a journal that
    cannot be read, was truncated, or names a package set whose wheels are not cached (the
    message names them and the command that fetches them); GuestDigestMismatch if another
    guest recorded it; GuestBuildError if the package set's guest cannot be built.
    """
    if not isinstance(journal, Journal):
        try:
            journal = Journal.load(journal, max_bytes=max_bytes)
        except OSError as exc:
            raise JournalError(f"the journal cannot be read: {exc.strerror}") from None
    if journal.header is None:
        raise JournalError("the journal has recorded nothing")
    if journal.truncated:
        raise JournalError(f"the journal was truncated at its bound of {journal.max_bytes} "
                           "bytes when it was recorded, so it cannot be replayed; record "
                           "again with a larger Journal(max_bytes=...) (--journal-bytes)")
    if any(call.outcome is None for call in journal._calls):
        raise JournalError("the journal ends inside a call (its outcome is missing)")
    package_set = _cached_package_set(journal.header)
    from ._guest import ensure_guest

    current = ensure_guest(None, package_set).digest
    if journal.header["guest_digest"] != current:
        raise GuestDigestMismatch(journal.header["guest_digest"], current)
    return journal, package_set


def _cached_package_set(header: Mapping[str, Any]) -> PackageSet | None:
    """The package set a (checked) header names, if its wheels are all in the package cache;
    None for none. Raises JournalError naming what is missing and how to fetch it."""
    pins = header["packages"]
    if not pins:
        return None
    if "wheels" not in header:
        raise JournalError(
            f"the journal names its package set ({', '.join(pins)}) by versions only, as "
            "wasibox did before it recorded each wheel's sha256, so the exact guest it ran "
            "cannot be rebuilt; record the run again with this wasibox to replay it")
    from ._packages import recorded_set

    package_set = recorded_set(header["wheels"])
    missing = package_set.uncached()
    if missing:
        flags = " ".join(f"--package {pin}" for pin in package_set.pins)
        raise JournalError(
            "the journal's package set needs wheels that are not in this machine's package "
            "cache: " + ", ".join(f"{wheel.filename} (sha256 {wheel.sha256[:16]}...)"
                                  for wheel in missing)
            + f"; fetch them with `wasibox prepare {flags}` (adding the --find-links or "
            "--index-url the recording machine used), then replay again. A wheel fetched "
            "again must have the recorded sha256, or the replay is refused")
    return package_set


def replay_into(journal: Journal, run_call: Callable[[dict[str, Any], Tape], RunResult],
                *, redo_files: bool = False,
                ) -> tuple[list[RunResult], list[tuple[str, ...]]]:
    """Replay each recorded call through ``run_call`` and compare it with its record.

    Returns the results and each call's differences; stops after a call that found the
    session ended (an earlier call ended it, which the recording did not). With
    ``redo_files``, file operations are performed again (see ``Tape.redo_files``).
    """
    results: list[RunResult] = []
    differences: list[tuple[str, ...]] = []
    for index in range(journal.calls):
        tape = replay_tape(journal, index)
        tape.redo_files = redo_files
        try:
            result = run_call(replay_request(journal, index), tape)
        except SessionEnded as exc:
            differences.append((f"the replayed session had ended: {exc}",))
            break
        results.append(result)
        recorded = journal._calls[index].outcome
        assert recorded is not None
        differences.append(compare(recorded, result, tape))
    return results, differences


def adopt(journal: Journal, into: Journal | None) -> Journal:
    """``into`` (or a new Journal) holding ``journal``'s header and calls, to record more
    calls after them (a restored session's); raises UsageError if ``into`` holds any."""
    target = into if into is not None else Journal(max_bytes=journal.max_bytes)
    with target._lock:
        if target.header is not None:
            raise UsageError("a restored session records into a journal of its own: pass "
                             "a new wasibox.Journal (or a file path)")
        target.header = journal.header
        target._calls = list(journal._calls)
        target._size = len(journal.dumps())
    return target


def replay_tape(journal: Journal, index: int) -> Tape:
    """A tape that serves call ``index``'s recorded exchanges."""
    return Tape(journal, journal._calls[index], replaying=True)


def replay_request(journal: Journal, index: int) -> dict[str, Any]:
    """Call ``index``'s request as ``Sandbox.run`` keywords (code first, under "code").

    Raises JournalError if its arguments cannot be decoded.
    """
    request = journal._calls[index].request
    keywords: dict[str, Any] = {
        "code": request["code"], "limits": request["limits"],
        "stdin": request["stdin"].encode("latin-1") if "stdin" in request else None,
        "argv": request.get("argv"), "env": request.get("env"),
        "filename": request.get("filename")}
    if request["op"] == "call":
        try:
            args, kwargs = msgpack.unpackb(request["args"].encode("latin-1"), raw=False,
                                           strict_map_key=False, max_bin_len=len(request["args"]),
                                           max_str_len=len(request["args"]))
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ValueError("not [args, kwargs]")
        except (ValueError, TypeError, msgpack.exceptions.ExtraData,
                msgpack.exceptions.UnpackException) as exc:
            raise JournalError(f"call {index}: its arguments cannot be decoded: "
                               f"{str(exc)[:200]}") from None
        keywords.update(entry=request["entry"], args=tuple(args), kwargs=kwargs)
    return keywords


def compare(recorded: Mapping[str, Any], result: RunResult, tape: Tape) -> tuple[str, ...]:
    """How a replayed call differs from its record, one line per field (empty: it matched)."""
    lines: list[str] = []
    if tape.diverged is not None:
        lines.append(f"the replay diverged: {tape.diverged}")
    elif tape.unserved():
        lines.append(f"the replay made {tape.unserved()} fewer boundary calls than recorded")
    replayed = outcome_of(result)
    for name in OUTCOME_FIELDS:
        if recorded[name] == replayed[name]:
            continue
        if name in ("stdout", "stderr"):
            diff = difflib.unified_diff(recorded[name].splitlines(), replayed[name].splitlines(),
                                        "recorded", "replayed", lineterm="", n=1)
            lines.append(f"{name} differs:\n" + "\n".join(list(diff)[:40]))
        else:
            lines.append(f"{name}: recorded {clip(recorded[name])}, "
                         f"replayed {clip(replayed[name])}")
    return tuple(lines)
