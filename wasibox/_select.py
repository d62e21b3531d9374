"""Choosing a backend before a run: wasm unless the code needs what only the microVM has.

The choice is made once, before anything runs, from a static scan of the code's imports (the
host parses it with ``ast``; nothing is executed) and the caller's explicit ``requires``. A
run is never retried on the other backend: side effects such as HTTP calls and host
functions must not happen twice.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from collections.abc import Collection, Iterable
from typing import Literal, overload

__all__ = ["WASM_MODULES", "imported_modules", "needs_microvm", "parse", "wasm_lacks"]

#: CPython 3.11's ``ast.parse`` is not safe to call from several threads at once: its
#: conversion to Python objects keeps a recursion depth in interpreter-wide state, and
#: concurrent parses fail with "SystemError: AST constructor recursion depth mismatch".
_PARSE_LOCK = threading.Lock()
#: Sources up to this size have their import scan cached (services and fuzzers run the
#: same code again and again); larger ones are scanned each time, so the cache stays small:
#: at most _CACHED_SCANS sources of this size, 16 MiB even if every character took 4 bytes.
_CACHED_SOURCE_CHARS = 16 * 1024
_CACHED_SCANS = 256

#: Standard-library modules the wasm guest cannot provide (no native libraries, no OS process
#: model, no terminal); the guest runner refuses them with a clear ImportError.
_WASM_UNAVAILABLE = frozenset({
    "ctypes", "ssl", "bz2", "lzma", "multiprocessing", "curses", "readline", "dbm", "tkinter",
    "turtle", "idlelib", "venv", "ensurepip", "pty", "tty", "termios", "fcntl", "grp", "pwd",
    "resource", "mmap", "syslog",
})
#: Top-level modules the wasm guest can import: the standard library it bundles, and the
#: pure-Python packages built into it.
WASM_MODULES = frozenset(sys.stdlib_module_names - _WASM_UNAVAILABLE) | {"msgpack", "tzdata"}


@overload
def parse(source: str, mode: Literal["exec"] = "exec") -> ast.Module: ...
@overload
def parse(source: str, mode: Literal["eval"]) -> ast.Expression: ...


def parse(source: str, mode: Literal["exec", "eval"] = "exec") -> ast.Module | ast.Expression:
    """``ast.parse``, one thread at a time (see ``_PARSE_LOCK``). Raises what it raises."""
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)  # type: ignore[return-value]


def imported_modules(code: str) -> set[str]:
    """The top-level modules ``code`` imports, found statically; empty if it does not parse.

    Counts ``import x``, ``from x import y``, and ``__import__("x")`` /
    ``importlib.import_module("x")`` with a literal name. Relative imports are ignored.
    """
    if len(code) <= _CACHED_SOURCE_CHARS:
        return set(_cached_scan(code))
    return set(_scan(code))


@functools.lru_cache(maxsize=_CACHED_SCANS)
def _cached_scan(code: str) -> frozenset[str]:
    return _scan(code)


def _scan(code: str) -> frozenset[str]:
    try:
        tree = parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # The run reports the error (or hits its limit) in the guest; no backend does better,
        # and a hostile source must not take the host's parser down.
        return frozenset()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            name = (function.id if isinstance(function, ast.Name)
                    else function.attr if isinstance(function, ast.Attribute) else "")
            first = node.args[0]
            if (name in ("__import__", "import_module") and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)):
                found.add(first.value.partition(".")[0])
    return frozenset(name for name in found if name)


def wasm_lacks(code: str, requires: Iterable[str]) -> set[str]:
    """The third-party modules the code imports or requires that the wasm guest lacks.

    Standard-library modules never count, even the few the wasm guest cannot provide (ctypes,
    ssl, multiprocessing, ...): those fail in the wasm guest with a clear ModuleNotFoundError
    rather than silently moving a stdlib-only program into a VM.
    """
    wanted = imported_modules(code) | {name.partition(".")[0] for name in requires}
    return {name for name in wanted
            if name not in WASM_MODULES and name not in sys.stdlib_module_names}


def needs_microvm(code: str, requires: Iterable[str], vm_modules: Collection[str]) -> bool:
    """True if the code needs a module the wasm guest lacks and the microVM image has."""
    return any(name in vm_modules for name in wasm_lacks(code, requires))
