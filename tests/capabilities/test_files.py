"""The files capability: mounts, quotas, staging and publishing, and every hostile input.

After each hostile case the host must be unaffected: the next benign run succeeds and the
host's open file descriptors are back at their baseline.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

import wasibox
from tests.conftest import PYTHON, child_env, open_fds
from wasibox import Limit
from wasibox.capabilities.files.mount import STAGING_DIR
from wasibox.capabilities.files.session import FileSession

pytestmark = pytest.mark.guest

SECRET = b"host secret\n"


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    """A read-only data dir, a writable out dir, and a host dir outside every mount."""
    data, out, outside = tmp_path / "data", tmp_path / "out", tmp_path / "outside"
    for directory in (data, out, outside, data / "sub" / "deeper"):
        directory.mkdir(parents=True, exist_ok=True)
    (data / "in.csv").write_text("a,b\n1,2\n3,4\n")
    (data / "sub" / "deeper" / "note.txt").write_text("deep\n")
    (outside / "secret.txt").write_bytes(SECRET)
    return {"data": data, "out": out, "outside": outside, "root": tmp_path}


def sandbox(tree: dict[str, Path], limits: wasibox.Limits | None = None,
            **out_options: Any) -> wasibox.Sandbox:
    return wasibox.Sandbox(limits, mounts=[
        wasibox.Mount(tree["data"], "/data"),
        wasibox.Mount(tree["out"], "/out", writable=True, **out_options)])


#: What every ``call`` program starts with: errno's names (guest errors are compared by name:
#: the guest's errno numbers are WASI's, not the host's), and ``attempt(action)``, the name of
#: the error ``action()`` raised, or "ok".
GUEST_PRELUDE = """\
from errno import errorcode
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return errorcode[exc.errno]
    except NotImplementedError:
        return "NotImplementedError"
"""


def call(sb: wasibox.Sandbox, code: str) -> Any:
    """Run ``code`` defining ``main()`` (after ``GUEST_PRELUDE``) and return its value,
    failing on any guest error."""
    r = sb.run(GUEST_PRELUDE + textwrap.dedent(code), entry="main")
    assert r.ok, (r.error, r.stderr, r.limit_exceeded)
    return r.value


def assert_healthy(sb: wasibox.Sandbox, tree: dict[str, Path], fds_before: int) -> None:
    value = call(sb, """
        def main():
            with open("/data/in.csv") as f:
                return f.read()
    """)
    assert value == "a,b\n1,2\n3,4\n"
    assert open_fds() <= fds_before
    assert staging_runs(tree["out"]) == []


def staging_runs(out: Path) -> list[str]:
    staging = out / STAGING_DIR
    return sorted(p.name for p in staging.iterdir() if p.name.startswith("run-")) \
        if staging.exists() else []


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a host tree: kind, mode, inode, size, mtime, content."""
    result: dict[str, tuple[Any, ...]] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != STAGING_DIR]
        for name in dirs + files:
            path = Path(directory) / name
            st = path.lstat()
            digest = (hashlib.sha256(path.read_bytes()).hexdigest()
                      if stat.S_ISREG(st.st_mode) else None)
            result[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode,
                                                   st.st_ino, st.st_size, st.st_mtime_ns,
                                                   st.st_nlink, digest)
    return result


@pytest.fixture()
def fds(tree: dict[str, Path]) -> int:
    with sandbox(tree) as sb:  # warm the runtime so its own descriptors are counted
        sb.run("pass")
    return open_fds()


# -- the ordinary case ---------------------------------------------------------------------------

def test_read_a_mount_and_publish_an_artifact(tree: dict[str, Path], fds: int) -> None:
    with sandbox(tree) as sb:
        r = sb.run(textwrap.dedent("""
            import csv, os, pathlib, shutil
            with open("/data/in.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            with open("/out/report.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["total"])
                writer.writerow([sum(int(row["b"]) for row in rows)])
            pathlib.Path("/out/logs").mkdir()
            pathlib.Path("/out/logs/run.txt").write_text("done\\n")
            shutil.copy("/data/sub/deeper/note.txt", "/out/note.txt")
            print(sorted(os.listdir("/")), sorted(os.listdir("/out")))
            print([(d, sorted(f)) for d, _, f in os.walk("/data")])
        """))
        assert r.ok, r.error
        assert r.stdout.splitlines() == [
            "['data', 'out'] ['logs', 'note.txt', 'report.csv']",
            "[('/data', ['in.csv']), ('/data/sub', []), ('/data/sub/deeper', ['note.txt'])]"]
        report = (tree["out"] / "report.csv").read_bytes()
        assert report == b"total\r\n6\r\n"
        # What stays in the user's directory explains itself.
        staging = tree["out"] / STAGING_DIR
        assert sorted(os.listdir(staging)) == ["README.txt", "publish.lock", "setup.lock"]
        assert "belongs to wasibox" in (staging / "README.txt").read_text()
        records = {f.path: f for f in r.files}
        assert set(records) == {"/out/report.csv", "/out/logs/run.txt", "/out/note.txt"}
        assert records["/out/report.csv"] == wasibox.FileRecord(
            path="/out/report.csv", size=len(report), sha256=hashlib.sha256(report).hexdigest())
        assert r.files_refused == []
        assert (tree["out"] / "logs" / "run.txt").read_text() == "done\n"
        assert_healthy(sb, tree, fds)


