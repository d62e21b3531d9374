"""wasibox.Transform: outputs, batching, determinism, error policies, limits."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import subprocess
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
from wasibox._batch import encode_records
from wasibox._result import clean_text

from .conftest import PYTHON, child_env, run_path_backend

pytestmark = pytest.mark.guest

TOTAL = 'def transform(r):\n    return {"id": r["id"], "total": r["price"] * r["qty"]}\n'

FLAKY = textwrap.dedent("""\
    def transform(r):
        if r == 3:
            raise ValueError(f"bad record {r}")
        if r == 5:
            while True:
                pass
        return r * 10
""")


def orders(n: int) -> list[dict[str, object]]:
    return [{"id": i, "price": 1.25 + i % 7, "qty": i % 5} for i in range(n)]


def expected(records: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{"id": r["id"], "total": r["price"] * r["qty"]} for r in records]  # type: ignore[operator]


def test_call_runs_one_record() -> None:
    with wasibox.Transform(TOTAL) as t:
        assert t({"id": 7, "price": 2.5, "qty": 4}) == {"id": 7, "total": 10.0}


def test_map_matches_host_python_for_every_batch_size() -> None:
    records = orders(250)
    with wasibox.Transform(TOTAL) as t:
        for size in (1, 7, 100, 1000):
            if size == 1:
                assert t.map(records[:20], batch_size=1, progress=False) == expected(records[:20])
            else:
                assert t.map(records, batch_size=size, progress=False) == expected(records)


def test_values_keep_their_types() -> None:
    code = textwrap.dedent("""\
        def transform(r):
            return r
    """)
    records = [
        {"a": 1, "b": 2.5, "c": "x", "d": None, "e": True},
        {"a": 2**60, "b": float("inf"), "c": "\\ud800", "d": [1, [2, {"k": b"v"}]], "e": False},
        [1, "two", 3.0], b"\x00\xff", (1, 2), {1: "int key"}, 2**70, -0.0, None,
    ]
    with wasibox.Transform(code) as t:
        out = t.map(records, progress=False)
    assert out[0] == records[0] and [type(v) for v in out[0].values()] == \
        [int, float, str, type(None), bool]
    assert out[1] == records[1]
    assert out[2] == [1, "two", 3.0] and type(out[2][2]) is float
    assert out[3] == b"\x00\xff"
    assert out[4] == [1, 2]  # tuples leave as lists, as with Sandbox.call
    assert out[5] == {1: "int key"}
    assert out[6:8] == [2**70, -0.0] and str(out[7]) == "-0.0"  # JSON carries big ints
    assert out[8] is None


def test_batches_of_same_key_dicts_keep_exact_types_and_key_order() -> None:
    """Same-key dicts travel keyed into the guest and as columns out of it: every column
    kind (int32, int64, bigger ints, floats, bools, None, str, mixed) keeps its types."""
    identity = "def transform(r):\n    return r\n"
    seen = ("def transform(r):\n"
            "    return [list(r), [type(v).__name__ for v in r.values()]]\n")
    records = [{"z": i, "int64": 2**40 + i, "huge": 2**70 * (i + 1), "f": i / 3,
                "special": [float("inf"), -0.0, float("nan")][i % 3], "b": i % 2 == 0,
                "n": None, "s": f"s{i}\ud800" if i % 2 else "", "mixed": [1, True, 1.0][i % 3],
                "a": -(2**31) if i % 2 else 2**31 - 1}
               for i in range(9)]
    # What leaves the guest encodes as UTF-8: its lone surrogates come back as U+FFFD.
    returned = [{**r, "s": str(r["s"]).replace("\ud800", "\ufffd")} for r in records]
    with wasibox.Transform(identity) as t:
        out = t.map(records, batch_size=9, progress=False)
    for got, want in zip(out, returned, strict=True):
        assert list(got) == list(want)
        assert [type(v) for v in got.values()] == [type(v) for v in want.values()]
        assert repr(got) == repr(want)  # -0.0, nan and inf included
    with wasibox.Transform(seen) as t:
        views = t.map(records, batch_size=9, progress=False)
    assert views == [[list(r), [type(v).__name__ for v in r.values()]] for r in records]
    # Same keys in another order, in one batch: each dict keeps its own order.
    swapped = [{"a": 1, "b": 2}, {"b": 3, "a": 4}, {"a": 5, "b": 6}]
    with wasibox.Transform(identity) as t:
        assert [list(r.items()) for r in t.map(swapped, batch_size=3, progress=False)] == \
            [list(r.items()) for r in swapped]


def test_the_programs_collector_setting_is_kept() -> None:
    code = "import gc\ngc.disable()\ndef transform(r):\n    return gc.isenabled()\n"
    with wasibox.Transform(code) as t:
        assert t.map([{"a": 1}, {"a": 2}], progress=False) == [False, False]


def test_homogeneous_dicts_with_failures_stay_aligned() -> None:
    code = textwrap.dedent("""\
        def transform(r):
            if r % 4 == 1:
                raise KeyError(r)
            return {"n": r, "half": r / 2, "s": str(r), "big": r * 2**62}
    """)
    with wasibox.Transform(code, on_error="collect") as t:
        out = t.map(range(12), batch_size=12, progress=False)
    for i, item in enumerate(out):
        if i % 4 == 1:
            assert isinstance(item, wasibox.Failed) and item.index == i
        else:
            assert item == {"n": i, "half": i / 2, "s": str(i), "big": i * 2**62}


def test_on_error_raise_names_the_global_index() -> None:
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000)) as t:
        with pytest.raises(wasibox.GuestError, match="record 103") as info:
            t.map(range(4), start=100, progress=False)  # record 3 -> index 103
        assert info.value.index == 103
        with pytest.raises(wasibox.GuestError) as info:
            t.map(range(10), progress=False)
        assert info.value.index == 3 and info.value.type == "ValueError"
        assert "bad record 3" in info.value.message


def test_imap_delivers_the_outputs_before_a_failed_record_then_raises() -> None:
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000)) as t:
        stream = t.imap([0, 1, 2, 3, 4], batch_size=5, progress=False)
        assert [next(stream), next(stream), next(stream)] == [0, 10, 20]
        with pytest.raises(wasibox.GuestError, match="bad record 3") as info:
            next(stream)
        assert info.value.index == 3


def test_on_error_skip_drops_failed_records() -> None:
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000),
                           on_error="skip") as t:
        assert t.map(range(8), batch_size=8, progress=False) == [0, 10, 20, 40, 60, 70]


def test_on_error_collect_puts_failed_in_place() -> None:
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000),
                           on_error="collect") as t:
        out = t.map(range(8), batch_size=8, progress=False)
        batches = t.batches_run
    assert [v for v in out if not isinstance(v, wasibox.Failed)] == [0, 10, 20, 40, 60, 70]
    guest, limit = out[3], out[5]
    assert isinstance(guest, wasibox.Failed) and guest.index == 3
    assert isinstance(guest.error, wasibox.GuestError) and guest.error.type == "ValueError"
    assert isinstance(limit, wasibox.Failed) and limit.index == 5
    assert isinstance(limit.error, wasibox.LimitExceeded)
    assert limit.error.limit == wasibox.Limit.FUEL and limit.error.index == 5
    assert limit.to_dict()["limit"] == "fuel"
    # The batch that ran out of fuel was split and re-run: 8 -> 4+4 -> 2+2 -> 1+1.
    assert batches == 7


def test_a_limit_in_one_record_does_not_change_the_others() -> None:
    code = textwrap.dedent("""\
        def transform(r):
            if r == 2:
                print("x" * 10_000)
            return r + 1
    """)
    limits = wasibox.Limits(output_bytes=1000)
    with wasibox.Transform(code, limits=limits, on_error="collect") as t:
        for size in (1, 3, 6):
            out = t.map(range(6), batch_size=size, progress=False)
            assert [v for i, v in enumerate(out) if i != 2] == [1, 2, 4, 5, 6]
            assert isinstance(out[2], wasibox.Failed)
            assert out[2].error.limit == wasibox.Limit.OUTPUT  # type: ignore[union-attr]


def test_memory_error_in_a_batch_is_judged_per_record() -> None:
    code = textwrap.dedent("""\
        def transform(r):
            if r == 1:
                return len(bytearray(10**9))
            return r
    """)
    with wasibox.Transform(code, on_error="collect") as t:
        out = t.map(range(4), batch_size=4, progress=False)
    assert out[0] == 0 and out[2:] == [2, 3]
    assert isinstance(out[1], wasibox.Failed)
    assert out[1].error.limit == wasibox.Limit.MEMORY  # type: ignore[union-attr]


def test_code_that_fails_to_load_fails_every_record() -> None:
    with wasibox.Transform("raise RuntimeError('no')", on_error="collect") as t:
        out = t.map(range(3), progress=False)
    assert [f.index for f in out] == [0, 1, 2]
    assert all(f.error.type == "RuntimeError" for f in out)
    with wasibox.Transform("x = 1", on_error="collect") as t:
        assert t.map([1], progress=False)[0].error.type == "NameError"


@pytest.mark.parametrize("workers", [1, 3])
def test_imap_streams_with_bounded_batches(workers: int) -> None:
    pulled: list[int] = []

    def source():  # type: ignore[no-untyped-def]
        for i in range(80):
            pulled.append(i)
            yield i

    with wasibox.Transform("def transform(r):\n    return -r\n", workers=workers) as t:
        stream = t.imap(source(), batch_size=10, progress=False)
        assert next(stream) == 0
        # The first batch, and one running ahead per worker.
        assert len(pulled) == 10 * (1 + workers)
        assert list(stream) == [-i for i in range(1, 80)]


def test_progress_callback_sees_every_batch() -> None:
    seen: list[wasibox.TransformProgress] = []
    with wasibox.Transform("def transform(r):\n    return r\n") as t:
        t.map(range(25), batch_size=10, progress=seen.append)
    assert [p.done for p in seen] == [10, 20, 25]
    assert all(p.total == 25 and p.fuel_used > 0 for p in seen)
    assert seen[-1].records_per_s > 0


def test_progress_says_when_batches_are_split_and_why() -> None:
    seen: list[wasibox.TransformProgress] = []
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000),
                           on_error="collect") as t:
        t.map(range(8), batch_size=8, progress=seen.append)
        t.map(range(3), batch_size=3, progress=seen.append)  # a map that splits nothing
    # One batch of 8: record 5 runs out of fuel, so 8 -> 4+4 -> 2+2 -> 1+1: three splits.
    first, second = seen
    assert (first.split, first.split_reason) == (3, "fuel")
    assert second.split == 0
    stream = io.StringIO()
    wasibox._transform.progress_bar(stream)(first)
    assert "3 batches split (fuel limit exceeded; a smaller batch_size avoids re-runs)" \
        in stream.getvalue()
    stream = io.StringIO()
    wasibox._transform.progress_bar(stream)(second)
    assert "split" not in stream.getvalue()


def test_fingerprint_is_stable_across_batch_sizes_and_sensitive_to_outputs() -> None:
    records = orders(60)
    with wasibox.Transform(TOTAL) as t:
        a = t.fingerprint(records, batch_size=60)
        b = t.fingerprint(records, batch_size=7)
    with wasibox.Transform(TOTAL.replace("* r[\"qty\"]", "* r[\"qty\"] + 1")) as other:
        c = other.fingerprint(records)
    assert a == b and a.startswith("sha256:")
    assert a != c


DETERMINISM_CHILD = f"""
import json, wasibox
code = {TOTAL!r} + "import random\\n_r = random.random()\\n"
records = [{{"id": i, "price": 1.25 + i % 7, "qty": i % 5}} for i in range(300)]
t = wasibox.Transform(code)
out = t.map(records, batch_size=100, progress=False)
print(json.dumps({{"fingerprint": t.fingerprint(records, batch_size=100),
                   "fuel": t.fuel_used, "first": out[:3]}}))
