"""Run a ``wasibox.Transform`` over ``dask.bag`` and ``dask.dataframe`` collections.

Needs the ``dask`` extra (``pip install 'wasibox[dask]'``). The transform travels to the
workers as data (its ``TransformSpec``: source, limits, seed, policy); host functions travel
as import paths (``"package.module:function"``) and a worker runs only those its own
``WasiboxPlugin(allow_functions=...)`` allows. Each worker keeps one warm runtime (engine,
compiled guest, sandboxes), set up once by the plugin, which also refuses to start when the
worker's guest digest differs from the client's.

Results equal a local ``Transform.map`` over the same records: every partition's failures
are numbered from its global offset, so they carry global indexes, and under
``on_error="raise"`` the error raised is the one with the lowest index, whatever the
partitioning. Importing this module also gives bags and DataFrames a ``.wasibox`` accessor:
``collection.wasibox.map(transform)``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import dask
import dask.bag as db
from dask.delayed import Delayed, delayed
from dask.sizeof import sizeof
from distributed import Client, WorkerPlugin

from ._errors import FunctionRefused, GuestMismatch, UsageError
from ._guest import guest_digest
from ._transform import FailedRecord, OnError, Transform, TransformSpec, _canonical, _check_on_error

__all__ = [
    "FunctionRefused",
    "GuestMismatch",
    "WasiboxAccessor",
    "WasiboxPlugin",
    "fingerprint",
    "map_partitions",
    "register",
]

#: Environment variable a worker reads for extra host functions it allows (comma-separated
#: import paths), in addition to its plugin's ``allow_functions``.
ALLOW_ENV = "WASIBOX_DASK_ALLOW_FUNCTIONS"

#: The column of a DataFrame result that holds each failed row's ``wasibox.FailedRecord``.
FAILED_COLUMN = "failed"


# -- the per-worker runtime ---------------------------------------------------------------------


class _Runtime:
    """One process's warm wasibox: the checked guest and one Transform per spec."""

    def __init__(self, digest: str, allow_functions: Iterable[str]) -> None:
        self.digest = digest
        self.allowed = frozenset(allow_functions)
        self._lock = threading.Lock()
        self._transforms: dict[str, Transform] = {}

    def transform(self, spec: dict[str, Any], functions: Mapping[str, str]) -> Transform:
        key = hashlib.sha256(_canonical([spec, sorted(functions.items())])).hexdigest()
        with self._lock:
            found = self._transforms.get(key)
            if found is None:
                resolved = {name: self._resolve(path) for name, path in functions.items()}
                options: dict[str, Any] = {"functions": resolved} if resolved else {}
                found = Transform.from_spec(TransformSpec.from_dict(spec), **options)
                self._transforms[key] = found
            return found

    def _resolve(self, path: str) -> Callable[..., Any]:
        if path not in self.allowed:
            raise FunctionRefused(
                f"this worker does not allow host function {path!r}; allow it with "
                f"WasiboxPlugin(allow_functions=[...]) or {ALLOW_ENV} on the worker")
        module, _, name = path.partition(":")
        function = getattr(importlib.import_module(module), name, None)
        if not callable(function):
            raise FunctionRefused(f"host function {path!r} is not a callable")
        return function

    def close(self) -> None:
        with self._lock:
            for transform in self._transforms.values():
                transform.close()
            self._transforms.clear()


_RUNTIME: _Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def _environment_allows() -> list[str]:
    return [path.strip() for path in os.environ.get(ALLOW_ENV, "").split(",") if path.strip()]


