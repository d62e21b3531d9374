"""Filesystem attacks the files capability's own tests (tests/capabilities/test_files.py) do
not already cover: one regression test per Wasmtime filesystem advisory, the guest's raw
``posix`` functions, inode and depth bombs, and hostile file names.

Every case snapshots the whole host tree (kind, mode, inode, size, mtime, links, sha256)
outside the writable mount's own output and checks that nothing else changed.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import wasibox
from tests.capabilities.test_files import SECRET, snapshot
from tests.security.conftest import HostBaseline, take_baseline
from wasibox.capabilities.files.mount import MAX_DEPTH, STAGING_DIR

pytestmark = pytest.mark.guest

LIMITS = wasibox.Limits(fuel=5_000_000_000, timeout_s=30)


@pytest.fixture()
def tree(tmp_path: Path) -> Iterator[dict[str, Path]]:
    data, out, outside = tmp_path / "data", tmp_path / "out", tmp_path / "outside"
    for directory in (data, out, outside):
        directory.mkdir()
    (data / "in.csv").write_text("a,b\n1,2\n")
    (outside / "secret.txt").write_bytes(SECRET)
    os.symlink(outside, data / "dir_link")
    os.symlink(outside / "secret.txt", data / "file_link")
    os.symlink(outside, out / "out_dir_link")
    yield {"root": tmp_path, "data": data, "out": out, "outside": outside}
    _remove_deep(out)  # a tree deeper than shutil.rmtree's recursion allows, if a test failed


def _remove_deep(top: Path) -> None:
    for directory, dirs, files in os.walk(top, topdown=False):
        for name in files:
            os.unlink(os.path.join(directory, name))
        for name in dirs:
            path = os.path.join(directory, name)
            os.unlink(path) if os.path.islink(path) else os.rmdir(path)


@pytest.fixture()
def sb(tree: dict[str, Path]) -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(LIMITS, mounts=[
            wasibox.Mount(tree["data"], "/data"),
            wasibox.Mount(tree["out"], "/out", writable=True, quota_files=300)]) as sandbox:
        yield sandbox


@pytest.fixture()
def host(sb: wasibox.Sandbox) -> HostBaseline:
    return take_baseline(sb)


def attempts(sb: wasibox.Sandbox, *actions: str) -> list[str]:
    """Run each action in the guest; 'reached' if it succeeded, else its errno name."""
    body = "".join(f"    try:\n        {action}\n        out.append('reached')\n"
                   f"    except (OSError, ValueError) as exc:\n"
                   f"        out.append(errorcode.get(getattr(exc, 'errno', None) or 0, "
                   f"type(exc).__name__))\n" for action in actions)
    code = ("import os, posix, _io, shutil\nfrom errno import errorcode\n"
            f"def main():\n    out = []\n{body}    return out\n")
    r = sb.run(code, entry="main")
    assert r.error is None, r.error
    value: list[str] = r.value
    return value


def outside_the_output(tree: dict[str, Path]) -> dict[str, Any]:
    return {name: snapshot(tree[name]) for name in ("data", "outside")}


# -- one regression test per Wasmtime filesystem advisory ---------------------------------------

def test_ghsa_2r75_truncate_on_a_read_only_file(sb: wasibox.Sandbox, host: HostBaseline,
                                                tree: dict[str, Path]) -> None:
    # GHSA-2r75-cxrj-cmph: open-at/path_open with TRUNCATE alone wrote to a read-only file.
    before = outside_the_output(tree)
    results = attempts(sb, "os.close(os.open('/data/in.csv', os.O_RDONLY | os.O_TRUNC))",
                       "os.close(posix.open('/data/in.csv', os.O_RDONLY | os.O_TRUNC))",
                       "_io.FileIO('/data/in.csv', 'w').close()",
                       "os.truncate('/data/in.csv', 0)")
    assert "reached" not in results, results
    assert outside_the_output(tree) == before
    host.assert_unaffected(sb)


def test_ghsa_4ch3_links_and_renames_out_of_a_read_only_mount(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path]) -> None:
    # GHSA-4ch3-9j33-3pmj: a hard link (or rename) from a read-only preopen into a writable
    # one, then an append, changed the read-only file.
    before = outside_the_output(tree)
    results = attempts(sb, "os.link('/data/in.csv', '/out/in.csv')",
                       "posix.link('/data/in.csv', '/out/in2.csv')",
                       "open('/out/in.csv', 'a').write('appended')",
                       "os.rename('/data/in.csv', '/out/moved.csv')",
                       "posix.rename('/data/in.csv', '/out/moved2.csv')",
                       "shutil.move('/data/in.csv', '/out/moved3.csv')")
    assert "reached" not in results[:2] + results[3:], results
    assert outside_the_output(tree) == before
    assert (tree["data"] / "in.csv").read_text() == "a,b\n1,2\n"
    host.assert_unaffected(sb)


def test_ghsa_vqjp_trailing_slash_symlinks(sb: wasibox.Sandbox, host: HostBaseline,
                                           tree: dict[str, Path]) -> None:
    # GHSA-vqjp-4c8c-hfgg: a path or symlink with a trailing slash escaped the preopen.
    before = outside_the_output(tree)
    results = attempts(sb, "os.listdir('/data/dir_link/')", "os.stat('/data/dir_link/')",
                       "open('/data/dir_link/secret.txt').read()",
                       "open('/data/file_link/').read()",
                       "os.listdir('/out/out_dir_link/')",
                       "open('/out/out_dir_link/new.txt', 'w').write('x')",
                       "os.mkdir('/out/out_dir_link/newdir/')",
                       "posix.listdir('/data/dir_link/')")
    assert "reached" not in results, results
    assert outside_the_output(tree) == before
    assert sorted(os.listdir(tree["outside"])) == ["secret.txt"]
    host.assert_unaffected(sb)


def test_ghsa_m9f7_renaming_symlinks_with_trailing_slashes(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path]) -> None:
    # GHSA-m9f7-9w4p-gv38: renaming a symlink with a trailing slash moved its target.
    before = outside_the_output(tree)
    r = sb.run(textwrap.dedent("""
        import os
        from errno import errorcode
        def main():
            out = []
            os.mkdir('/out/d')
            open('/out/d/f', 'w').write('mine')
            for src, dst in [('/out/out_dir_link/', '/out/moved'),
                             ('/out/out_dir_link/secret.txt', '/out/stolen'),
                             ('/out/d/', '/out/out_dir_link/'),
                             ('/out/d', '/out/out_dir_link/d')]:
                try:
                    os.rename(src, dst)
                    out.append('reached')
                except OSError as exc:
                    out.append(errorcode[exc.errno])
            return out
    """), entry="main")
    assert r.ok, r.error
    assert r.value[1] != "reached" and r.value[3] != "reached", r.value
    assert outside_the_output(tree) == before
    assert (tree["outside"] / "secret.txt").read_bytes() == SECRET
    assert sorted(os.listdir(tree["outside"])) == ["secret.txt"]
    host.assert_unaffected(sb)


def test_raw_posix_functions_reach_no_host_file(sb: wasibox.Sandbox, host: HostBaseline,
                                                tree: dict[str, Path]) -> None:
    # The runner routes os, posix (which importlib calls directly) and io through the files
    # capability; the original C functions beneath have no WASI directories at all.
    before = outside_the_output(tree)
    results = attempts(sb, "posix.open('/outside/secret.txt', os.O_RDONLY)",
                       f"posix.open({str(tree['outside'] / 'secret.txt')!r}, os.O_RDONLY)",
                       "posix.listdir('/data/dir_link')", "posix.stat('/data/../outside')",
                       "posix.open('/data/../../outside/secret.txt', os.O_RDONLY)",
                       "posix.unlink('/data/in.csv')", "posix.mkdir('/data/x')",
                       "posix.chmod('/data/in.csv', 0o777)")
    assert "reached" not in results, results
    assert sb.call("import posix\ndef f():\n    return sorted(posix.listdir('/'))", "f") == [
        "data", "out"]
    assert outside_the_output(tree) == before
    host.assert_unaffected(sb)


# -- bombs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [
    # absolute paths, one level deeper each time
    "p = '/out'\nfor i in range(3000):\n    p += '/d'\n    os.mkdir(p)\n    n += 1",
    # relative: chdir down, so no single path is long
    "os.chdir('/out')\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n    n += 1",
    # build shallow, then move a deep subtree under another deep one
    "os.makedirs('/out/a/' + '/'.join(['d'] * 40))\nos.makedirs('/out/b/' + '/'.join(['d'] * 40))"
    "\nn = 80\nos.rename('/out/a', '/out/b/' + '/'.join(['d'] * 40) + '/a')\nn = 3000",
])
def test_a_3000_deep_directory_chain_stops_at_the_depth_cap(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path], code: str) -> None:
    # Regression: a 2,000-deep chain made the host's staging walkers (populate, publish,
    # discard) raise RecursionError out of Sandbox.run.
    before = outside_the_output(tree)
    guest = ("import os\nfrom errno import errorcode\nn = 0\ntry:\n"
             + textwrap.indent(code, "    ")
             + "\nexcept OSError as exc:\n    print(errorcode[exc.errno])\n")
    for ending in ("raise SystemExit(1)", ""):  # discarded, then published
        r = sb.run(guest + ending)
        assert r.stdout == "ENAMETOOLONG\n", (r.stdout, r.error)
        assert r.ok is not ending
    depth = max(len(Path(d).relative_to(tree["out"]).parts)
                for d, _, _ in os.walk(tree["out"]) if STAGING_DIR not in d)
    assert depth <= MAX_DEPTH
    assert outside_the_output(tree) == before
    host.assert_unaffected(sb)


def test_a_million_file_inode_bomb_stops_at_the_file_quota(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path]) -> None:
    r = sb.run("from errno import errorcode\nn = 0\ntry:\n    for i in range(10**6):\n"
               "        open(f'/out/f{i}', 'w').close()\n        n += 1\n"
               "except OSError as exc:\n    print(n, errorcode[exc.errno])\n")
    assert r.ok and r.stdout.split()[1] == "EDQUOT"
    assert int(r.stdout.split()[0]) <= 300
    assert len([p for p in tree["out"].iterdir() if p.name.startswith("f")]) <= 300
    host.assert_unaffected(sb)


# -- hostile names -----------------------------------------------------------------------------

HOSTILE_NAMES = {
    "newline": ("a\nb", "reached"),
    "escape sequence": ("\x1b[31mred\x1b]0;title\x07", "reached"),
    "255 bytes": ("n" * 255, "reached"),
    "255 bytes of UTF-8": ("é" * 127 + "n", "reached"),
    "256 bytes": ("n" * 256, "ENAMETOOLONG"),
    "NUL": ("a\x00b", "ValueError"),
    "only spaces": ("   ", "reached"),
    "leading dash": ("-rf", "reached"),
    "staging directory's name": (STAGING_DIR, "EACCES"),
}


def test_hostile_file_names_are_written_exactly_or_refused(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path]) -> None:
    names = {label: name for label, (name, _) in HOSTILE_NAMES.items()}
    results = attempts(sb, *(f"open('/out/' + {name!r}, 'w').write({label!r})"
                             for label, name in names.items()))
    assert results == [expected for _, expected in HOSTILE_NAMES.values()]
    for label, (name, expected) in HOSTILE_NAMES.items():
        if expected == "reached":
            assert (tree["out"] / name).read_text() == label
    on_host = {p.name for p in tree["out"].iterdir()}
    assert on_host == {STAGING_DIR, "out_dir_link"} | {
        name for name, expected in HOSTILE_NAMES.values() if expected == "reached"}
    host.assert_unaffected(sb)
