"""wasibox.dask with dask's synchronous scheduler (the same graph a cluster runs)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest

dask = pytest.importorskip("dask", reason="needs the wasibox[dask] extra (dask)")
pytest.importorskip("distributed", reason="needs the wasibox[dask] extra (distributed)")
pytest.importorskip("pandas", reason="needs the wasibox[dask] extra (pandas)")

import dask.bag as db  # noqa: E402
import dask.dataframe as dd  # noqa: E402
import pandas as pd  # noqa: E402

import wasibox  # noqa: E402
import wasibox.dask as wd  # noqa: E402

pytestmark = pytest.mark.guest

CODE = '''
def transform(r):
    if r["id"] % 7 == 3:
        raise ValueError(f"bad record {r['id']}")
    if r["id"] == 40:
        while True:
            pass
    return {"id": r["id"], "total": r["price"] * r["qty"]}
'''
LIMITS = wasibox.Limits(fuel=2 * 10**8)
RECORDS = [{"id": i, "price": 1.5 + i % 5, "qty": i % 11} for i in range(60)]


def double(x: int) -> int:
    """A host function the workers allow."""
    return 2 * x


def forbidden(x: int) -> int:
    """A host function no worker allows."""
    return x


@pytest.fixture(scope="module")
def client() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch, dask.config.set(scheduler="sync"):
        patch.setenv("WASIBOX_DASK_ALLOW_FUNCTIONS", "tests.test_dask:double")
        yield None


def described(items: list[Any]) -> list[Any]:
    return [item.to_dict() if isinstance(item, wasibox.Failed) else item for item in items]


@pytest.fixture(scope="module")
def transform() -> Iterator[wasibox.Transform]:
    with wasibox.Transform(CODE, limits=LIMITS, on_error="collect", batch_size=8) as t:
        yield t


@pytest.fixture(scope="module")
def local(transform: wasibox.Transform) -> list[Any]:
    return transform.map(RECORDS, progress=False)


def test_bag_equals_local_map_with_global_indices(client: None, transform: wasibox.Transform,
                                                   local: list[Any]) -> None:
    bag = db.from_sequence(RECORDS, npartitions=5)
    out = wd.map_partitions(transform, bag).compute()
    assert described(out) == described(local)
    failed = [item for item in out if isinstance(item, wasibox.Failed)]
    assert [f.index for f in failed] == [3, 10, 17, 24, 31, 38, 40, 45, 52, 59]
    assert isinstance(failed[6].error, wasibox.LimitExceeded)
    assert failed[6].error.limit is wasibox.Limit.FUEL
    assert str(failed[1].error).startswith("record 10: ")
    assert wd.fingerprint(transform, bag) == transform.fingerprint(RECORDS)


def test_skip_and_raise_match_local_whatever_the_partitioning(
        client: None, transform: wasibox.Transform) -> None:
    for npartitions in (1, 4, 7):
        bag = db.from_sequence(RECORDS, npartitions=npartitions)
        assert transform.to_dask(bag, on_error="skip").compute() == \
            transform.map(RECORDS, on_error="skip", progress=False)
        with pytest.raises(wasibox.GuestError) as raised:
            transform.to_dask(bag, on_error="raise").compute()
        assert raised.value.index == 3  # the lowest failing index, as a local map raises


def test_dataframe_rows_indexed_by_global_record_index(
        client: None, transform: wasibox.Transform, local: list[Any]) -> None:
    frame = dd.from_pandas(pd.DataFrame(RECORDS), npartitions=3)
    out = wd.map_partitions(transform, frame, on_error="skip").compute()
    expected = {i: item for i, item in enumerate(local) if not isinstance(item, wasibox.Failed)}
    assert list(out.index) == list(expected)
    assert out.to_dict("records") == list(expected.values())
    assert wd.fingerprint(transform, frame) == transform.fingerprint(RECORDS)


def test_host_functions_travel_as_import_paths(client: None) -> None:
    code = "import host\ndef transform(x):\n    return host.double(x)\n"
    with wasibox.Transform(code) as t:
        bag = db.from_sequence(range(10), npartitions=2)
        out = wd.map_partitions(t, bag, functions={"double": "tests.test_dask:double"})
        assert out.compute() == [2 * x for x in range(10)]


def test_worker_refuses_a_host_function_it_does_not_allow(client: None) -> None:
    code = "import host\ndef transform(x):\n    return host.forbidden(x)\n"
    with wasibox.Transform(code) as t:
        bag = db.from_sequence(range(4), npartitions=2)
        out = wd.map_partitions(t, bag, functions={"forbidden": "tests.test_dask:forbidden"})
        with pytest.raises(wd.FunctionRefused, match="does not allow host function "
                                                     "'tests.test_dask:forbidden'"):
            out.compute()


def test_bad_input_is_a_usage_error(transform: wasibox.Transform) -> None:
    with pytest.raises(wasibox.UsageError, match="dask.bag.Bag"):
        wd.map_partitions(transform, [1, 2, 3])
    with pytest.raises(wasibox.UsageError, match="import path"):
        wd.map_partitions(transform, db.from_sequence([1]), functions={"f": "nocolon"})


def test_plugin_refuses_a_guest_digest_mismatch() -> None:
    plugin = wd.WasiboxPlugin(guest_digest="sha256:" + "0" * 64)
    with pytest.raises(wd.GuestMismatch, match="install the same wasibox version"):
        plugin.setup(worker=None)


def test_failures_pickle_whole(transform: wasibox.Transform, local: list[Any]) -> None:
    # What a worker sends back: the Failed, its error, its message, index and result.
    for item in (local[10], local[40]):
        copy = pickle.loads(pickle.dumps(item))
        assert copy.index == item.index and copy.to_dict() == item.to_dict()
        assert type(copy.error) is type(item.error)
        assert str(copy.error) == str(item.error) and copy.error.index == item.error.index
        assert copy.error.result == item.error.result
    assert pickle.loads(pickle.dumps(local[40].error)).limit is wasibox.Limit.FUEL
    busy = pickle.loads(pickle.dumps(wasibox.Busy(2, 3)))
    assert (busy.max_concurrency, busy.max_queue, str(busy)) == (2, 3, str(wasibox.Busy(2, 3)))


SHUFFLED = """
def transform(r):
    if r["id"] % 4 == 0:
        raise ValueError("every fourth")
    return {"z": r["id"], "a": r["qty"], "m": f"m{r['id']}"}