def _runtime() -> _Runtime:
    """This process's runtime: the plugin's, or (no plugin: a local scheduler) a default one
    that allows only the host functions named in the environment."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = _Runtime(guest_digest(), _environment_allows())
        return _RUNTIME


def _mismatch(address: str, digest: str, expected: str) -> str:
    return (f"worker {address} runs guest {digest}, but the client expects {expected}: "
            f"install the same wasibox version (and dependencies) on every worker and give "
            f"them one build of the guest (`wasibox prepare` once, in the image or a shared "
            f"WASIBOX_CACHE_DIR), so that results stay deterministic")


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:  # not in a distributed worker (a local scheduler)
        return "(local)"


class WasiboxPlugin(WorkerPlugin):
    """Sets up one warm wasibox runtime per worker, once, when the worker starts.

    ``guest_digest`` is the digest every worker must run (the client's, by default with
    ``register``); a worker whose guest differs raises ``GuestMismatch`` and starts no
    transform. ``allow_functions`` lists the host functions (``"module:function"``) this
    worker may import for transforms; any other is refused with ``FunctionRefused``.
    """

    name = "wasibox"

    def __init__(self, *, guest_digest: str | None = None,
                 allow_functions: Iterable[str] = ()) -> None:
        self.guest_digest = guest_digest
        self.allow_functions = sorted(allow_functions)

    def setup(self, worker: Any) -> None:
        global _RUNTIME
        digest = guest_digest()  # builds or loads the guest: once per worker
        if self.guest_digest is not None and digest != self.guest_digest:
            raise GuestMismatch(_mismatch(getattr(worker, "address", "?"), digest,
                                          self.guest_digest))
        runtime = _Runtime(digest, [*self.allow_functions, *_environment_allows()])
        # Warm the engine and the compiled guest, so no task pays for them.
        with Transform("def transform(r):\n    return r\n") as warm:
            warm.map([0], progress=False)
        with _RUNTIME_LOCK:
            previous, _RUNTIME = _RUNTIME, runtime
        if previous is not None:
            previous.close()

    def teardown(self, worker: Any) -> None:
        global _RUNTIME
        with _RUNTIME_LOCK:
            previous, _RUNTIME = _RUNTIME, None
        if previous is not None:
            previous.close()


def register(client: Client, *, allow_functions: Iterable[str] = ()) -> None:
    """Register ``WasiboxPlugin`` on every worker of ``client`` (present and future), checking
    each worker's guest digest against this process's. Raises ``GuestMismatch`` (or
    ``FunctionRefused``-free setup errors) as the failing worker reports them."""
    plugin = WasiboxPlugin(guest_digest=guest_digest(), allow_functions=allow_functions)
    replies = client.register_plugin(plugin)
    for reply in (replies or {}).values():
        if isinstance(reply, dict) and reply.get("status") == "error":
            raise reply["exception"]


# -- running partitions -------------------------------------------------------------------------


class _Outputs:
    """One partition's records or outputs, boxed between tasks: distributed pickles a box in
    one piece, where it serializes a list of dicts element by element, tens of times slower
    (and slow transfers between workers are what stops a cluster from scaling)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Outputs, (self.items,))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __sizeof__(self) -> int:  # what dask's scheduler weighs before moving it
        return int(sizeof(self.items))


def _run_partition(spec: dict[str, Any], functions: dict[str, str], digest: str,
                   records: Iterable[Any]) -> _Outputs:
    """Outputs (FailedRecord in place of failures, numbered from 0) for one partition; runs on a
    worker, which refuses if its guest is not ``digest`` (the client's), plugin or not.

    It does not wait for the partition's global offset (which needs every partition's
    length): it runs as soon as its records exist, where they are, and ``_renumber`` then
    gives its failures their global index."""
    runtime = _runtime()
    if runtime.digest != digest:
        raise GuestMismatch(_mismatch(_worker_address(), runtime.digest, digest))
    transform = runtime.transform(spec, functions)
    # One batch at a time: dask already runs a partition per worker thread, on every core
    # it was given; more threads here would only contend for them and hold more batches.
    return _Outputs(transform.map(list(records), on_error="collect", progress=False,
                                  workers=1))


def _renumber(items: _Outputs, start: int) -> _Outputs:
    """``items`` with each failure's index (and the ``record N:`` of its message) moved on
    by ``start``: what ``Transform.map(..., start=start)`` would have given."""
    if not start:
        return items
    moved = []
    for item in items:
        if isinstance(item, FailedRecord):
            # A copy: the partition's own outputs stay as they were, should dask run this
            # step again on them.
            error, index = copy.copy(item.error), item.index + start
            message = str(error.args[0]) if error.args else ""
            message = message.removeprefix(f"record {item.index}: ")
            error.index = index
            error.args = (f"record {index}: {message}",)
            item = FailedRecord(index, error)
        moved.append(item)
    return _Outputs(moved)


def _offsets(*lengths: int) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts


def _first_failure(part: _Outputs) -> FailedRecord | None:
    return next((item for item in part if isinstance(item, FailedRecord)), None)


def _earliest(*firsts: FailedRecord | None) -> FailedRecord | None:
    return next((first for first in firsts if first is not None), None)


def _finish(part: _Outputs, policy: OnError, first: FailedRecord | None) -> list[Any]:
    if policy == "raise":
        if first is not None:
            raise first.error
        return part.items
    if policy == "skip":
        return [item for item in part if not isinstance(item, FailedRecord)]
    return part.items


def _box(records: Iterable[Any]) -> _Outputs:
    return _Outputs(list(records))


