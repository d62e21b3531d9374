"""Mounts on the microVM backend, end to end: real QEMU, the real image, the real agent.

The same semantics as on wasm: read-only and writable mounts at the same guest paths, writes
published through the same staging only when the run ends ok, and nothing the guest makes
can reach a host file outside its mounts. Each test asserts several things about one run,
because under TCG every run costs a VM restore (about a second or two).
"""

from __future__ import annotations

import hashlib
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

import wasibox
from tests.backends.microvm.host_tree import host_view

# vm_runtime: the session's VM runtime (it skips only where QEMU or the image is missing).
from tests.backends.microvm.test_backend import VM_LIMITS, _no_orphans, vm_runtime  # noqa: F401
from wasibox import Limit, Mount
from wasibox.capabilities.files.mount import STAGING_DIR

pytestmark = [pytest.mark.microvm, pytest.mark.usefixtures("vm_runtime")]

SECRET = "host secret\n"


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    data, out, outside = tmp_path / "data", tmp_path / "out", tmp_path / "outside"
    for directory in (data / "sub", out / "old", outside):
        directory.mkdir(parents=True)
    (data / "in.csv").write_text("a,b\n1,2\n3,4\n5,6\n")
    (data / "sub" / "weights.txt").write_text("0.5 2\n")
    (data / "sub" / "blob.bin").write_bytes(os.urandom(3 * 2**20 // 2))  # several frames
    (data / "to-secret").symlink_to(outside / "secret.txt")
    os.mkfifo(data / "pipe")
    (out / "old" / "stale.txt").write_text("stale")
    (out / "keep.txt").write_text("keep")
    (out / "change.txt").write_text("before")
    (outside / "secret.txt").write_text(SECRET)
    return {"data": data, "out": out, "outside": outside}


def sandbox(tree: dict[str, Path], limits: wasibox.Limits = VM_LIMITS, backend: str = "microvm",
            **options: Any) -> wasibox.Sandbox:
    mounts = [Mount(tree["data"], "/data"), Mount(tree["out"], "/out", writable=True, **options),
              Mount.scratch("/scratch")]
    return wasibox.Sandbox(limits, backend=backend, allow_emulation=True,  # type: ignore[arg-type]
                           mounts=mounts, requires=["numpy"] if backend == "auto" else ())


def staging_left(tree: dict[str, Path]) -> list[str]:
    staging = tree["out"] / STAGING_DIR
    return [name for name in os.listdir(staging) if name.startswith("run-")] \
        if staging.is_dir() else []


NUMPY_JOB = textwrap.dedent("""
    import hashlib
    import os
    import numpy as np

    def main():
        table = np.loadtxt("/data/in.csv", delimiter=",", skiprows=1)
        weights = np.loadtxt("/data/sub/weights.txt")
        result = table @ weights
        os.makedirs("/out/report", exist_ok=True)
        np.save("/out/report/result.npy", result)
        np.save("/scratch/thrown-away.npy", result)  # a scratch mount: gone after the run
        with open("/data/sub/blob.bin", "rb") as source, open("/out/copy.bin", "wb") as copy:
            blob = source.read()
            copy.write(blob[::-1])
        with open("/out/change.txt", "w") as handle:
            handle.write("after")
        os.remove("/out/old/stale.txt")
        os.rmdir("/out/old")
        return {"result": result.tolist(), "listing": sorted(os.listdir("/data")),
                "blob": hashlib.sha256(blob).hexdigest(),
                "mode": oct(os.stat("/data/in.csv").st_mode & 0o777),
                "keep": open("/out/keep.txt").read(), "scratch": os.listdir("/scratch")}
""")


def test_numpy_reads_a_read_only_mount_and_its_artifact_appears_on_the_host(
        tree: dict[str, Path]) -> None:
    with sandbox(tree) as sb:
        result = sb.run(NUMPY_JOB, entry="main")
    assert result.ok, (result.error, result.stderr)
    assert result.backend == "microvm"
    assert result.value["result"] == [4.5, 9.5, 14.5]
    assert result.value["listing"] == ["in.csv", "pipe", "sub", "to-secret"]
    assert result.value["mode"] == "0o444"  # read-only: no write bits, as on wasm
    assert result.value["keep"] == "keep"
    assert result.value["scratch"] == ["thrown-away.npy"]
    blob = (tree["data"] / "sub" / "blob.bin").read_bytes()
    assert result.value["blob"] == hashlib.sha256(blob).hexdigest()
    assert (tree["out"] / "copy.bin").read_bytes() == blob[::-1]
    view = host_view(tree["out"])
    assert set(view) == {"change.txt", "copy.bin", "keep.txt", "report", "report/result.npy"}
    assert view["change.txt"] == "after" and view["keep.txt"] == "keep"
    saved = (tree["out"] / "report" / "result.npy").read_bytes()
    records = {record.path: record for record in result.files}
    assert set(records) == {"/out/change.txt", "/out/copy.bin", "/out/report/result.npy"}
    assert records["/out/report/result.npy"].sha256 == hashlib.sha256(saved).hexdigest()
    assert result.files_refused == []
    assert staging_left(tree) == []
    _no_orphans()


ESCAPES = textwrap.dedent("""
    import errno, os

    def attempt(action):
        try:
            action()
        except OSError as exc:
            return errno.errorcode[exc.errno]
        return "done"

    def write(path, data="pwned"):
        with open(path, "w") as handle:
            handle.write(data)

    def main(outside):
        return {
            "ro write": attempt(lambda: write("/data/in.csv")),
            "ro create": attempt(lambda: write("/data/new.txt")),
            "ro link follow": attempt(lambda: open("/data/to-secret").read()),
            "ro link target": os.readlink("/data/to-secret"),
            "ro fifo": attempt(lambda: open("/data/pipe").read()),
            "host path": attempt(lambda: write(outside + "/secret.txt")),
            "dotdot": attempt(lambda: write("/out/../../" + outside + "/secret.txt")),
            "symlink": attempt(lambda: os.symlink(outside + "/secret.txt", "/out/evil")),
            "follow own": attempt(lambda: write("/out/evil")),
            "dir link": attempt(lambda: os.symlink(outside, "/out/evildir")),
            "fifo": attempt(lambda: os.mkfifo("/out/fifo")),
            "artifact": attempt(lambda: write("/out/artifact.txt", "fine")),
            "hard link": attempt(lambda: os.link("/out/artifact.txt", "/out/second")),
        }
""")


def test_what_the_guest_makes_in_the_vm_cannot_reach_the_host(
        tree: dict[str, Path]) -> None:
    outside = str(tree["outside"])
    with sandbox(tree) as sb:
        result = sb.run(ESCAPES, entry="main", args=[outside])
    assert result.ok, (result.error, result.stderr)
    seen = result.value
    assert seen["ro write"] == seen["ro create"] == "EROFS"
    assert seen["ro link follow"] == "ELOOP"  # never followed, as on wasm
    assert seen["ro link target"] == str(tree["outside"] / "secret.txt")
    assert seen["ro fifo"] == "ENXIO"
    assert seen["host path"] == seen["dotdot"] == "ENOENT"  # no host directory is in the VM
    assert seen["follow own"] == "ELOOP"
    assert seen["artifact"] == "done"
    # The host: its file outside every mount is untouched, and of everything the guest
    # made only the regular file was published; the rest is reported as refused.
    assert host_view(tree["outside"]) == {"secret.txt": SECRET}
    assert (tree["data"] / "in.csv").read_text() == "a,b\n1,2\n3,4\n5,6\n"
    view = host_view(tree["out"])
    assert view.get("artifact.txt") == "fine", (view, result)
    assert not {"evil", "evildir", "fifo", "second"} & set(view)
    refused = {item.path: item.reason for item in result.files_refused}
    assert refused == {"/out/evil": "symbolic link", "/out/evildir": "symbolic link",
                       "/out/fifo": "FIFO", "/out/second": "hard link"}
    assert [record.path for record in result.files] == ["/out/artifact.txt"]
    assert staging_left(tree) == []


def test_a_run_that_fails_is_killed_or_is_over_its_quota_publishes_nothing(
        tree: dict[str, Path]) -> None:
    before = host_view(tree["out"])
    with sandbox(tree) as sb:
        result = sb.run("open('/out/change.txt', 'w').write('half')\nraise KeyError('late')")
    assert result.error is not None and result.error.type == "KeyError"
    assert result.files == [] and host_view(tree["out"]) == before
    killed = textwrap.dedent("""
        with open("/out/change.txt", "w") as handle:
            handle.write("half")
        open("/out/partial.txt", "w").write("partial")
        while True:
            pass
    """)
    with sandbox(tree, VM_LIMITS.replace(timeout_s=10.0)) as sb:
        result = sb.run(killed)
    assert result.limit_exceeded == Limit.TIMEOUT
    assert result.files == []
    assert host_view(tree["out"]) == before
    assert staging_left(tree) == []
    _no_orphans()
    # Over the quota: the VM lets the write through (its tmpfs admits at least what the
    # quota does); the host counts what comes back and refuses the whole run.
    with sandbox(tree, quota_bytes=4096) as sb:
        result = sb.run("open('/out/big.bin', 'wb').write(b'x' * 10000)")
    assert not result.ok
    assert result.error is not None and result.error.type == "OSError"
    assert "quota" in result.error.message
    assert host_view(tree["out"]) == before
    assert staging_left(tree) == []


def test_auto_picks_the_microvm_for_numpy_and_keeps_the_mounts(
        tree: dict[str, Path]) -> None:
    with sandbox(tree, backend="auto") as sb:
        result = sb.run(NUMPY_JOB, entry="main")
    assert result.ok, (result.error, result.stderr)
    assert result.backend == "microvm"
    assert result.value["result"] == [4.5, 9.5, 14.5]
    assert (tree["out"] / "change.txt").read_text() == "after"
    assert (tree["out"] / "report" / "result.npy").is_file()
