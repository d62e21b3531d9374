"""Every reader of the guest sees the mounts and nothing else.

The import system and the readers built on it (``io.open_code``, ``io.FileIO``, ``_io.open``,
``os.open``/``posix.open``, ``open``, ``linecache``, ``tokenize.open``,
``importlib.util.spec_from_file_location``, ``runpy``, ``import`` through ``sys.path``) go
through the ``files`` capability. Each is pointed at host files outside the mounts (by the
host's own path, by ``..``, through symlinks that lead out) and must never return their
bytes or import them, while the same reader does read a file inside a mount.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import wasibox
from tests.security.conftest import HostBaseline, take_baseline

pytestmark = pytest.mark.guest

TOKEN = "wasibox-reader-canary-7f3a"

READERS = """\
import _io, importlib.util, io, json, linecache, os, posix, runpy, sys, tokenize

def _runpy(path):
    return runpy.run_path(path).get("TOKEN", "").encode()

def _spec(path):
    spec = importlib.util.spec_from_file_location("probe", path)
    return spec.loader.get_data(path)

READERS = {
    "open": lambda p: open(p, "rb").read(),
    "io.open": lambda p: io.open(p, "rb").read(),
    "_io.open": lambda p: _io.open(p, "rb").read(),
    "io.open_code": lambda p: io.open_code(p).read(),
    "_io.open_code": lambda p: _io.open_code(p).read(),
    "io.FileIO": lambda p: io.FileIO(p).read(),
    "_io.FileIO": lambda p: _io.FileIO(p, "r").read(),
    "os.open": lambda p: os.read(os.open(p, os.O_RDONLY), 1 << 16),
    "posix.open": lambda p: posix.read(posix.open(p, posix.O_RDONLY), 1 << 16),
    "tokenize.open": lambda p: tokenize.open(p).read().encode(),
    "linecache": lambda p: "".join(linecache.getlines(p)).encode(),
    "spec_from_file_location": _spec,
    "runpy": _runpy,
}

def main(paths, directories):
    seen = {}
    for path in paths:
        for name, reader in READERS.items():
            try:
                seen[name + " " + path] = reader(path).decode("utf-8", "replace")
            except (OSError, ValueError, SyntaxError, ImportError, AttributeError) as exc:
                seen[name + " " + path] = type(exc).__name__
    for directory in directories:
        sys.path.insert(0, directory)
        try:
            import secret_module
            seen["import " + directory] = secret_module.TOKEN
            del sys.modules["secret_module"]
        except ImportError as exc:
            seen["import " + directory] = type(exc).__name__
        finally:
            sys.path.remove(directory)
            sys.path_importer_cache.clear()
    return seen
"""


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "inside.py").write_text("TOKEN = 'inside'\n")
    (outside / "secret_module.py").write_text(f"TOKEN = {TOKEN!r}\n")
    os.symlink(outside, data / "dir_link")
    os.symlink(outside / "secret_module.py", data / "file_link.py")
    return {"root": tmp_path, "data": data, "outside": outside}


@pytest.fixture()
def sb(tree: dict[str, Path]) -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(mounts=[wasibox.Mount(tree["data"], "/data")],
                         python_path=["/data"]) as sandbox:
        yield sandbox


@pytest.fixture()
def host(sb: wasibox.Sandbox) -> HostBaseline:
    return take_baseline(sb)


def probe(sb: wasibox.Sandbox, paths: list[str], directories: list[str]) -> dict[str, str]:
    result = sb.run(READERS, entry="main", args=(paths, directories))
    assert result.error is None, result.error
    seen: dict[str, str] = result.value
    return seen


def escapes(tree: dict[str, Path]) -> list[str]:
    secret = str(tree["outside"] / "secret_module.py")
    up = "/..".join([""] * (len(tree["data"].parts) + 1))
    return [secret, "/data/dir_link/secret_module.py", "/data/file_link.py",
            f"/data{up}{secret}", f"/data/../..{secret}", "/data/dir_link/../outside/x",
            "../outside/secret_module.py", f"{secret}\x00/data/inside.py"]


def test_every_reader_reads_a_mounted_file(sb: wasibox.Sandbox) -> None:
    seen = probe(sb, ["/data/inside.py"], ["/data"])
    for name, text in seen.items():
        if name.startswith("runpy"):
            assert text == "inside", name
        elif name.startswith("import"):
            assert text == "ImportError" or text == "ModuleNotFoundError", name
        else:
            assert text == "TOKEN = 'inside'\n", name


def test_no_reader_reaches_a_host_file_outside_the_mounts(
        sb: wasibox.Sandbox, host: HostBaseline, tree: dict[str, Path]) -> None:
    directories = [str(tree["outside"]), "/data/dir_link", "/data/..", "/", "", "."]
    seen = probe(sb, escapes(tree), directories)
    assert len(seen) == 13 * len(escapes(tree)) + len(directories)
    leaked = {name: text for name, text in seen.items() if TOKEN in text}
    assert not leaked, leaked
    assert {seen[f"import {directory}"] for directory in directories} == {
        "ModuleNotFoundError"}
    host.assert_unaffected(sb)


PIECES = st.sampled_from(["..", ".", "data", "dir_link", "file_link.py", "outside",
                          "secret_module.py", "", "inside.py", "\\", "%2e%2e"])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(PIECES, max_size=8).map(lambda parts: "/" + "/".join(parts)),
                min_size=1, max_size=6))
def test_no_path_of_mount_names_and_dots_reaches_the_secret(paths: list[str]) -> None:
    # Made here, not from the function-scoped fixtures: hypothesis calls this many times.
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        data, outside = root / "data", root / "outside"
        data.mkdir()
        outside.mkdir()
        (outside / "secret_module.py").write_text(f"TOKEN = {TOKEN!r}\n")
        os.symlink(outside, data / "dir_link")
        os.symlink(outside / "secret_module.py", data / "file_link.py")
        with wasibox.Sandbox(mounts=[wasibox.Mount(data, "/data")]) as sandbox:
            seen = probe(sandbox, paths, [path.rpartition("/")[0] or "/" for path in paths])
    leaked = {name: text for name, text in seen.items() if TOKEN in text}
    assert not leaked, leaked
