"""``wasibox transform``: JSON Lines, CSV and msgpack in and out, errors, the summary line."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path

import msgpack
import pytest

from tests.conftest import PYTHON, child_env

pytestmark = pytest.mark.guest

CODE = """\
def transform(r):
    return {"id": int(r["id"]), "total": float(r["price"]) * int(r["qty"]), "note": r["note"]}
"""

RECORDS = [{"id": str(i), "price": f"{1.5 + i}", "qty": str(i % 3), "note": f"n{i},\"q\"\n"}
           for i in range(25)]
EXPECTED = [{"id": i, "total": (1.5 + i) * (i % 3), "note": f"n{i},\"q\"\n"} for i in range(25)]


def write(path: Path, records: list[dict[str, str]]) -> None:
    fmt = path.suffix
    if fmt == ".csv":
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    elif fmt == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_bytes(b"".join(msgpack.packb(r) for r in records))


def read(path: Path) -> list[dict[str, object]]:
    if path.suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"), newline="")))
        return [{"id": int(r["id"]), "total": float(r["total"]), "note": r["note"]} for r in rows]
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return list(msgpack.Unpacker(io.BytesIO(path.read_bytes()), raw=False))


def transform_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "wasibox", "transform", *args], capture_output=True,
                          text=True, env=child_env(), timeout=300)


@pytest.mark.parametrize("source, target", [
    ("csv", "jsonl"), ("jsonl", "msgpack"), ("msgpack", "csv"), ("csv", "csv"),
])
def test_round_trip_between_formats(tmp_path: Path, source: str, target: str) -> None:
    code = tmp_path / "t.py"
    code.write_text(CODE)
    src, dst = tmp_path / f"in.{source}", tmp_path / f"out.{target}"
    write(src, RECORDS)
    size = "auto" if source == target else "10"
    done = transform_cli(str(code), str(src), str(dst), "--batch-size", size)
    assert done.returncode == 0, done.stderr
    assert read(dst) == EXPECTED
    summary = done.stderr.strip().splitlines()[-1]
    assert "25 records" in summary and "records/s" in summary and "fuel" in summary


def test_failed_record_stops_or_is_skipped(tmp_path: Path) -> None:
    code = tmp_path / "t.py"
    code.write_text("def transform(r):\n    return 10 // r['n']\n")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"n": n}) + "\n" for n in (1, 2, 0, 5)))
    stopped = transform_cli(str(code), str(src), str(tmp_path / "a.jsonl"))
    assert stopped.returncode == 1
    assert "record 2" in stopped.stderr and "ZeroDivisionError" in stopped.stderr
    skipped = transform_cli(str(code), str(src), str(tmp_path / "b.jsonl"), "--on-error", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert read(tmp_path / "b.jsonl") == [10, 5, 2]  # type: ignore[comparison-overlap]
    assert "1 failed and skipped" in skipped.stderr


def test_bad_inputs_are_reported_with_status_2(tmp_path: Path) -> None:
    code = tmp_path / "t.py"
    code.write_text(CODE)
    unknown = transform_cli(str(code), str(tmp_path / "in.xml"), str(tmp_path / "out.jsonl"))
    assert unknown.returncode == 2 and "cannot tell the format" in unknown.stderr
    broken = tmp_path / "in.jsonl"
    broken.write_text('{"id": 1}\nnot json\n')
    bad = transform_cli(str(code), str(broken), str(tmp_path / "out.jsonl"))
    assert bad.returncode == 2 and "line 2" in bad.stderr
    missing = transform_cli(str(tmp_path / "nope.py"), str(broken), str(tmp_path / "o.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    for size in ("0", "many"):
        refused = transform_cli(str(code), str(broken), str(tmp_path / "o.jsonl"),
                                "--batch-size", size)
        assert refused.returncode == 2
        assert f"not a positive number of records or 'auto': '{size}'" in refused.stderr


def test_help_explains_formats() -> None:
    done = subprocess.run([PYTHON, "-m", "wasibox", "transform", "--help"], capture_output=True,
                          text=True, env=child_env(), timeout=60)
    assert done.returncode == 0
    for word in (".jsonl", ".csv", ".msgpack", "records/s", "--batch-size", "--on-error"):
        assert word in done.stdout


def test_a_failed_run_leaves_no_partial_output(tmp_path: Path) -> None:
    code = tmp_path / "t.py"
    code.write_text("def transform(r):\n    return 10 // r['n']\n")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"n": n}) + "\n" for n in (1, 2, 0, 5)))
    out = tmp_path / "out.jsonl"
    failed = transform_cli(str(code), str(src), str(out), "--batch-size", "1")
    assert failed.returncode == 1 and "record 2" in failed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "t.py"]
    out.write_text("earlier output\n")  # an existing OUTPUT survives a failed run whole
    again = transform_cli(str(code), str(src), str(out), "--batch-size", "1")
    assert again.returncode == 1 and out.read_text() == "earlier output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl", "t.py"]
    fine = transform_cli(str(code), str(src), str(out), "--on-error", "skip")
    assert fine.returncode == 0, fine.stderr
    assert read(out) == [10, 5, 2]  # type: ignore[comparison-overlap]
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_missing_entry_is_a_usage_error(tmp_path: Path, on_error: str) -> None:
    code = tmp_path / "t.py"
    code.write_text(CODE)
    src = tmp_path / "in.csv"
    write(src, RECORDS)
    out = tmp_path / "out.jsonl"
    done = transform_cli(str(code), str(src), str(out), "--entry", "nope", "--on-error", on_error)
    assert done.returncode == 2, done.stderr
    assert "defines no function named 'nope' (--entry); it defines transform" in done.stderr
    assert "record 0" not in done.stderr and not out.exists()
    # An entry bound where the host cannot see it statically is found by running the code.
    code.write_text(CODE.replace("def transform", "def _t") + "globals()['trans' + 'form'] = _t\n")
    dynamic = transform_cli(str(code), str(src), str(out), "--on-error", on_error)
    assert dynamic.returncode == 0, dynamic.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == EXPECTED
    missing = transform_cli(str(code), str(src), str(out), "--entry", "nope2")
    assert missing.returncode == 2 and "'nope2'" in missing.stderr and "_t" in missing.stderr


def test_transform_and_fuzz_help_describe_their_own_command() -> None:
    helps = {command: subprocess.run([PYTHON, "-m", "wasibox", command, "--help"],
                                     capture_output=True, text=True, env=child_env(),
                                     timeout=60).stdout
             for command in ("transform", "fuzz")}
    assert "fuzz" not in helps["transform"] and "partial output" in helps["transform"]
    for text in helps.values():
        assert "--entry ENTRY" in text and "(default: transform)" in text
