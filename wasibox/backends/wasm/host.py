"""The host functions the guest imports, and the epoch-deadline callback.

Every host function is wrapped by ``_host``, so that nothing it raises escapes as a Python
exception: wasmtime-py parks those in a process-global, where another thread's call could pick
them up. ``wasi:clocks/*`` and ``wasi:random/random`` are defined in full, shadowing
wasmtime's own, so a guest sees only the virtual clock and seeded entropy unless the policy
grants the real ones, and a WASI poll that would block inside the host (where epochs never
tick) is refused at once. The files interface answers every failure with a WIT error code,
never a trap.
"""

from __future__ import annotations

import ctypes
import time
from types import ModuleType
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import component as cm

from ..._limits import Limit
from ..._result import GuestException
from ...capabilities.files.session import FilesError, FileSession, StatInfo
from .run import Run, address_of, adopted_run, current, taped

__all__ = ["NO_FINALIZER", "ON_EPOCH_DEADLINE", "WASI_VERSION", "define_host"]

WASI_VERSION = "0.2.9"  # the WASI interfaces componentize-py 0.25's guest imports


def _host(function: Any) -> Any:
    """Wrap a host function so that nothing it raises escapes as a Python exception.

    wasmtime-py parks non-WasmtimeError exceptions from callbacks in a process-global and
    re-raises them from whichever call returns next, possibly on another thread. Every
    failure here becomes a WasmtimeError (a trap for this run only) and is recorded on the
    run itself.
    """

    def call(context: Any, *args: Any) -> Any:
        run: Run | None = getattr(current, "run", None) or adopted_run()
        if run is None:
            raise wasmtime.WasmtimeError("wasibox: host function called outside a run")
        if run.cancelled:
            run.stop(Limit.CANCELLED)
        try:
            return function(run, context._context(), *args)
        except wasmtime.WasmtimeError:
            raise
        except BaseException as exc:  # noqa: BLE001 - see docstring
            run.fault = run.fault or GuestException(
                type="HostError", message=f"host function failed: {type(exc).__name__}",
                traceback="")
            raise wasmtime.WasmtimeError("wasibox: host function failed") from None

    return call


class _DateTime:
    """A wasi:clocks/wall-clock datetime record."""

    __slots__ = ("seconds", "nanoseconds")

    def __init__(self, ns: int) -> None:
        self.seconds, self.nanoseconds = divmod(ns, 10**9)


def _write(run: Run, context: Any, fd: int, data: str) -> None:
    if run.limit is not None or not run.append(fd, data.encode("latin-1")):
        run.stop(Limit.OUTPUT)


def _sleep(run: Run, context: Any, ns: int) -> None:
    run.wait(context, ns)


def _start(run: Run, context: Any) -> None:
    """The program is about to run: meter its fuel from here, so compiling is not counted.

    The runner calls this before any of the program runs; later calls (the program's own)
    are ignored, so a program cannot reset its fuel.
    """
    if run.started:
        return
    run.started = True
    if ffi.wasmtime_context_set_fuel(context, run.job.limits.fuel):
        raise wasmtime.WasmtimeError("wasibox: could not reset the guest's fuel")


def _exit(run: Run, context: Any, status: int) -> None:
    run.exit_code = status
    raise wasmtime.WasmtimeError(f"wasibox: the guest exited with status {status}")


def _subscribe(run: Run, context: Any, ns: int) -> None:
    # A WASI pollable would block inside the host, where epochs never tick. The guest runner
    # routes every wait through clock.sleep; whatever still reaches here is refused at once.
    if run.would_block_past_deadline(context, ns):
        run.stop(Limit.TIMEOUT)
    run.fault = GuestException(
        type="BlockingIOError",
        message="the guest tried to wait through WASI poll, which wasibox does not allow; "
                "use time.sleep", traceback="")
    raise wasmtime.WasmtimeError("wasibox: blocking WASI poll refused")


#: The files interface: (WIT name, FileSession method, whether the result is "tagged").
#: wasmtime-py lowers a result as a bare value when its ok and err types have different
#: Python classes, and as a Variant when they share one (string ok + enum err).
_FILE_OPS = (
    ("open", "open", False), ("read", "read", True), ("write", "write", False),
    ("pread", "pread", True), ("pwrite", "pwrite", False), ("dup", "dup", False),
    ("seek", "seek", False), ("truncate", "truncate", False), ("close", "close_fd", False),
    ("fstat", "fstat", True), ("stat", "stat", True), ("readdir", "readdir", True),
    ("mkdir", "mkdir", False), ("unlink", "unlink", False), ("rmdir", "rmdir", False),
    ("rename", "rename", False), ("chmod", "chmod", False), ("utime", "utime", False),
    ("link", "link", False), ("symlink", "symlink", False), ("readlink", "readlink", True),
)
_FD_OPS = frozenset({"read", "write", "pread", "pwrite", "dup", "seek", "truncate", "close_fd",
                     "fstat"})