def test_pathlib_glob_stat_and_relative_paths(tree: dict[str, Path]) -> None:
    with sandbox(tree) as sb:
        value = call(sb, """
            import os, pathlib
            def main():
                os.chdir("/data/sub")
                here = os.getcwd()
                names = sorted(str(p) for p in pathlib.Path("/data").rglob("*.txt"))
                st = os.stat("deeper/note.txt")
                with open("../in.csv", "rb") as f:
                    f.seek(2)
                    tail = f.read(3)
                return [here, names, st.st_size, stat_kind(st), tail,
                        os.path.isdir("/data/sub"), os.path.exists("/nope"),
                        os.access("/data/in.csv", os.W_OK), os.access("/out", os.W_OK)]
            def stat_kind(st):
                import stat
                return stat.S_ISREG(st.st_mode)
        """)
        assert value == ["/data/sub", ["/data/sub/deeper/note.txt"], 5, True, b"b\n1",
                         True, False, False, True]


def test_no_mounts_means_no_files() -> None:
    with wasibox.Sandbox() as sb:
        value = call(sb, """
            import os
            def main():
                out = []
                for attempt in (lambda: open("/etc/passwd"), lambda: os.listdir("/"),
                                lambda: open("x.txt", "w"), lambda: os.stat("/")):
                    try:
                        attempt()
                        out.append("reached")
                    except OSError as exc:
                        out.append(type(exc).__name__)
                return out
        """)
        assert value == ["FileNotFoundError"] * 4


# -- confinement -----------------------------------------------------------------------------

