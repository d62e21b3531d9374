"""MicroVM benchmark: cold boot, restore, a small numpy run, and the image build.

What it measures (printed; nothing is asserted):

1. Cold boot to a ready agent: a VM booted from scratch (kernel, initramfs, root file
   system, agent imports numpy and pandas) until the agent's ``ready`` frame, ``--cold`` times.
2. Restore to a ready agent: a VM restored from the template until its channel is connected
   (the agent is then waiting for its job), and restore plus a ``pass`` job end to end.
3. ``Sandbox.run`` of a small numpy program from a restored template, ``--runs`` times
   (median), beside the same program on the wasm backend (which cannot import numpy: its
   result is printed) and a pure-Python equivalent on wasm as a baseline.
4. The image build time recorded when this machine built the image (``--rebuild`` builds a
   fresh one into an empty cache directory instead; a few minutes).
5. The extra latency of mounts: alternating runs with a read-only mount of five 1 KiB files
   and a writable mount that gets one artifact, against the same work without mounts; and
   the copy-in rate, from runs with a read-only mount of one 8 MiB file.

Run it as root (the image build needs root) with ``python bench/microvm.py``; it opts in to
TCG when KVM is not usable here, and says which accelerator ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import wasibox
from wasibox._progress import silent
from wasibox.backends.microvm import runtime as vm
from wasibox.backends.microvm.image import ensure_image
from wasibox.backends.microvm.qemu import MachineSpec

NUMPY_CODE = "import numpy as np\na = np.arange(10_000, dtype=np.float64)\nprint(float(a @ a))"
PYTHON_CODE = "a = [float(i) for i in range(10_000)]\nprint(sum(x * x for x in a))"
LIMITS = wasibox.Limits(timeout_s=120, fuel=10**12)


def _median(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1000:8.1f} ms (n={len(samples)}, " \
           f"min {min(samples) * 1000:.1f}, max {max(samples) * 1000:.1f})"


def cold_boot(runtime: vm.MicroVMRuntime, count: int) -> list[float]:
    spec = MachineSpec(runtime.image, runtime.accel, vm.default_memory_mib())
    samples = []
    for _ in range(count):
        with vm.run_directory() as paths:
            listener = vm.listen(paths.channel)
            started = time.perf_counter()
            process = runtime.engine.launch(spec, paths, ram=paths.directory / "ram",
                                            restore=None)
            machine = vm.VM(process, paths, listener)
            try:
                runtime._wait_ready(machine, time.monotonic() + vm.TEMPLATE_TIMEOUT_S)
                samples.append(time.perf_counter() - started)
            finally:
                machine.kill()
    return samples


def restore(runtime: vm.MicroVMRuntime, count: int) -> tuple[list[float], list[float]]:
    memory_mib = vm.default_memory_mib()
    runtime.template(memory_mib)
    connected, round_trip = [], []
    request = {"kind": "run", "job": {"op": "run", "code": "pass", "seed": 0},
               "output_bytes": 1024, "cpu_s": 10, "entropy": os.urandom(32), "time_ns": 0}
    for _ in range(count):
        with vm.run_directory() as paths:
            started = time.perf_counter()
            machine = runtime.restore(memory_mib, paths)
            try:
                deadline = time.monotonic() + 60
                while machine.channel is None and time.monotonic() < deadline:
                    for _frame in machine.poll(time.monotonic() + 0.01):
                        pass
                connected.append(time.perf_counter() - started)
                machine.send(request)
                for frame in machine.poll(deadline):
                    if frame.get("kind") == "done":
                        break
                round_trip.append(time.perf_counter() - started)
            finally:
                machine.kill()
    return connected, round_trip


def sandbox_runs(backend: str, code: str, count: int) -> tuple[list[float], wasibox.RunResult]:
    samples = []
    with wasibox.Sandbox(LIMITS, backend=backend, allow_emulation=True) as sandbox:  # type: ignore[arg-type]
        result = sandbox.run(code)  # warm-up: templates and pools are made outside the timing
        for _ in range(count):
            started = time.perf_counter()
            result = sandbox.run(code)
            samples.append(time.perf_counter() - started)
    return samples, result


MOUNT_CODE = textwrap.dedent("""
    import os
    total = 0
    for name in sorted(os.listdir("/data")):
        with open("/data/" + name, "rb") as handle:
            total += len(handle.read())
    with open("/out/result.txt", "w") as handle:
        handle.write(str(total))
