"""Load test of ``wasibox serve``: many requests at once against the live service.

What it does (everything is printed; the exit status is 1 only if a response was wrong or
lost, or the service did not come back to its baseline):

1. Starts ``wasibox serve`` on 127.0.0.1 (a free port) in a subprocess, with one tenant.
2. Warms it up, waits for it to go idle, and records the service process's baseline: RSS,
   open file descriptors and threads (from /proc).
3. Sends ``--requests`` requests (default 1,000) with ``--concurrency`` in flight (default 50),
   alternating ``/v1/run`` and ``/v1/call``, each with its own expected answer, and checks
   every response: status 200 and the exact output or value. Nothing may be lost.
4. Waits for the service to go idle again and compares RSS, fds and threads to the baseline.
5. Prints p50/p99 latency (client-side, per request) and throughput.

    python bench/serve_load.py [--requests 1000] [--concurrency 50] [--max-concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from wasibox.services.config import hash_token

TOKEN = "bench-load-token"
#: How long the service must stay quiet before its resources are sampled: the epoch ticker
#: and the pool's refill thread end after a few idle seconds.
SETTLE_S = 7.0
#: Allowed RSS growth between the two idle samples (allocator slack, not a leak).
RSS_SLACK_BYTES = 16 * 2**20


def config_text(max_concurrency: int, max_queue: int) -> str:
    return f"""
[tenants.bench]
token_sha256 = "{hash_token(TOKEN)}"
max_concurrency = {max_concurrency}
max_queue = {max_queue}
limits = {{ fuel = 500_000_000, timeout_s = 10 }}
"""


class Service:
    """``wasibox serve`` in a subprocess, with its stderr drained in the background."""

    def __init__(self, config: Path) -> None:
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "wasibox", "serve", "--config", str(config), "--port", "0",
             "--log-level", "warning"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.url = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def drain() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                self.lines.append(line)
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(180) or not self.url:
            self.stop()
            sys.exit("the service did not start:\n" + "".join(self.lines))

    def resources(self) -> dict[str, int]:
        pid = self.process.pid
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"rss": int(fields["VmRSS"].split()[0]) * 1024,
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": int(fields["Threads"])}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def request_for(i: int) -> tuple[str, dict[str, object], object]:
    """The i-th request: its path, body and the answer it must produce."""
    if i % 2:
        return ("/v1/call", {"code": "def f(a, b):\n    return {'sum': a + b, 'i': a}",
                             "entry": "f", "args": [i, 1000]}, {"sum": i + 1000, "i": i})
    return "/v1/run", {"code": f"print(sum(range({i})))"}, f"{sum(range(i))}\n"


async def load(url: str, requests: int, concurrency: int) -> tuple[list[float], list[str], float]:
    latencies: list[float] = []
    failures: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {TOKEN}"}) as client:
        async def one(i: int) -> None:
            path, body, expected = request_for(i)
            async with gate:
                started = time.perf_counter()
                try:
                    response = await client.post(path, json=body)
                except httpx.HTTPError as exc:
                    failures.append(f"request {i}: {type(exc).__name__}: {exc}")
                    return
                latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                failures.append(f"request {i}: HTTP {response.status_code}: {response.text}")
                return
            result = response.json()
            got = result["value"] if path == "/v1/call" else result["stdout"]
            if not result["ok"] or got != expected:
                failures.append(f"request {i}: expected {expected!r}, got {got!r}")

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed = time.perf_counter() - started
    return latencies, failures, elapsed


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description="Load-test a live `wasibox serve`.")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=50,
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=4,
                        help="the tenant's max_concurrency (runs executing at once)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "wasibox.toml"
        config.write_text(config_text(args.max_concurrency, max(args.concurrency, 1)))
        service = Service(config)
        try:
            print(f"service at {service.url} (pid {service.process.pid}), tenant "
                  f"max_concurrency={args.max_concurrency}", flush=True)
            asyncio.run(load(service.url, args.concurrency * 2, args.concurrency))  # warm-up
            time.sleep(SETTLE_S)
            baseline = service.resources()
            latencies, failures, elapsed = asyncio.run(
                load(service.url, args.requests, args.concurrency))
            time.sleep(SETTLE_S)
            after = service.resources()
        finally:
            service.stop()

    print(f"\n{args.requests} requests, {args.concurrency} in flight")
    print(f"  answered    {len(latencies)} ({len(failures)} wrong or lost)")
    for failure in failures[:10]:
        print(f"    {failure}")
    if latencies:
        print(f"  latency     p50 {percentile(latencies, 0.5) * 1e3:.1f} ms   "
              f"p99 {percentile(latencies, 0.99) * 1e3:.1f} ms   "
              f"mean {statistics.mean(latencies) * 1e3:.1f} ms")
    print(f"  throughput  {args.requests / elapsed:.0f} requests/s ({elapsed:.2f} s)")
    print("  service resources, idle before -> idle after:")
    leaked = False
    for name, unit in (("rss", "MiB"), ("fds", ""), ("threads", "")):
        scale = 2**20 if unit else 1
        before_value, after_value = baseline[name] / scale, after[name] / scale
        grew = after[name] - baseline[name]
        ok = grew <= (RSS_SLACK_BYTES if name == "rss" else 0)
        leaked |= not ok
        print(f"    {name:<8} {before_value:>9.1f} -> {after_value:>9.1f} {unit:<4} "
              f"({'back to baseline' if ok else 'GREW'})")
    return 1 if failures or leaked or len(latencies) != args.requests else 0


if __name__ == "__main__":
    sys.exit(main())