TRAVERSALS = [
    "/etc/passwd",
    "/data/../etc/passwd",
    *("/data/" + "../" * depth + "outside/secret.txt" for depth in (1, 2, 3, 5, 12)),
    "/data/sub/deeper/../../../outside/secret.txt",
    "//data/..//..//outside/secret.txt",
    "/data/./sub/./../../outside/secret.txt",
    "../../../../outside/secret.txt",
    "/data/" + STAGING_DIR,
    "/out/" + STAGING_DIR,
    "/out/" + STAGING_DIR + "/publish.lock",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_paths_outside_the_mounts_do_not_exist(tree: dict[str, Path], fds: int,
                                               path: str) -> None:
    with sandbox(tree) as sb:
        value = call(sb, f"""
            import os
            def main():
                os.chdir("/data/sub/deeper")
                result = []
                for attempt in (lambda: open({path!r}, "rb").read(),
                                lambda: os.stat({path!r}),
                                lambda: os.listdir({path!r}),
                                lambda: open({path!r}, "w")):
                    try:
                        attempt()
                        result.append("reached")
                    except OSError as exc:
                        result.append(errorcode[exc.errno])
                return result
        """)
        assert "reached" not in value
        assert value[0] == "ENOENT", value
        assert (tree["outside"] / "secret.txt").read_bytes() == SECRET
        assert_healthy(sb, tree, fds)


@pytest.fixture()
def planted_links(tree: dict[str, Path]) -> dict[str, Path]:
    data, outside = tree["data"], tree["outside"]
    os.symlink(outside / "secret.txt", data / "abs_link")
    os.symlink("../outside/secret.txt", data / "rel_link")
    os.symlink("sub/../../outside/secret.txt", data / "sub" / "deep_rel_link")
    os.symlink("loop", data / "loop")
    os.symlink("loop_b", data / "loop_a")
    os.symlink("loop_a", data / "loop_b")
    os.symlink(outside, data / "dir_link")
    os.symlink("in.csv", data / "inside_link")
    os.symlink(outside, tree["out"] / "out_dir_link")
    return tree


LINK_PATHS = ["/data/abs_link", "/data/rel_link", "/data/sub/deep_rel_link", "/data/loop",
              "/data/loop_a", "/data/dir_link/secret.txt", "/data/dir_link/",
              "/data/dir_link/../outside/secret.txt", "/out/out_dir_link/secret.txt"]


@pytest.mark.parametrize("path", LINK_PATHS)
def test_planted_symlinks_never_lead_out(planted_links: dict[str, Path], fds: int,
                                         path: str) -> None:
    # A link is followed in the guest's namespace: the host's absolute path, or a relative
    # one climbing above the mount, names nothing the guest was granted.
    tree = planted_links
    with sandbox(tree) as sb:
        value = call(sb, f"""
            import os
            def main():
                result = []
                for attempt in (lambda: open({path!r}, "rb").read(),
                                lambda: os.stat({path!r}),
                                lambda: os.listdir({path!r}),
                                lambda: open({path!r}, "ab").write(b"x")):
                    try:
                        attempt()
                        result.append("reached")
                    except OSError as exc:
                        result.append(errorcode[exc.errno])
                return result
        """)
        assert "reached" not in value, value
        assert set(value) <= {"ELOOP", "ENOENT", "ENOTDIR", "EROFS"}
        assert (tree["outside"] / "secret.txt").read_bytes() == SECRET
        assert sorted(os.listdir(tree["outside"])) == ["secret.txt"]
        assert_healthy(sb, tree, fds)


def test_planted_symlinks_are_followed_inside_the_mount(
        planted_links: dict[str, Path]) -> None:
    with sandbox(planted_links) as sb:
        value = call(sb, """
            import os
            def main():
                entries = {e.name: (e.is_symlink(), e.is_file(), e.is_dir())
                           for e in os.scandir("/data") if not e.name.startswith("loop")}
                return [entries["abs_link"], entries["dir_link"], entries["inside_link"],
                        os.path.islink("/data/loop"), os.path.exists("/data/rel_link"),
                        os.readlink("/data/rel_link"), open("/data/inside_link").read()]
        """)
        assert value == [[True, False, False], [True, False, False], [True, True, False],
                         True, False, "../outside/secret.txt",
                         (planted_links["data"] / "in.csv").read_text()]


@pytest.mark.parametrize("path, expected", [
    ("/data/in.csv/", "ENOTDIR"),
    ("/data/in.csv/.", "ENOTDIR"),
    ("/data/dir_link/", "ENOENT"),  # the host's path, which the guest's namespace lacks
    ("/data/abs_link/", "ENOENT"),
    ("/data/inside_link/", "ENOTDIR"),
])
def test_trailing_slash_tricks(planted_links: dict[str, Path], fds: int, path: str,
                               expected: int) -> None:
    tree = planted_links
    with sandbox(tree) as sb:
        value = call(sb, f"""
            import os
            def main():
                out = []
                for attempt in (lambda: os.stat({path!r}), lambda: open({path!r}, "rb")):
                    try:
                        attempt()
                        out.append("reached")
                    except OSError as exc:
                        out.append(errorcode[exc.errno])
                try:
                    open("/out/new.txt/", "w")
                    out.append("reached")
                except OSError as exc:
                    out.append(errorcode[exc.errno])
                return out
        """)
        assert value[:2] == [expected, expected]
        assert value[2] in ("EISDIR", "ENOENT")
        assert not (tree["out"] / "new.txt").exists()
        assert_healthy(sb, tree, fds)


def test_a_planted_fifo_cannot_hang_the_host(tree: dict[str, Path], fds: int) -> None:
    os.mkfifo(tree["data"] / "pipe")
    with sandbox(tree) as sb:
        value = call(sb, """
            import os
            def main():
                try:
                    open("/data/pipe", "rb").read()
                except OSError as exc:
                    return errorcode[exc.errno]
        """)
        assert value == "ENXIO"
        assert_healthy(sb, tree, fds)


# -- read-only mounts ------------------------------------------------------------------------

MUTATIONS = {
    "write": "open('/data/in.csv', 'w')",
    "append": "open('/data/in.csv', 'a')",
    "update": "open('/data/in.csv', 'r+')",
    "create": "open('/data/new.txt', 'x')",
    "o_trunc": "os.open('/data/in.csv', os.O_RDONLY | os.O_TRUNC)",
    "o_creat": "os.open('/data/new.txt', os.O_RDONLY | os.O_CREAT)",
    "truncate": "os.truncate('/data/in.csv', 0)",
    "remove": "os.remove('/data/in.csv')",
    "rmdir": "os.rmdir('/data/sub/deeper')",
    "rmtree": "shutil.rmtree('/data/sub')",
    "rename_within": "os.rename('/data/in.csv', '/data/moved.csv')",
    "rename_out": "os.rename('/data/in.csv', '/out/in.csv')",
    "rename_in": "open('/out/x', 'w').close(); os.replace('/out/x', '/data/in.csv')",
    "move_out": "shutil.move('/data/sub', '/out/sub')",
    "chmod": "os.chmod('/data/in.csv', 0o777)",
    "chmod_dir": "os.chmod('/data/sub', 0o777)",
    "utime": "os.utime('/data/in.csv', (0, 0))",
    "utime_now": "os.utime('/data/in.csv')",
    "mkdir": "os.mkdir('/data/newdir')",
    "makedirs": "os.makedirs('/data/sub/a/b')",
    "link_into_writable": "os.link('/data/in.csv', '/out/in.csv')",
    "link_within": "os.link('/data/in.csv', '/data/again.csv')",
    "symlink_in_ro": "os.symlink('in.csv', '/data/link')",
    "touch": "pathlib.Path('/data/in.csv').touch()",
    "write_text": "pathlib.Path('/data/in.csv').write_text('x')",
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_read_only_mount_refuses_every_mutation(tree: dict[str, Path], fds: int,
                                                name: str) -> None:
    before = snapshot(tree["data"])
    with sandbox(tree) as sb:
        value = call(sb, f"""
            import os, pathlib, shutil
            def main():
                try:
                    {MUTATIONS[name]}
                except OSError as exc:
                    return errorcode[exc.errno]
                return "mutated"
        """)
        assert value in ("EROFS", "EPERM", "EXDEV"), value
        assert snapshot(tree["data"]) == before
        assert not (tree["out"] / "in.csv").exists() and not (tree["out"] / "link").exists()
        assert_healthy(sb, tree, fds)


# -- quotas and descriptors ----------------------------------------------------------------------

def test_byte_quota_gives_enospc(tree: dict[str, Path], fds: int) -> None:
    with sandbox(tree, quota_bytes=10_000) as sb:
        value = call(sb, """
            import os
            def main():
                with open("/out/a.bin", "wb") as f:
                    f.write(b"x" * 6_000)
                try:
                    with open("/out/b.bin", "wb") as f:
                        f.write(b"y" * 6_000)
                except OSError as exc:
                    os.remove("/out/b.bin")
                    first = errorcode[exc.errno]
                try:
                    os.truncate("/out/a.bin", 20_000)
                except OSError as exc:
                    return [first, errorcode[exc.errno], os.path.getsize("/out/a.bin")]
        """)
        assert value == ["ENOSPC", "ENOSPC", 6_000]
        assert (tree["out"] / "a.bin").stat().st_size == 6_000
        assert not (tree["out"] / "b.bin").exists()
        assert_healthy(sb, tree, fds)


def test_byte_quota_counts_what_the_mount_already_holds(tree: dict[str, Path]) -> None:
    (tree["out"] / "old.bin").write_bytes(b"o" * 900)
    with sandbox(tree, quota_bytes=1_000) as sb:
        value = call(sb, """
            import os
            def main():
                fd = os.open("/out/new.bin", os.O_WRONLY | os.O_CREAT)
                written = os.write(fd, b"n" * 500)   # only 100 bytes fit
                try:
                    os.write(fd, b"n")
                except OSError as exc:
                    return [written, errorcode[exc.errno]]
        """)
        assert value == [100, "ENOSPC"]


def test_file_quota_gives_edquot(tree: dict[str, Path], fds: int) -> None:
    with sandbox(tree, quota_files=3) as sb:
        value = call(sb, """
            import os
            def main():
                os.mkdir("/out/d")
                open("/out/d/1", "w").close()
                open("/out/2", "w").close()
                result = []
                for attempt in (lambda: open("/out/3", "w"), lambda: os.mkdir("/out/e")):
                    try:
                        attempt()
                    except OSError as exc:
                        result.append(errorcode[exc.errno])
                os.remove("/out/2")
                open("/out/4", "w").close()   # room again after a delete
                return result
        """)
        assert value == ["EDQUOT", "EDQUOT"]
        assert sorted(p.name for p in tree["out"].iterdir() if p.name != STAGING_DIR) == \
            ["4", "d"]
        assert_healthy(sb, tree, fds)


def test_open_file_cap_gives_emfile_without_starving_other_runs(tree: dict[str, Path],
                                                                fds: int) -> None:
    hog = """
        import time
        def main():
            held = []
            try:
                while True:
                    held.append(open("/data/in.csv"))
            except OSError as exc:
                code = errorcode[exc.errno]
            time.sleep(0.5)   # hold them while the other run works
            return [code, len(held)]
    """
    other = """
        def main():
            files = [open("/data/in.csv") for _ in range(6)]
            return sum(len(f.read()) for f in files)
    """
    limits = wasibox.Limits(open_files=8, timeout_s=20)
    with wasibox.Sandbox(limits, clock="real", mounts=[
            wasibox.Mount(tree["data"], "/data"),
            wasibox.Mount(tree["out"], "/out", writable=True)]) as sb:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            hogging = pool.submit(call, sb, hog)
            others = [pool.submit(call, sb, other) for _ in range(3)]
            assert hogging.result() == ["EMFILE", 8]
            assert [f.result() for f in others] == [6 * 12] * 3
        assert_healthy(sb, tree, fds)


# -- staging and publishing ------------------------------------------------------------------

def test_a_killed_run_mid_write_leaves_no_partial_file(tree: dict[str, Path], fds: int) -> None:
    (tree["out"] / "report.csv").write_text("old complete report\n")
    before = snapshot(tree["out"])
    writer = """
        f = open("/out/report.csv", "w")
        f.write("new, partial\\n")
        f.flush()
        g = open("/out/fresh.bin", "wb")
        while True:
            g.write(b"z" * 4096)
            g.flush()
    """
    for limits in (wasibox.Limits(timeout_s=0.5, fuel=10**15),
                   wasibox.Limits(fuel=300_000_000)):
        with sandbox(tree, limits, quota_bytes=2**30) as sb:
            r = sb.run(textwrap.dedent(writer))
            assert r.limit_exceeded in (Limit.TIMEOUT, Limit.FUEL) and r.files == []
            assert snapshot(tree["out"]) == before
            assert staging_runs(tree["out"]) == []
            assert_healthy(sb, tree, fds)


@pytest.mark.parametrize("ending", ["raise ValueError('half way')", "import sys; sys.exit(3)",
                                    "import os; os._exit(0)"])
def test_a_run_that_fails_publishes_nothing(tree: dict[str, Path], fds: int,
                                            ending: str) -> None:
    with sandbox(tree) as sb:
        r = sb.run(f"f = open('/out/a.txt', 'w')\nf.write('a')\n{ending}")
        if "_exit(0)" in ending:
            # os._exit ends the run at once, as on a real OS: its exit status is 0, so the
            # run is ok, but the unflushed write never reached the host.
            assert r.ok and [f.path for f in r.files] == ["/out/a.txt"]
            assert (tree["out"] / "a.txt").read_text() == ""
        else:
            assert not r.ok and r.files == []
            assert not (tree["out"] / "a.txt").exists()
        assert staging_runs(tree["out"]) == []
        assert_healthy(sb, tree, fds)


def test_files_left_open_are_flushed_before_publishing(tree: dict[str, Path]) -> None:
    with sandbox(tree) as sb:
        r = sb.run("f = open('/out/a.txt', 'w')\nf.write('kept')\n")
        assert r.ok and (tree["out"] / "a.txt").read_text() == "kept"


def test_changes_to_existing_files_are_staged_and_never_touch_shared_inodes(
        tree: dict[str, Path], fds: int) -> None:
    out, outside = tree["out"], tree["outside"]
    (out / "keep.txt").write_text("keep\n")
    (out / "drop.txt").write_text("drop\n")
    (out / "old").mkdir()
    (out / "old" / "moved.txt").write_text("moved\n")
    os.link(outside / "secret.txt", out / "shared.txt")  # a hard link planted on the host
    shared_before = (outside / "secret.txt").stat()
    with sandbox(tree) as sb:
        r = sb.run(textwrap.dedent("""
            import os
            with open("/out/shared.txt", "a") as f:
                f.write("appended by the guest\\n")
            os.chmod("/out/keep.txt", 0o600)
            os.remove("/out/drop.txt")
            os.rename("/out/old/moved.txt", "/out/new_name.txt")
            os.rmdir("/out/old")
        """))
        assert r.ok, r.error
        assert (outside / "secret.txt").read_bytes() == SECRET
        after = (outside / "secret.txt").stat()
        assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (
            shared_before.st_ino, shared_before.st_mode, shared_before.st_mtime_ns)
        assert (out / "shared.txt").read_bytes() == SECRET + b"appended by the guest\n"
        assert (out / "shared.txt").stat().st_ino != shared_before.st_ino
        assert stat.S_IMODE((out / "keep.txt").stat().st_mode) == 0o600
        assert not (out / "drop.txt").exists() and not (out / "old").exists()
        assert (out / "new_name.txt").read_text() == "moved\n"
        assert {f.path for f in r.files} == {"/out/shared.txt", "/out/keep.txt",
                                             "/out/new_name.txt"}
        assert_healthy(sb, tree, fds)


def test_concurrent_runs_on_one_mount_both_publish(tree: dict[str, Path]) -> None:
    code = "def main(n):\n    open(f'/out/{n}.txt', 'w').write(str(n))\n"
    with sandbox(tree) as sb, concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: sb.run(code, entry="main", args=[n]), range(8)))
    assert all(r.ok for r in results)
    assert sorted(p.name for p in tree["out"].iterdir()) == \
        sorted([STAGING_DIR, *(f"{n}.txt" for n in range(8))])
    assert staging_runs(tree["out"]) == []