"""


def test_map_is_deterministic_across_processes() -> None:
    runs = [subprocess.run([PYTHON, "-c", DETERMINISM_CHILD], capture_output=True, text=True,
                           env=child_env(), check=True, timeout=300) for _ in range(2)]
    first, second = (json.loads(r.stdout.splitlines()[-1]) for r in runs)
    assert first == second
    assert first["fuel"] > 0


def test_fuel_is_deterministic_for_a_batch_size() -> None:
    records = orders(200)
    fuels = []
    for _ in range(2):
        with wasibox.Transform(TOTAL) as t:
            t.map(records, batch_size=50, progress=False)
            fuels.append(t.fuel_used)
    assert fuels[0] == fuels[1]
    with wasibox.Transform(TOTAL) as t:
        t.map(records, batch_size=200, progress=False)
        assert t.fuel_used < fuels[0]  # fewer batches, less fixed cost


def batch_sizes(seen: list[wasibox.TransformProgress]) -> list[int]:
    """The records in each batch of a map, from its progress reports."""
    done = [0, *(p.done for p in seen)]
    return [after - before for before, after in zip(done, done[1:], strict=False)]


@pytest.fixture
def small_auto_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Automatic batches that start at 10 records and grow to at most 1,000: the sizing
    rule of a map of 100,000 records, at the scale of a few hundred."""
    monkeypatch.setattr(wasibox._transform, "FIRST_AUTO_BATCH", 10)
    monkeypatch.setattr(wasibox._transform, "MAX_AUTO_BATCH", 1000)


