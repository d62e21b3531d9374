"""Mount depth benchmark: what a writable mount's directory depth costs the host.

For each depth (``--depths``), a host directory holding a chain of that many directories is
mounted writable and taken through a whole run's file work with ``FileSession`` (the host
side every backend uses): staging (the chain is linked into the run's tree), a guest
``mkdir`` and ``rename`` of a directory at the bottom (the rename measures the moved tree's
height), planning and publishing. Printed per depth:

* the fewest descriptors above those already open with which that succeeds, found by
  bisection on the soft ``RLIMIT_NOFILE`` (a real limit, not a count of calls);
* the fewest Python frames the run needs, found the same way on the recursion limit;
* the wall time of the whole sequence (median of ``--runs``).

Then what many concurrent runs at the deepest depth would hold against this process's
``RLIMIT_NOFILE``. Nothing is asserted.

    python bench/mount_depth.py [--depths 8 32 64 128] [--runs 5]
"""

from __future__ import annotations

import argparse
import bisect
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from wasibox import Mount
from wasibox.capabilities.files.mount import MAX_DEPTH, STAGING_DIR
from wasibox.capabilities.files.session import FileSession


def one_run(depth: int) -> None:
    """Stage a mount holding a chain of ``depth - 1`` directories, move the chain one level
    down (so ``depth`` deep) and publish that (depth >= 2)."""
    host = Path(tempfile.mkdtemp(prefix="wasibox-depth-"))
    try:
        host.joinpath(*["d"] * (depth - 1)).mkdir(parents=True)
        with FileSession([Mount(host, "/out", writable=True)], 8) as session:
            session.mkdir("/out/new", 0o755)
            session.rename("/out/d", "/out/new/d")
            _, refused = session.publish()
        if refused or not host.joinpath("new", *["d"] * (depth - 1)).is_dir():
            raise RuntimeError(f"depth {depth}: the run was not published as written")
        # Discarding the staging ignores errors: a staging left behind counts as a failure.
        if list(host.joinpath(STAGING_DIR).glob("run-*")):
            raise OSError(f"depth {depth}: the run's staging was left behind")
    finally:
        shutil.rmtree(host)


def fewest(works: Callable[[int], bool], high: int) -> int:
    """The least n in [0, high] for which ``works(n)`` holds (it holds for ``high``)."""
    return bisect.bisect_left(range(high + 1), True, key=works)


def descriptors_needed(depth: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The limit bounds descriptor numbers: fill the holes below the highest one open, so
    # that ``extra`` more descriptors is exactly what fits under ``base + extra``.
    top = max(map(int, os.listdir("/proc/self/fd")))
    fillers = []
    while (fd := os.open(os.devnull, os.O_RDONLY)) < top:
        fillers.append(fd)
    os.close(fd)
    base = fd

    def works(extra: int) -> bool:
        resource.setrlimit(resource.RLIMIT_NOFILE, (base + extra, hard))
        try:
            one_run(depth)
            return True
        except OSError:
            return False
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    try:
        return fewest(works, 4 * depth + 64)
    finally:
        for fd in fillers:
            os.close(fd)


def frames_needed(depth: int) -> int:
    limit = sys.getrecursionlimit()

    def works(extra: int) -> bool:
        sys.setrecursionlimit(len_stack() + extra)  # frames below this one
        try:
            one_run(depth)
            return True
        except RecursionError:
            return False
        finally:
            sys.setrecursionlimit(limit)

    return fewest(works, 4 * depth + 200)


def len_stack() -> int:
    """How many frames the calling thread's stack holds."""
    frame: FrameType | None = sys._getframe()
    count = 0
    while frame is not None:
        count, frame = count + 1, frame.f_back
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+",
                        default=sorted({8, 32, 64, MAX_DEPTH}))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"MAX_DEPTH = {MAX_DEPTH}")
    print(f"{'depth':>6} {'descriptors':>12} {'frames':>7} {'median ms':>10}")
    needed = 0
    for depth in args.depths:
        descriptors = descriptors_needed(depth)
        frames = frames_needed(depth)
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            one_run(depth)
            times.append(time.perf_counter() - start)
        print(f"{depth:>6} {descriptors:>12} {frames:>7} "
              f"{statistics.median(times) * 1e3:>10.1f}")
        needed = descriptors
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    for runs in (2, 32, 256):
        print(f"{runs} concurrent runs at depth {args.depths[-1]}: {runs * needed} "
              f"descriptors at most, against RLIMIT_NOFILE {soft}")


if __name__ == "__main__":
    main()
