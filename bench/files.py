"""Files benchmark: what the host-mediated ``files`` capability costs, against its alternatives.

What it measures (everything is printed; nothing is asserted):

1. Run latency, median over ``--runs`` runs of ``print(1)``: with no mounts (the baseline),
   with a read-only mount, with an empty writable mount (staging made and discarded), and
   with a writable mount already holding ``--files`` files (staging populated with links);
   each writable one also with ``c_access`` (a new instance with a preopen instead of a
   pooled one, and the staging populated with copies).
2. One mediated call: ``os.stat`` on a mounted file, ``--calls`` times in one run, minus an
   empty loop; microseconds per call.
3. Bulk data in 64 KiB chunks through ``open()``: reading and writing a ``--mib`` MiB file,
   MB/s, beside the same loop in plain host Python (the ratio is the mediation's price).
   The write figure includes publishing (sha256, fsync, rename).
4. The alternative the design rejected: the same read through wasmtime's own WASI
   filesystem (a preopened directory, read with the guest's original ``open``). It cannot
   give quotas, EMFILE, staging or an audit; this shows what that would have saved.
5. Publishing: a run that writes 100 small files, against the baseline.

    python bench/files.py [--runs 30] [--calls 2000] [--mib 16] [--files 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import wasmtime

import wasibox
from wasibox.backends.wasm.backend import WasmBackend
from wasibox.backends.wasm.runtime import WasmRuntime

CHUNK = 1 << 16


def median_s(runs: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ok(r: wasibox.RunResult) -> wasibox.RunResult:
    assert r.ok, (r.error, r.stderr, r.limit_exceeded)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--files", type=int, default=200)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wasibox-bench-files-"))
    data, out, full = root / "data", root / "out", root / "full"
    for directory in (data, out, full):
        directory.mkdir()
    size = args.mib * 2**20
    (data / "big.bin").write_bytes(os.urandom(size))
    line = b"2024-01-01,order-000123,widget,3,19.99\n"
    (data / "big.csv").write_bytes((line * (size // len(line) + 1))[:size])
    (data / "small.txt").write_text("x")
    for i in range(args.files):
        (full / f"f{i}.txt").write_text(str(i))
    limits = wasibox.Limits(timeout_s=120, fuel=10**13)
    big_quota = {"quota_bytes": 4 * size}

    def sandbox(*mounts: wasibox.Mount) -> wasibox.Sandbox:
        return wasibox.Sandbox(limits, mounts=list(mounts))

    ro = wasibox.Mount(data, "/data")
    rw = wasibox.Mount(out, "/out", writable=True, **big_quota)
    print(f"runs={args.runs} calls={args.calls} file={args.mib} MiB files={args.files}")

    # 1. latency
    with wasibox.Sandbox(limits) as plain:
        base = median_s(args.runs, lambda: ok(plain.run("print(1)")))
    print(f"run, no mounts:                 {base * 1e3:7.2f} ms (baseline)")
    for label, mounts in (("run, read-only mount:", (ro,)),
                          ("run, empty writable mount:", (rw,)),
                          ("  the same, c_access:", (wasibox.Mount(out, "/out", writable=True,
                                                                   c_access=True, **big_quota),)),
                          (f"run, writable with {args.files} files:",
                           (wasibox.Mount(full, "/full", writable=True),)),
                          ("  the same, c_access:", (wasibox.Mount(full, "/full", writable=True,
                                                                   c_access=True),))):
        with sandbox(*mounts) as sb:
            value = median_s(args.runs, lambda sb=sb: ok(sb.run("print(1)")))
        print(f"{label:32s}{value * 1e3:7.2f} ms ({value / base:.2f}x)")

    # 2. per call
    with sandbox(ro) as sb:
        loop = f"import os\nfor _ in range({args.calls}):\n    {{}}\n"
        empty = median_s(5, lambda: ok(sb.run(loop.format("pass"))))
        stats = median_s(5, lambda: ok(sb.run(loop.format("os.stat('/data/small.txt')"))))
    per_call = (stats - empty) / args.calls
    print(f"os.stat through the host:       {per_call * 1e6:7.1f} us per call")

    # 3. bulk data
    read_code = textwrap.dedent(f"""
        with open("/data/big.bin", "rb", buffering=0) as f:
            while f.read({CHUNK}):
                pass
    """)
    write_code = textwrap.dedent(f"""
        block = bytes({CHUNK})
        with open("/out/big.bin", "wb", buffering=0) as f:
            for _ in range({size // CHUNK}):
                f.write(block)
    """)
    with sandbox(ro, rw) as sb:
        read_s = median_s(5, lambda: ok(sb.run(read_code)))
        text_s = median_s(5, lambda: ok(sb.run(read_code.replace("big.bin", "big.csv"))))
        write_s = median_s(5, lambda: ok(sb.run(write_code)))

    def host_read() -> None:
        with open(data / "big.bin", "rb", buffering=0) as f:
            while f.read(CHUNK):
                pass

    def host_write() -> None:
        block = bytes(CHUNK)
        with open(root / "host.bin", "wb", buffering=0) as f:
            for _ in range(size // CHUNK):
                f.write(block)
            os.fsync(f.fileno())

    host_read_s, host_write_s = median_s(5, host_read), median_s(5, host_write)
    mb = size / 1e6
    print(f"read, mediated, 64 KiB chunks:  {mb / read_s:7.0f} MB/s random bytes, "
          f"{mb / text_s:.0f} MB/s ASCII text "
          f"(host Python {mb / host_read_s:.0f} MB/s)")
    print(f"write + publish, 64 KiB chunks: {mb / write_s:7.0f} MB/s "
          f"(host Python + fsync {mb / host_write_s:.0f} MB/s)")

    # 4. the rejected alternative: wasmtime's WASI filesystem, preopened
    real_config = wasmtime.WasiConfig

    def preopened_config() -> object:
        config = real_config()
        config.preopen_dir(str(data), "/pre", False)
        return config

    wasmtime.WasiConfig = preopened_config  # bench only: grant a real WASI preopen
    try:
        backend = WasmBackend(WasmRuntime(pool_size=0))
        with wasibox.Sandbox(limits, backend=backend) as sb:
            wasi_code = ("import wasibox_files\n" + read_code.replace(
                "open(", "wasibox_files._real_open(").replace("/data/", "/pre/"))
            wasi_read_s = median_s(5, lambda: ok(sb.run(wasi_code)))
            wasi_text_s = median_s(5, lambda: ok(sb.run(wasi_code.replace("big.bin", "big.csv"))))
    finally:
        wasmtime.WasiConfig = real_config
    print(f"read, wasmtime WASI preopen:    {mb / wasi_read_s:7.0f} MB/s random bytes, "
          f"{mb / wasi_text_s:.0f} MB/s ASCII text (mediated: {wasi_read_s / read_s:.2f}x and "
          f"{wasi_text_s / text_s:.2f}x its speed)")

    # 5. publishing many files
    with sandbox(rw) as sb:
        many = median_s(args.runs, lambda: ok(sb.run(
            "for i in range(100):\n    open(f'/out/m{i}.txt', 'w').write(str(i))\n")))
    print(f"run writing + publishing 100 files: {many * 1e3:.1f} ms "
          f"({(many - base) / 100 * 1e3:.2f} ms per file over the baseline)")


if __name__ == "__main__":
    main()