def _file_op(method: str, tagged: bool) -> Any:
    """A files host function: FilesError becomes the WIT error-code, never a trap."""

    def answer(run: Run, args: tuple[Any, ...]) -> list[Any]:
        session: FileSession | None = run.job.files
        try:
            if session is None:  # no mounts: nothing exists
                raise FilesError("badf" if method in _FD_OPS else "noent")
            value = getattr(session, method)(*args)
        except FilesError as exc:
            return ["err", exc.code]
        except OSError:  # the host's own disk failed under the operation
            return ["err", "io"]
        return ["ok", value.encode() if isinstance(value, StatInfo) else value]

    kind = f"files.{method}"
    # Decided once, not per call: only utime's arguments depend on the run (its clock).
    adapt = _utime_args if method == "utime" else None

    def op(run: Run, context: Any, *args: Any) -> Any:
        if adapt is not None:
            args = adapt(run, context, *args)
        tag, value = (answer(run, args) if run.job.tape is None
                      else taped(run, kind, args, lambda: answer(run, args)))
        return cm.Variant(tag, value) if tagged else value

    return op


def _utime_args(run: Run, context: Any, path: str, atime: int, mtime: int, now: bool,
                follow: bool) -> tuple[str, int, int, bool]:
    """``FileSession.utime``'s arguments: "now" is the run's wall clock (the virtual one
    unless the policy grants the real), so a guest never reads the host's time off a file
    it touched, and a virtual-clock run stays deterministic."""
    if now:
        atime = mtime = run.wall_ns(context)
    return path, atime, mtime, follow


def define_host(linker: cm.Linker, native: ModuleType | None = None) -> None:
    """Define the guest's capabilities, and shadow WASI clocks and random.

    With ``native``, the host functions every run uses are the C ones of the native run
    path (``native/wasibox_native.c``, which mirrors ``_define_every_run``); the
    capabilities that need Python (files, host functions, HTTP) are defined here either way.
    """
    linker.allow_shadowing = True
    with linker.root() as root:
        with root.add_instance("wasibox:sandbox/files@0.1.0") as files:
            for name, method, tagged in _FILE_OPS:
                files.add_func(name, _host(_file_op(method, tagged)))
        with root.add_instance("wasibox:sandbox/host@0.1.0") as host:
            host.add_func("call", _host(lambda run, ctx, name, payload:
                                        run.host_call(name, payload)))
        if native is None:
            _define_every_run(root)
    if native is not None:
        native.define(address_of(linker.ptr()), WASI_VERSION)


def _define_every_run(root: Any) -> None:
    """The host functions every run uses, in Python: stdio, clocks, entropy, exit, start."""
    with root.add_instance("wasibox:sandbox/runner@0.1.0") as runner:
        runner.add_func("start", _host(_start))
    with root.add_instance("wasibox:sandbox/stdio@0.1.0") as stdio:
        stdio.add_func("write", _host(_write))
    with root.add_instance("wasibox:sandbox/clock@0.1.0") as clock:
        clock.add_func("sleep", _host(_sleep))
    with root.add_instance("wasibox:sandbox/process@0.1.0") as process:
        process.add_func("exit", _host(_exit))
    with root.add_instance("wasibox:sandbox/entropy@0.1.0") as entropy:
        entropy.add_func("random-bytes", _host(
            lambda run, ctx, size: run.random_bytes(size).decode("latin-1")))
    with root.add_instance(f"wasi:clocks/monotonic-clock@{WASI_VERSION}") as monotonic:
        monotonic.add_func("now", _host(lambda run, ctx: run.monotonic_ns(ctx)))
        monotonic.add_func("resolution", _host(lambda run, ctx: 1))
        monotonic.add_func("subscribe-duration", _host(_subscribe))
        monotonic.add_func("subscribe-instant", _host(
            lambda run, ctx, when: _subscribe(run, ctx, max(when - run.monotonic_ns(ctx), 0))))
    with root.add_instance(f"wasi:clocks/wall-clock@{WASI_VERSION}") as wall:
        wall.add_func("now", _host(lambda run, ctx: _DateTime(run.wall_ns(ctx))))
        wall.add_func("resolution", _host(lambda run, ctx: _DateTime(1)))
    with root.add_instance(f"wasi:random/random@{WASI_VERSION}") as wasi_random:
        wasi_random.add_func("get-random-bytes",
                             _host(lambda run, ctx, size: run.random_bytes(size)))
        wasi_random.add_func("get-random-u64", _host(lambda run, ctx: run.random_u64()))


#: Called by Wasmtime, on the thread running the guest, whenever a store reaches its epoch
#: deadline. Every run's deadline is one tick ahead, so this decides at every tick whether the
#: run goes on (cancellation and the wall-clock limit are checked here) without any other
#: thread touching the Store. Returning an error traps the guest.
_DeadlineCallback = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))
NO_FINALIZER = ctypes.cast(0, ctypes.CFUNCTYPE(None, ctypes.c_void_p))
_UPDATE_DEADLINE_CONTINUE = 0


def _on_epoch_deadline(context: Any, data: Any, delta: Any, kind: Any) -> int:
    run: Run | None = getattr(current, "run", None)
    limit = None
    if run is not None:
        if run.cancelled:
            limit = Limit.CANCELLED
        elif time.monotonic() >= run.deadline:
            limit = Limit.TIMEOUT
    if limit is None or run is None:
        delta[0] = 1
        kind[0] = _UPDATE_DEADLINE_CONTINUE
        return 0
    run.limit = run.limit or limit
    error = ffi.wasmtime_error_new(f"wasibox: {limit.value} limit exceeded".encode())
    return ctypes.cast(error, ctypes.c_void_p).value or 0


ON_EPOCH_DEADLINE = _DeadlineCallback(_on_epoch_deadline)  # kept alive for the process
