"""``Transform``: run an untrusted function over many records, fast and deterministically.

How a map runs:

* Records go to the guest in **batches**: one request and one reply per batch (see the batch
  shapes in ``wasibox/_wire.py``), and every record of a batch is handled by the same fresh
  instance. Separate batches, and separate ``t(record)`` calls, never share an instance.
* **Limits apply to a batch as a whole.** A batch that exceeds one (fuel, time, memory,
  output), or whose instance traps, is split in two and each half re-runs in a fresh
  instance, down to single records: a record fails with ``LimitExceeded`` only if it exceeds
  the limit on its own. Splitting is deterministic, so the outputs never depend on the batch
  size. Records that re-run call host functions again: with ``functions=``, a host function
  may see the same record more than once, so make it idempotent (or use ``batch_size=1``).
* **Batch sizes.** ``batch_size="auto"`` (the default) starts with batches of
  ``FIRST_AUTO_BATCH`` records and then sizes each batch from the ones already settled: up
  to ``AUTO_GROWTH`` times larger, as long as a batch is expected to use at most
  ``1/AUTO_FUEL_SHARE`` of the fuel limit (by the fuel per record seen so far; a limit
  derived from the timeout counts at ``AUTO_FUEL_PER_SECOND``) and to send
  at most ``1/AUTO_MEMORY_SHARE`` of the memory limit (by the bytes per record), and never
  more than ``MAX_AUTO_BATCH``; after a batch had to be split, the batches that follow are
  half its size and stop growing. The sizes follow only from fuel and bytes, which are
  deterministic, and so are they. A batch is sized from the batches settled
  ``AUTO_LAG + 1`` or more places before it, a fixed lag whatever the workers: the first
  ``AUTO_LAG + 1`` batches are ``FIRST_AUTO_BATCH`` records, and the lag leaves room for up to
  ``MAX_WORKERS`` batches running ahead of the one being settled.
* **Workers.** Up to ``workers`` batches run at once, each on its own thread (wasm runs
  without the GIL), while the calling thread encodes the next batch and decodes the one
  before, in order: at most ``workers + 1`` batches are in memory, and a batch may run before
  an earlier record's failure is raised. ``workers=None`` (the default) is one per CPU this
  process may use, at most ``MAX_WORKERS``, and 1 with host functions or a writable mount,
  or on another backend than wasm. Outputs, fuel, batch sizes and progress do not depend
  on it.
* **Determinism.** The same code, records, seed and batch size give the same outputs and the
  same fuel in every process with the same guest digest (an automatic size included: it
  follows only from the fuel and bytes of earlier batches, unless a batch was split for a
  timeout, which depends on the machine). Outputs do not depend on the batch
  size as long as the function does not carry state from one record to the next (globals,
  ``random`` without a per-record seed, the virtual clock, which advances with the fuel
  burnt). Fuel does: each batch pays a fixed cost (a fresh instance, loading the code, the
  reply), so ``fuel_used = batches * fixed + sum(per-record fuel)``, plus the fuel of any
  batch that was split and re-run.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import msgpack

from ._batch import batch_elements, decode_batch_reply, encode_records
from ._errors import GuestError, LimitExceeded, UsageError
from ._limits import Limit, Limits
from ._result import GuestException, Outcome, RunResult, build_result
from ._sandbox import Sandbox, sandbox_for
from ._wire import ProtocolError
from .backends.base import Backend

__all__ = ["BatchSize", "Failed", "FailedRecord", "Transform", "TransformProgress",
           "TransformSpec"]

OnError = Literal["raise", "skip", "collect"]
#: Records per batch (one fresh instance each), or "auto": sized from the batches before.
BatchSize = int | Literal["auto"]
#: The largest batch reply accepted, in characters.
BATCH_REPLY_LIMIT = 256 * 2**20
#: Records per batch unless a transform or a map says otherwise: sized automatically. A
#: batch's fixed cost (making, priming and dropping an instance, and the threads' hand-offs:
#: ~5-15 ms of CPU) dwarfed 1,000 small records' own work, and was still a fifth of a map's
#: CPU at 10,000: 100,000 records of numbers took 605 ms of CPU at 5,000 a batch, 461 at
#: 10,000, 370 at 25,000 and 344 in one batch, on a loaded machine (``python
#: bench/transform.py``). A fixed large size would make batches of slow or large records
#: exceed the limits, and a batch that exceeds one is split and re-run, paying for the part
#: that ran twice.
DEFAULT_BATCH_SIZE: BatchSize = "auto"
#: The first batches of an automatically sized map: the size every map had before sizes
#: adapted, so a map whose records are too slow or large for it fares no worse than then.
FIRST_AUTO_BATCH = 10_000
#: The most an automatic batch grows in one step, and the largest it gets: at 100,000 small
#: records a batch's fixed cost is a few percent of its work, and the host holds two.
AUTO_GROWTH = 4
MAX_AUTO_BATCH = 100_000
#: An automatic batch is expected to use at most this share of the fuel limit (by the fuel
#: per record of earlier batches), leaving room for records dearer than those seen...
AUTO_FUEL_SHARE = 8
#: ...where a fuel limit derived from the timeout counts at this rate, not at
#: ``FUEL_PER_SECOND``: that one sits above the fastest C loops (a timeout must stop a run
#: before its fuel does), while typical interpreted code burns 3-10e9 fuel/s, so an eighth
#: of the timeout at this rate is about an eighth of it in time, or less.
AUTO_FUEL_PER_SECOND = 10**10
#: ...and to send at most this share of the memory limit: the guest holds the records' bytes
#: several times over (the request, its text, the bytes) beside the objects they decode to,
#: ~19 times the bytes for records of small numbers.
AUTO_MEMORY_SHARE = 64
#: The most batches a map runs at once: each holds an instance and its batch on the host,
#: and a map's batches are only a few dozen (100,000 small records made 7), so more rarely
#: has batches to run.
MAX_WORKERS = 4
#: An automatic batch is sized from the batches settled this many places before the one
#: just before it: up to ``MAX_WORKERS`` batches run ahead of the one settling, whatever the
#: number of workers, and they are sized the same way with one worker or four.
AUTO_LAG = MAX_WORKERS


@dataclasses.dataclass(frozen=True)
class FailedRecord:
    """A record that failed, in place of its output (``on_error="collect"``).

    ``index`` is the record's index in the whole input (plus ``start``); ``error`` is the
    GuestError or LimitExceeded that ``on_error="raise"`` would have raised.
    """

    index: int
    error: GuestError | LimitExceeded

    def to_dict(self) -> dict[str, Any]:
        """The failure as plain data."""
        error = self.error
        if isinstance(error, LimitExceeded):
            return {"index": self.index, "type": "LimitExceeded", "limit": error.limit.value,
                    "message": str(error)}
        return {"index": self.index, "type": error.type, "message": error.message}


#: ``FailedRecord``'s first name, kept as an alias so code written against it keeps working.
Failed = FailedRecord


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformProgress:
    """How far a map has got; passed to the ``progress`` callback after every batch."""

    done: int
    total: int | None
    failed: int
    #: Fuel of this map's batches settled so far, re-runs of split ones included (not of
    #: the batch already running ahead), so the same map reports the same figures.
    fuel_used: int
    elapsed_s: float
    #: Batches split in two so far because they exceeded a limit (or their reply was
    #: refused); each half re-runs in its own instance, so their records cost more.
    split: int = 0
    #: Why the latest split happened: the limit's name ("timeout", "memory", ...), or
    #: "reply" when the batch's reply was too large or malformed. None before any split.
    split_reason: str | None = None

    @property
    def records_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformSpec:
    """A transform's policy as plain data: what to run, under which limits and grants.

    Everything a worker process needs to rebuild the same ``Transform`` (host functions
    excepted: they are code on the host, passed by reference when pickled).
    """

    code: str
    entry: str = "transform"
    limits: Limits = dataclasses.field(default_factory=Limits)
    seed: int = 0
    clock: Literal["virtual", "real"] = "virtual"
    entropy: Literal["seeded", "real"] = "seeded"
    on_error: OnError = "raise"
    batch_size: BatchSize = DEFAULT_BATCH_SIZE
    #: Batches run at once (None: one per CPU, at most ``MAX_WORKERS``); results never
    #: depend on it.
    workers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible data; ``TransformSpec.from_dict`` reads it back."""
        data = dataclasses.asdict(self)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformSpec:
        """Rebuild a spec from ``to_dict`` output; raises UsageError for bad fields."""
        try:
            fields = dict(data)
            fields["limits"] = Limits(**fields.get("limits", {}))
            return cls(**fields)
        except TypeError as exc:
            raise UsageError(f"not a transform spec: {exc}") from None


