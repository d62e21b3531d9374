"""C code in the guest sees ``c_access`` mounts (sqlite3 on a file), with the guarantees of the
Python view: confinement, quotas at publish, and publishing only when the run ends ok."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

import wasibox
from wasibox import Mount, UsageError

pytestmark = pytest.mark.guest

CREATE = """
import sqlite3
db = sqlite3.connect('/out/shop.db')
db.execute('create table items (name text, price real)')
db.executemany('insert into items values (?, ?)', [('apple', 0.5), ('pear', 0.75)])
db.commit()
print(db.execute('select count(*), sum(price) from items').fetchone())
db.close()
print(open('/out/notes.txt').read(), len(open('/out/shop.db', 'rb').read()) > 0)
"""


def _sandbox(directory: Path, **quotas: object) -> wasibox.Sandbox:
    return wasibox.Sandbox(backend="wasm", mounts=[
        Mount(directory, "/out", writable=True, c_access=True, **quotas)])  # type: ignore[arg-type]


def test_sqlite_creates_queries_and_publishes_a_database(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("kept")
    with _sandbox(tmp_path) as sandbox:
        created = sandbox.run(CREATE)
        assert created.ok, created.error
        assert created.stdout == "(2, 1.25)\nkept True\n"
        assert [record.path for record in created.files] == ["/out/shop.db"]
        # The host has the database, complete, and can query it itself.
        with sqlite3.connect(tmp_path / "shop.db") as db:
            assert db.execute("select name from items order by name").fetchall() == [
                ("apple",), ("pear",)]
        read = sandbox.run("import sqlite3\n"
                           "print(sqlite3.connect('/out/shop.db').execute("
                           "'select max(price) from items').fetchone())")
        assert read.ok and read.stdout == "(0.75,)\n"
        assert read.files == []  # nothing changed: the private copies are not republished
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_a_failed_run_never_touches_the_hosts_database(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "shop.db") as db:
        db.execute("create table items (name text)")
        db.execute("insert into items values ('apple')")
    before = (tmp_path / "shop.db").read_bytes()
    code = ("import sqlite3\ndb = sqlite3.connect('/out/shop.db')\n"
            "db.execute(\"delete from items\")\ndb.commit()\n"
            "assert db.execute('select count(*) from items').fetchone() == (0,)\n"
            "raise SystemExit(3)")
    with _sandbox(tmp_path) as sandbox:
        result = sandbox.run(code)
    assert result.exit_code == 3 and result.files == []
    # C code wrote a private copy in the staging, never the host's file in place.
    assert (tmp_path / "shop.db").read_bytes() == before


def test_the_quota_holds_for_what_c_code_writes(tmp_path: Path) -> None:
    code = ("import sqlite3\ndb = sqlite3.connect('/out/big.db')\n"
            "db.execute('create table t (b blob)')\n"
            "db.execute('insert into t values (zeroblob(300000))')\ndb.commit()\nprint('wrote')")
    with _sandbox(tmp_path, quota_bytes="128KiB") as sandbox:
        result = sandbox.run(code)
    assert not result.ok
    # Caught at publish, or (rarely, if a check falls between the commit and the print)
    # while the run goes on.
    assert result.stdout in ("wrote\n", "")
    assert result.error is not None and "over its quota" in result.error.message
    assert result.files == [] and not (tmp_path / "big.db").exists()


def test_c_code_writing_without_end_is_stopped_at_its_quota_not_its_timeout(
        tmp_path: Path) -> None:
    """C writes bypass the file layer's accounting, so the tree is measured while the run
    goes on: a writer that never stops is stopped near its quota, long before its timeout."""
    code = ("import sqlite3\ndb = sqlite3.connect('/out/big.db')\n"
            "db.execute('create table t (b blob)')\n"
            "while True:\n"
            "    db.execute('insert into t values (zeroblob(100000))')\n    db.commit()")
    with wasibox.Sandbox(backend="wasm", limits=wasibox.Limits(timeout_s=120), mounts=[
            Mount(tmp_path, "/out", writable=True, c_access=True,
                  quota_bytes="2MiB")]) as sandbox:
        result = sandbox.run(code)
        assert not result.ok and result.limit_exceeded is None, result
        assert result.error is not None and result.error.type == "OSError"
        assert "over its quota of 2097152" in result.error.message
        assert "nothing was published" in result.error.message
        assert result.files == []
        assert [entry.name for entry in tmp_path.iterdir()] == [".wasibox-staging"]
        # The sandbox and its mount work on.
        assert sandbox.run("import sqlite3\nsqlite3.connect('/out/ok.db').execute("
                           "'create table t (x)')").ok
    assert (tmp_path / "ok.db").is_file()


@pytest.mark.parametrize("target", [
    "/out/../escape.db", "/out/../../escape.db", "file:/out/../escape.db?mode=rwc",
    "/out/link/escape.db", "/escape.db", "/out/.wasibox-staging/escape.db",
])
def test_c_code_cannot_leave_the_mount(tmp_path: Path, target: str) -> None:
    mount = tmp_path / "mount"
    outside = tmp_path / "outside"
    mount.mkdir()
    outside.mkdir()
    (mount / "link").symlink_to(outside)
    code = ("import sqlite3, sys\ntry:\n"
            f"    db = sqlite3.connect({target!r}, uri={target.startswith('file:')})\n"
            "    db.execute('create table t (x)')\n    db.commit()\n"
            "except sqlite3.Error as exc:\n    print('refused', exc)\n")
    with _sandbox(mount) as sandbox:
        result = sandbox.run(code)
    assert result.ok, result.error
    assert result.stdout.startswith("refused"), result.stdout
    assert sorted(path.name for path in tmp_path.rglob("*.db")) == []
    assert list(outside.iterdir()) == []


def test_c_code_cannot_plant_the_staging_directorys_name(tmp_path: Path) -> None:
    code = ("import sqlite3\ndb = sqlite3.connect('/out/.wasibox-staging')\n"
            "db.execute('create table t (x)')\ndb.commit()")
    with _sandbox(tmp_path) as sandbox:
        result = sandbox.run(code)
    assert result.ok, result.error
    assert [(r.path, r.reason) for r in result.files_refused] == [
        ("/out/.wasibox-staging", "a name wasibox reserves")]
    assert (tmp_path / ".wasibox-staging").is_dir()


def test_a_scratch_mount_gives_c_code_a_private_directory() -> None:
    code = ("import sqlite3\ndb = sqlite3.connect('/scratch/s.db')\n"
            "db.execute('create table t (x)')\ndb.execute('insert into t values (1)')\n"
            "print(db.execute('select x from t').fetchone())")
    with wasibox.Sandbox(backend="wasm",
                         mounts=[Mount.scratch("/scratch", c_access=True)]) as sandbox:
        first = sandbox.run(code)
        second = sandbox.run("import os\nprint(os.listdir('/scratch'))")
    assert first.ok and first.stdout == "(1,)\n"
    assert second.stdout == "[]\n"


def test_c_access_needs_a_writable_mount(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="c_access needs a writable"):
        Mount(tmp_path, "/data", c_access=True)


def test_without_c_access_c_code_sees_no_mount(tmp_path: Path) -> None:
    with wasibox.Sandbox(backend="wasm",
                         mounts=[Mount(tmp_path, "/out", writable=True)]) as sandbox:
        result = sandbox.run("import sqlite3\ntry:\n    sqlite3.connect('/out/x.db')"
                             ".execute('create table t (x)')\n"
                             "except sqlite3.OperationalError as exc:\n    print(exc)")
    assert result.stdout == "unable to open database file\n"
    assert not (tmp_path / "x.db").exists()


def test_wasibox_run_gives_c_code_a_mount_written_rw_c_access(tmp_path: Path) -> None:
    from tests.test_cli import wasibox_cli

    out, script = tmp_path / "out", tmp_path / "orders.py"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    script.write_text(CREATE + "import os\nprint(sorted(os.listdir('/tmp')))\n")
    done = wasibox_cli("run", "--mount", f"{out}:/out:rw,c_access", "--scratch", "/tmp:c_access",
                       "--json", str(script))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"] == "(2, 1.25)\nkept True\n[]\n"
    assert [record["path"] for record in result["files"]] == ["/out/shop.db"]
    with sqlite3.connect(out / "shop.db") as db:
        assert db.execute("select name from items order by price").fetchall() == [
            ("apple",), ("pear",)]
    # The same run without c_access: C code sees no mount, and nothing is published.
    (out / "shop.db").unlink()
    plain = wasibox_cli("run", "--mount", f"{out}:/out:rw", "--json", str(script))
    assert json.loads(plain.stdout)["error"]["message"] == "unable to open database file"
    assert not (out / "shop.db").exists() and (out / "notes.txt").read_text() == "kept"


def test_wasibox_run_refuses_c_access_on_a_read_only_mount(tmp_path: Path) -> None:
    from tests.test_cli import wasibox_cli

    for text in (f"{tmp_path}:/out:c_access", f"{tmp_path}:/out:ro,c_access"):
        done = wasibox_cli("run", "--mount", text, "-c", "pass")
        assert done.returncode == 2
        assert "c_access needs a writable mount" in done.stderr
        assert f"write {tmp_path}:/out:rw,c_access" in done.stderr
    bad = wasibox_cli("run", "--scratch", "/tmp:rw", "-c", "pass")
    assert bad.returncode == 2 and "--scratch takes GUEST or GUEST:c_access" in bad.stderr