def _rows(frame: Any) -> _Outputs:
    return _Outputs(frame.to_dict("records"))


def _frame(items: _Outputs, start: int, policy: OnError, first: FailedRecord | None,
           columns: list[str] | None) -> Any:
    """A pandas DataFrame of one partition's output rows, indexed by global record index.

    Every partition gets exactly ``columns`` (in that order; None: the keys of its rows, in
    order of first appearance), then, under ``"collect"``, a ``failed`` column holding each
    failed row's ``wasibox.FailedRecord`` (None for the others). A row key outside ``columns``
    raises UsageError: its column would be missing from the result's other partitions.
    """
    import pandas

    if policy == "raise" and first is not None:
        raise first.error
    rows: list[dict[str, Any]] = []
    labels: list[int] = []
    failures: list[FailedRecord | None] = []
    for offset, item in enumerate(items):
        if isinstance(item, FailedRecord):
            if policy == "skip":
                continue
            rows.append({})
            failures.append(item)
        elif isinstance(item, Mapping):
            rows.append(dict(item))
            failures.append(None)
        else:
            raise UsageError(f"a DataFrame transform must return dicts (rows), not "
                             f"{type(item).__name__}")
        labels.append(start + offset)
    frame = pandas.DataFrame.from_records(rows, index=pandas.Index(labels, dtype="int64"))
    if FAILED_COLUMN in frame.columns:
        raise UsageError(f"a DataFrame transform's rows must not have a {FAILED_COLUMN!r} "
                         f"key: that column holds the failures")
    if columns is not None:
        extra = [name for name in frame.columns if name not in columns]
        if extra:
            raise UsageError(
                f"rows from record {start} on have columns {extra} that the first partition "
                f"(or meta=) does not have; pass meta= naming every output column")
        frame = frame.reindex(columns=columns)
    if policy == "collect":
        frame[FAILED_COLUMN] = pandas.Series(failures, index=frame.index, dtype=object)
    return frame


def _transform_parts(transform: Transform, collection: Any, on_error: OnError | None,
                     functions: Mapping[str, str] | None) -> tuple[list[Delayed], list[Delayed],
                                                                   OnError, bool]:
    policy = transform.spec.on_error if on_error is None else on_error
    _check_on_error(policy)
    names = dict(functions or {})
    for name, path in names.items():
        if not isinstance(path, str) or ":" not in path:
            raise UsageError(f"host function {name!r} must be an import path such as "
                             f"'package.module:function', not {path!r}")
    frame = _is_dataframe(collection)
    if frame:
        parts = [delayed(_rows)(part) for part in collection.to_delayed()]
    elif isinstance(collection, db.Bag):
        # Boxed first, by a task that dask keeps where the records are: whichever worker
        # then runs the partition receives them in one piece.
        parts = [delayed(_box)(part) for part in collection.to_delayed()]
    else:
        raise UsageError(f"expected a dask.bag.Bag or a dask.dataframe.DataFrame, not "
                         f"{type(collection).__name__}")
    lengths = [delayed(len)(part) for part in parts]
    starts = delayed(_offsets, nout=len(parts))(*lengths)
    spec = transform.spec.to_dict()
    digest = guest_digest()
    ran = [delayed(_renumber, pure=True)(
               delayed(_run_partition, pure=True)(spec, names, digest, part), starts[i])
           for i, part in enumerate(parts)]
    return ran, [starts[i] for i in range(len(parts))], policy, frame


def _is_dataframe(collection: Any) -> bool:
    try:
        import dask.dataframe as dd
    except ImportError:  # pandas missing: no DataFrames to be given
        return False
    return isinstance(collection, dd.DataFrame)


def map_partitions(transform: Transform, collection: Any, *, on_error: OnError | None = None,
                   functions: Mapping[str, str] | None = None, meta: Any = None) -> Any:
    """Apply ``transform`` to every record of a dask Bag or DataFrame, lazily.

    A Bag gives a Bag of outputs; a DataFrame gives its rows to the transform as dicts and
    returns a DataFrame of the output rows (dicts), indexed by global record index. Its
    columns are those of ``meta`` (an empty pandas DataFrame) or, without ``meta``, the keys
    of the first partition's output rows in order (that partition runs once now to find
    them); under ``"collect"`` a last ``failed`` column holds each failed row's
    ``wasibox.FailedRecord`` (None elsewhere).
    ``functions`` maps guest-visible names to import paths (``"module:function"``) that
    every worker must allow. Failures carry global indexes; under ``"raise"`` computing
    raises the failure with the lowest index. Raises UsageError for bad arguments.
    """
    ran, starts, policy, frame = _transform_parts(transform, collection, on_error, functions)
    first = (delayed(_earliest)(*[delayed(_first_failure)(part) for part in ran])
             if policy == "raise" else None)
    if frame:
        return _dataframe(ran, starts, policy, first, meta)
    return db.from_delayed([delayed(_finish)(part, policy, first) for part in ran])


