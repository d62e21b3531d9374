"""Builds and loads the native run path (``wasibox_native.c``) with this machine's C compiler.

The extension is compiled against the Wasmtime C library wasmtime-py ships, and cached under
the cache directory, keyed by a digest of its source, of that library, of how it is linked and
of the Python ABI. ``wasibox prepare`` builds it; a build takes about a second.

It must call into the very copy of the library that wasmtime-py loaded, never a second copy of
the same file found elsewhere: Wasmtime keeps the state of the wasm call in progress in a
thread-local of its own copy, and a trap raised through another copy finds none there and
aborts the whole process (a panic in ``traphandlers.rs``). Linking by an rpath would bind
whichever library the path named when the extension was built, and the cache is shared by
every environment of the user. So the extension names no library at all: its Wasmtime symbols
stay undefined, and before it is loaded the library wasmtime-py already loaded is promoted to
the global symbol scope (``RTLD_NOLOAD | RTLD_GLOBAL``), so the symbols can only resolve there.

It is built only for the library build whose C API layout was verified (the one
``_slots.KNOWN_LIBRARY_SHA256`` names): the C source declares Wasmtime's structures itself.
Where it cannot be built (no compiler, no Python headers, another Wasmtime build, a compile
error), ``load`` says why and the Python run path runs instead.
"""

from __future__ import annotations

import ctypes
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

from ...._guest import cache_dir, file_lock
from ...._progress import Reporter
from ..slots import KNOWN_LIBRARY_SHA256, library_path, unverified_library

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


#: No -l and no rpath: see the module docstring. Part of the cache key, so that an extension
#: linked another way is never picked up from a cache.
LINK_FLAGS = ("-shared", "-fPIC")


def _target(library_digest: str) -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(library_digest.encode())
    digest.update(" ".join(LINK_FLAGS).encode())
    digest.update(sys.implementation.cache_tag.encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / "native" / digest.hexdigest()[:24] / f"{MODULE_NAME}{suffix}"


def _build(compiler: list[str], target: Path, progress: Reporter) -> str | None:
    """Compile the extension into ``target``; return None, or why it failed."""
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").is_file():
        return f"the Python headers are not installed (no Python.h in {include})"
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    command = [*compiler, *LINK_FLAGS, "-O2", "-std=gnu11", "-Wall", "-Werror",
               f"-I{include}", str(SOURCE), "-o", str(staged)]
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
    # The library is already loaded (wasmtime-py loaded it, privately): RTLD_NOLOAD only
    # re-opens that copy, and RTLD_GLOBAL lets the extension's undefined symbols bind to it.
    ctypes.CDLL(str(library_path()), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
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
    except (ImportError, OSError) as exc:
        return NativeBuild(None, f"the built extension does not load ({exc})")
    return NativeBuild(module, f"built with this machine's C compiler ({target.parent.name})")