ProgressCallback = Callable[[TransformProgress], None]


class Transform:
    """An untrusted function applied to records, each batch in a fresh sandbox.

    ``code`` defines ``entry``, a function of one record. Records and return values are
    plain data: None, bool, int, float, str, bytes, and lists, tuples and dicts of them
    (tuples arrive as tuples and leave as lists). ``functions=``, ``http=`` and any other
    keyword are passed to the Sandbox each batch runs in.

    ``on_error`` says what a failed record becomes: ``"raise"`` raises its GuestError or
    LimitExceeded (with ``.index``), ``"skip"`` drops it, ``"collect"`` puts a
    ``wasibox.FailedRecord(index, error)`` in its place.

    ``batch_size`` is the records per batch (each batch one fresh instance), or ``"auto"``
    (the default): batches of 10,000 that grow as the fuel and bytes of the first ones show
    the limits have room (see the module's docstring).

    ``workers`` is how many batches run at once, each in its own instance on its own
    thread: None (the default) is one per CPU this process may use, at most
    ``MAX_WORKERS`` (4), or 1 when the transform has host functions or a writable mount
    (which several batches at once would call or publish in an order that depends on
    timing) or another backend than wasm; 1 runs them one after another. Outputs, fuel and
    batch sizes are the same whatever it is; ``wasibox.dask`` runs each partition with one,
    as dask spreads the partitions over its own workers.

    Raises UsageError for a bad entry name, policy, batch size, workers or sandbox option.
    """

    def __init__(
        self,
        code: str,
        entry: str = "transform",
        *,
        limits: Limits | None = None,
        seed: int = 0,
        clock: Literal["virtual", "real"] = "virtual",
        entropy: Literal["seeded", "real"] = "seeded",
        on_error: OnError = "raise",
        batch_size: BatchSize = DEFAULT_BATCH_SIZE,
        workers: int | None = None,
        backend: Literal["wasm"] | Backend = "wasm",
        functions: Any = None,
        http: Any = None,
        **sandbox_options: Any,
    ) -> None:
        if not isinstance(entry, str) or not entry.isidentifier():
            raise UsageError(f"entry must name a function, such as 'transform', not {entry!r}")
        _check_on_error(on_error)
        _check_batch_size(batch_size)
        _check_workers(workers)
        if functions is not None:
            sandbox_options["functions"] = functions
        if http is not None:
            sandbox_options["http"] = http
        self._sandbox = sandbox_for(code, limits, seed=seed, clock=clock, entropy=entropy,
                                    backend=backend, **sandbox_options)
        self.spec = TransformSpec(code=code, entry=entry, limits=self._sandbox.limits,
                                  seed=seed, clock=clock, entropy=entropy, on_error=on_error,
                                  batch_size=batch_size, workers=workers)
        self._options = sandbox_options
        self._backend_choice = backend
        self._lock = threading.Lock()
        self._fuel_used = 0
        #: The fuel of the batches settled (decoded, or split and re-run): what progress
        #: reports, which must not count the batch already running ahead of them.
        self._settled_fuel = 0
        self._batches = 0
        self._splits = 0
        self._split_reason: str | None = None

    @classmethod
    def from_spec(cls, spec: TransformSpec, **sandbox_options: Any) -> Transform:
        """Rebuild a transform from its spec (and the same host-side options)."""
        return cls(spec.code, spec.entry, limits=spec.limits, seed=spec.seed, clock=spec.clock,
                   entropy=spec.entropy, on_error=spec.on_error, batch_size=spec.batch_size,
                   workers=spec.workers, **sandbox_options)

    def __reduce__(self) -> tuple[Any, ...]:
        if not isinstance(self._backend_choice, str):
            raise TypeError("a Transform with a custom backend cannot be pickled")
        return (_rebuild, (self.spec.to_dict(), self._options))

    # -- the API -----------------------------------------------------------------------------

    @property
    def fuel_used(self) -> int:
        """Fuel burnt by every batch this transform has run, re-runs included."""
        return self._fuel_used

    @property
    def batches_run(self) -> int:
        """Instances this transform has run (each batch, and each re-run half)."""
        return self._batches

    def __call__(self, record: Any) -> Any:
        """Apply the function to one record in a fresh instance; return its output.

        Raises GuestError or LimitExceeded (``index`` 0) when the record fails, whatever
        ``on_error`` says, and UsageError for a record that is not plain data.
        """
        item = self._run([record], 0)[0][0]
        if isinstance(item, FailedRecord):
            raise item.error
        return item

    def map(self, records: Iterable[Any], *, batch_size: BatchSize | None = None,
            on_error: OnError | None = None, start: int = 0,
            progress: bool | ProgressCallback | None = None,
            workers: int | None = None) -> list[Any]:
        """Apply the function to every record; return the outputs in order.

        ``batch_size``, ``on_error`` and ``workers`` (None: the transform's) override the
        transform's for this map. ``start`` is the index of the first record, so that
        partitions of a larger input report global indexes. ``progress`` is a callback
        (called after each batch with a TransformProgress), True or False for a bar on
        stderr, or None: a bar when stderr is a terminal. Raises as ``on_error`` says, and
        UsageError for bad arguments.
        """
        outputs: list[Any] = []
        # A batch's outputs at a time: a generator resumed per record cost ~70 ns each, a
        # third of what host CPython spends per record on a small function.
        for items in self._outputs_by_batch(records, batch_size, on_error, start, progress, None,
                                            workers):
            outputs += items
        return outputs

    def imap(self, records: Iterable[Any], *, batch_size: BatchSize | None = None,
             on_error: OnError | None = None, start: int = 0,
             progress: bool | ProgressCallback | None = None,
             total: int | None = None, workers: int | None = None) -> Iterator[Any]:
        """Like ``map``, but lazily: reads one batch of ``records`` at a time.

        Memory stays bounded by the batch size (times ``workers + 1``) whatever the length
        of ``records``.
        ``total`` (if known) lets the progress bar show a percentage.
        """
        return itertools.chain.from_iterable(
            self._outputs_by_batch(records, batch_size, on_error, start, progress, total,
                                   workers))

    def _outputs_by_batch(self, records: Iterable[Any], batch_size: BatchSize | None,
                          on_error: OnError | None, start: int,
                          progress: bool | ProgressCallback | None,
                          total: int | None, workers: int | None) -> Iterator[list[Any]]:
        """``imap``'s outputs a batch at a time (checking the arguments now, not lazily)."""
        size = self.spec.batch_size if batch_size is None else batch_size
        policy = self.spec.on_error if on_error is None else on_error
        _check_batch_size(size)
        _check_on_error(policy)
        _check_workers(workers)
        threads = workers or self.spec.workers or self._default_workers()
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise UsageError(f"start must be a non-negative int, not {start!r}")
        if total is None and isinstance(records, Sequence):
            total = len(records)
        return self._each_batch(iter(records), size, policy, start, _reporter(progress), total,
                                threads)

    def fingerprint(self, records: Iterable[Any], *,
                    batch_size: BatchSize | None = None) -> str:
        """A stable digest of the outputs (and failures) for ``records``.

        Equal for equal outputs, whatever the process, machine or batch size; compare it
        between runs. Failures count by index, type and message.
        """
        digest = hashlib.sha256()
        for index, item in enumerate(self.imap(records, batch_size=batch_size,
                                               on_error="collect", progress=False)):
            digest.update(self._fingerprint_entry(index, item))
        return "sha256:" + digest.hexdigest()

    @staticmethod
    def _fingerprint_entry(index: int, item: Any) -> bytes:
        """What ``fingerprint`` hashes for the item at ``index`` (shared with wasibox.dask)."""
        if isinstance(item, FailedRecord):
            described = item.to_dict()
            return _canonical([index, "failed", described["type"], described["message"]])
        return _canonical([index, "ok", item])

    def to_dask(self, collection: Any, **options: Any) -> Any:
        """``wasibox.dask.map_partitions(self, collection, **options)``: this transform over
        a dask Bag or DataFrame, lazily (needs the ``wasibox[dask]`` extra)."""
        from .dask import map_partitions

        return map_partitions(self, collection, **options)

    def close(self) -> None:
        """Release the sandbox; idempotent."""
        self._sandbox.close()

    def __enter__(self) -> Transform:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<wasibox.Transform entry={self.spec.entry!r}>"

    # -- internals ---------------------------------------------------------------------------

    def _each_batch(self, records: Iterator[Any], size: BatchSize, policy: OnError,
                    start: int, report: ProgressCallback | None,
                    total: int | None, workers: int) -> Iterator[list[Any]]:
        started = time.perf_counter()
        done = failed = 0
        fuel_before, splits_before = self._settled_fuel, self._splits
        index = start
        sizer = _AutoSize(self._sandbox.limits) if size == "auto" else None
        # Up to ``workers`` batches run at once on worker threads (wasm runs without the GIL)
        # while this thread encodes the next ones and decodes the oldest: ``workers + 1``
        # batches in memory at most, and the workers only ever run wasm.
        ahead: collections.deque[tuple[list[Any], int, int, Future[Outcome]]] = (
            collections.deque())
        exhausted = False
        with ThreadPoolExecutor(max_workers=workers,
                                thread_name_prefix="wasibox-transform") as pool:

            def submit_next() -> None:
                nonlocal index, exhausted
                count = sizer.take() if sizer is not None else size
                assert isinstance(count, int)
                if not (batch := list(itertools.islice(records, count))):
                    exhausted = True
                else:
                    payload = b""
                    try:
                        payload = self._payload(batch, index)
                    except UsageError as exc:  # raised in order, when this batch's turn comes
                        future: Future[Outcome] = Future()
                        future.set_exception(exc)
                    else:
                        future = pool.submit(self._attempt, batch, index, payload)
                    ahead.append((batch, index, len(payload), future))
                    index += len(batch)

            try:
                while not exhausted and len(ahead) < workers:
                    submit_next()
                while ahead:
                    batch, first, sent, future = ahead.popleft()
                    # Sized from the batches settled AUTO_LAG places before (see _AutoSize):
                    # every map sizes its batches alike, whatever the timing or the workers.
                    while not exhausted and len(ahead) < workers:
                        submit_next()
                    outcome = future.result()
                    items, failures = self._settle(batch, first, outcome, sizer)
                    if sizer is not None:
                        sizer.settled(len(batch), sent, outcome.fuel_used)
                    done += len(batch)
                    if failures and policy == "raise":
                        position = next(i for i, item in enumerate(items)
                                        if isinstance(item, FailedRecord))
                        failed += 1
                        yield items[:position]  # the outputs before it are delivered first
                        raise items[position].error
                    failed += failures
                    if failures and policy == "skip":
                        items = [item for item in items if not isinstance(item, FailedRecord)]
                    yield items
                    if report is not None:
                        report(TransformProgress(done=done, total=total, failed=failed,
                                                 fuel_used=self._settled_fuel - fuel_before,
                                                 elapsed_s=time.perf_counter() - started,
                                                 split=self._splits - splits_before,
                                                 split_reason=self._split_reason))
            finally:
                for *_, future in ahead:
                    future.cancel()

    def _default_workers(self) -> int:
        """``workers=None``: one batch per CPU (``default_workers``) on the wasm backend for
        a function that only computes. With host functions or a writable mount, one: they
        would otherwise be called, or published, from several batches at once and in an
        order that depends on timing; and another backend may not run batches at once."""
        policy = self._sandbox.policy
        if (self._sandbox._backend.name != "wasm" or policy.functions
                or any(mount.writable for mount in policy.mounts)):
            return 1
        return default_workers()

    def _run(self, batch: list[Any], index: int) -> tuple[list[Any], int]:
        """Outputs (or FailedRecord) for ``batch``, whose first record has index ``index``,
        and how many are FailedRecord."""
        return self._settle(batch, index, self._attempt(batch, index))

    def _payload(self, batch: list[Any], index: int) -> bytes:
        """``batch`` encoded for the guest; raises UsageError for a non-plain record."""
        try:
            return encode_records(batch)
        except (ValueError, TypeError) as exc:
            bad = next((i for i, record in enumerate(batch) if not _marshallable(record)), 0)
            raise UsageError(f"record {index + bad} is not plain data (None, bool, int, "
                             f"float, str, bytes, lists, tuples and dicts): {exc}") from None

    def _attempt(self, batch: list[Any], index: int, payload: bytes | None = None) -> Outcome:
        """Run ``batch`` in one fresh instance; raises UsageError for a non-plain record."""
        if payload is None:
            payload = self._payload(batch, index)
        outcome = self._sandbox._execute_batch(self.spec.code, self.spec.entry, payload)
        with self._lock:
            self._fuel_used += outcome.fuel_used
            self._batches += 1
        return outcome

    def _settle(self, batch: list[Any], index: int, outcome: Outcome,
                sizer: _AutoSize | None = None) -> tuple[list[Any], int]:
        """Decode a batch's outcome, as ``_run``'s result; split and re-run it if it exceeded
        a limit (and then tell ``sizer``, which sizes the map's batches, if any)."""
        with self._lock:
            self._settled_fuel += outcome.fuel_used
        problem = outcome.limit_exceeded is not None or outcome.reply is None
        reason = outcome.limit_exceeded.value if outcome.limit_exceeded is not None else "reply"
        reply = None
        if not problem:
            assert outcome.reply is not None
            try:
                reply = decode_batch_reply(
                    outcome.reply, len(batch), BATCH_REPLY_LIMIT,
                    batch_elements(self._sandbox.limits.memory_bytes, len(batch)))
            except ProtocolError as exc:
                if len(batch) == 1:
                    failure = GuestException(type="ProtocolError", message=str(exc),
                                             traceback="")
                    return [self._failed(index, outcome, failure)], 1
                problem = True
            else:
                # A MemoryError anywhere may be the batch's fault (everything it holds) and
                # not the record's: judge those records on their own.
                problem = reply.memory_error and len(batch) > 1
                reason = "memory"
        if problem and len(batch) > 1:
            with self._lock:
                self._splits += 1
                self._split_reason = reason
            if sizer is not None:
                sizer.split(len(batch))
            middle = len(batch) // 2
            left, left_failed = self._run(batch[:middle], index)
            right, right_failed = self._run(batch[middle:], index + middle)
            return left + right, left_failed + right_failed
        if reply is None:
            return [self._failed(index, outcome, None)], 1
        if reply.error is not None:
            failure = GuestException(**reply.error)
            return [self._failed(index + i, outcome, failure, memory=reply.memory_error)
                    for i in range(len(batch))], len(batch)
        items = reply.values
        for position, described in reply.errors.items():
            items[position] = self._failed(index + position, outcome,
                                           GuestException(**described),
                                           memory=described["type"] == "MemoryError")
        return items, len(reply.errors)

    def _failed(self, index: int, outcome: Outcome, failure: GuestException | None,
                memory: bool = False) -> FailedRecord:
        result = _result_of(outcome, self._sandbox, failure, memory)
        error: GuestError | LimitExceeded
        if result.limit_exceeded is not None:
            error = LimitExceeded(result.limit_exceeded, result)
        else:
            assert result.error is not None
            error = GuestError(result.error, result)
        error.index = index
        error.args = (f"record {index}: {error.args[0]}",)
        return FailedRecord(index, error)


