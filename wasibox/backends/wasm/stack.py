"""Run guest code on a native stack deep enough for Wasmtime's own stack limit.

Threat: Wasmtime stops a guest's recursion when the guest has used ``max_wasm_stack`` bytes
of the *calling thread's* native stack. If that thread's stack is smaller than the limit (a
thread made after ``threading.stack_size(512 * 1024)``, or any secondary thread on macOS),
a guest recursion bomb such as ``json.loads('[' * 10**6)`` runs off the end of the native
stack and the whole host process dies with SIGSEGV before Wasmtime's check fires.

``call_with_stack`` measures the current thread's stack once and, when it is too small (or
cannot be measured), makes the call on a short-lived helper thread whose stack is large
enough, so a guest can never take the host process down this way.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["call_with_stack", "thread_stack_bytes"]

T = TypeVar("T")

_measured = threading.local()
_stack_size_lock = threading.Lock()


def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:  # pragma: no cover - no C library to ask
        return None


_LIBC = _libc()


def thread_stack_bytes() -> int | None:
    """The size of the calling thread's native stack in bytes, or None if it is unknown."""
    if _LIBC is None:
        return None
    try:
        if sys.platform == "darwin":
            _LIBC.pthread_self.restype = ctypes.c_void_p
            _LIBC.pthread_get_stacksize_np.restype = ctypes.c_size_t
            _LIBC.pthread_get_stacksize_np.argtypes = [ctypes.c_void_p]
            return int(_LIBC.pthread_get_stacksize_np(_LIBC.pthread_self()))
        _LIBC.pthread_self.restype = ctypes.c_void_p
        _LIBC.pthread_getattr_np.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _LIBC.pthread_attr_getstacksize.argtypes = [ctypes.c_void_p,
                                                    ctypes.POINTER(ctypes.c_size_t)]
        _LIBC.pthread_attr_destroy.argtypes = [ctypes.c_void_p]
    except AttributeError:
        return None
    attr = ctypes.create_string_buffer(256)  # larger than any libc's pthread_attr_t
    if _LIBC.pthread_getattr_np(_LIBC.pthread_self(), attr) != 0:
        return None
    try:
        size = ctypes.c_size_t(0)
        if _LIBC.pthread_attr_getstacksize(attr, ctypes.byref(size)) != 0:
            return None
        return size.value
    finally:
        _LIBC.pthread_attr_destroy(attr)


def _current_stack_bytes() -> int | None:
    if not hasattr(_measured, "size"):
        _measured.size = thread_stack_bytes()
    size: int | None = _measured.size
    return size


def call_with_stack(function: Callable[..., T], min_bytes: int, *args: Any) -> T:
    """Call ``function(*args)`` on a thread with at least ``min_bytes`` of native stack.

    On the calling thread when its stack is known to be large enough (the common case: no
    thread hand-off, and the arguments passed as they are, with no closure or partial made
    per call), otherwise on a helper thread that is joined before returning. The function's
    result is returned and its exception re-raised, in the calling thread.
    """
    size = _current_stack_bytes()
    if size is not None and size >= min_bytes:
        return function(*args)
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, function(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            outcome.append((False, exc))

    with _stack_size_lock:
        previous = threading.stack_size(min_bytes)
        try:
            helper = threading.Thread(target=target, name="wasibox-deep-stack", daemon=True)
            helper.start()
        finally:
            threading.stack_size(previous)
    helper.join()
    succeeded, value = outcome[0]
    if succeeded:
        result: T = value
        return result
    raise value
