"""Journals: a run recorded in one process replays in another, offline, with identical
outputs and fuel; a tampered, truncated, foreign or hostile journal is a typed error."""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from tests.conftest import PYTHON, child_env
from wasibox import GuestDigestMismatch, Journal, JournalError, ReplayMismatch, replay
from wasibox.backends.base import Outcome
from wasibox.backends.fake import FakeBackend

pytestmark = pytest.mark.guest

#: Reads a mounted file, calls a host function, fetches over HTTP, and returns a value.
PROGRAM = """\
import host, os, random
def main(url, scale):
    text = open('/data/notes.txt').read()
    print('file:', text.strip(), sorted(os.listdir('/data')))
    print('host:', host.price('apple', scale=scale))
    r = host.http.request('GET', url)
    print('http:', r.status, r.body.decode())
    print('seeded:', random.random(), os.urandom(4).hex())
    return {'words': len(text.split()), 'status': r.status, 'raw': text.encode()[:4]}
"""


class Origin(http.server.ThreadingHTTPServer):
    """A real HTTP server on loopback that counts the requests it answered."""

    def __init__(self) -> None:
        self.requests = 0
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                origin.requests += 1
                body = f"answer #{origin.requests} from the origin".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/item"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture()
def origin() -> Iterator[Origin]:
    server = Origin()
    yield server
    server.stop()


def replay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``wasibox replay`` in another process."""
    return subprocess.run([PYTHON, "-m", "wasibox", "replay", *args], capture_output=True,
                          text=True, env=child_env(), timeout=300, check=False)


def record(tmp_path: Path, origin: Origin, prices: dict[str, float],
           ) -> tuple[Path, list[wasibox.RunResult]]:
    """Record two runs (a call with a host function, HTTP and a file; a plain run) into a
    journal file, and return it with their results."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("three little words\n")
    http = wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[
        f"127.0.0.1:{origin.server_address[1]}"])
    journal = Journal()
    with wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")], http=http, seed=7,
                         functions={"price": lambda name, scale: prices[name] * scale}) as sb:
        first = sb.run(PROGRAM, entry="main", args=(origin.url,), kwargs={"scale": 3},
                       journal=journal)
        second = sb.run("import sys; print(sys.stdin.read().upper()); raise SystemExit(3)",
                        stdin="from stdin", journal=journal)
    path = tmp_path / "run.journal"
    journal.save(path)
    return path, [first, second]


def test_a_journal_replays_in_another_process_offline_with_identical_outputs_and_fuel(
        tmp_path: Path, origin: Origin) -> None:
    path, (first, second) = record(tmp_path, origin, {"apple": 1.5})
    assert first.ok and "http: 200 answer #1 from the origin" in first.stdout, first
    assert "host: 4.5" in first.stdout and first.value["raw"] == b"thre"
    assert second.exit_code == 3 and second.stdout == "FROM STDIN\n"
    # Offline: the server is gone and so is the mounted directory.
    origin.stop()
    shutil.rmtree(tmp_path / "data")
    served = origin.requests

    done = replay_cli("--json", str(path))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    replayed = [call["result"] for call in report["calls"]]
    for recorded, again in zip((first, second), replayed, strict=True):
        expected = recorded.to_dict()
        for name in ("stdout", "stderr", "exit_code", "error", "value", "fuel_used",
                     "limit_exceeded"):
            assert again[name] == expected[name], name
    assert origin.requests == served
    # The plain form says so call by call, with the fuel.
    done = replay_cli(str(path))
    assert done.returncode == 0, done.stderr
    assert f"call 0: matches (fuel_used={first.fuel_used:,}" in done.stderr
    assert f"call 1: matches (fuel_used={second.fuel_used:,}" in done.stderr