def test_a_run_starting_while_another_removes_its_staging_is_unaffected(
        tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's setup reclaims the staging of dead runs. One that starts at any step of a live
    run's removal of its published staging must neither fail nor publish that tree again:
    the owner removes it with its lock held, journal first and lock file last."""
    out = tree["out"]
    mount = wasibox.Mount(out, "/out", writable=True)
    seen: list[list[str] | OSError] = []  # each other run: the host's names, or its error
    starting = False

    def another_run_starts() -> None:
        nonlocal starting
        if starting:
            return  # the other run's own cleanup
        starting = True
        try:
            with FileSession([mount], open_files=8):
                seen.append(sorted(p.name for p in out.iterdir()))
        except OSError as exc:  # kept: the removal step it interrupts would swallow it
            seen.append(exc)
        finally:
            starting = False

    def after(step: Any) -> Any:
        def stepped(*args: Any, **kwargs: Any) -> Any:
            step(*args, **kwargs)
            another_run_starts()
        return stepped

    with FileSession([mount], open_files=8) as session:
        (session.trees["/out"] / "new.txt").write_text("new")
        monkeypatch.setattr(os, "unlink", after(os.unlink))
        monkeypatch.setattr(os, "rmdir", after(os.rmdir))
        monkeypatch.setattr(shutil, "rmtree", after(shutil.rmtree))
        records, refused = session.publish()
    assert [r.path for r in records] == ["/out/new.txt"] and refused == []
    assert len(seen) >= 4  # journal, tree, lock, directory: another run started after each
    assert seen == [[STAGING_DIR, "new.txt"]] * len(seen)
    assert (out / "new.txt").read_text() == "new"
    assert staging_runs(out) == []


def _plant(tree_dir: Path, outside: Path) -> None:
    (tree_dir / "good.txt").write_text("good\n")
    os.symlink(outside / "secret.txt", tree_dir / "abs_link")
    os.symlink("../../../../outside", tree_dir / "rel_dir_link")
    os.mkfifo(tree_dir / "fifo")
    os.link(outside / "secret.txt", tree_dir / "hard_link")
    (tree_dir / "sub").mkdir()
    os.symlink("/etc/passwd", tree_dir / "sub" / "nested_link")
    if os.geteuid() == 0:
        os.mknod(tree_dir / "null_device", 0o600 | stat.S_IFCHR, os.makedev(1, 3))


def test_publishing_refuses_planted_links_fifos_and_devices(tree: dict[str, Path]) -> None:
    """A backend whose guest writes the staging tree directly (the microVM) may plant
    anything there; publishing moves only regular files and reports the rest."""
    out, outside = tree["out"], tree["outside"]
    fds_before = open_fds()
    mount = wasibox.Mount(out, "/out", writable=True)
    with FileSession([mount], open_files=8) as session:
        staged = session.trees["/out"]
        _plant(staged, outside)
        records, refused = session.publish()
    assert [r.path for r in records] == ["/out/good.txt"]
    reasons = {r.path: r.reason for r in refused}
    expected = {"/out/abs_link": "symbolic link", "/out/rel_dir_link": "symbolic link",
                "/out/fifo": "FIFO", "/out/hard_link": "hard link",
                "/out/sub/nested_link": "symbolic link"}
    if os.geteuid() == 0:
        expected["/out/null_device"] = "device"
    assert reasons == expected
    assert sorted(p.name for p in out.iterdir()) == [STAGING_DIR, "good.txt", "sub"]
    assert list((out / "sub").iterdir()) == []
    assert (outside / "secret.txt").read_bytes() == SECRET
    assert (outside / "secret.txt").stat().st_nlink == 1
    assert staging_runs(out) == [] and open_fds() == fds_before


def test_publishing_never_follows_a_symlink_planted_in_the_host_directory(
        tree: dict[str, Path]) -> None:
    out, outside = tree["out"], tree["outside"]

    def plant() -> None:  # someone on the host points a directory outward, mid-run
        os.symlink(outside, out / "reports")

    mounts = [wasibox.Mount(tree["data"], "/data"), wasibox.Mount(out, "/out", writable=True)]
    with wasibox.Sandbox(mounts=mounts, functions={"plant": plant}) as sb:
        r = sb.run("import os, host\nos.mkdir('/out/reports')\n"
                   "open('/out/reports/r.txt', 'w').write('x')\nhost.plant()\n")
        assert r.ok, r.error
        assert [f.path for f in r.files_refused] == ["/out/reports", "/out/reports/r.txt"]
        assert r.files == []
        assert sorted(os.listdir(outside)) == ["secret.txt"]


def test_files_refused_and_records_reach_to_dict(tree: dict[str, Path]) -> None:
    with sandbox(tree) as sb:
        data = sb.run("open('/out/a', 'w').write('a')").to_dict()
    assert data["files"] == [{"path": "/out/a", "size": 1,
                              "sha256": hashlib.sha256(b"a").hexdigest()}]
    assert data["files_refused"] == []


CRASH = """
import os, sys
import wasibox
from wasibox.capabilities.files import session as files, staging
mount = wasibox.Mount(sys.argv[1], "/out", writable=True)
session = files.FileSession([mount], open_files=8)
(session.trees["/out"] / "staged.txt").write_text("staged")
if sys.argv[2] == "after-journal":
    staging._apply = lambda *args, **kwargs: os._exit(0)   # die between journal and renames
    session.publish()
os._exit(0)   # die mid-run: no cleanup, no unlock
"""


@pytest.mark.parametrize("moment, published", [("mid-run", False), ("after-journal", True)])
def test_a_crashed_host_process_is_reclaimed_at_the_next_start(
        tree: dict[str, Path], moment: str, published: bool) -> None:
    out = tree["out"]
    subprocess.run([PYTHON, "-c", CRASH, str(out), moment], check=True, env=child_env(),
                   timeout=120)
    assert len(staging_runs(out)) == 1
    with sandbox(tree) as sb:
        r = sb.run("import os\nprint(sorted(os.listdir('/out')))")
    assert r.ok
    assert r.stdout == ("['staged.txt']\n" if published else "[]\n")
    assert staging_runs(out) == []
    assert (out / "staged.txt").exists() is published


def test_workspace_persists_files_but_nothing_else(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import json, os
        path = "/workspace/state.json"
        state = json.load(open(path)) if os.path.exists(path) else {"runs": 0}
        state["runs"] += 1
        json.dump(state, open(path, "w"))
        print(state["runs"], "counter" in globals())
        counter = 1
    """)
    with wasibox.Sandbox(workspace=tmp_path) as sb:
        assert [sb.run(code).stdout for _ in range(3)] == ["1 False\n", "2 False\n",
                                                           "3 False\n"]
        failed = sb.run("open('/workspace/state.json', 'w').write('broken')\n1/0")
        assert not failed.ok
    assert (tmp_path / "state.json").read_text() == '{"runs": 3}'