def _dataframe(ran: list[Delayed], starts: list[Delayed], policy: OnError,
               first: Delayed | None, meta: Any) -> Any:
    """The output DataFrame: every partition with the columns of ``meta``, or (no meta)
    of the first partition's rows, which this computes now (only that partition)."""
    import dask.dataframe as dd
    import pandas

    if meta is None:
        probe = delayed(_frame)(ran[0], starts[0], "skip" if policy == "raise" else policy,
                                None, None)
        (sample,) = dask.compute(probe)  # type: ignore[attr-defined]
        meta = sample.iloc[:0]
    elif not isinstance(meta, pandas.DataFrame):
        raise UsageError(f"meta must be an (empty) pandas DataFrame, not "
                         f"{type(meta).__name__}")
    columns = [name for name in meta.columns if name != FAILED_COLUMN]
    meta = meta[columns]
    if policy == "collect":
        meta = meta.assign(**{FAILED_COLUMN: pandas.Series(dtype=object)})
    frames = [delayed(_frame)(part, start, policy, first, columns)
              for part, start in zip(ran, starts, strict=True)]
    # Partitions may differ in dtype (an int column with a failed row is float): pandas
    # upcasts when they are concatenated, as it does for one frame of all the rows. Object
    # columns stay objects: dask would turn them into strings, the FailedRecord ones included.
    with dask.config.set({"dataframe.convert-string": False}):
        return dd.from_delayed(frames, meta=meta, verify_meta=False)


def fingerprint(transform: Transform, collection: Any, *,
                functions: Mapping[str, str] | None = None, **compute_options: Any) -> str:
    """``transform.fingerprint(records)`` for the records of a Bag or DataFrame, computed on
    the cluster (outputs are hashed here, in order). Equal to the local fingerprint."""
    ran, _, _, _ = _transform_parts(transform, collection, "collect", functions)
    parts = dask.compute(*ran, **compute_options)  # type: ignore[attr-defined]
    digest = hashlib.sha256()
    index = 0
    for part in parts:
        for item in part:
            digest.update(Transform._fingerprint_entry(index, item))
            index += 1
    return "sha256:" + digest.hexdigest()


# -- method-style accessors ----------------------------------------------------------------------


class WasiboxAccessor:
    """``collection.wasibox``: wasibox.dask's functions as methods of a dask DataFrame or Bag.

    Registered when ``wasibox.dask`` is imported: ``frame.wasibox.map(transform)`` is
    ``map_partitions(transform, frame)``, ``bag.wasibox.fingerprint(transform)`` is
    ``fingerprint(transform, bag)``.
    """

    def __init__(self, collection: Any) -> None:
        self._collection = collection

    def map(self, transform: Transform, *, on_error: OnError | None = None,
            functions: Mapping[str, str] | None = None, meta: Any = None) -> Any:
        """``map_partitions(transform, collection, ...)``."""
        return map_partitions(transform, self._collection, on_error=on_error,
                              functions=functions, meta=meta)

    def fingerprint(self, transform: Transform, *, functions: Mapping[str, str] | None = None,
                    **compute_options: Any) -> str:
        """``fingerprint(transform, collection, ...)``."""
        return fingerprint(transform, self._collection, functions=functions,
                           **compute_options)


class _BagAccessor:
    """The descriptor that makes ``bag.wasibox`` a WasiboxAccessor (dask has no accessor
    registry for bags, so this is what its DataFrame registry does, done for Bag)."""

    def __get__(self, bag: Any, owner: type) -> Any:
        if bag is None:
            return WasiboxAccessor
        return WasiboxAccessor(bag)


def _register_accessors() -> None:
    if not hasattr(db.Bag, "wasibox"):
        db.Bag.wasibox = _BagAccessor()  # type: ignore[attr-defined]
    try:
        import dask.dataframe as dd
        from dask.dataframe.extensions import register_dataframe_accessor
    except ImportError:  # no pandas: bags only
        return
    if not hasattr(dd.DataFrame, "wasibox"):
        register_dataframe_accessor("wasibox")(WasiboxAccessor)


_register_accessors()
