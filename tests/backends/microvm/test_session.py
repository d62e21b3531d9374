"""Sessions on the microVM backend: one VM, and one interpreter in it, for a session's life.

Real QEMU, the real image and agent; under TCG each call costs a fraction of a second, so
the calls are few and each asserts several things. With mounts, the same semantics as a wasm
session's: one view for the session's life, published when it closes, discarded when a
limit or a trap ends it (the host side of the copy is in ``test_files.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import wasibox
from tests.backends.microvm.host_tree import host_view
from wasibox import Limit, Limits, Mount, SessionEnd, SessionEnded
from wasibox.backends.microvm.backend import FUEL_PER_CPU_SECOND
from wasibox.backends.microvm.runtime import MicroVMRuntime
from wasibox.capabilities.files.mount import STAGING_DIR

from .test_backend import VM_LIMITS, _no_orphans, vm_runtime  # noqa: F401 - the fixture

pytestmark = pytest.mark.microvm


def test_a_session_keeps_its_vm_and_interpreter(vm_runtime: MicroVMRuntime) -> None:  # noqa: F811
    with wasibox.Sandbox(VM_LIMITS, backend="microvm", allow_emulation=True) as sandbox:
        with sandbox.session() as session:
            first = session.run("import numpy as np\nimport random\na = np.arange(4)\n"
                                "r = random.random()")
            assert first.ok, first
            assert first.isolation in ("kvm", "tcg") and first.backend == "microvm"
            second = session.run("a = a * 2\nprint(int(a.sum()), random.random() != r)")
            assert second.stdout == "12 True\n"
            failed = session.run("raise KeyError('k')")
            assert failed.error is not None and failed.error.type == "KeyError"
            assert session.ended is None  # an exception does not end it
            # Each call has its own CPU budget: a loop past one second of it ends the session.
            stopped = session.run("while True: pass",
                                  limits={"fuel": FUEL_PER_CPU_SECOND, "timeout_s": 30})
            assert stopped.limit_exceeded is Limit.FUEL
            assert session.ended is SessionEnd.LIMIT
            with pytest.raises(SessionEnded, match="fuel limit"):
                session.run("print(a)")
        with sandbox.session() as fresh:  # a new session is a new VM, from the template
            assert fresh.run("print('a' in dir())").stdout == "False\n"
    _no_orphans()


def _mount_tree(root: Path) -> dict[str, Path]:
    data, out = root / "data", root / "out"
    for directory in (data, out / "old"):
        directory.mkdir(parents=True)
    (data / "in.csv").write_text("a,b\n1,2\n")
    (out / "change.txt").write_text("before")
    (out / "gone.txt").write_text("bye")
    (out / "old" / "stale.txt").write_text("stale")
    return {"data": data, "out": out}


def _mounted(tree: dict[str, Path], limits: Limits = VM_LIMITS,
             **options: Any) -> wasibox.Sandbox:
    return wasibox.Sandbox(limits, backend="microvm", allow_emulation=True, mounts=[
        Mount(tree["data"], "/data"), Mount(tree["out"], "/out", writable=True, **options)])


CALL_ONE = """
import os
rows = open("/data/in.csv").read().splitlines()
log = open("/out/log.txt", "w")  # stays open for the next call
log.write("one ")
open("/out/made.txt", "w").write("made in call one")
open("/out/change.txt", "w").write("after")
os.remove("/out/gone.txt")
os.symlink("/etc/passwd", "/out/link")
try:
    open("/data/in.csv", "w")
except OSError as exc:
    print("read-only:", exc.errno == 30)
"""

CALL_TWO = """
import os
log.write("two")
log.close()
print(open("/out/made.txt").read(), len(rows))
os.remove("/out/made.txt")  # made by the previous call: its removal must come back too
os.makedirs("/out/new/deep")
open("/out/new/deep/rows.txt", "w").write(str(rows))
"""


def test_a_session_keeps_its_mounts_between_calls_and_publishes_at_close(
        vm_runtime: MicroVMRuntime, tmp_path: Path) -> None:  # noqa: F811
    tree = _mount_tree(tmp_path)
    before = host_view(tree["out"])
    with _mounted(tree) as sandbox, sandbox.session() as session:
        first = session.run(CALL_ONE)
        assert first.ok, (first.error, first.stderr)
        assert first.stdout == "read-only: True\n"
        second = session.run(CALL_TWO)
        assert second.ok, (second.error, second.stderr)
        assert second.stdout == "made in call one 2\n"
        # The session's view holds both calls' writes; the host directory nothing yet.
        view = session._view("/out")
        assert view is not None and (view / "log.txt").read_text() == "one two"
        assert host_view(tree["out"]) == before
    assert host_view(tree["out"]) == {
        "change.txt": "after", "log.txt": "one two", "new": "/", "new/deep": "/",
        "new/deep/rows.txt": "['a,b', '1,2']", "old": "/", "old/stale.txt": "stale"}
    assert sorted(record.path for record in session.files) == [
        "/out/change.txt", "/out/log.txt", "/out/new/deep/rows.txt"]
    # Reported after each call, refused once: the last account is what stands.
    assert [(item.path, item.reason) for item in session.files_refused] == [
        ("/out/link", "symbolic link")]
    assert (tree["data"] / "in.csv").read_text() == "a,b\n1,2\n"
    assert not (tree["out"] / STAGING_DIR).exists() or not any(
        name.startswith("run-") for name in os.listdir(tree["out"] / STAGING_DIR))
    _no_orphans()


def test_a_session_cut_short_or_over_its_quota_publishes_nothing_by_default(
        vm_runtime: MicroVMRuntime, tmp_path: Path) -> None:  # noqa: F811
    tree = _mount_tree(tmp_path)
    before = host_view(tree["out"])
    write = "open('/out/{0}.txt', 'w').write('{0}')"
    spin = write.format("late") + "\nwhile True: pass"
    short = {"fuel": FUEL_PER_CPU_SECOND, "timeout_s": 30}
    with _mounted(tree) as sandbox:
        with sandbox.session() as session:  # a limit ends it: its writes are discarded
            assert session.run(write.format("kept")).ok
            assert session.run(spin, limits=short).limit_exceeded is Limit.FUEL
            assert session.ended is SessionEnd.LIMIT
        assert host_view(tree["out"]) == before and session.files == []
        with sandbox.session(publish="always") as session:
            assert session.run(write.format("kept")).ok
            assert session.run(spin, limits=short).limit_exceeded is Limit.FUEL
        # The VM was killed before it could report the cut-short call: "always" publishes
        # the state after the last call that completed.
        assert host_view(tree["out"]) == {**before, "kept.txt": "kept"}
    (tree["out"] / "kept.txt").unlink()
    with _mounted(tree, quota_bytes=4096) as sandbox, sandbox.session() as session:
        # The VM lets the write through; the host counts what comes back after the call.
        over = session.run("open('/out/big.bin', 'wb').write(b'x' * 10000)")
        assert over.error is not None and over.error.type == "OSError"
        assert "quota" in over.error.message
        assert session.ended is SessionEnd.TRAP
        with pytest.raises(SessionEnded):
            session.run("print(1)")
    assert host_view(tree["out"]) == before
    _no_orphans()