# -- configuration ---------------------------------------------------------------------------

def test_mount_validation(tmp_path: Path) -> None:
    with pytest.raises(wasibox.UsageError, match="existing directory"):
        wasibox.Mount(tmp_path / "missing", "/data")
    (tmp_path / "file").write_text("")
    with pytest.raises(wasibox.UsageError, match="directory"):
        wasibox.Mount(tmp_path / "file", "/data")
    for guest in ("data", "/", "/..", ""):
        with pytest.raises(wasibox.UsageError, match="guest_path"):
            wasibox.Mount(tmp_path, guest)
    with pytest.raises(wasibox.UsageError, match="quota_bytes"):
        wasibox.Mount(tmp_path, "/d", quota_bytes="lots")
    with pytest.raises(wasibox.UsageError, match="quota_files"):
        wasibox.Mount(tmp_path, "/d", quota_files=0)
    assert wasibox.Mount(tmp_path, "/a/../b/", quota_bytes="1KiB").guest_path == "/b"
    (tmp_path / "sub").mkdir()
    with pytest.raises(wasibox.UsageError, match="overlap"):
        wasibox.Sandbox(mounts=[wasibox.Mount(tmp_path, "/a"), wasibox.Mount(tmp_path, "/a/b")])
    with pytest.raises(wasibox.UsageError, match="overlap"):
        wasibox.Sandbox(mounts=[wasibox.Mount(tmp_path, "/a", writable=True),
                                wasibox.Mount(tmp_path / "sub", "/b")])
    with pytest.raises(wasibox.UsageError, match="mounts"):
        wasibox.Sandbox(mounts=wasibox.Mount(tmp_path, "/a"))  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="open_files"):
        wasibox.Limits(open_files=0)
    # Two read-only views of one directory are fine.
    wasibox.Sandbox(mounts=[wasibox.Mount(tmp_path, "/a"), wasibox.Mount(tmp_path, "/b")])


