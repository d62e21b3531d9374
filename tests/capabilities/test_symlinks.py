"""Symbolic links inside mounts, as a guest program uses them.

The guest makes links on a writable mount and follows them through ``open``, ``stat``,
``listdir``, ``chmod``, ``realpath``, ``scandir`` and ``os.walk``, as on Linux; the host
resolves every one in the guest's namespace (docs/threat-model.md), so none of them, nor
one the host planted, leads out of the mounts. That is tested from both sides, with
hypothesis, in tests/security/test_symlink_resolution.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import wasibox
from tests.capabilities.test_files import SECRET, call, sandbox, tree  # noqa: F401
from wasibox import RefusedFile

pytestmark = pytest.mark.guest


def test_a_guest_makes_and_follows_links(tree: dict[str, Path]) -> None:  # noqa: F811
    with sandbox(tree) as sb:
        value = call(sb, """
            import os, pathlib
            def main():
                os.chdir("/out")
                os.mkdir("dirB")
                with open("fileA", "w") as f:
                    f.write("A")
                os.symlink("fileA", "linkA")              # relative, to a file
                os.symlink("dirB", "linkB")               # relative, to a directory
                os.symlink("/out/dirB", "absB")           # absolute, in the guest's namespace
                os.symlink("/data/in.csv", "data_link")   # into another mount
                os.symlink("missing", "dangling")
                os.symlink("linkA", "chain")
                with open("linkB/inside", "w") as f:      # written through a link
                    f.write("through")
                os.chmod("linkA", 0o400)                  # chmod follows, as on Linux
                return {
                    "read": open("linkA").read(),
                    "chain": open("chain").read(),
                    "other mount": open("data_link").read(),
                    "stat": os.stat("linkA").st_size,
                    "lstat is link": os.path.islink("linkA"),
                    "listdir": os.listdir("absB"),
                    "dotdot": open("linkB/../fileA").read(),
                    "abs dotdot": open("/out/absB/../fileA").read(),
                    "readlink": os.readlink("absB"),
                    "realpath": os.path.realpath("chain"),
                    "resolve": str(pathlib.Path("/out/linkB/inside").resolve()),
                    "mode": oct(os.stat("fileA").st_mode & 0o777),
                    "exists dangling": [os.path.exists("dangling"),
                                        os.path.lexists("dangling")],
                    "scandir": sorted((e.name, e.is_symlink(), e.is_dir(), e.is_file())
                                      for e in os.scandir("/out")),
                    "walk": sorted(top for top, _, _ in os.walk("/out", followlinks=True)),
                    "walk without links": sorted(top for top, _, _ in os.walk("/out")),
                    "cwd": (os.chdir("linkB"), os.getcwd(), sorted(os.listdir("..")))[1:],
                }
        """)
    assert value == {
        "read": "A", "chain": "A", "other mount": "a,b\n1,2\n3,4\n", "stat": 1,
        "lstat is link": True, "listdir": ["inside"], "dotdot": "A", "abs dotdot": "A",
        "readlink": "/out/dirB", "realpath": "/out/fileA", "resolve": "/out/dirB/inside",
        "mode": "0o400", "exists dangling": [False, True],
        "scandir": [["absB", True, True, False], ["chain", True, False, True],
                    ["dangling", True, False, False], ["data_link", True, False, True],
                    ["dirB", False, True, False], ["fileA", False, False, True],
                    ["linkA", True, False, True], ["linkB", True, True, False]],
        "walk": ["/out", "/out/absB", "/out/dirB", "/out/linkB"],
        "walk without links": ["/out", "/out/dirB"],
        # getcwd() names where the link led, and ".." is that directory's parent
        "cwd": ["/out/dirB", ["absB", "chain", "dangling", "data_link", "dirB", "fileA",
                              "linkA", "linkB"]],
    }


def test_link_errors_are_linux_errors(tree: dict[str, Path]) -> None:  # noqa: F811
    with sandbox(tree) as sb:
        value = call(sb, """
            import os
            def main():
                os.symlink("loop", "/out/loop")
                os.symlink("/out/b", "/out/a")
                os.symlink("/out/a", "/out/b")
                for i in range(41):                       # link i -> link i+1 -> ... -> file
                    os.symlink(f"c{i + 1}", f"/out/c{i}")
                open("/out/c41", "w").write("end")
                return {
                    "self loop": attempt(lambda: os.stat("/out/loop")),
                    "mutual loop": attempt(lambda: open("/out/a")),
                    "chain of 41": attempt(lambda: open("/out/c0")),
                    "chain of 40": open("/out/c1").read(),
                    "lstat of a loop": attempt(lambda: os.lstat("/out/loop")),
                    "exists": attempt(lambda: os.symlink("x", "/out/loop")),
                    "over a file": attempt(lambda: os.symlink("x", "/out/c41")),
                    "read-only mount": attempt(lambda: os.symlink("in.csv", "/data/link")),
                    "virtual root": attempt(lambda: os.symlink("/out", "/link")),
                    "empty target": attempt(lambda: os.symlink("", "/out/empty")),
                    "long target": attempt(lambda: os.symlink("x" * 4097, "/out/long")),
                    # Made as on Linux, whose names are checked when it is followed
                    "long name in target": [attempt(lambda: os.symlink("x" * 256, "/out/l")),
                                            attempt(lambda: open("/out/l"))],
                    "readlink of a file": attempt(lambda: os.readlink("/out/c41")),
                    "o_nofollow": attempt(lambda: os.open("/out/c40",
                                                         os.O_RDONLY | os.O_NOFOLLOW)),
                    "o_excl": attempt(lambda: os.open("/out/c40",
                                                     os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
                    "rmdir a link": attempt(lambda: os.rmdir("/out/c40")),
                    "lchmod": attempt(lambda: os.chmod("/out/c40", 0o600,
                                                       follow_symlinks=False)),
                    "etc passwd": attempt(lambda: os.symlink("/etc/passwd", "/out/pw")
                                          or open("/out/pw")),
                    "climb out": attempt(lambda: os.symlink("../../../../outside/secret.txt",
                                                            "/out/up") or open("/out/up")),
                }
        """)
    assert value == {
        "self loop": "ELOOP", "mutual loop": "ELOOP", "chain of 41": "ELOOP",
        "chain of 40": "end", "lstat of a loop": "ok", "exists": "EEXIST",
        "over a file": "EEXIST", "read-only mount": "EROFS", "virtual root": "EACCES",
        "empty target": "ENOENT", "long target": "ENAMETOOLONG",
        "long name in target": ["ok", "ENAMETOOLONG"], "readlink of a file": "EINVAL",
        "o_nofollow": "ELOOP", "o_excl": "EEXIST", "rmdir a link": "ENOTDIR",
        "lchmod": "NotImplementedError", "etc passwd": "ENOENT", "climb out": "ENOENT",
    }
    assert (tree["outside"] / "secret.txt").read_bytes() == SECRET


def test_links_change_themselves_not_their_targets(tree: dict[str, Path]) -> None:  # noqa: F811
    (tree["out"] / "kept.txt").write_text("kept")
    with sandbox(tree) as sb:
        value = call(sb, """
            import os
            def main():
                os.symlink("kept.txt", "/out/l1")
                os.rename("/out/l1", "/out/l2")           # the link moves, not the file
                os.symlink("kept.txt", "/out/l3")
                os.unlink("/out/l3")                      # the link goes, not the file
                os.symlink("missing.txt", "/out/dangling")
                with open("/out/dangling", "w") as f:     # O_CREAT makes the target
                    f.write("made")
                os.utime("/out/l2", ns=(10**9, 2 * 10**9), follow_symlinks=False)
                return [sorted(os.listdir("/out")), open("/out/l2").read(),
                        os.lstat("/out/l2").st_mtime_ns, os.stat("/out/l2").st_mtime_ns > 0,
                        os.readlink("/out/l2")]
        """)
    assert value[0] == ["dangling", "kept.txt", "l2", "missing.txt"]
    assert value[1:] == ["kept", 2 * 10**9, True, "kept.txt"]


def test_links_are_refused_at_publishing_and_their_targets_published(
        tree: dict[str, Path]) -> None:  # noqa: F811
    with sandbox(tree) as sb:
        r = sb.run("import os\n"
                   "os.mkdir('/out/d')\n"
                   "open('/out/d/f.txt', 'w').write('x')\n"
                   "os.symlink('d/f.txt', '/out/link')\n"
                   "os.symlink('/data', '/out/d/data')\n")
    assert r.ok, r.error
    assert [f.path for f in r.files] == ["/out/d/f.txt"]
    assert sorted(r.files_refused, key=lambda f: f.path) == [
        RefusedFile(path="/out/d/data", reason="symbolic link"),
        RefusedFile(path="/out/link", reason="symbolic link")]
    assert sorted(os.listdir(tree["out"])) == [".wasibox-staging", "d"]
    assert os.listdir(tree["out"] / "d") == ["f.txt"]


def test_a_link_counts_against_the_file_quota(tree: dict[str, Path]) -> None:  # noqa: F811
    with sandbox(tree, quota_files=2) as sb:
        value = call(sb, """
            import os
            def main():
                os.symlink("a", "/out/l1")
                os.symlink("b", "/out/l2")
                try:
                    os.symlink("c", "/out/l3")
                except OSError as exc:
                    return errorcode[exc.errno]
        """)
    assert value == "EDQUOT"


def test_host_links_in_a_writable_mount_stay_unseen_and_untouched(
        tree: dict[str, Path]) -> None:  # noqa: F811
    # Not staged (the microVM's copy-out could not keep them either): the guest's own name
    # there is its own, and publishing leaves the host's link alone.
    out = tree["out"]
    (out / "real.txt").write_text("real")
    os.symlink("real.txt", out / "kept")
    os.symlink(tree["outside"], out / "escape")
    with sandbox(tree) as sb:
        value = call(sb, """
            import os
            def main():
                return [sorted(os.listdir("/out")), os.path.lexists("/out/kept"),
                        os.path.exists("/out/escape/secret.txt")]
        """)
        r = sb.run("pass")
    assert value == [["real.txt"], False, False]
    assert r.ok and r.files_refused == []
    assert sorted(os.listdir(out)) == [".wasibox-staging", "escape", "kept", "real.txt"]
    assert os.readlink(out / "kept") == "real.txt"


def test_a_read_only_mount_follows_its_links(tree: dict[str, Path]) -> None:  # noqa: F811
    os.symlink("sub/deeper", tree["data"] / "deep")
    os.symlink("/data/in.csv", tree["data"] / "abs")
    with wasibox.Sandbox(mounts=[wasibox.Mount(tree["data"], "/data")]) as sb:
        value = call(sb, """
            import os
            def main():
                return [os.listdir("/data/deep"), open("/data/deep/../../abs").read(),
                        os.path.realpath("/data/deep/note.txt")]
        """)
    assert value == [["note.txt"], "a,b\n1,2\n3,4\n", "/data/sub/deeper/note.txt"]
