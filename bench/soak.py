"""Leak soak: many sequential runs in one process, some of them hostile, watching RSS and fds.

Runs ``--runs`` runs (default 10,000) one after another in one Sandbox. One run in ten is
hostile, cycling through: an infinite loop (fuel), a busy wait past the deadline (timeout),
memory growth (memory), an output flood (output) and an attempt to reach the cloud metadata
address (denied by the HTTP gate; the guest has no sockets). Every run's result is checked.
The process's RSS, open fds and threads are sampled every ``--sample-every`` runs (default
500), and the RSS slope per run is fitted by least squares over the samples after warm-up
(the first ``--warmup`` runs, default 1,000). Target: under 2 KiB per run. Nothing is
asserted; the exit status is 1 if a run's result was wrong.

    python bench/soak.py [--runs 10000] [--sample-every 500] [--warmup 1000]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import wasibox
from wasibox import Limit

SLOPE_TARGET_BYTES = 2048
LIMITS = wasibox.Limits(fuel=150_000_000, timeout_s=1.0, memory_bytes="96MiB",
                        output_bytes="64KiB")

Check = Callable[[wasibox.RunResult], bool]

#: The hostile runs, in the order they cycle, with what each must report.
HOSTILE: list[tuple[str, str, Check]] = [
    ("infinite loop", "while True: pass",
     lambda r: r.limit_exceeded is Limit.FUEL),
    ("past the deadline", "import time\nwhile True: time.sleep(0.05)",
     lambda r: r.limit_exceeded is Limit.TIMEOUT),
    ("memory growth", "blocks = []\nwhile True: blocks.append(bytearray(2**23))",
     lambda r: r.limit_exceeded is Limit.MEMORY),
    ("output flood", "while True: print('x' * 4096)",
     lambda r: r.limit_exceeded is Limit.OUTPUT and r.stdout_truncated),
    ("network", "import urllib.request\n"
                "urllib.request.urlopen('http://169.254.169.254/latest/meta-data/', timeout=1)",
     lambda r: r.error is not None and r.error.type == "CapabilityDenied"
     and [e.allowed for e in r.capability_log] == [False]),
]


def benign(i: int) -> tuple[str, Check]:
    code = f"import json\nprint(json.dumps({{'i': {i}, 's': sum(range({i % 500}))}}))"
    expected = f'{{"i": {i}, "s": {sum(range(i % 500))}}}\n'
    return code, lambda r: r.ok and r.stdout == expected


def sample() -> tuple[int, int, int]:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    return rss, len(os.listdir("/proc/self/fd")), threading.active_count()


def main() -> int:
    parser = argparse.ArgumentParser(description="Sequential leak soak with hostile runs.")
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=1_000,
                        help="runs before the RSS slope is fitted (default: %(default)s)")
    args = parser.parse_args()

    # The "past the deadline" run sleeps, so it needs the real clock to reach its deadline.
    # HTTP is granted for one allowlisted name only, so the network run is refused by the
    # mediating gate (the metadata address is denied whatever the allowlist says).
    sandbox = wasibox.Sandbox(LIMITS, clock="real",
                              http=wasibox.HttpPolicy(allow=["api.example.com"]))
    wrong: list[str] = []
    samples: list[tuple[int, int, int, int]] = []  # runs done, rss, fds, threads
    kinds: dict[str, int] = {}
    started = time.perf_counter()
    print(f"{'runs':>7} {'RSS MiB':>9} {'fds':>5} {'threads':>8} {'runs/s':>8}", flush=True)
    for i in range(args.runs):
        if i % 10 == 9:
            name, code, check = HOSTILE[(i // 10) % len(HOSTILE)]
        else:
            name, (code, check) = "benign", benign(i)
        result = sandbox.run(code)
        kinds[name] = kinds.get(name, 0) + 1
        if not check(result):
            wrong.append(f"run {i} ({name}): ok={result.ok} limit={result.limit_exceeded} "
                         f"error={result.error and result.error.type}")
        done = i + 1
        if done % args.sample_every == 0 or done == args.runs:
            gc.collect()
            rss, fds, threads = sample()
            samples.append((done, rss, fds, threads))
            rate = done / (time.perf_counter() - started)
            print(f"{done:>7} {rss / 2**20:>9.1f} {fds:>5} {threads:>8} {rate:>8.0f}",
                  flush=True)
    sandbox.close()

    print(f"\n{args.runs} runs in {time.perf_counter() - started:.0f} s: "
          + ", ".join(f"{count} {name}" for name, count in sorted(kinds.items())))
    print(f"  wrong results: {len(wrong)}")
    for line in wrong[:10]:
        print(f"    {line}")
    fitted = [(done, rss) for done, rss, _, _ in samples if done > args.warmup]
    if len(fitted) >= 2:
        slope = statistics.linear_regression([d for d, _ in fitted],
                                             [r for _, r in fitted]).slope
        verdict = "met" if slope < SLOPE_TARGET_BYTES else "MISSED"
        print(f"  RSS slope after {args.warmup} warm-up runs: {slope:+.1f} bytes/run "
              f"(target < {SLOPE_TARGET_BYTES}: {verdict})")
    else:
        print("  RSS slope: not enough samples after warm-up (raise --runs)")
    fds = [f for _, _, f, _ in samples]
    print(f"  fds: first sample {fds[0]}, last {fds[-1]}, max {max(fds)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