def test_a_journal_holds_no_host_path_and_no_host_environment(
        tmp_path: Path, origin: Origin, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_TEST_SECRET", "hunter2-host-only")
    path, _ = record(tmp_path, origin, {"apple": 1.0})
    with wasibox.Sandbox() as sb:
        journal = Journal()
        sb.run("import os; print(os.environ['GIVEN'])", env={"GIVEN": "passed-on-purpose"},
               journal=journal)
    text = path.read_text(encoding="utf-8") + journal.dumps().decode()
    assert str(tmp_path) not in text and os.getcwd() not in text
    assert "hunter2-host-only" not in text
    assert "passed-on-purpose" in text  # env given explicitly is what the guest saw
    header = json.loads(text.splitlines()[0])
    assert header["mounts"] == [{"path": "/data", "writable": False}]
    assert header["functions"] == ["price"] and header["http"] is True


def tamper(path: Path, kind: str, edit: Any) -> Path:
    """A copy of a journal with the first ``kind`` record changed by ``edit``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        record = json.loads(line)
        if kind in record:
            edit(record[kind])
            lines[index] = json.dumps(record, ensure_ascii=False)
            break
    else:
        raise AssertionError(f"no {kind} record")
    tampered = path.with_name("tampered.journal")
    tampered.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tampered


def test_a_tampered_output_makes_the_replay_fail_with_a_diff(
        tmp_path: Path, origin: Origin) -> None:
    path, (first, _) = record(tmp_path, origin, {"apple": 2.0})
    tampered = tamper(path, "outcome", lambda outcome: outcome.update(
        stdout=outcome["stdout"].replace("host: 6.0", "host: 6.5"),
        fuel_used=outcome["fuel_used"] + 1))
    done = replay_cli(str(tampered))
    assert done.returncode == 1
    assert "call 0: DIFFERS" in done.stderr and "call 1: matches" in done.stderr
    assert "-host: 6.5" in done.stderr and "+host: 6.0" in done.stderr
    assert f"fuel_used: recorded {first.fuel_used + 1}, replayed {first.fuel_used}" \
        in done.stderr
    with pytest.raises(ReplayMismatch) as caught:
        replay(tampered)
    assert caught.value.call == 0 and "fuel_used" in caught.value.diff
    report = replay(tampered, check=False)
    assert not report.ok and report.differences[1] == ()


def test_a_tampered_input_changes_what_the_replay_computes(
        tmp_path: Path, origin: Origin) -> None:
    """The file content the guest read comes from the journal, not from the disk."""
    path, _ = record(tmp_path, origin, {"apple": 2.0})
    text = path.read_text(encoding="utf-8").replace("three little words", "four tiny words!")
    changed = path.with_name("changed.journal")
    changed.write_text(text.replace('"stdout":"file: four tiny words!',
                                    '"stdout":"file: three little words'), encoding="utf-8")
    report = replay(changed, check=False)
    assert "file: four tiny words!" in report.results[0].stdout
    assert any(line.startswith("stdout differs") for line in report.differences[0])


def test_replaying_other_code_diverges_at_the_first_boundary_call(
        tmp_path: Path, origin: Origin) -> None:
    path, _ = record(tmp_path, origin, {"apple": 2.0})
    tampered = tamper(path, "call", lambda call: call.update(
        code=call["code"].replace("open('/data/notes.txt')", "open('/data/other.txt')")))
    report = replay(tampered, check=False)
    (first, *_), _ = report.differences
    assert first.startswith("the replay diverged: boundary call 1 was files.open")
    assert report.results[0].error is not None
    assert report.results[0].error.type == "ReplayDiverged"


def test_a_journal_from_another_guest_is_refused_naming_both_digests(
        tmp_path: Path, origin: Origin) -> None:
    path, _ = record(tmp_path, origin, {"apple": 2.0})
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    current = header["guest_digest"]
    header["guest_digest"] = "0" * 64
    lines[0] = json.dumps(header)
    other = tmp_path / "other.journal"
    other.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(GuestDigestMismatch) as caught:
        replay(other)
    assert caught.value.recorded == "0" * 64 and caught.value.current == current
    done = replay_cli(str(other))
    assert done.returncode == 2
    assert "0" * 64 in done.stderr and current in done.stderr


def test_a_journal_naming_its_package_set_by_versions_only_is_refused_clearly(
        tmp_path: Path, origin: Origin) -> None:
    """Journals from before each wheel's sha256 was recorded (tests/test_packages.py replays
    a package set's journal)."""
    path, _ = record(tmp_path, origin, {"apple": 2.0})
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    assert header["packages"] == []  # this sandbox had none
    header["packages"] = ["attrs==26.1.0"]
    lines[0] = json.dumps(header)
    other = tmp_path / "packages.journal"
    other.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(JournalError, match=r"attrs==26\.1\.0.*record the run again") as caught:
        replay(other)
    assert not isinstance(caught.value, GuestDigestMismatch)


def test_a_journal_past_its_bound_is_truncated_and_cannot_be_replayed(tmp_path: Path) -> None:
    journal = Journal(max_bytes=2000)
    with wasibox.Sandbox() as sb:
        result = sb.run("print('x' * 5000)", journal=journal)
    assert result.ok and len(result.stdout) == 5001  # the run itself is unchanged
    assert journal.truncated
    data = journal.dumps()
    assert len(data) <= 2000
    assert json.loads(data.splitlines()[-1]) == {"truncated": {"max_bytes": 2000}}
    path = tmp_path / "cut.journal"
    journal.save(path)
    with pytest.raises(JournalError, match="truncated.*larger Journal"):
        replay(path)
    assert replay_cli(str(path)).returncode == 2


def test_a_granted_real_clock_and_entropy_are_recorded_and_replayed(tmp_path: Path) -> None:
    code = ("import os, random, time\n"
            "start = time.time(); time.sleep(0.05)\n"
            "print(start, time.time() - start >= 0.05, time.monotonic(),"
            " os.urandom(8).hex(), random.random())\n")
    journal = Journal()
    with wasibox.Sandbox(clock="real", entropy="real") as sb:
        result = sb.run(code, journal=journal)
    assert result.ok and " True " in result.stdout
    path = tmp_path / "real.journal"
    journal.save(path)
    kinds = {json.loads(line)["io"][0] for line in path.read_text().splitlines()
             if line.startswith('{"io"')}
    assert {"clock.wall", "clock.monotonic", "clock.wait", "entropy.bytes"} <= kinds
    done = replay_cli("--json", str(path))
    assert done.returncode == 0, done.stderr
    (call,) = json.loads(done.stdout)["calls"]
    assert call["result"]["stdout"] == result.stdout
    assert call["result"]["fuel_used"] == result.fuel_used


def test_writes_to_a_writable_mount_are_answered_from_the_journal(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    journal = Journal()
    with wasibox.Sandbox(mounts=[wasibox.Mount(out, "/out", writable=True)]) as sb:
        result = sb.run("open('/out/a.txt', 'w').write('written'); "
                        "print(open('/out/a.txt').read())", journal=journal)
    assert result.ok and (out / "a.txt").read_text() == "written"
    (out / "a.txt").unlink()
    report = replay(journal)
    assert report.ok and report.results[0].stdout == "written\n"
    assert not (out / "a.txt").exists()  # the replay touched no host file


def test_journal_misuse_is_a_usage_error(tmp_path: Path) -> None:
    journal = Journal()
    with wasibox.Sandbox(seed=1) as sb:
        sb.run("pass", journal=journal)
    with wasibox.Sandbox(seed=2) as sb, pytest.raises(wasibox.UsageError, match="another"):
        sb.run("pass", journal=journal)
    fake = FakeBackend(lambda job, control: Outcome())
    with wasibox.Sandbox(backend=fake) as sb, pytest.raises(wasibox.UsageError,
                                                            match="does not record"):
        sb.run("pass", journal=Journal())
    with wasibox.Sandbox(backend=fake) as sb, pytest.raises(wasibox.UsageError,
                                                            match="does not record"):
        sb.session(journal=Journal())
    with wasibox.Sandbox() as sb, pytest.raises(wasibox.UsageError, match="journal must"):
        sb.run("pass", journal=42)  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="max_bytes"):
        Journal(max_bytes=0)


def test_a_journal_path_is_written_when_the_run_ends(tmp_path: Path) -> None:
    path = tmp_path / "direct.journal"
    with wasibox.Sandbox() as sb:
        result = sb.run("print(6 * 7)", journal=path)
    assert replay(path).results[0].stdout == result.stdout == "42\n"


def test_a_journal_larger_than_max_bytes_is_refused_before_decoding(tmp_path: Path) -> None:
    path = tmp_path / "big.journal"
    path.write_bytes(b"[" * 10_000)
    with pytest.raises(JournalError, match="larger than 100 bytes"):
        Journal.load(path, max_bytes=100)
    done = replay_cli("--max-bytes", "100", str(path))
    assert done.returncode == 2 and "larger than 100 bytes" in done.stderr


# -- hostile journals --------------------------------------------------------------------------

@functools.cache
def valid_journal() -> bytes:
    journal = Journal()
    with wasibox.Sandbox(functions={"f": lambda: "host"}) as sb:
        sb.run("import host\ndef main(x):\n    return [x, host.f()]", entry="main",
               args=(b"\x00\xff",), journal=journal)
    return journal.dumps()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_hostile_journal_file_is_a_typed_error_never_a_crash(draw: st.DataObject) -> None:
    valid = valid_journal()
    size = len(valid)
    data = draw.draw(st.one_of(
        st.binary(max_size=2000),
        st.builds(lambda cut, noise: valid[:cut] + noise + valid[cut:],
                  st.integers(0, size), st.binary(max_size=40)),
        st.builds(lambda start, end: valid[:start] + valid[end:],
                  st.integers(0, size), st.integers(0, size)),
        st.builds(lambda depth: b'{"wasibox_journal":' + b"[" * depth,
                  st.integers(1, 200_000)),
    ))
    try:
        journal = Journal.loads(data, max_bytes=1 << 20)
    except JournalError:
        return
    assert journal.header is not None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_replaying_a_mutated_journal_reports_or_refuses_it(data: st.DataObject) -> None:
    lines = valid_journal().decode().splitlines()
    index = data.draw(st.integers(1, len(lines) - 1))
    record = json.loads(lines[index])
    key = next(iter(record))
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5),
                                                                     inner, max_size=4),
        max_leaves=10)
    if isinstance(record[key], dict) and record[key]:
        field = data.draw(st.sampled_from(sorted(record[key])))
        record[key][field] = data.draw(json_values)
    elif isinstance(record[key], list):
        record[key][data.draw(st.integers(0, len(record[key]) - 1))] = data.draw(json_values)
    lines[index] = json.dumps(record)
    try:
        report = replay(Journal.loads("\n".join(lines).encode()), check=False)
    except (JournalError, wasibox.UsageError):
        return
    assert len(report.results) == 1


