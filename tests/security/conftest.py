"""Shared checks for the adversarial suite: every hostile case must leave the host unaffected.

``host`` is a fixture that records the host's baseline (resident memory, open file
descriptors, live threads) before a case; ``host.assert_unaffected(sandbox)`` then checks,
after the case, that

* the next benign run in the same sandbox succeeds,
* the host's private resident memory is back within ``RSS_SLACK_BYTES`` of the baseline,
* no file descriptor was leaked, and
* no thread was left behind: neither a Python thread (wasibox's own service threads may
  come and go, but never more of them than at the baseline) nor a native one (wasmtime's
  I/O worker threads idle out after ~10 s, so a few extra are waited for).

Host exceptions need no check of their own: ``Sandbox.run`` raising would fail the test.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

import wasibox
from tests.conftest import PYTHON, child_env

#: What the host may still hold after a hostile run, over its baseline: allocator caches and
#: the instance the pool made ahead of demand (its memory is the guest's snapshot, ~30 MiB).
RSS_SLACK_BYTES = 96 * 2**20
BENIGN = "print(sum(range(10)))"
#: Warms what the host makes once per process on first use: wasmtime's runtime for the
#: guest's WASI output (its eventfd, epoll fd and worker threads).
WARM_UP = "import os\nos.write(1, b'')\nprint(sum(range(10)))"
#: How long to wait for wasmtime's idle I/O worker threads to exit before calling them leaked.
NATIVE_THREAD_GRACE_S = 15.0


def rss_bytes() -> int:
    """The host's private resident memory now (not its peak), after a garbage collection.

    Pages of mapped files do not count: each memory slot the instance pool opens maps the
    compiled guest's image and reads it in once (see ``backends/wasm/slots.py``), and those pages
    are the kernel's page cache, shared by every slot, not memory the host holds on to.
    """
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("/proc/self/status has no RssAnon line")


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def live_threads() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@dataclasses.dataclass
class HostBaseline:
    rss: int
    fds: set[int]
    threads: list[str]
    native_threads: int

    def assert_unaffected(self, sandbox: wasibox.Sandbox) -> None:
        after = sandbox.run(BENIGN)
        assert after.ok and after.stdout == "45\n", after
        deadline = time.monotonic() + NATIVE_THREAD_GRACE_S
        while True:  # wasmtime may release a run's resources a moment after it returns
            leaked_fds = open_fds() - self.fds
            extra_threads = _excess(live_threads(), self.threads)
            extra_native = native_threads() - self.native_threads
            if (not leaked_fds and not extra_threads and extra_native <= 0
                    or time.monotonic() > deadline):
                break
            time.sleep(0.1)
        assert not leaked_fds, {fd: _describe_fd(fd) for fd in leaked_fds}
        assert not extra_threads, extra_threads
        assert extra_native <= 0, f"{extra_native} native threads more than at the baseline"
        grown = rss_bytes() - self.rss
        assert grown < RSS_SLACK_BYTES, f"host RSS grew by {grown / 2**20:.0f} MiB"


def _excess(now: list[str], before: list[str]) -> list[str]:
    remaining = list(before)
    extra = []
    for name in now:
        if name in remaining:
            remaining.remove(name)
        else:
            extra.append(name)
    return extra


def _describe_fd(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def take_baseline(sandbox: wasibox.Sandbox) -> HostBaseline:
    """Warm the sandbox (so its service threads and pooled instance exist), then measure."""
    assert sandbox.run(WARM_UP).ok
    return HostBaseline(rss=rss_bytes(), fds=open_fds(), threads=live_threads(),
                        native_threads=native_threads())


@pytest.fixture()
def host(request: pytest.FixtureRequest) -> Iterator[HostBaseline]:
    """The baseline of the module's ``sb`` sandbox fixture, taken before the test."""
    sandbox: wasibox.Sandbox = request.getfixturevalue("sb")
    yield take_baseline(sandbox)


_CHILD_HOST = """
import json, resource, sys, time, wasibox
limits = wasibox.Limits(**json.loads(sys.argv[1]))
with wasibox.Sandbox(limits) as sandbox:
    assert sandbox.run("print(1)").ok
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    result = sandbox.run(sys.argv[2])
    wall = time.monotonic() - started
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    after = sandbox.run("print(6 * 7)")
print(json.dumps({"peak_growth_bytes": grown * 1024, "limit": result.limit_exceeded,
                  "error": result.error and result.error.type, "next_ok": after.ok,
                  "wall_s": wall, "value_length": len(result.value or ()),
                  "log": [[e.target, e.allowed] for e in result.capability_log]}))
"""


def run_in_child_host(code: str, **limits: object) -> dict[str, object]:
    """Run ``code`` in a fresh host process; report how far the host's peak RSS grew, how
    long ``Sandbox.run`` took (the reply's decoding included), and what the run returned.

    A process of its own, because peak RSS only ever rises: measured in the test process,
    an earlier test's peak would hide this one's.
    """
    done = subprocess.run([PYTHON, "-c", _CHILD_HOST, json.dumps(limits), code],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
