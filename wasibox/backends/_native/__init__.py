"""Builds and loads the native run path (``wasibox_native.c``) with this machine's C compiler.

The extension is compiled against the Wasmtime C library wasmtime-py ships, linked by path
(it has no SONAME, so an rpath names its directory), and cached under the cache directory,
keyed by a digest of its source, of that library and of the Python ABI. ``wasibox prepare``
builds it; a build takes about a second.

It is built only for the library build whose C API layout was verified (the one
``_slots.KNOWN_LIBRARY_SHA256`` names): the C source declares Wasmtime's structures itself.
Where it cannot be built (no compiler, no Python headers, another Wasmtime build, a compile
error), ``load`` says why and the Python run path runs instead.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..._guest import cache_dir, file_lock
from ..._progress import Reporter
from .._slots import KNOWN_LIBRARY_SHA256, library_path, unverified_library

__all__ = ["NativeBuild", "load"]

SOURCE = Path(__file__).with_name("wasibox_native.c")
MODULE_NAME = "_wasibox_native"


@dataclass(frozen=True)
class NativeBuild:
    """The loaded extension, or None and the reason it is unavailable."""

    module: ModuleType | None
    reason: str


def _compiler() -> list[str] | None:
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    command = shlex.split(configured)
    if command and shutil.which(command[0]):
        return command
    return None


def _target(library_digest: str) -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(library_digest.encode())
    digest.update(sys.implementation.cache_tag.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / "native" / digest.hexdigest()[:24] / f"{MODULE_NAME}{suffix}"


def _build(compiler: list[str], target: Path, progress: Reporter) -> str | None:
    """Compile the extension into ``target``; return None, or why it failed."""
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").is_file():
        return f"the Python headers are not installed (no Python.h in {include})"
    library = library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    command = [*compiler, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Werror",
               f"-I{include}", str(SOURCE), "-o", str(staged), f"-L{library.parent}",
               f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"]
    progress(f"building the native run path with {compiler[0]}")
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                   check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the C compiler could not run: {exc}"
    if completed.returncode != 0:
        staged.unlink(missing_ok=True)
        first = (completed.stderr.strip().splitlines() or ["no output"])[0]
        return f"the C compiler failed ({first})"
    os.replace(staged, target)
    progress(f"built the native run path in {time.perf_counter() - started:.1f}s (cached)")
    return None


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(progress: Reporter, *, build: bool = True) -> NativeBuild:
    """The native extension, built first if needed (and ``build``). Never raises."""
    problem = unverified_library()
    if problem is not None:
        return NativeBuild(None, problem)
    target = _target(KNOWN_LIBRARY_SHA256)
    if not target.is_file():
        if not build:
            return NativeBuild(None, "not built yet (`wasibox prepare` builds it)")
        compiler = _compiler()
        if compiler is None:
            return NativeBuild(None, "no C compiler found (set CC, or install gcc)")
        with file_lock(target.with_name("build.lock")):
            if not target.is_file():
                failure = _build(compiler, target, progress)
                if failure is not None:
                    return NativeBuild(None, failure)
    try:
        module = _import(target)
    except ImportError as exc:
        return NativeBuild(None, f"the built extension does not load ({exc})")
    return NativeBuild(module, f"built with this machine's C compiler ({target.parent.name})")
