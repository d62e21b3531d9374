"""``wasibox.replay``: re-execute a journal offline in a new Sandbox and check it.

It sits above both ``wasibox._journal`` (the format and the tapes) and ``wasibox._sandbox``
(which records into journals), so that neither imports the other's layer.
"""

from __future__ import annotations

import os

from ._errors import ReplayMismatch
from ._journal import DEFAULT_JOURNAL_BYTES, Journal
from ._journal_replay import ReplayReport, load_for_replay, replay_into
from ._limits import Limits
from ._sandbox import Sandbox

__all__ = ["replay"]


def replay(journal: Journal | str | os.PathLike[str], *, check: bool = True,
           max_bytes: int = DEFAULT_JOURNAL_BYTES) -> ReplayReport:
    """Re-execute a journal offline and compare every output and the fuel with the record.

    Nothing of the host is used: no network, no mounts, no host functions; every value that
    crossed into the guest is served from the journal. A journal of a sandbox with
    ``packages=`` runs on the guest built for that exact package set, from the wheels in the
    package cache (never fetched; the guest is built first if this machine has not yet).
    A ``"run"`` journal replays each call in a fresh interpreter; a ``"session"`` journal
    replays its calls in one new session. Returns the report; with ``check`` (the
    default) raises ReplayMismatch, with the diff, if any call differs.

    Raises JournalError if the journal cannot be read (or is larger than ``max_bytes``, or
    was truncated, or names a package set whose wheels are not cached: the message names
    them and the ``wasibox prepare`` command that fetches them), GuestDigestMismatch if
    another guest recorded it, GuestBuildError if the package set's guest cannot be built,
    ReplayMismatch as said, and UsageError if the journal holds something this Sandbox
    refuses.
    """
    journal, package_set = load_for_replay(journal, max_bytes)
    header = journal.header
    assert header is not None
    with Sandbox(Limits(**header["limits"]), seed=header["seed"], clock=header["clock"],
                 entropy=header["entropy"], backend="wasm",
                 python_path=header["python_path"],
                 packages=package_set if package_set is not None else ()) as sandbox:
        # A session's calls replay in one new session, a run journal's each in a fresh
        # interpreter, as they were recorded.
        if header["kind"] == "session":
            with sandbox.session() as session:
                results, differences = replay_into(journal, session._run_taped)
        else:
            results, differences = replay_into(journal, sandbox._run_taped)
    report = ReplayReport(tuple(results), tuple(differences))
    if check and not report.ok:
        first = next(index for index, lines in enumerate(differences) if lines)
        raise ReplayMismatch(first, report.diff())
    return report