class _AutoSize:
    """The sizes of a map's batches when its batch_size is "auto" (see the module's
    docstring): told about every batch once it has settled, in order, and asked for the size
    of each batch when it is made, in order.

    The first ``AUTO_LAG + 1`` batches are ``FIRST_AUTO_BATCH`` records; the batch settled
    in ``i``th place sizes the one in ``i + AUTO_LAG + 1``th place. ``take`` is never asked
    more than ``AUTO_LAG + 1`` sizes ahead of the batches settled (``workers <= AUTO_LAG``).
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        #: The fuel a batch's share is taken of (see AUTO_FUEL_PER_SECOND).
        self._fuel = (math.ceil(limits.timeout_s * AUTO_FUEL_PER_SECOND)
                      if limits.fuel_from_timeout else limits.fuel)
        #: The size that the batches settled so far give the next batch to be sized.
        self.size = FIRST_AUTO_BATCH
        self._sizes = collections.deque([FIRST_AUTO_BATCH] * (AUTO_LAG + 1))
        self._growing = True

    def take(self) -> int:
        """The records in the next batch to be made."""
        return self._sizes.popleft()

    def settled(self, count: int, sent: int, fuel_used: int) -> None:
        """A batch of ``count`` records, ``sent`` bytes, that burnt ``fuel_used`` (its re-runs
        not counted) has settled."""
        if self._growing:
            self._grow(count, sent, fuel_used)
        self._sizes.append(self.size)

    def _grow(self, count: int, sent: int, fuel_used: int) -> None:
        # Per record, with the batch's fixed cost spread over its records: never less than
        # a record costs, so a batch sized from it is if anything smaller than it could be.
        fuel_room = self._fuel * count // (AUTO_FUEL_SHARE * max(fuel_used, 1))
        byte_room = self._limits.memory_bytes * count // (AUTO_MEMORY_SHARE * max(sent, 1))
        self.size = max(1, min(self.size * AUTO_GROWTH, MAX_AUTO_BATCH, fuel_room, byte_room))

    def split(self, count: int) -> None:
        """A batch of ``count`` records exceeded a limit (or sent a reply too large) and was
        split: the limits have less room than its fuel and bytes suggested, or the machine
        is slower than the fuel limit assumes."""
        self._growing = False
        self.size = max(1, min(self.size, count // 2))


def _result_of(outcome: Outcome, sandbox: Sandbox, failure: GuestException | None,
               memory: bool) -> RunResult:
    """The RunResult of a one-record failure (the reply, if any, is already decoded)."""
    base = build_result(dataclasses.replace(outcome, reply=None), sandbox._backend.name, 0)
    limit = base.limit_exceeded or (Limit.MEMORY if memory else None)
    error = failure if failure is not None else base.error
    if limit is None and error is None:
        error = GuestException(type="SystemExit", message=str(base.exit_code), traceback="")
    return dataclasses.replace(base, ok=False, error=error, limit_exceeded=limit,
                               exit_code=base.exit_code or 1)


def _rebuild(spec: dict[str, Any], options: dict[str, Any]) -> Transform:
    return Transform.from_spec(TransformSpec.from_dict(spec), **options)


def _check_on_error(on_error: object) -> None:
    if on_error not in ("raise", "skip", "collect"):
        raise UsageError(f"on_error must be 'raise', 'skip' or 'collect', not {on_error!r}")


def _check_workers(workers: object) -> None:
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not 1 <= workers <= MAX_WORKERS):
        raise UsageError(f"workers must be None or an int from 1 to {MAX_WORKERS}, "
                         f"not {workers!r}")


def default_workers() -> int:
    """Batches a map runs at once by default: one per CPU this process may use, at most
    ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def _check_batch_size(size: object) -> None:
    if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise UsageError(f"batch_size must be a positive int or 'auto', not {size!r}")