""")
#: The same work without files, as the baseline.
NO_MOUNT_CODE = "total = sum(len(bytes(1024)) for _ in range(5))\nresult = str(total)"


def mount_runs(count: int, files: int = 5) -> tuple[list[float], list[float]]:
    """Alternating runs with a read-only mount of ``files`` 1 KiB files and a writable
    mount that gets one artifact, and the same work without mounts."""
    with tempfile.TemporaryDirectory() as scratch:
        data, out = os.path.join(scratch, "data"), os.path.join(scratch, "out")
        os.mkdir(data)
        os.mkdir(out)
        for index in range(files):
            with open(os.path.join(data, f"part-{index}.csv"), "wb") as handle:
                handle.write(os.urandom(512).hex().encode())
        mounts = [wasibox.Mount(data, "/data"), wasibox.Mount(out, "/out", writable=True)]
        with_mounts, without = [], []
        with wasibox.Sandbox(LIMITS, backend="microvm", allow_emulation=True,
                             mounts=mounts) as mounted, \
                wasibox.Sandbox(LIMITS, backend="microvm", allow_emulation=True) as bare:
            for sandbox, code in ((mounted, MOUNT_CODE), (bare, NO_MOUNT_CODE)):
                assert sandbox.run(code).ok  # warm-up
            for _ in range(count):
                for sandbox, code, samples in ((mounted, MOUNT_CODE, with_mounts),
                                               (bare, NO_MOUNT_CODE, without)):
                    started = time.perf_counter()
                    result = sandbox.run(code)
                    samples.append(time.perf_counter() - started)
                    assert result.ok, result
        return with_mounts, without


def copy_in_throughput(count: int, mib: int = 8) -> tuple[list[float], list[float]]:
    """Runs with a read-only mount of one ``mib`` MiB file (copied into the VM), against
    ``pass`` without mounts, alternating."""
    with tempfile.TemporaryDirectory() as data:
        with open(os.path.join(data, "blob.bin"), "wb") as handle:
            handle.write(os.urandom(mib * 2**20))
        limits = LIMITS.replace(memory_bytes=max(LIMITS.memory_bytes, 4 * (mib + 1) * 2**20))
        mounted_samples, bare_samples = [], []
        with wasibox.Sandbox(limits, backend="microvm", allow_emulation=True,
                             mounts=[wasibox.Mount(data, "/data")]) as mounted, \
                wasibox.Sandbox(limits, backend="microvm", allow_emulation=True) as bare:
            for sandbox in (mounted, bare):
                assert sandbox.run("pass").ok  # warm-up
            for _ in range(count):
                for sandbox, samples in ((mounted, mounted_samples), (bare, bare_samples)):
                    started = time.perf_counter()
                    assert sandbox.run("pass").ok
                    samples.append(time.perf_counter() - started)
        return mounted_samples, bare_samples


def build_times(rebuild: bool) -> str:
    if rebuild:
        with tempfile.TemporaryDirectory() as cache:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "wasibox", "microvm", "build", "--no-template"],
                           env=dict(os.environ, WASIBOX_CACHE_DIR=cache), check=True)
            return f"{time.perf_counter() - started:.1f} s (fresh build, this run)"
    image = ensure_image(progress=silent)
    kernel = json.loads((image.kernel.parent / "kernel.json").read_text())
    rootfs = image.manifest["build_seconds"]
    return (f"{kernel['build_seconds'] + rootfs:.1f} s recorded at build (kernel "
            f"{kernel['build_seconds']} s, root file system {rootfs} s; --rebuild to measure)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold", type=int, default=1)
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    runtime = vm.microvm_runtime()
    print(f"accelerator: {runtime.accel}   engine: {runtime.engine.identity()}")
    print(f"image build:            {build_times(args.rebuild)}")
    print(f"cold boot to ready:     {_median(cold_boot(runtime, args.cold))}")
    connected, round_trip = restore(runtime, args.runs)
    print(f"restore to ready:       {_median(connected)}")
    print(f"restore + 'pass' job:   {_median(round_trip)}")
    vm_samples, vm_result = sandbox_runs("microvm", NUMPY_CODE, args.runs)
    print(f"numpy run, microvm:     {_median(vm_samples)}  -> {vm_result.stdout.strip()}")
    _, wasm_result = sandbox_runs("wasm", NUMPY_CODE, 0)
    failure = wasm_result.error.type if wasm_result.error else "ran"
    print(f"numpy run, wasm:        cannot run there ({failure}: "
          f"{wasm_result.error.message if wasm_result.error else ''})")
    py_samples, py_result = sandbox_runs("wasm", PYTHON_CODE, args.runs)
    print(f"pure-Python run, wasm:  {_median(py_samples)}  -> {py_result.stdout.strip()}")
    ratio = statistics.median(vm_samples) / statistics.median(py_samples)
    print(f"ratio microvm numpy run / wasm pure-Python run: {ratio:.0f}x")
    with_mounts, without = mount_runs(args.runs)
    print(f"run with mounts, microvm (5 x 1 KiB in, 1 file out): {_median(with_mounts)}")
    print(f"same work without mounts, microvm:                   {_median(without)}")
    extra = statistics.median(with_mounts) - statistics.median(without)
    least = min(with_mounts) - min(without)
    print(f"extra latency of the mounts: {extra * 1000:+.1f} ms (difference of medians), "
          f"{least * 1000:+.1f} ms (of minima)")
    mounted, bare = copy_in_throughput(args.runs)
    extra = statistics.median(mounted) - statistics.median(bare)
    print(f"run with an 8 MiB read-only mount:  {_median(mounted)}")
    print(f"copy-in rate: {8 / max(extra, 1e-3):.1f} MiB/s (8 MiB over the difference of "
          "medians against a bare run)")


if __name__ == "__main__":
    main()
