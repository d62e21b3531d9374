"""A session's journal replays in another process call by call; a session's snapshot
restores, in another process, the state its calls left."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import wasibox
from tests.conftest import PYTHON, child_env
from tests.test_journal import Origin
from wasibox import Journal, JournalError, ReplayMismatch, replay

pytestmark = pytest.mark.guest

CALLS = [
    "import host, random\nnotes = open('/data/notes.txt')\nfirst = notes.readline()\n"
    "print('first:', first.strip(), random.random())",
    "total = host.price('apple') * 2\nprint('total:', total)",
    "r = host.http.request('GET', URL)\nprint('http:', r.status, r.body.decode())",
    "print('rest:', notes.read().split(), first.strip(), total)",
]


@pytest.fixture()
def origin() -> Iterator[Origin]:
    server = Origin()
    yield server
    server.stop()


def sandbox(data: Path, origin: Origin, prices: dict[str, float]) -> wasibox.Sandbox:
    http = wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[
        f"127.0.0.1:{origin.server_address[1]}"])
    return wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")], http=http, seed=11,
                           functions={"price": lambda name: prices[name]})


def notes(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("alpha\nbeta gamma\n")
    return data


def test_a_session_journal_replays_in_another_process_call_by_call(
        tmp_path: Path, origin: Origin) -> None:
    data = notes(tmp_path)
    path = tmp_path / "session.journal"
    with sandbox(data, origin, {"apple": 2.5}) as sb, sb.session(journal=path) as session:
        results = [session.run(code.replace("URL", repr(origin.url))) for code in CALLS]
    assert all(result.ok for result in results), results
    assert results[3].stdout == "rest: ['beta', 'gamma'] alpha 5.0\n"
    assert "http: 200 answer #1" in results[2].stdout
    origin.stop()
    shutil.rmtree(data)

    done = subprocess.run([PYTHON, "-m", "wasibox", "replay", "--json", str(path)],
                          capture_output=True, text=True, env=child_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    calls = json.loads(done.stdout)["calls"]
    assert [call["result"]["stdout"] for call in calls] == [r.stdout for r in results]
    assert [call["result"]["fuel_used"] for call in calls] == [r.fuel_used for r in results]
    assert origin.requests == 1


def test_a_session_ended_by_a_limit_replays_to_the_same_end(tmp_path: Path) -> None:
    journal = Journal()
    with wasibox.Sandbox() as sb, sb.session(journal=journal) as session:
        assert session.run("x = 1").ok
        ended = session.run("while True: x += 1", limits={"fuel": 10**7})
        assert ended.limit_exceeded is wasibox.Limit.FUEL
        with pytest.raises(wasibox.SessionEnded):
            session.run("print(x)")
    assert journal.calls == 2  # the refused call never ran, so it is not recorded
    report = replay(journal)
    assert report.results[1].limit_exceeded is wasibox.Limit.FUEL
    assert report.results[1].fuel_used == ended.fuel_used


def test_a_tampered_session_journal_fails_at_the_call_that_differs(tmp_path: Path) -> None:
    journal = Journal()
    with wasibox.Sandbox() as sb, sb.session(journal=journal) as session:
        session.run("x = 20")
        session.run("x += 1")
        session.run("print(x * 2)")
    lines = journal.dumps().decode().splitlines()
    tampered = [line.replace('"stdout":"42\\n"', '"stdout":"41\\n"') for line in lines]
    assert tampered != lines
    with pytest.raises(ReplayMismatch) as caught:
        replay(Journal.loads("\n".join(tampered).encode()))
    assert caught.value.call == 2 and "-41" in caught.value.diff


RESTORE = """\
import json, sys
import wasibox
data, snapshot, url = sys.argv[1:]
prices = {"apple": 100.0}  # different now: a restore does not call host functions again
http = wasibox.HttpPolicy(allow=[], allow_loopback_endpoints=[url.split("/")[2]])
with wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")], http=http, seed=11,
                     functions={"price": lambda name: prices[name]}) as sb:
    with sb.session(restore=snapshot) as session:
        result = session.run(
            "print(first.strip(), total, notes.read().split(), host.price('apple'))")
        print(json.dumps({"stdout": result.stdout, "ok": result.ok}))
"""


def test_a_snapshot_restores_the_sessions_state_in_another_process(
        tmp_path: Path, origin: Origin) -> None:
    data = notes(tmp_path)
    with sandbox(data, origin, {"apple": 2.5}) as sb, \
            sb.session(journal=Journal()) as session:
        for code in CALLS[:3]:
            assert session.run(code.replace("URL", repr(origin.url))).ok
        snapshot = session.snapshot()
        after = session.run("print(first.strip(), total, notes.read().split(), "
                            "host.price('apple'))")
    path = tmp_path / "session.snapshot"
    path.write_bytes(snapshot)
    served = origin.requests
    done = subprocess.run([PYTHON, "-c", RESTORE, str(data), str(path), origin.url],
                          capture_output=True, text=True, env=child_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    restored = json.loads(done.stdout)
    assert restored["ok"], restored
    # The same names and the same open file, at the same position; the live host function
    # answers with today's price.
    assert after.stdout == "alpha 5.0 ['beta', 'gamma'] 2.5\n"
    assert restored["stdout"] == "alpha 5.0 ['beta', 'gamma'] 100.0\n"
    assert origin.requests == served  # the HTTP request was not made again


def test_a_restored_session_can_be_snapshotted_again(tmp_path: Path) -> None:
    with wasibox.Sandbox(seed=5) as sb:
        with sb.session(journal=Journal()) as session:
            session.run("import random\nxs = [random.random()]")
            first = session.snapshot()
        with sb.session(restore=first) as restored:
            restored.run("xs.append(random.random())")
            second = restored.snapshot()
        with sb.session(restore=second) as again:
            values = again.run("print(len(xs), xs[0] != xs[1])")
    assert values.stdout == "2 True\n"
    assert replay(Journal.loads(second)).ok


def test_restoring_into_another_setup_or_with_changed_files_is_refused(
        tmp_path: Path) -> None:
    data = notes(tmp_path)
    with wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")]) as sb:
        with sb.session(journal=Journal()) as session:
            session.run("f = open('/data/notes.txt')")
            snapshot = session.snapshot()
        (data / "notes.txt").unlink()
        with pytest.raises(ReplayMismatch, match="mounted files changed since the snapshot"):
            sb.session(restore=snapshot)
    with wasibox.Sandbox(seed=99, mounts=[wasibox.Mount(data, "/data")]) as other, \
            pytest.raises(wasibox.UsageError, match="differs in seed"):
        other.session(restore=snapshot)
    with wasibox.Sandbox() as sb:
        journal = Journal()
        sb.run("pass", journal=journal)
        with pytest.raises(JournalError, match="records runs, not a session"):
            sb.session(restore=journal)
        with sb.session() as plain, pytest.raises(wasibox.UsageError, match="journal="):
            plain.snapshot()