def test_nested_guest_paths_make_virtual_directories(tree: dict[str, Path]) -> None:
    with wasibox.Sandbox(mounts=[wasibox.Mount(tree["data"], "/mnt/inputs/data")]) as sb:
        value = call(sb, """
            import os
            def main():
                try:
                    os.mkdir("/mnt/other")
                except OSError as exc:
                    code = errorcode[exc.errno]
                return [os.listdir("/"), os.listdir("/mnt"), os.path.isdir("/mnt/inputs"),
                        os.listdir("/mnt/inputs/data/sub"), code]
        """)
        assert value == [["mnt"], ["inputs"], True, ["deeper"], "EACCES"]


def test_scratch_is_private_to_each_run_and_discarded(
        tree: dict[str, Path], fds: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A temporary directory of this test's own: other processes' runs make scratch
    # directories in the system one at any moment.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = """
        import os, tempfile
        def main():
            before = os.listdir("/tmp")
            with tempfile.NamedTemporaryFile("w+", suffix=".txt") as f:
                f.write("scratch data")
                f.seek(0)
                data = f.read()
            with open("/tmp/left.txt", "w") as f:
                f.write("left behind")
            return [before, data, tempfile.gettempdir()]
    """
    with wasibox.Sandbox(mounts=[wasibox.Mount(tree["data"], "/data"),
                                 wasibox.Mount(tree["out"], "/out", writable=True),
                                 wasibox.Mount.scratch("/tmp", quota_bytes="1MiB")]) as sb:
        assert call(sb, code) == [[], "scratch data", "/tmp"]
        r = sb.run(textwrap.dedent(code), entry="main")
        assert r.value[0] == [] and r.files == []  # nothing persisted, nothing published
        assert not list(tmp_path.glob("wasibox-scratch-*"))
        assert_healthy(sb, tree, fds)
    with pytest.raises(wasibox.UsageError, match="writable"):
        wasibox.Mount(None, "/tmp")


def test_directory_nesting_is_capped(tree: dict[str, Path], fds: int) -> None:
    from wasibox.capabilities.files.mount import MAX_DEPTH
    with sandbox(tree) as sb:
        value = call(sb, f"""
            import os
            def main():
                path = "/out"
                for depth in range({MAX_DEPTH} + 5):
                    path += "/d"
                    try:
                        os.mkdir(path)
                    except OSError as exc:
                        return [depth, errorcode[exc.errno]]
        """)
        assert value == [MAX_DEPTH, "ENAMETOOLONG"]
        assert_healthy(sb, tree, fds)
    # A tree planted deeper than that (by a backend that writes the staging tree directly)
    # is refused at publishing, not walked.
    with FileSession([wasibox.Mount(tree["out"], "/out", writable=True)], 8) as session:
        deep = session.trees["/out"].joinpath(*["e"] * (MAX_DEPTH + 3))
        deep.mkdir(parents=True)
        (deep / "f.txt").write_text("deep")
        records, refused = session.publish()
    assert [r.reason for r in refused] == ["nested too deep"]
    assert records == []


def test_a_vanished_host_directory_is_a_usage_error(tree: dict[str, Path]) -> None:
    with sandbox(tree) as sb:
        tree["data"].rename(tree["root"] / "moved")
        with pytest.raises(wasibox.UsageError, match="host directory"):
            sb.run("pass")


def test_command_line_mounts(tree: dict[str, Path]) -> None:
    from tests.test_cli import wasibox_cli

    code = ("import tempfile\n"
            "open('/out/n.txt', 'w').write(open('/data/in.csv').read().upper())\n"
            "print(tempfile.gettempdir())")
    done = wasibox_cli("run", "--mount", f"{tree['data']}:/data",
                       "--mount", f"{tree['out']}:/out:rw", "--scratch", "/tmp", "--json",
                       "-c", code)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"] == "/tmp\n"
    assert [f["path"] for f in result["files"]] == ["/out/n.txt"]
    assert (tree["out"] / "n.txt").read_text() == "A,B\n1,2\n3,4\n"
    bad = wasibox_cli("run", "--mount", "nowhere", "-c", "pass")
    assert bad.returncode == 2 and "--mount takes" in bad.stderr


def test_opening_directories(tree: dict[str, Path], fds: int) -> None:
    with sandbox(tree) as sb:
        value = call(sb, """
            import os, stat
            def main():
                out = []
                for path in ("/data/sub", "/data", "/", "/out"):
                    try:
                        open(path)
                        out.append("opened")
                    except IsADirectoryError:
                        out.append("EISDIR")
                fd = os.open("/data/sub", os.O_RDONLY)
                out.append(stat.S_ISDIR(os.fstat(fd).st_mode))
                try:
                    os.read(fd, 10)
                except OSError as exc:
                    out.append(errorcode[exc.errno])
                os.close(fd)
                return out
        """)
        assert value == ["EISDIR"] * 4 + [True, "EISDIR"]
        assert_healthy(sb, tree, fds)


def test_modules_import_from_mounts_on_sys_path_and_nowhere_else(tree: dict[str, Path]) -> None:
    (tree["data"] / "doubling.py").write_text("def double(x):\n    return 2 * x\n")
    (tree["data"] / "pkg").mkdir()
    (tree["data"] / "pkg" / "__init__.py").write_text("from . import inner\n")
    (tree["data"] / "pkg" / "inner.py").write_text("VALUE = 'inner'\n")
    (tree["outside"] / "escaped.py").write_text("print('imported from outside')\n")
    (tree["root"] / "escaped.py").write_text("print('imported from outside')\n")
    with sandbox(tree) as sb:
        r = sb.run("import sys\nsys.path.insert(0, '/data')\nimport doubling, pkg\n"
                   "print(doubling.double(21), pkg.inner.VALUE, doubling.__file__)")
        assert r.ok and r.stdout == "42 inner /data/doubling.py\n", r.error
        for entry in ("/data/..", "/data/../outside", "/outside", "/"):
            r = sb.run(f"import sys\nsys.path.insert(0, {entry!r})\nimport escaped")
            assert r.error is not None and r.error.type == "ModuleNotFoundError", (entry, r)
        # Without the mount on sys.path, nothing is imported from it.
        r = sb.run("import doubling")
        assert r.error is not None and r.error.type == "ModuleNotFoundError"