"""


def test_dataframe_columns_are_in_the_order_of_the_rows(client: None) -> None:
    # Each partition's first row fails (the bug: its frame began with "failed"), and one
    # partition has no failure at all (the bug: it had no "failed" column).
    records = RECORDS[:13]
    frame = dd.from_pandas(pd.DataFrame(records), npartitions=4)
    with wasibox.Transform(SHUFFLED, on_error="collect") as t:
        local = t.map(records, progress=False)
        out = frame.wasibox.map(t).compute()
        assert list(out.columns) == ["z", "a", "m", "failed"]
        rows = [item for item in local if not isinstance(item, wasibox.Failed)]
        expected = pd.DataFrame(rows, index=[i for i, item in enumerate(local)
                                             if not isinstance(item, wasibox.Failed)])
        kept = out[out["failed"].isna()].drop(columns="failed")
        pd.testing.assert_frame_equal(kept, expected, check_dtype=False)
        assert [f.index for f in out["failed"].dropna()] == [0, 4, 8, 12]
        skipped = t.to_dask(frame, on_error="skip").compute()
        assert list(skipped.columns) == ["z", "a", "m"]
        pd.testing.assert_frame_equal(skipped, expected)


def test_meta_names_the_columns(client: None, transform: wasibox.Transform) -> None:
    frame = dd.from_pandas(pd.DataFrame(RECORDS[:20]), npartitions=2)
    meta = pd.DataFrame({"total": pd.Series(dtype=float), "id": pd.Series(dtype=int)})
    out = wd.map_partitions(transform, frame, on_error="skip", meta=meta)
    assert list(out.columns) == ["total", "id"]
    assert list(out.compute().columns) == ["total", "id"]
    with pytest.raises(wasibox.UsageError, match="meta= naming every output column"):
        wd.map_partitions(transform, frame, on_error="skip",
                          meta=meta[["id"]]).compute()
    with pytest.raises(wasibox.UsageError, match="meta must be"):
        wd.map_partitions(transform, frame, meta={"id": int})


def test_bags_and_dataframes_have_a_wasibox_accessor(client: None,
                                                     transform: wasibox.Transform,
                                                     local: list[Any]) -> None:
    bag = db.from_sequence(RECORDS, npartitions=3)
    assert described(bag.wasibox.map(transform).compute()) == described(local)
    assert bag.wasibox.fingerprint(transform) == transform.fingerprint(RECORDS)
    frame = dd.from_pandas(pd.DataFrame(RECORDS), npartitions=3)
    assert frame.wasibox.fingerprint(transform) == transform.fingerprint(RECORDS)
    assert isinstance(db.Bag.wasibox, type) and db.Bag.wasibox is wd.WasiboxAccessor