def test_auto_batches_grow_while_the_limits_have_room(small_auto_batches: None) -> None:
    assert wasibox.TransformSpec(code=TOTAL).batch_size == "auto"
    records = orders(1500)
    runs = []
    for workers in (1, 4, 2):
        seen: list[wasibox.TransformProgress] = []
        with wasibox.Transform(TOTAL, workers=workers) as t:
            assert t.map(records, progress=seen.append) == expected(records)
            runs.append((batch_sizes(seen), t.fuel_used, [p.fuel_used for p in seen]))
    # The first AUTO_LAG + 1 batches are made before the first is settled, so they are the
    # first's size; then each grows fourfold (the default limits have room for far more).
    assert wasibox._transform.AUTO_LAG == 4
    assert runs[0][0] == [10, 10, 10, 10, 10, 40, 160, 640, 610]
    # Sizes, and so fuel and progress, are deterministic, whatever the workers.
    assert runs[0] == runs[1] == runs[2]


def test_auto_batches_are_the_same_on_both_run_paths(small_auto_batches: None) -> None:
    records = orders(700)
    runs = []
    for path in ("python", "native"):
        backend = run_path_backend(path)
        seen: list[wasibox.TransformProgress] = []
        with wasibox.Transform(TOTAL, backend=backend) as t:
            out = t.map(records, progress=seen.append)
            runs.append((out, batch_sizes(seen), t.fuel_used))
        backend.close()
    assert runs[0] == runs[1]
    assert runs[0][0] == expected(records)
    assert runs[0][1] == [10, 10, 10, 10, 10, 40, 160, 450]


