"""The microVM ``Backend``: one VM restored from the clean template per run, or kept for a
session's calls; it sends the agent its job, relays host calls and mounts over the channel,
and turns the agent's report into an ``Outcome`` (the package docstring has the threat
model)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import msgpack

from ..._control import RunControl, RunState
from ..._errors import EmulationRefused, UsageError
from ..._events import CapabilityEvent
from ..._limits import Limit, Limits
from ..._result import GuestException, Outcome, RefusedFile
from ...capabilities.files.session import FileSession
from ...capabilities.hostcall import HostCalls, StopRun
from ...capabilities.http import HttpGate
from ..base import Backend, BackendSession, Job, Policy
from .channel import ChannelClosed
from .files import CopyIn, CopyOut, QuotaExceeded
from .qemu import Accelerator
from .runtime import (
    MIN_MEMORY_BYTES,
    VM,
    MicroVMRuntime,
    emulation_allowed,
    microvm_runtime,
    run_directory,
)

__all__ = ["FUEL_PER_CPU_SECOND", "MicroVMBackend"]

#: Fuel is wasm's CPU budget; in a VM it becomes guest CPU seconds at this rate: what the wasm
#: guest burned per CPU second in a pure-Python loop on the reference machine (1.4-1.8e9).
FUEL_PER_CPU_SECOND = 1_500_000_000
#: The guest's virtual wall clock starts here unless the policy grants the real clock.
VIRTUAL_EPOCH_NS = 1_704_067_200 * 10**9


class MicroVMBackend(Backend):
    """Runs each job in a fresh microVM restored from the clean template.

    ``allow_emulation`` (default: ``WASIBOX_ALLOW_EMULATION``) permits running under TCG,
    which is not a security boundary; without it ``execute`` raises EmulationRefused on machines
    without working KVM.
    """

    name = "microvm"

    def __init__(self, *, allow_emulation: bool | None = None,
                 runtime_: MicroVMRuntime | None = None) -> None:
        self.allow_emulation = emulation_allowed(allow_emulation)
        self._runtime = runtime_

    @property
    def runtime(self) -> MicroVMRuntime:
        if self._runtime is None:
            self._runtime = microvm_runtime()
        return self._runtime

    @property
    def isolation(self) -> Accelerator:
        """``"kvm"`` or ``"tcg"``: what really isolates the guest on this machine."""
        return self.runtime.accel

    def check_allowed(self) -> None:
        """Raise EmulationRefused if this machine only has TCG and emulation was not allowed."""
        if self.isolation == "tcg" and not self.allow_emulation:
            raise EmulationRefused()

    def execute(self, job: Job, control: RunControl | None = None) -> Outcome:
        self.check_allowed()
        limits = job.limits
        _check_memory(limits)
        memory_mib = math.ceil(limits.memory_bytes / 2**20)
        request = _request(job)
        # Mounts are copied in over the channel and their changes applied to the run's
        # staging (wasibox/backends/microvm/files.py); sized up here, before any VM starts.
        copy_in = CopyIn(job.files, limits.memory_bytes) if job.files is not None else None
        if copy_in is not None:
            request["mounts"] = copy_in.specs()
        runtime = self.runtime
        runtime.template(memory_mib)  # made outside the run's clock, once per size
        with run_directory() as paths:
            started = time.perf_counter()
            deadline = time.monotonic() + limits.timeout_s
            log: list[CapabilityEvent] = []
            calls = _host_calls(job, log)
            control = control or RunControl()
            control.enter(RunState.INSTANTIATING)
            vm = runtime.restore(memory_mib, paths)
            control.enter(RunState.RUNNING)
            detach = control.on_cancel(vm.stop)  # the VM is killed; the run reports cancelled
            copy_out = CopyOut(job.files, copy_in) \
                if job.files is not None and copy_in is not None else None
            try:
                outcome = self._drive(vm, request, calls, limits.output_bytes,
                                      limits.memory_bytes, deadline, started, copy_in,
                                      copy_out)
            finally:
                detach()
                vm.kill()
                if copy_out is not None:
                    copy_out.close()
            return _settled(outcome, control, log)

    def open_session(self, limits: Limits, policy: Policy,
                     files: FileSession | None) -> BackendSession:
        """One VM kept for a session's calls: its agent keeps one unprivileged interpreter.

        ``files`` (the session's view of its mounts) is copied in with the first call, and
        the writable mounts' state comes back into its staging after every call.

        Raises EmulationRefused as ``execute`` does, and UsageError for a memory cap below
        the VM's minimum or for mounts that hold more than the VM takes (before a VM starts).
        """
        self.check_allowed()
        _check_memory(limits)
        return _MicroVMSession(self, limits, files)

    def _drive(self, vm: VM, request: dict[str, Any], calls: HostCalls, output_bytes: int,
               memory_bytes: int, deadline: float, started: float,
               copy_in: CopyIn | None = None, copy_out: CopyOut | None = None) -> Outcome:
        outcome = Outcome(memory_limit_bytes=memory_bytes, isolation=self.runtime.accel)
        sinks = {1: bytearray(), 2: bytearray()}
        room = output_bytes
        sent = False
        done: dict[str, Any] | None = None
        try:
            while vm.channel is None and time.monotonic() < deadline:
                for _ in vm.poll(min(deadline, time.monotonic() + 0.05)):
                    pass
            if vm.channel is not None:
                vm.send(request)
                sent = True
                if copy_in is not None:
                    for message in copy_in.frames():
                        vm.send(message, deadline)
                    vm.send({"kind": "files_end"}, deadline)
                for frame in vm.poll(deadline):
                    kind = frame.get("kind")
                    if kind == "output":
                        fd, data = frame.get("fd"), frame.get("data")
                        if fd not in (1, 2) or not isinstance(data, bytes):
                            raise ValueError("a malformed output frame")
                        keep = data[:room]
                        room -= len(keep)
                        sinks[fd] += keep
                        if len(keep) < len(data):
                            setattr(outcome, "stdout_truncated" if fd == 1 else
                                    "stderr_truncated", True)
                            outcome.limit_exceeded = Limit.OUTPUT
                            break
                    elif kind == "call":
                        name, payload = frame.get("name"), frame.get("payload")
                        if not isinstance(name, str) or not isinstance(payload, bytes):
                            raise ValueError("a malformed host call")
                        try:
                            answer = calls.handle(name, payload.decode("latin-1"), deadline)
                        except StopRun as stop:
                            outcome.limit_exceeded = stop.limit
                            break
                        vm.send({"kind": "result", "ok": answer.ok,
                                 "payload": answer.payload.encode("latin-1")})
                    elif kind == "files" and copy_out is not None:
                        copy_out.apply(frame)
                    elif kind == "done":
                        done = frame
                        if copy_out is not None and done.get("limit") is None \
                                and done.get("fault") is None:
                            copy_out.finish()
                        break
        except ChannelClosed:
            pass
        except TimeoutError:  # the VM stopped reading the copy-in before the deadline
            outcome.limit_exceeded = Limit.TIMEOUT
        except QuotaExceeded as exc:
            outcome.fault = GuestException(type="OSError", traceback="", message=(
                f"{exc}: nothing was published"))
            outcome.exit_code = 1
        except OSError as exc:  # the host's own disk failed under the run's staging
            outcome.fault = GuestException(type="OSError", traceback="", message=(
                f"the run's files could not be staged: {exc.strerror or exc}"))
            outcome.exit_code = 1
        except (ValueError, msgpack.UnpackException) as exc:
            outcome.fault = GuestException(type="ProtocolError", traceback="",
                                           message=f"the guest broke the channel protocol: {exc}")
        outcome.duration_s = time.perf_counter() - started
        outcome.stdout, outcome.stderr = bytes(sinks[1]), bytes(sinks[2])
        if outcome.limit_exceeded is not None or outcome.fault is not None:
            return outcome
        if done is not None:
            self._apply_done(outcome, done, memory_bytes)
        elif time.monotonic() >= deadline:
            outcome.limit_exceeded = Limit.TIMEOUT
        else:
            vm.kill()
            console = vm.console.text()
            if "Out of memory" in console or "oom-kill" in console or not sent:
                outcome.limit_exceeded = Limit.MEMORY if sent else None
            if outcome.limit_exceeded is None:
                tail = console.strip().splitlines()[-5:]
                outcome.fault = GuestException(
                    type="VMError", traceback="",
                    message="the VM stopped before the run finished"
                            + (": " + " | ".join(tail) if tail else ""))
        return outcome

    @staticmethod
    def _apply_done(outcome: Outcome, done: dict[str, Any], memory_bytes: int) -> None:
        reply, exit_code, limit = done.get("reply"), done.get("exit_code"), done.get("limit")
        fault, cpu_s, peak = done.get("fault"), done.get("cpu_s"), done.get("memory_peak_bytes")
        if limit is not None:
            try:
                outcome.limit_exceeded = Limit(limit)
            except ValueError:
                outcome.limit_exceeded = None
            truncated = done.get("truncated")
            if outcome.limit_exceeded is Limit.OUTPUT and isinstance(truncated, list):
                outcome.stdout_truncated = 1 in truncated
                outcome.stderr_truncated = 2 in truncated
        if isinstance(reply, str):
            outcome.reply = reply
        if type(exit_code) is int and 0 <= exit_code <= 255:
            outcome.exit_code = exit_code
        if isinstance(fault, dict) and all(type(fault.get(k)) is str
                                           for k in ("type", "message", "traceback")):
            outcome.fault = GuestException(type=fault["type"], message=fault["message"],
                                           traceback=fault["traceback"])
        if isinstance(cpu_s, int | float) and math.isfinite(cpu_s) and cpu_s >= 0:
            outcome.fuel_used = int(cpu_s * FUEL_PER_CPU_SECOND)
        if type(peak) is int and peak >= 0:
            outcome.memory_peak_bytes = min(peak, memory_bytes)


def _check_memory(limits: Limits) -> None:
    if limits.memory_bytes < MIN_MEMORY_BYTES:
        raise UsageError(
            f"memory_bytes={limits.memory_bytes} is below the microVM's minimum of "
            f"{MIN_MEMORY_BYTES} bytes ({MIN_MEMORY_BYTES // 2**20} MiB): the VM's RAM "
            "holds its kernel and the preloaded Python stack too")


def _request(job: Job) -> dict[str, Any]:
    """The agent's ``run`` frame for ``job``; UsageError if its arguments cannot cross."""
    limits = job.limits
    request = {
        "kind": "run", "job": job.request(), "output_bytes": limits.output_bytes,
        "cpu_s": max(1, math.ceil(limits.fuel / FUEL_PER_CPU_SECOND)), "entropy": os.urandom(64),
        "time_ns": time.time_ns() if job.policy.clock == "real" else VIRTUAL_EPOCH_NS,
    }
    try:
        msgpack.packb(request, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"arguments must be msgpack-compatible values: {exc}") from None
    return request


def _host_calls(job: Job, log: list[CapabilityEvent]) -> HostCalls:
    policy = job.policy
    return HostCalls(functions=policy.functions, limits=job.limits,
                     http=HttpGate(policy.http) if policy.http is not None else None, log=log)


def _settled(outcome: Outcome, control: RunControl, log: list[CapabilityEvent]) -> Outcome:
    """The outcome as reported: cancelled if the caller cancelled, with the capability log."""
    if control.cancelled:
        outcome = Outcome(limit_exceeded=Limit.CANCELLED, stdout=outcome.stdout,
                          stderr=outcome.stderr, duration_s=outcome.duration_s,
                          isolation=outcome.isolation)
    outcome.capability_log = tuple(log)
    return outcome


class _MicroVMSession(BackendSession):
    """One VM serving a session's calls; its agent keeps the interpreter between them.

    The VM's RAM is the session's memory cap. Each call has its own timeout (the VM is
    killed at it), CPU budget (metered per call by the agent) and output cap. Any call that
    does not end with the agent's report (a limit, a fault, a cancel) kills the VM: the
    session is over. Runs here are not deterministic, so a session on the microVM cannot be
    replayed.

    Mounts: the session's view of them (``files``, its staging kept for the session's life)
    is copied into the VM with the first call. After every call that leaves the session
    live, the agent reports its writable mounts, and the staging is brought to the same
    state, checked and held to the quota as a run's copy-out is; the session publishes the
    staging when it ends (``wasibox._session``). A call cut short kills the VM before it
    can report, so what it wrote is lost even with ``publish="always"``, which then
    publishes the state after the last call that completed.
    """

    def __init__(self, backend: MicroVMBackend, limits: Limits,
                 files: FileSession | None) -> None:
        self._backend = backend
        self._memory_bytes = limits.memory_bytes
        self._files = files
        # Sized up before a VM starts (UsageError if the mounts do not fit in it); sent with
        # the first call, and the base every later account of the mounts is taken against.
        self._copy_in = CopyIn(files, limits.memory_bytes) if files is not None else None
        self._copied_in = False
        self._refused: list[RefusedFile] = []  # what the latest account refused
        memory_mib = math.ceil(limits.memory_bytes / 2**20)
        runtime = backend.runtime
        runtime.template(memory_mib)
        self._directory = contextlib.ExitStack()
        paths = self._directory.enter_context(run_directory())
        try:
            self._vm: VM | None = runtime.restore(memory_mib, paths)
        except BaseException:
            self._directory.close()
            raise

    @property
    def alive(self) -> bool:
        return self._vm is not None

    def run(self, job: Job, control: RunControl | None = None) -> Outcome:
        vm = self._vm
        if vm is None:
            raise UsageError("this session's VM is gone; open a new session")
        control = control or RunControl()
        if control.cancelled:
            return Outcome(limit_exceeded=Limit.CANCELLED, isolation=self._backend.isolation)
        request = _request(job)
        copy_in, files = self._copy_in, self._files
        if copy_in is not None and not self._copied_in:
            request["mounts"] = copy_in.specs()  # the agent builds them before its child
        else:
            copy_in = None
        copy_out = CopyOut(files, self._copy_in) \
            if files is not None and self._copy_in is not None else None
        started = time.perf_counter()
        log: list[CapabilityEvent] = []
        control.enter(RunState.RUNNING)
        detach = control.on_cancel(vm.stop)
        try:
            self._copied_in = True  # sent now, or the VM is gone with the call
            outcome = self._backend._drive(
                vm, request, _host_calls(job, log), job.limits.output_bytes,
                self._memory_bytes, time.monotonic() + job.limits.timeout_s, started,
                copy_in, copy_out)
        finally:
            detach()
            if copy_out is not None:
                copy_out.close()
        outcome = _settled(outcome, control, log)
        if outcome.reply is None or outcome.limit_exceeded is not None \
                or outcome.fault is not None:
            self.close()  # the agent's interpreter is gone, or cannot be trusted to go on
        elif copy_out is not None and files is not None:
            # The account is complete: it replaces the previous one's refusals.
            files.withdraw(self._refused)
            self._refused = copy_out.refused
        return outcome

    def close(self) -> None:
        vm, self._vm = self._vm, None
        if vm is not None:
            vm.kill()
            self._directory.close()
