"""wasibox.dask on a real ``distributed.LocalCluster``: two worker processes, each with its
own warm wasibox runtime set up by ``WasiboxPlugin``.

One cluster serves the whole module. The workers get their environment from the cluster
(``env=``), never from this process: the host-function allow-list and the marker that makes
one worker die on purpose exist only on the workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dask", reason="needs the wasibox[dask] extra (dask)")
distributed = pytest.importorskip("distributed",
                                  reason="needs the wasibox[dask] extra (distributed)")
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
    return {"id": r["id"], "total": r["price"] * r["qty"], "tag": f"r{r['id']}"}
'''
LIMITS = wasibox.Limits(fuel=2 * 10**8)
RECORDS = [{"id": i, "price": 1.5 + i % 5, "qty": i % 11} for i in range(60)]
FAILED_AT = [3, 10, 17, 24, 31, 38, 40, 45, 52, 59]

#: Set only in the workers' environment: the file whose creation marks the one death.
DIE_ONCE_ENV = "WASIBOX_TEST_DIE_ONCE_MARKER"
HERE = __name__  # "tests.test_dask_cluster": the workers import host functions from here


def double(x: int) -> int:
    """A host function the workers allow."""
    return 2 * x


def forbidden(x: int) -> int:
    """A host function no worker allows."""
    return x


def die_once(x: int) -> int:
    """A host function that kills its own worker process the first time any worker calls
    it (whoever creates the marker file dies), and is ``2 * x`` from then on."""
    marker = os.environ.get(DIE_ONCE_ENV)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os._exit(17)  # the worker dies in the middle of a transform batch
    return 2 * x


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dask-cluster") / "died"


@pytest.fixture(scope="module")
def client(marker: Path) -> Iterator[Any]:
    # No dashboard (it needs bokeh, and a fixed port may be taken); quiet logs, since a
    # worker dies on purpose here. The cluster is closed with a timeout so a stuck worker
    # fails the teardown instead of hanging the suite.
    cluster = distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
        silence_logs=logging.CRITICAL, env={DIE_ONCE_ENV: str(marker)})
    client = distributed.Client(cluster)
    try:
        wd.register(client, allow_functions=[f"{HERE}:double", f"{HERE}:die_once"])
        yield client
    finally:
        client.close(timeout=30)
        cluster.close(timeout=30)


def described(items: list[Any]) -> list[Any]:
    return [item.to_dict() if isinstance(item, wasibox.Failed) else item for item in items]


@pytest.fixture(scope="module")
def transform() -> Iterator[wasibox.Transform]:
    with wasibox.Transform(CODE, limits=LIMITS, on_error="collect", batch_size=8) as t:
        yield t


@pytest.fixture(scope="module")
def local(transform: wasibox.Transform) -> list[Any]:
    return transform.map(RECORDS, progress=False)


def test_bag_on_two_workers_equals_local_map(client: Any, transform: wasibox.Transform,
                                              local: list[Any]) -> None:
    bag = db.from_sequence(RECORDS, npartitions=6)
    out = client.compute(wd.map_partitions(transform, bag)).result()
    assert described(out) == described(local)
    failed = [item for item in out if isinstance(item, wasibox.Failed)]
    assert [f.index for f in failed] == FAILED_AT
    assert isinstance(failed[6].error, wasibox.LimitExceeded)
    assert failed[6].error.limit is wasibox.Limit.FUEL
    assert str(failed[1].error).startswith("record 10: ")
    # Both workers took part, each with its own runtime.
    ran = client.run(lambda: wd._RUNTIME is not None and bool(wd._RUNTIME._transforms))
    assert len(ran) == 2 and all(ran.values())
    assert wd.fingerprint(transform, bag) == transform.fingerprint(RECORDS)


def test_every_policy_reports_global_indexes(client: Any, transform: wasibox.Transform) -> None:
    bag = db.from_sequence(RECORDS, npartitions=5)
    assert transform.to_dask(bag, on_error="skip").compute() == \
        transform.map(RECORDS, on_error="skip", progress=False)
    with pytest.raises(wasibox.GuestError) as raised:
        transform.to_dask(bag, on_error="raise").compute()
    assert raised.value.index == 3
    assert str(raised.value).startswith("record 3: ")
    # A partition that starts later: its failures, the fuel-limited one among them, are
    # numbered from the start of the whole input.
    tail = db.from_sequence(RECORDS[33:], npartitions=3)
    collected = tail.wasibox.map(transform).compute()
    failed = [item for item in collected if isinstance(item, wasibox.Failed)]
    assert [f.index for f in failed] == [index - 33 for index in FAILED_AT if index >= 33]
    with pytest.raises(wasibox.LimitExceeded) as limited:
        wd.map_partitions(transform, db.from_sequence(RECORDS[39:42], npartitions=2),
                          on_error="raise").compute()
    assert limited.value.index == 1  # RECORDS[40], the second record of that input


def test_dataframe_on_two_workers_equals_local_map(client: Any, transform: wasibox.Transform,
                                                    local: list[Any]) -> None:
    frame = dd.from_pandas(pd.DataFrame(RECORDS), npartitions=4)
    ok = {i: item for i, item in enumerate(local) if not isinstance(item, wasibox.Failed)}
    skipped = wd.map_partitions(transform, frame, on_error="skip").compute()
    assert list(skipped.index) == list(ok)
    assert list(skipped.columns) == ["id", "total", "tag"]
    assert skipped.to_dict("records") == list(ok.values())
    collected = frame.wasibox.map(transform).compute()
    failed = collected["failed"].dropna()
    assert list(failed.index) == FAILED_AT
    assert [f.index for f in failed] == FAILED_AT
    assert wd.fingerprint(transform, frame) == transform.fingerprint(RECORDS)


def test_worker_refuses_a_host_function_it_does_not_allow(client: Any) -> None:
    code = "import host\ndef transform(x):\n    return host.forbidden(x)\n"
    with wasibox.Transform(code) as t:
        bag = db.from_sequence(range(4), npartitions=2)
        out = wd.map_partitions(t, bag, functions={"forbidden": f"{HERE}:forbidden"})
        with pytest.raises(wd.FunctionRefused, match=f"does not allow host function "
                                                     f"'{HERE}:forbidden'"):
            out.compute()
        # An allowed one runs on the same workers.
        out = wd.map_partitions(t, bag, functions={"forbidden": f"{HERE}:double"})
        assert out.compute() == [0, 2, 4, 6]


def test_a_worker_killed_mid_transform_is_retried_with_the_same_result(
        client: Any, marker: Path) -> None:
    code = ("import host\n"
            "def transform(r):\n    return {'id': r['id'], 'x': host.die_once(r['id'])}\n")
    records = [{"id": i} for i in range(40)]
    before = set(client.scheduler_info()["workers"])
    with wasibox.Transform(code, batch_size=4) as cluster_side, \
            wasibox.Transform(code, batch_size=4, functions={"die_once": die_once}) as local:
        bag = db.from_sequence(records, npartitions=8)
        found = wd.fingerprint(cluster_side, bag, functions={"die_once": f"{HERE}:die_once"})
        assert marker.exists()  # a worker did die, inside a host call of a running batch
        assert found == local.fingerprint(records)
        out = wd.map_partitions(cluster_side, bag,
                                functions={"die_once": f"{HERE}:die_once"}).compute()
        assert out == [{"id": i, "x": 2 * i} for i in range(40)]
    client.wait_for_workers(2, timeout=60)
    assert set(client.scheduler_info()["workers"]) != before  # the nanny replaced it


def test_a_worker_with_another_guest_is_refused(client: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A client whose wasibox runs another guest than the workers' (here: claims to).
    other = "0" * 64
    monkeypatch.setattr(wd, "guest_digest", lambda: other)
    with wasibox.Transform("def transform(r):\n    return r\n") as t:
        with pytest.raises(wd.GuestMismatch, match=f"but the client expects {other}: install "
                                                   f"the same wasibox version"):
            wd.map_partitions(t, db.from_sequence(range(4), npartitions=2)).compute()
        # The plugin refuses it as the workers start (or at once, for running workers).
        with pytest.raises(wd.GuestMismatch, match="runs guest [0-9a-f]{64}, but the client"):
            wd.register(client)
        monkeypatch.undo()
        wd.register(client, allow_functions=[f"{HERE}:double"])
        assert t.to_dask(db.from_sequence(range(4), npartitions=2)).compute() == [0, 1, 2, 3]
