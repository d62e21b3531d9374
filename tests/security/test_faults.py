"""Faults of the host itself: killed mid-write, and a full disk under a writable mount.

The host process is killed (SIGKILL, no cleanup) at 50 random points while it stages and
publishes a run's files. After every kill the output directory holds either nothing new or
complete files, never a partial one, and the next start reclaims the staging. The child
host drives the same ``FileSession`` calls a guest's writes become, without an engine, so
each kill costs a process start of ~0.1 s rather than ~1 s.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import wasibox
from tests.conftest import PYTHON, child_env
from tests.security.conftest import take_baseline
from wasibox.capabilities.files.mount import STAGING_DIR
from wasibox.capabilities.files.session import FileSession

pytestmark = pytest.mark.guest

KILLS = 50
FILES = 12
FILE_BYTES = 128 * 1024

WRITER = f"""
import sys
import wasibox
from wasibox.capabilities.files import session as files
mount = wasibox.Mount(sys.argv[1], "/out", writable=True, quota_bytes=2**30)
session = files.FileSession([mount], open_files=8)
print("staged", flush=True)
for index in range({FILES}):
    fd = session.open(f"/out/f{{index}}.bin", files.F_WRITE | files.F_CREATE | files.F_TRUNC,
                      0o644)
    block = bytes([index]) * 4096
    for _ in range({FILE_BYTES} // 4096):
        session.write(fd, block.decode("latin-1"))
    session.close_fd(fd)
session.publish()
print("published", flush=True)
"""


def expected(index: int) -> str:
    return hashlib.sha256(bytes([index]) * FILE_BYTES).hexdigest()


def staging_runs(out: Path) -> list[str]:
    staging = out / STAGING_DIR
    return sorted(p.name for p in staging.iterdir() if p.name.startswith("run-")) \
        if staging.exists() else []


def published(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in out.iterdir() if p.name != STAGING_DIR}


def test_a_host_killed_at_random_points_never_publishes_a_partial_file(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    subprocess.run([PYTHON, "-c", WRITER, str(out)], env=child_env(), check=True, timeout=60)
    full_run_s = time.monotonic() - started
    rng = random.Random(7)  # reproducible kill points
    outcomes = {"nothing new": 0, "complete": 0}
    for _ in range(KILLS):
        for name in list(published(out)):
            (out / name).unlink()
        child = subprocess.Popen([PYTHON, "-c", WRITER, str(out)], env=child_env(),
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0, full_run_s))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        assert child.stdout is not None
        child.stdout.close()
        files = published(out)
        # Each file is complete or absent: never partial, never another file's bytes.
        for name, digest in files.items():
            index = int(name.removeprefix("f").removesuffix(".bin"))
            assert digest == expected(index), name
        outcomes["complete" if files else "nothing new"] += 1
        # The next start reclaims whatever the killed host left in staging.
        with FileSession([wasibox.Mount(out, "/out", writable=True)], open_files=8) as session:
            assert len(staging_runs(out)) == 1  # only this session's own
            session.close()
        assert staging_runs(out) == []
        for name, digest in published(out).items():  # a reclaimed journal completes a publish
            assert digest == expected(int(name.removeprefix("f").removesuffix(".bin")))
    assert sum(outcomes.values()) == KILLS


# -- a full disk -------------------------------------------------------------------------------

@pytest.fixture()
def small_disk() -> Iterator[Path]:
    """A 2 MiB tmpfs, mounted for the test (needs root and mount permission)."""
    with tempfile.TemporaryDirectory() as directory:
        mountpoint = Path(directory)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs",
                               str(mountpoint)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here, so no small disk to fill: "
                        f"{done.stderr.strip()}")
        try:
            yield mountpoint
        finally:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def test_a_full_disk_gives_the_guest_enospc_and_keeps_the_host_intact(
        small_disk: Path) -> None:
    out = small_disk / "out"
    out.mkdir()
    (out / "kept.txt").write_text("the host's own file\n")
    writer = """
import errno
try:
    with open('/out/big.bin', 'wb') as f:
        while True:
            f.write(b'x' * 65536)
except OSError as exc:
    print(errno.errorcode[exc.errno])
import os
os.remove('/out/big.bin')
with open('/out/small.txt', 'w') as f:
    f.write('fits once the big file is gone\\n')
"""
    # The byte quota is larger than the disk: the disk fills first.
    mount = wasibox.Mount(out, "/out", writable=True, quota_bytes="64MiB")
    with wasibox.Sandbox(mounts=[mount]) as sb:
        baseline = take_baseline(sb)
        r = sb.run(writer)
        assert r.ok, (r.error, r.stderr)
        assert r.stdout == "ENOSPC\n"
        assert [f.path for f in r.files] == ["/out/small.txt"]
        assert (out / "kept.txt").read_text() == "the host's own file\n"
        assert not (out / "big.bin").exists()
        assert staging_runs(out) == []
        # A run that fills the disk and then ends ok. Regression: publishing it raised the
        # host's OSError out of Sandbox.run; now the run reports it, and nothing is published.
        full = sb.run("f = open('/out/fill.bin', 'wb')\n"
                      "try:\n    while True:\n        f.write(b'y' * 65536)\n"
                      "except OSError:\n    pass\ntry:\n    f.close()\n"
                      "except OSError:\n    pass")
        assert not full.ok and full.error is not None and full.error.type == "OSError"
        assert "could not be published" in full.error.message and full.files == []
        assert sorted(os.listdir(out)) == [STAGING_DIR, "kept.txt", "small.txt"]
        assert staging_runs(out) == []
        baseline.assert_unaffected(sb)