def test_auto_batches_keep_to_a_share_of_the_fuel_limit(small_auto_batches: None) -> None:
    fuel = 20_000_000
    seen: list[wasibox.TransformProgress] = []
    records = orders(1500)
    with wasibox.Transform(TOTAL, limits=wasibox.Limits(fuel=fuel)) as t:
        assert t.map(records, progress=seen.append) == expected(records)
        sizes = batch_sizes(seen)
        assert all(p.split == 0 for p in seen)
        # Progress counts the batches settled, never the one already running ahead: each
        # batch's share is what the same records burn when run again on their own.
        reported = [p.fuel_used for p in seen]
        burnt = [after - before for before, after in zip([0, *reported], reported, strict=False)]
        starts = [0, *(p.done for p in seen)]
        for first, end, used in zip(starts, starts[1:], burnt, strict=False):
            before = t.fuel_used
            t.map(records[first:end], batch_size=end - first, progress=False)
            assert t.fuel_used - before == used
    # Sized from the fuel per record of the batch two before, fixed cost included: never
    # above the share, and held below fourfold growth by it (the last batch is what is left).
    assert all(used <= fuel // wasibox._transform.AUTO_FUEL_SHARE for used in burnt[2:])
    assert any(size < 4 * before for before, size in zip(sizes[1:-1], sizes[2:-1], strict=True))
    assert max(sizes) > 40


def test_a_fuel_limit_from_the_timeout_sizes_auto_batches_at_a_typical_rate() -> None:
    # FUEL_PER_SECOND sits above the fastest C loops, so that a timeout stops a run before its
    # fuel does; sizing batches by it would make them take several times the share of the
    # timeout that typical code needs. A derived limit counts as AUTO_FUEL_PER_SECOND does.
    from wasibox._transform import AUTO_FUEL_PER_SECOND, AUTO_FUEL_SHARE, _AutoSize
    derived = _AutoSize(wasibox.Limits(timeout_s=2))
    given = _AutoSize(wasibox.Limits(timeout_s=2, fuel=2 * AUTO_FUEL_PER_SECOND))
    for sizer in (derived, given):
        sizer.settled(10_000, 1_000, 10_000 * 10**6)  # a million fuel a record
    assert derived.size == given.size == 2 * AUTO_FUEL_PER_SECOND // (AUTO_FUEL_SHARE * 10**6)
    assert wasibox.Limits(timeout_s=2).fuel > 2 * AUTO_FUEL_PER_SECOND


def test_auto_batches_keep_to_a_share_of_the_memory_limit(small_auto_batches: None) -> None:
    memory = 64 * 2**20
    records = [{"id": i, "text": f"{i:04}" + "x" * 1996} for i in range(1500)]  # none repeat
    seen: list[wasibox.TransformProgress] = []
    with wasibox.Transform("def transform(r):\n    return len(r['text'])\n",
                           limits=wasibox.Limits(memory_bytes=memory)) as t:
        assert t.map(records, progress=seen.append) == [2000] * 1500
    sizes = batch_sizes(seen)
    starts = [0, *(p.done for p in seen)]
    sent = [len(encode_records(records[a:b])) for a, b in zip(starts, starts[1:], strict=False)]
    share = memory // wasibox._transform.AUTO_MEMORY_SHARE
    assert all(size <= share * 1.01 for size in sent)
    assert 40 < max(sizes) < 4 * 160  # grew, then stopped at the share (~520 records)


def test_auto_batches_after_a_split_are_halved_and_stop_growing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wasibox._transform, "FIRST_AUTO_BATCH", 8)
    seen: list[wasibox.TransformProgress] = []
    with wasibox.Transform(FLAKY, limits=wasibox.Limits(fuel=50_000_000),
                           on_error="collect") as t:
        out = t.map(range(80), progress=seen.append)
    assert [type(item) for item in out[3:6]] == [wasibox.FailedRecord, int,
                                                 wasibox.FailedRecord]
    # Record 5 runs out of fuel in the first batch, which is split; the next AUTO_LAG had
    # already been made at the first size. The rest are half the split batch, never growing.
    assert batch_sizes(seen) == [8] * 5 + [4] * 10


