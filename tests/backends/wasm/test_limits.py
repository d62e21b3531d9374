"""Every limit, with its limit_exceeded value, and the host still healthy afterwards."""

from __future__ import annotations

import resource
import threading

import pytest

import wasibox
from tests.conftest import open_fds
from wasibox import Limit
from wasibox.backends.wasm.runtime import runtime

pytestmark = pytest.mark.guest

BENIGN = "print(sum(range(10)))"


def assert_host_healthy(sb: wasibox.Sandbox, fds_before: int) -> None:
    after = sb.run(BENIGN)
    assert after.ok and after.stdout == "45\n"
    assert open_fds() <= fds_before + 2


@pytest.fixture()
def fds() -> int:
    # The process-wide runtime holds a few descriptors for good (the compiled guest, and
    # /proc/self/pagemap when memory slots are reused): count from after it exists.
    runtime()
    return open_fds()


def test_fuel_stops_an_infinite_loop(fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(fuel=100_000_000, timeout_s=30)) as sb:
        r = sb.run("while True: pass")
        assert (r.ok, r.limit_exceeded, r.fuel_used) == (False, Limit.FUEL, 100_000_000)
        assert r.limit_exceeded == "fuel"
        assert_host_healthy(sb, fds)


def test_timeout_stops_an_infinite_loop(fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(fuel=10**15, timeout_s=0.3)) as sb:
        r = sb.run("while True: pass")
        assert r.limit_exceeded is Limit.TIMEOUT
        assert r.duration_s < 10  # generous: only proves the loop did not run unbounded
        assert_host_healthy(sb, fds)


@pytest.mark.parametrize("clock", ["virtual", "real"])
def test_sleep_ends_at_the_timeout(clock: str, fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(timeout_s=0.5), clock=clock) as sb:  # type: ignore[arg-type]
        r = sb.run("import time\nprint('before', flush=True)\ntime.sleep(3600)\nprint('after')")
        assert r.limit_exceeded is Limit.TIMEOUT
        assert r.stdout == "before\n"
        assert r.duration_s < 60
        assert_host_healthy(sb, fds)


def test_short_real_sleep_completes() -> None:
    with wasibox.Sandbox(wasibox.Limits(timeout_s=5), clock="real") as sb:
        r = sb.run("import time\nt = time.monotonic()\ntime.sleep(0.05)\n"
                   "print(time.monotonic() - t >= 0.05)")
        assert r.ok and r.stdout == "True\n"


def test_blocking_bypasses_are_cut_short(sandbox: wasibox.Sandbox) -> None:
    # Ways around the patched time.sleep still cannot block past the deadline.
    for code in ("import select\nselect.select([], [], [], 3600)",
                 "import sys\ndel sys.modules['time']\nimport time\ntime.sleep(3600)",
                 "import asyncio\nasyncio.run(asyncio.sleep(3600))"):
        r = sandbox.run(code)
        assert r.limit_exceeded is Limit.TIMEOUT, code


def test_asyncio_runs_with_the_virtual_clock(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("""
import asyncio
async def job(n):
    await asyncio.sleep(0.1 * n)
    return n
async def main():
    return await asyncio.gather(*(job(n) for n in range(5)))
print(asyncio.run(main()))
""")
    assert r.ok and r.stdout == "[0, 1, 2, 3, 4]\n"


def test_memory_cap_gives_memory_error(fds: int) -> None:
    with wasibox.Sandbox(wasibox.Limits(memory_bytes="96MiB")) as sb:
        r = sb.run("x = bytearray(200 * 2**20)")
        assert r.limit_exceeded is Limit.MEMORY
        assert r.error is not None and r.error.type == "MemoryError"
        assert r.memory_peak_bytes == 96 * 2**20
        caught = sb.run("try:\n    x = bytearray(200 * 2**20)\nexcept MemoryError:\n"
                        "    print('caught')")
        assert caught.ok and caught.stdout == "caught\n"  # a handled MemoryError is no limit
        creep = sb.run("chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))")
        assert creep.limit_exceeded is Limit.MEMORY
        assert_host_healthy(sb, fds)


def test_output_flood_is_capped_and_host_memory_bounded(fds: int) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with wasibox.Sandbox(wasibox.Limits(output_bytes=64 * 1024, timeout_s=10)) as sb:
        r = sb.run("while True: print('A' * 10**6)")
        assert r.limit_exceeded is Limit.OUTPUT
        assert r.stdout_truncated and not r.stderr_truncated
        assert len(r.stdout) == 64 * 1024
        giant = sb.run("import sys\nsys.stderr.write('B' * 10**7)")
        assert giant.limit_exceeded is Limit.OUTPUT and giant.stderr_truncated
        assert len(giant.stderr) == 64 * 1024
        both = sb.run("import sys\nprint('x' * 40000)\nsys.stderr.write('y' * 40000)")
        assert len(both.stdout) + len(both.stderr) == 64 * 1024
        assert_host_healthy(sb, fds)
    # The host never buffered the flood: its peak RSS grew by far less than the 10 MB line.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


def test_output_under_the_cap_is_untouched() -> None:
    with wasibox.Sandbox(wasibox.Limits(output_bytes=1000)) as sb:
        r = sb.run("print('z' * 998)")
        assert r.ok and not r.stdout_truncated and r.stdout == "z" * 998 + "\n"


def test_deep_recursion_is_a_clean_error(sandbox: wasibox.Sandbox) -> None:
    r = sandbox.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert r.error is not None and r.error.type == "RecursionError"
    deep = sandbox.run("import sys\nsys.setrecursionlimit(10**6)\n"
                       "def f(n):\n    return f(n + 1)\nf(0)")
    assert not deep.ok  # a RecursionError, stack exhaustion or fuel: never a host crash
    assert sandbox.run(BENIGN).ok


def test_limits_hold_under_concurrency() -> None:
    with wasibox.Sandbox(wasibox.Limits(fuel=30_000_000, timeout_s=5)) as sb:
        outcomes: list[wasibox.RunResult] = []
        lock = threading.Lock()

        def work(code: str) -> None:
            result = sb.run(code)
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=work, args=(code,))
                   for code in ["while True: pass", BENIGN] * 4]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(str(r.limit_exceeded) for r in outcomes) == ["None"] * 4 + ["fuel"] * 4
    assert all(r.stdout == "45\n" for r in outcomes if r.limit_exceeded is None)
