"""The microVM backend's host-side logic, without booting a VM: backend choice, image
pieces (and the file agent's one shared host module), the channel's framing and the console
ring."""

from __future__ import annotations

import lzma
import shutil
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wasibox import UsageError
from wasibox._select import WASM_MODULES, imported_modules, needs_microvm
from wasibox.backends.microvm.backend import MicroVMBackend
from wasibox.backends.microvm.channel import MAX_FRAME_BYTES, Channel, ConsoleRing
from wasibox.backends.microvm.image import (
    ImageConfig,
    _initramfs_inputs,
    extract_vmlinux,
    write_cpio,
)
from wasibox.backends.microvm.runtime import emulation_allowed
from wasibox.capabilities.files import refusals
from wasibox.capabilities.files.mount import MAX_DEPTH
from wasibox.capabilities.files.refusals import refusal

VM_MODULES = frozenset({"numpy", "pandas", "msgpack", "json", "ctypes"})


def test_imports_are_found_statically() -> None:
    code = ("import numpy as np, os.path\nfrom pandas.api import types\nfrom . import sibling\n"
            "mod = __import__('scipy')\nimport importlib\nimportlib.import_module('yaml.x')\n"
            "def f():\n    import json\n")
    assert imported_modules(code) == {"numpy", "os", "pandas", "scipy", "importlib", "yaml",
                                      "json"}
    assert imported_modules("def broken(:\n") == set()
    assert imported_modules("x = " + "1+" * 300000 + "1") == set()  # deeper than the parser


@pytest.mark.parametrize(("code", "requires", "expected"), [
    ("import json\nprint(1)", (), False),
    ("import numpy", (), True),
    ("try:\n    import pandas\nexcept ImportError:\n    pandas = None", (), True),
    ("print(1)", ("numpy",), True),
    ("print(1)", ("numpy.linalg",), True),
    ("import not_anywhere", (), False),  # neither has it: wasm reports the ImportError
    ("import msgpack", (), False),  # bundled in the wasm guest
    ("import ctypes", (), False),  # stdlib: fails clearly in wasm rather than moving
    ("x = '''import numpy'''", (), False),  # a string is not an import
])
def test_backend_choice(code: str, requires: tuple[str, ...], expected: bool) -> None:
    assert needs_microvm(code, requires, VM_MODULES) is expected


@given(st.text(max_size=200))
def test_import_scan_never_raises(code: str) -> None:
    assert isinstance(imported_modules(code), set)


def test_wasm_module_set_is_the_bundled_stdlib() -> None:
    assert {"json", "csv", "decimal", "msgpack", "zoneinfo"} <= WASM_MODULES
    assert not {"numpy", "pandas", "ctypes", "ssl"} & WASM_MODULES


def test_image_config_accepts_only_debian_python_packages() -> None:
    config = ImageConfig(extra_packages=("python3-scipy", "python3-scipy", "python3-yaml"))
    assert config.extra_packages == ("python3-scipy", "python3-yaml")
    assert config.packages[:4] == ("python3", "python3-numpy", "python3-pandas",
                                   "python3-msgpack")
    assert config.rootfs_key() != ImageConfig().rootfs_key()
    assert config.kernel_key() == ImageConfig().kernel_key()
    for bad in ("curl", "python3-x;rm -rf /", "--option", "Python3-numpy"):
        with pytest.raises(UsageError, match="Debian Python packages"):
            ImageConfig(extra_packages=(bad,))


def test_image_config_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_MICROVM_PACKAGES", "python3-yaml, python3-scipy")
    assert ImageConfig.from_environment(["python3-six"]).extra_packages == (
        "python3-scipy", "python3-six", "python3-yaml")


def test_cpio_is_deterministic_newc(tmp_path) -> None:  # type: ignore[no-untyped-def]
    entries = [("bin", 0o40755, b""), ("init", 0o100755, b"#!/bin/sh\n")]
    first, second = tmp_path / "a.cpio", tmp_path / "b.cpio"
    write_cpio(entries, first)
    write_cpio(entries, second)
    data = first.read_bytes()
    assert data == second.read_bytes()
    assert data.startswith(b"070701")
    assert b"init\0" in data and b"#!/bin/sh\n" in data and b"TRAILER!!!" in data
    assert len(data) % 4 == 0


@pytest.mark.skipif(shutil.which("busybox") is None,
                    reason="busybox is missing (the initramfs packs it): install busybox-static")
