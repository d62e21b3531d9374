"""Build the wasibox guest: a pre-initialized CPython component made by componentize-py.

Usage: ``python guest/build.py OUTPUT.wasm`` (the host's ``wasibox prepare`` calls ``build``).

The recipe, step by step:

1. Lay out a private build tree: the runner, the WIT world plus every capability contract
   (one WIT package), the pure-Python packages the guest bundles (msgpack's fallback
   codec, tzdata) and, for a derived guest, a package set's unpacked wheels. Every file
   gets the same fixed mtime, because the snapshot records the mtimes the importer saw.
2. Compile ``pin_entropy.c`` and preload it into componentize-py, so the hash seed and every
   other draw from entropy during pre-init are the same on every build (see that file).
3. Run componentize-py with an empty virtual environment, so nothing from the building
   machine's site-packages leaks into the guest.
4. Fit CPython's C-stack limit to the WebAssembly stack the host grants (see
   ``_fit_c_stack_limit``), so deep recursion in C raises ``RecursionError`` instead of
   trapping.

This script needs no network and never imports the host package.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER_MODULE = "wasibox_guest"
FIXED_MTIME = 946684800  # 2000-01-01: any constant works; it only has to be the same
BUNDLED = ("msgpack", "tzdata")  # pure-Python packages copied into the guest
#: The shadow stack (the C stack in linear memory) of componentize-py 0.25's component: the
#: 1 MiB wit-component's linker reserves by default, at the start of linear memory, growing
#: down from here.
SHADOW_STACK_TOP = 1 << 20
#: CPython's ``_PyOS_STACK_MARGIN_BYTES`` on wasm32 (2048 pointers of 4 bytes).
STACK_MARGIN_BYTES = 8192
#: How much of the shadow stack CPython may use before it raises RecursionError: the
#: ``Py_C_STACK_SIZE`` CPython 3.14 itself uses on WASI when it cannot ask for the stack's
#: size. The host's ``max_wasm_stack`` is sized against it (wasibox/backends/wasm/engine.py).
C_STACK_BYTES = 128 * 1024

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """The guest could not be built; the message says what to install or fix."""


def inputs_digest() -> str:
    """A digest of everything that goes into a build, to key the build cache."""
    digest = hashlib.sha256()
    for path in sorted(_source_files()):
        digest.update(str(path.relative_to(HERE.parent)).encode())
        digest.update(path.read_bytes())
    for dist in ("componentize-py", *BUNDLED):
        digest.update(f"{dist}=={installed_version(dist)}".encode())
    return digest.hexdigest()


def build(output: Path, progress: Progress = lambda message: None,
          site: Path | None = None) -> str:
    """Build the guest component into ``output`` and return its sha256.

    ``site`` is a directory holding a package set's unpacked pure-Python wheels: the guest
    runner packs and imports them at pre-init, so the snapshot holds them (a derived guest).
    """
    output = Path(output)
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise BuildError("building the guest needs a C compiler to pin its entropy: "
                         "install one (for example `apt-get install gcc`) or set CC")
    with tempfile.TemporaryDirectory(prefix="wasibox-guest-") as scratch:
        tree = Path(scratch)
        progress("laying out the build tree")
        app, wit = tree / "app", tree / "wit"
        app.mkdir()
        wit.mkdir()
        # The runner and the guest-side modules beside it (such as the `host` package).
        shutil.copytree(HERE / "runner", app, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        # The world and every capability's contract (guest/wit/), side by side.
        for contract in sorted((HERE / "wit").glob("*.wit")):
            shutil.copy2(contract, wit / contract.name)
        for package in BUNDLED:
            _copy_pure_package(package, app / package)
        if site is not None:
            shutil.copytree(site, app / "wasibox_site", symlinks=True)
        empty_env = tree / "empty-venv"
        (empty_env / "lib").mkdir(parents=True)
        for path in tree.rglob("*"):
            os.utime(path, (FIXED_MTIME, FIXED_MTIME), follow_symlinks=False)

        progress("compiling the entropy pin")
        pin = tree / "pin_entropy.so"
        _check(subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(pin),
                               str(HERE / "pin_entropy.c"), "-ldl"],
                              capture_output=True, text=True), "compiling pin_entropy.c")

        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(tree),
            "VIRTUAL_ENV": str(empty_env),
            "LD_PRELOAD": str(pin),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "SOURCE_DATE_EPOCH": str(FIXED_MTIME),
        }
        command = [sys.executable, "-c", "import sys; from componentize_py import script; "
                   "sys.argv[0] = 'componentize-py'; sys.exit(script())",
                   "-q", "-d", str(wit), "-w", "sandbox", "componentize", "-p", str(app),
                   RUNNER_MODULE, "-o", str(tree / "guest.wasm")]
        result = _with_heartbeat(
            lambda: subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True),
            "snapshotting CPython with componentize-py", progress)
        _check(result, "componentize-py")
        progress("fitting CPython's C-stack limit")
        _fit_c_stack_limit(tree / "guest.wasm")

        output.parent.mkdir(parents=True, exist_ok=True)
        staged = output.with_name(output.name + f".{os.getpid()}.tmp")
        shutil.copyfile(tree / "guest.wasm", staged)
        os.replace(staged, output)
    digest = hashlib.sha256(output.read_bytes()).hexdigest()
    progress(f"built guest {digest[:12]} ({output.stat().st_size / 2**20:.1f} MiB)")
    return digest


def _fit_c_stack_limit(component: Path) -> None:
    """Lower the C-stack limits CPython recorded in the snapshot to ``C_STACK_BYTES``.

    CPython 3.14 raises RecursionError when its stack pointer passes a soft limit that it
    computed once, at pre-init, from the stack's size: here the whole 1 MiB shadow stack in
    linear memory. Wasmtime meanwhile traps when compiled wasm has used ``max_wasm_stack``
    of the *native* stack, and a frame costs 8 to 32 times more native stack than shadow
    stack (measured: pickle, repr, json, comparisons of nested containers), so with 1 MiB
    CPython's check never fired first and deep recursion was an uncatchable trap. The limits
    are three words of the thread state in the snapshot's data (``c_stack_top``,
    ``c_stack_soft_limit``, ``c_stack_hard_limit``), written here as CPython writes them when
    it takes the stack to be ``Py_C_STACK_SIZE`` bytes.

    Raises BuildError unless those three words occur exactly once, so a componentize-py
    whose layout differs fails the build instead of shipping an unfitted guest.
    """
    data = bytearray(component.read_bytes())
    recorded = struct.pack("<III", SHADOW_STACK_TOP, STACK_MARGIN_BYTES * 2, STACK_MARGIN_BYTES)
    at = data.find(recorded)
    if at < 0 or data.find(recorded, at + 1) >= 0:
        raise BuildError("the snapshot's C-stack limits were not found exactly once: this "
                         "componentize-py lays out the shadow stack differently; pin "
                         "componentize-py to the version pyproject.toml names")
    soft = SHADOW_STACK_TOP - C_STACK_BYTES
    data[at:at + len(recorded)] = struct.pack("<III", SHADOW_STACK_TOP, soft,
                                              soft - STACK_MARGIN_BYTES)
    component.write_bytes(data)


def _source_files() -> list[Path]:
    return [HERE / "build.py", HERE / "pin_entropy.c", *(HERE / "runner").rglob("*.py"),
            *(HERE / "wit").glob("*.wit")]


def installed_version(dist: str) -> str:
    """The installed version of ``dist``, read from its dist-info directory's name.

    Cheaper than importlib.metadata (whose import alone costs ~40 ms), and this runs on every
    process start to find the cached guest.
    """
    version = _dist_info_versions().get(dist.replace("-", "_").lower())
    if version is None:
        raise BuildError(f"building the guest needs the {dist!r} package: pip install {dist}")
    return version


@functools.cache
def _dist_info_versions() -> dict[str, str]:
    """``{normalised name: version}`` from one scan of sys.path; earlier entries win."""
    versions: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and "-" in name:
                project, _, version = name[: -len(".dist-info")].partition("-")
                versions.setdefault(project.lower(), version)
    return versions


def _copy_pure_package(name: str, destination: Path) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"building the guest needs the {name!r} package: pip install {name}")
    source = Path(next(iter(spec.submodule_search_locations)))
    shutil.copytree(source, destination,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.pyx",
                                                  "*.c", "*.h", "*.cpp", "*.pyi", "py.typed"))


def _with_heartbeat(work: Callable[[], subprocess.CompletedProcess[str]], label: str,
                    progress: Progress) -> subprocess.CompletedProcess[str]:
    """Run ``work`` while reporting elapsed time every second, so no wait is silent."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(1.0):
            progress(f"{label} ({time.monotonic() - started:.0f}s)")

    progress(label)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        return work()
    finally:
        done.set()
        thread.join()


def _check(result: subprocess.CompletedProcess[str], step: str) -> None:
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-4000:]
        raise BuildError(f"{step} failed (exit {result.returncode}):\n{detail}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python guest/build.py OUTPUT.wasm")
    print(build(Path(sys.argv[1]), lambda message: print(message, file=sys.stderr)))