def test_fuel_does_not_depend_on_whether_the_callers_strings_are_interned() -> None:
    """A replay reads its entry name and code from JSON (not interned); the recording may
    have had them as literals (interned). The fuel must not tell the two apart."""
    literal = "main"
    built = "".join(["ma", "in"])
    assert literal == built and literal is not built
    code = "def main(x):\n    return x"
    with wasibox.Sandbox() as sb:
        fuels = {sb.run(code, entry=name, args=(name,), argv=[name], env={name: name},
                        filename=f"/{name}").fuel_used for name in (literal, built)}
    assert len(fuels) == 1


DOC = Path(__file__).resolve().parent.parent / "docs" / "journal.md"


@pytest.mark.parametrize("index", range(3))
def test_the_docs_examples_run(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 3
    exec(compile(blocks[index], f"docs/journal.md example {index + 1}", "exec"), {})
    assert capsys.readouterr().out == ["10.0\n\n", "ValueError\n", "1\n\n"][index]


@pytest.mark.parametrize("bad", [{"not": "a value"}, ["ok", 2**70], ["ok", "text"], None,
                                 ["maybe", 1], ["err", "no-such-code"]])
def test_an_answer_of_the_wrong_shape_is_refused_before_it_reaches_the_engine(
        tmp_path: Path, bad: Any) -> None:
    """A value wasmtime could not hand the guest is refused by the replay itself, so no
    engine error escapes (wasmtime-py would park it in a process-global)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a")
    journal = Journal()
    with wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")]) as sb:
        sb.run("print(open('/data/a.txt').read())", journal=journal)
    lines = journal.dumps().decode().splitlines()
    opened = next(index for index, line in enumerate(lines) if '"files.open"' in line)
    event = json.loads(lines[opened])
    event["io"][3] = bad
    lines[opened] = json.dumps(event)
    report = replay(Journal.loads("\n".join(lines).encode()), check=False)
    (result,) = report.results
    assert result.error is not None and result.error.type == "ReplayDiverged"
    assert "wrong shape" in result.error.message
    assert wasibox.run("print(1)").stdout == "1\n"  # nothing was left for the next run


def test_wasibox_run_records_a_journal_that_wasibox_replay_checks(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("line one\n")
    path = tmp_path / "cli.jsonl"
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--journal", str(path), "--real-entropy",
         "--mount", f"{tmp_path}:/in", "--env", "MODE=check", "-c",
         "import os; print(open('/in/in.txt').read().strip(), os.environ['MODE'], "
         "len(os.urandom(3)))"],
        capture_output=True, text=True, env=child_env(), timeout=300, check=False)
    assert done.returncode == 0 and done.stdout == "line one check 3\n", done.stderr
    assert str(tmp_path) not in path.read_text()
    replayed = replay_cli("--show-output", str(path))
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout == done.stdout and "call 0: matches" in replayed.stderr

    cut = tmp_path / "cut.jsonl"
    done = subprocess.run(
        [PYTHON, "-m", "wasibox", "run", "--journal", str(cut), "--journal-bytes", "600",
         "-c", "print('x' * 1000)"],
        capture_output=True, text=True, env=child_env(), timeout=300, check=False)
    assert done.returncode == 0 and "truncated: it cannot be replayed" in done.stderr
    assert replay_cli(str(cut)).returncode == 2


def test_async_and_started_runs_record_too(tmp_path: Path) -> None:
    async def main() -> wasibox.RunResult:
        with wasibox.Sandbox(max_concurrency=2) as sb:
            handle = sb.start("print('started')", journal=tmp_path / "started.jsonl")
            awaited = await sb.arun("print('awaited')", journal=tmp_path / "awaited.jsonl")
            assert handle.result().stdout == "started\n"
            return awaited

    awaited = asyncio.run(main())
    assert replay(tmp_path / "awaited.jsonl").results[0].stdout == awaited.stdout
    assert replay(tmp_path / "started.jsonl").results[0].stdout == "started\n"


CALLED = """\
import host, random
def score(word, *, weight):
    print('scoring', word)
    if word == 'boom':
        raise ValueError(f'cannot score {word!r}')
    return {'word': word, 'score': host.rate() * weight * len(word), 'noise': random.random()}
"""


def test_call_records_a_journal_that_replays_in_another_process(tmp_path: Path) -> None:
    """``Sandbox.call(..., journal=)`` records the call whether it returns or raises; the
    replay, in a process of its own, gives the same value, stdout and fuel."""
    script = (
        "import json, sys, wasibox\n"
        "journal = wasibox.Journal()\n"
        "with wasibox.Sandbox(seed=5, functions={'rate': lambda: 1.5}) as sb:\n"
        "    value = sb.call(sys.argv[1], 'score', 'abc', weight=2, journal=journal)\n"
        "    try:\n"
        "        sb.call(sys.argv[1], 'score', 'boom', weight=1, journal=journal)\n"
        "    except wasibox.GuestError as exc:\n"
        "        failed = exc.result.to_dict()\n"
        "journal.save(sys.argv[2])\n"
        "print(json.dumps([value, failed]))\n")
    path = tmp_path / "call.jsonl"
    done = subprocess.run([PYTHON, "-c", script, CALLED, str(path)], env=child_env(),
                          capture_output=True, text=True, timeout=300, check=True)
    value, failed = json.loads(done.stdout)
    assert value["word"] == "abc" and value["score"] == 9.0
    assert failed["error"]["type"] == "ValueError"
    replayed = replay_cli("--json", str(path))
    assert replayed.returncode == 0, replayed.stderr
    first, second = (call["result"] for call in json.loads(replayed.stdout)["calls"])
    assert first["value"] == value and first["stdout"] == "scoring abc\n"
    assert second["error"] == failed["error"] and second["fuel_used"] == failed["fuel_used"]


def test_acall_records_a_journal_too(tmp_path: Path) -> None:
    async def main() -> object:
        with wasibox.Sandbox(functions={"rate": lambda: 2.0}) as sb:
            return await sb.acall(CALLED, "score", "xy", weight=3,
                                  journal=tmp_path / "acall.jsonl")

    value = asyncio.run(main())
    report = replay(tmp_path / "acall.jsonl")
    assert report.ok and report.results[0].value == value
    assert isinstance(value, dict) and value["score"] == 12.0