def test_spec_is_plain_data_and_a_transform_pickles() -> None:
    t = wasibox.Transform(TOTAL, limits=wasibox.Limits(fuel=10**8), seed=3, batch_size=5)
    data = t.spec.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert wasibox.TransformSpec.from_dict(data) == t.spec
    clone = pickle.loads(pickle.dumps(t))
    assert clone.spec == t.spec
    assert clone({"id": 1, "price": 2.0, "qty": 2}) == {"id": 1, "total": 4.0}


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(wasibox.UsageError, match="entry"):
        wasibox.Transform(TOTAL, entry="not a name")
    with pytest.raises(wasibox.UsageError, match="on_error"):
        wasibox.Transform(TOTAL, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="batch_size"):
        wasibox.Transform(TOTAL, batch_size=0)
    with pytest.raises(wasibox.UsageError, match="positive int or 'auto'"):
        wasibox.Transform(TOTAL, batch_size="big")  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="option"):
        wasibox.Transform(TOTAL, no_such_option=1)
    with wasibox.Transform(TOTAL) as t:
        with pytest.raises(wasibox.UsageError, match="record 1 is not plain data"):
            t.map([{"id": 1}, object()], progress=False)
    # A bad record in a later batch: the batches before it are still delivered first.
    with wasibox.Transform("def transform(r):\n    return r + 1\n", batch_size=2) as t:
        out = t.imap([1, 2, 3, object()], progress=False)
        assert [next(out), next(out)] == [2, 3]
        with pytest.raises(wasibox.UsageError, match="record 3 is not plain data"):
            next(out)