def _marshallable(record: Any) -> bool:
    try:
        encode_records([record])
    except (ValueError, TypeError):
        return False
    return True


def _canonical(value: Any) -> bytes:
    """Bytes that identify a value: msgpack, or a tagged repr for what msgpack cannot hold."""
    try:
        return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError):
        return b"repr:" + repr(value).encode("utf-8", "surrogatepass")


def _reporter(progress: bool | ProgressCallback | None) -> ProgressCallback | None:
    if callable(progress):
        return progress
    if progress is None:
        progress = sys.stderr.isatty()
    return progress_bar() if progress else None


#: How the progress bar says why batches were split.
_SPLIT_WORDS = {"reply": "a reply too large", "memory": "memory limit or MemoryError",
                "timeout": "timeout exceeded", "fuel": "fuel limit exceeded",
                "output": "output limit exceeded", "host_calls": "host-call limit exceeded"}


def progress_bar(stream: Any = None, width: int = 30) -> ProgressCallback:
    """A progress callback that draws one updating line on ``stream`` (stderr)."""
    out = stream if stream is not None else sys.stderr

    def draw(state: TransformProgress) -> None:
        if state.total:
            filled = int(width * state.done / state.total)
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {state.done}/{state.total}"
        else:
            bar = f"{state.done} records"
        failed = f", {state.failed} failed" if state.failed else ""
        split = (f", {state.split} batch{'es' if state.split > 1 else ''} split "
                 f"({_SPLIT_WORDS.get(state.split_reason or '', 'a limit exceeded')}; "
                 "a smaller batch_size avoids re-runs)" if state.split else "")
        out.write(f"\r\x1b[2K{bar}  {state.records_per_s:,.0f} records/s, "
                  f"fuel {state.fuel_used:,}{failed}{split}")
        if state.total is not None and state.done >= state.total:
            out.write("\n")
        out.flush()

    return draw