def test_the_vm_file_agent_imports_with_only_what_the_image_packs(tmp_path: Path) -> None:
    (tmp_path / "modules").mkdir()
    packed = {path: data for path, _, data in _initramfs_inputs(tmp_path)}
    shared = Path(refusals.__file__).read_bytes()
    assert packed["wasibox_refusals.py"] == shared  # the host's module, byte for byte
    root = tmp_path / "root"
    root.mkdir()
    for name in ("wasibox_vm_files.py", "wasibox_refusals.py"):
        (root / name).write_bytes(packed[name])
    # -I -S: no site-packages and no wasibox on the path, as in the VM's initramfs.
    probe = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         "import sys, stat; sys.path.insert(0, sys.argv[1]); import wasibox_vm_files as f; "
         "print(f.MAX_DEPTH, f.refusal(stat.S_IFIFO), f.refusal(stat.S_IFLNK))", str(root)],
        capture_output=True, text=True, check=False)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split(" ", 1) == [str(MAX_DEPTH), "FIFO symbolic link\n"]


@given(st.sampled_from([stat.S_IFLNK, stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK,
                        stat.S_IFDOOR, stat.S_IFWHT, 0o170000]),
       st.integers(0, 0o7777))
def test_every_file_type_that_is_not_published_has_its_reason(kind: int, mode: int) -> None:
    expected = {stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "FIFO", stat.S_IFCHR: "device",
                stat.S_IFBLK: "device", stat.S_IFSOCK: "socket"}
    assert refusal(kind | mode) == expected.get(kind, "not a regular file or directory")


def test_vmlinux_is_found_inside_a_bzimage() -> None:
    elf = b"\x7fELF" + bytes(range(256)) * 64
    bzimage = b"MZ" + b"\0" * 500 + b"\xfd7zXZ\x00junk" + lzma.compress(elf) + b"trailer"
    assert extract_vmlinux(bzimage) == elf
    with pytest.raises(Exception, match="no compressed ELF"):
        extract_vmlinux(b"MZ not a kernel")


def _channel_pair() -> tuple[Channel, socket.socket]:
    host, guest = socket.socketpair()
    host.setblocking(False)
    return Channel(host), guest


def test_channel_frames_round_trip_and_split_reads() -> None:
    channel, guest = _channel_pair()
    payload = msgpack.packb({"kind": "output", "fd": 1, "data": b"x" * 10})
    frame = struct.pack(">I", len(payload)) + payload
    guest.sendall(frame[:3])
    assert channel.feed()
    assert list(channel.frames()) == []
    guest.sendall(frame[3:] + frame)
    assert channel.feed()
    assert [f["data"] for f in channel.frames()] == [b"x" * 10, b"x" * 10]
    guest.close()
    assert not channel.feed()
    channel.sock.close()


def test_channel_refuses_oversized_and_non_map_frames() -> None:
    channel, guest = _channel_pair()
    guest.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    channel.feed()
    with pytest.raises(ValueError, match="frame"):
        list(channel.frames())
    channel.sock.close()
    guest.close()
    channel, guest = _channel_pair()
    payload = msgpack.packb([1, 2])
    guest.sendall(struct.pack(">I", len(payload)) + payload)
    channel.feed()
    with pytest.raises(ValueError, match="not a map"):
        list(channel.frames())
    channel.sock.close()
    guest.close()


def test_console_ring_keeps_only_the_tail() -> None:
    ring = ConsoleRing(size=100)
    for index in range(1000):
        ring.append(f"line {index}\n".encode())
    text = ring.text()
    assert len(text) <= 100
    assert text.endswith("line 999\n")


def test_emulation_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WASIBOX_ALLOW_EMULATION", raising=False)
    assert emulation_allowed(None) is False
    assert emulation_allowed(True) is True
    monkeypatch.setenv("WASIBOX_ALLOW_EMULATION", "1")
    assert emulation_allowed(None) is True
    assert emulation_allowed(False) is False
    assert MicroVMBackend(allow_emulation=False).allow_emulation is False


def test_unknown_backend_names_the_choices() -> None:
    import wasibox

    with pytest.raises(UsageError, match="'auto', 'wasm', 'microvm'"):
        wasibox.Sandbox(backend="docker")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="module names"):
        wasibox.Sandbox(requires="numpy")