def test_host_functions_are_forwarded_and_rerun_on_split() -> None:
    seen: list[int] = []

    def price(item: int) -> float:
        seen.append(item)
        return item * 1.5

    code = textwrap.dedent("""\
        import host
        def transform(r):
            if r == 3:
                while True:
                    pass
            return host.price(r)
    """)
    with wasibox.Transform(code, functions={"price": price}, on_error="collect",
                           limits=wasibox.Limits(fuel=100_000_000)) as t:
        out = t.map(range(4), batch_size=4, progress=False)
    assert out[:3] == [0.0, 1.5, 3.0] and isinstance(out[3], wasibox.Failed)
    # The batch ran out of fuel, so it was split and its records re-ran: at least once each.
    assert sorted(set(seen)) == [0, 1, 2] and len(seen) > 3


#: Records 3 and 5 fail (5 by running out of fuel, so its batch is split and re-run), the
#: others may burn a little fuel each, and every output carries its record.
UNEVEN = textwrap.dedent("""\
    def transform(r):
        if r["n"] % 17 == 3:
            raise ValueError(f"bad record {r['n']}")
        if r["n"] % 29 == 5:
            while True:
                pass
        return {"n": r["n"], "name": r["name"].upper(), "sum": sum(range(r["n"] % 50))}
""")


@settings(max_examples=12, deadline=None)
@given(count=st.integers(0, 120), size=st.sampled_from(["auto", 1, 7, 40]),
       workers=st.integers(2, wasibox._transform.MAX_WORKERS))
def test_workers_change_neither_outputs_nor_fuel_nor_batches(count: int, size: object,
                                                             workers: int) -> None:
    records = [{"n": i, "name": f"customer-{i}"} for i in range(count)]
    runs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wasibox._transform, "FIRST_AUTO_BATCH", 4)
        for threads in (1, workers):
            seen: list[wasibox.TransformProgress] = []
            with wasibox.Transform(UNEVEN, limits=wasibox.Limits(fuel=30_000_000),
                                   on_error="collect", workers=threads) as t:
                out = t.map(records, batch_size=size, progress=seen.append)  # type: ignore[arg-type]
                runs.append(([item.to_dict() if isinstance(item, wasibox.FailedRecord)
                              else item for item in out],
                             batch_sizes(seen), [(p.fuel_used, p.split) for p in seen],
                             t.fuel_used, t.batches_run))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == count


@pytest.mark.parametrize("workers", [1, 3])
def test_the_first_failure_is_raised_after_the_outputs_before_it(workers: int) -> None:
    records = [{"n": i, "name": "x"} for i in range(60)]
    got: list[object] = []
    with wasibox.Transform(UNEVEN, limits=wasibox.Limits(fuel=30_000_000),
                           workers=workers) as t:
        with pytest.raises(wasibox.GuestError) as raised:
            got.extend(t.imap(records[6:], batch_size=5, start=6, progress=False))
    # Record 20 (17 + 3) is the first failure from record 6 on; record 34 (29 + 5) fails
    # later, in a batch that may already have run.
    assert raised.value.index == 20
    assert [item["n"] for item in got] == list(range(6, 20))  # type: ignore[index]


def test_workers_are_checked_and_kept_in_the_spec() -> None:
    for bad in (0, -1, True, 1.5, "2", wasibox._transform.MAX_WORKERS + 1):
        with pytest.raises(wasibox.UsageError, match="workers"):
            wasibox.Transform(TOTAL, workers=bad)  # type: ignore[arg-type]
    with wasibox.Transform(TOTAL) as t:
        with pytest.raises(wasibox.UsageError, match="workers"):
            t.map(orders(3), workers=0)
        assert t.spec.workers is None
    assert 1 <= wasibox._transform.default_workers() <= wasibox._transform.MAX_WORKERS
    t = wasibox.Transform(TOTAL, workers=2)
    clone = pickle.loads(pickle.dumps(t))
    assert clone.spec.workers == 2 and clone.spec == t.spec
    assert wasibox.TransformSpec.from_dict(t.spec.to_dict()).workers == 2


def test_str_outputs_cross_exactly_whatever_their_text() -> None:
    # Columns of strs cross as one text joined by NULs; a str holding a NUL, or a lone
    # surrogate (which UTF-8 cannot carry, and so comes back as U+FFFD, as a single run's
    # values do), sends its column by the other paths instead.
    texts = ["plain", "", "Zoë 🎉", "a\x00b", "\ud800", "x" * 500]
    code = "def transform(r):\n    return {'t': r['t'], 'n': r['n'], 'u': r['t'].upper()}\n"
    with wasibox.Transform(code) as t:
        for chosen in ([0, 1, 2, 5], [0, 3], [2, 4], [4]):
            records = [{"t": texts[i], "n": i} for i in chosen * 3]
            want = [{"t": clean_text(texts[i]), "n": i, "u": clean_text(texts[i].upper())}
                    for i in chosen * 3]
            got = t.map(records, batch_size=len(records), progress=False)
            assert got == want
            assert [list(map(type, row.values())) for row in got] == [[str, int, str]] * len(got)


def test_host_functions_and_writable_mounts_run_one_batch_at_a_time(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wasibox._transform, "default_workers", lambda: 3)
    calls: list[int] = []

    def seen(record: int) -> int:
        calls.append(record)
        return record

    code = "import host\ndef transform(r):\n    return host.seen(r)\n"
    cases: list[tuple[str, dict[str, object], int]] = [
        ("def transform(r):\n    return r\n", {}, 3),
        (code, {"functions": {"seen": seen}}, 1),
        ("def transform(r):\n    return r\n",
         {"mounts": [wasibox.Mount(tmp_path, "/out", writable=True)]}, 1),
        ("def transform(r):\n    return r\n",
         {"mounts": [wasibox.Mount(tmp_path, "/in")]}, 3),
    ]
    for source, options, workers in cases:
        pulled: list[int] = []

        def records(pulled: list[int] = pulled):  # type: ignore[no-untyped-def]
            for i in range(60):
                pulled.append(i)
                yield i

        with wasibox.Transform(source, **options) as t:  # type: ignore[arg-type]
            stream = t.imap(records(), batch_size=10, progress=False)
            assert next(stream) == 0
            assert len(pulled) == 10 * (1 + workers), options
            assert list(stream) == list(range(1, 60))
    assert calls == list(range(60))  # in order: one batch at a time
