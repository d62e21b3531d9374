"""The engine seam (``Engine``) and its QEMU driver: the ``microvm`` machine launched cold or
restored from a template snapshot, with ``-sandbox on``, inside bubblewrap, dying with its
parent. A Firecracker driver would implement the same four methods."""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal

from ..._errors import VMError
from .image import VMImage

__all__ = ["Accelerator", "Engine", "MachineSpec", "QemuMicrovm", "RunPaths", "Template"]

Accelerator = Literal["kvm", "tcg"]
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """What a VM is made of; everything here is part of the template snapshot's key."""

    image: VMImage
    accel: Accelerator
    memory_mib: int
    vcpus: int = 1


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """One VM's private directory (bound into its jail) and the sockets in it."""

    directory: Path

    @property
    def channel(self) -> Path:
        return self.directory / "channel.sock"

    @property
    def monitor(self) -> Path:
        return self.directory / "monitor.sock"

    @property
    def migration(self) -> Path:
        return self.directory / "migration.sock"


@dataclasses.dataclass(frozen=True)
class Template:
    """A snapshot of a VM whose agent is ready: its RAM file and its device state."""

    ram: Path
    state: Path
    key: str


class Engine(abc.ABC):
    """One way to run a microVM. ``QemuMicrovm`` here; Firecracker where it exists."""

    name: str

    @abc.abstractmethod
    def identity(self) -> str:
        """The engine's exact version: part of every snapshot key."""

    @abc.abstractmethod
    def launch(self, spec: MachineSpec, paths: RunPaths, *, ram: Path, restore: Template | None,
               probe: bool = False) -> subprocess.Popen[bytes]:
        """Start a VM (cold, or restored from ``restore``); its stdout is the console."""

    @abc.abstractmethod
    def save(self, paths: RunPaths, state: Path, deadline: float) -> None:
        """Snapshot the running VM's device state into ``state`` (RAM is in its file)."""

    @abc.abstractmethod
    def device_config(self, spec: MachineSpec) -> str:
        """The device configuration a snapshot depends on, as a stable string."""


def _host_tsc_khz() -> int:
    """The host's TSC rate; a TCG guest needs it on the command line or its boot may hang."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000) // 1000 * 1000
    except (OSError, ValueError):
        pass
    return 2_000_000


class QemuMicrovm(Engine):
    """QEMU's ``microvm`` machine (Debian ``qemu-system-x86``), jailed by bubblewrap."""

    name = "qemu-microvm"

    def __init__(self, binary: str | None = None, jail: bool = True) -> None:
        found = binary or shutil.which("qemu-system-x86_64")
        if found is None:
            raise VMError("QEMU is not installed: apt-get install qemu-system-x86")
        self.binary = found
        self.jail = jail and shutil.which("bwrap") is not None
        self._identity: str | None = None
        self._tsc_khz = _host_tsc_khz()

    def identity(self) -> str:
        if self._identity is None:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True,
                                 check=False).stdout
            digest = hashlib.sha256(Path(self.binary).read_bytes()).hexdigest()[:16]
            self._identity = f"{out.splitlines()[0] if out else 'qemu'} {digest}"
        return self._identity

    def _kernel_args(self, spec: MachineSpec, probe: bool) -> str:
        args = ["console=ttyS0", "quiet", "panic=-1", "reboot=t", "nomodeset",
                "rootwait=0", "i8042.noaux", "i8042.nokbd"]
        if spec.accel == "tcg":
            # Without a known TSC rate most TCG boots hang; without tsc=reliable the clocksource
            # watchdog drops the TSC after a snapshot restore and the guest falls back to
            # jiffies (4 ms resolution).
            args += [f"tsc_early_khz={self._tsc_khz}", "tsc=reliable"]
        if probe:
            args.append("wasibox.probe")
        return " ".join(args)

    def _device_args(self, spec: MachineSpec, paths: RunPaths, probe: bool) -> list[str]:
        image = spec.image
        args = [
            "-M", "microvm,pit=on,rtc=on,acpi=on,isa-serial=on,memory-backend=ram",
            "-accel", spec.accel,
            "-cpu", "host" if spec.accel == "kvm" else "max",
            "-m", f"{spec.memory_mib}M", "-smp", str(spec.vcpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(image.initramfs),
            "-append", self._kernel_args(spec, probe),
            "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
        ]
        if not probe:
            args += [
                "-drive", f"id=root,file={image.rootfs},format=raw,if=none,readonly=on",
                "-device", "virtio-blk-device,drive=root",
                "-device", "virtio-serial-device",
                "-chardev", f"socket,id=channel,path={paths.channel}",
                "-device", "virtserialport,chardev=channel,name=agent",
            ]
        return args

    def device_config(self, spec: MachineSpec) -> str:
        placeholder = RunPaths(Path("/run"))
        return json.dumps([self.identity(), spec.memory_mib, spec.vcpus,
                           self._device_args(spec, placeholder, False)])

    def launch(self, spec: MachineSpec, paths: RunPaths, *, ram: Path, restore: Template | None,
               probe: bool = False) -> subprocess.Popen[bytes]:
        argv = [self.binary, *self._device_args(spec, paths, probe),
                "-object", f"memory-backend-file,id=ram,size={spec.memory_mib}M,"
                           f"mem-path={ram},share={'off' if restore else 'on'}",
                # seccomp: no spawning, no privilege changes, no obsolete syscalls.
                "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,"
                            "resourcecontrol=deny"]
        pass_fds: tuple[int, ...] = ()
        state_fd = -1
        if restore is not None:
            state_fd = os.open(restore.state, os.O_RDONLY | os.O_CLOEXEC)
            os.set_inheritable(state_fd, True)
            pass_fds = (state_fd,)
            argv += ["-incoming", "defer"]
        argv += ["-qmp", f"unix:{paths.monitor},server=on,wait=off"]
        readable: list[Path] = [spec.image.kernel, spec.image.initramfs, spec.image.rootfs]
        if restore is not None:
            readable += [restore.state]
        writable = [paths.directory, ram.parent if restore is None else ram]
        command = _jailed(argv, readable, writable, kvm=spec.accel == "kvm") if self.jail \
            else argv
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       pass_fds=pass_fds, preexec_fn=_die_with_parent,
                                       start_new_session=True)
        finally:
            if state_fd >= 0:
                os.close(state_fd)
        if restore is not None:
            try:
                with _Qmp(paths.monitor, time.monotonic() + 30.0, process) as qmp:
                    qmp.command("migrate-set-capabilities", capabilities=[
                        {"capability": "x-ignore-shared", "state": True}])
                    qmp.command("migrate-incoming", uri=f"fd:{state_fd}")
            except BaseException:
                process.kill()
                process.wait()
                raise
        return process

    def save(self, paths: RunPaths, state: Path, deadline: float) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(paths.migration))
        listener.listen(1)
        received = threading.Event()
        failure: list[BaseException] = []

        def receive() -> None:
            try:
                listener.settimeout(max(deadline - time.monotonic(), 1.0))
                connection, _ = listener.accept()
                with connection, open(state, "wb") as sink:
                    while chunk := connection.recv(1 << 20):
                        sink.write(chunk)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                failure.append(exc)
            finally:
                received.set()

        thread = threading.Thread(target=receive, name="wasibox-vm-save", daemon=True)
        thread.start()
        with _Qmp(paths.monitor, deadline) as qmp:
            qmp.command("migrate-set-capabilities", capabilities=[
                {"capability": "x-ignore-shared", "state": True}])
            qmp.command("migrate", uri=f"unix:{paths.migration}")
            while True:
                status = qmp.command("query-migrate").get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled") or time.monotonic() > deadline:
                    raise VMError(f"QEMU could not snapshot the template VM ({status})")
                time.sleep(0.05)
        received.wait(max(deadline - time.monotonic(), 1.0))
        listener.close()
        if failure:
            raise VMError(f"receiving the template snapshot failed: {failure[0]}")


class _Qmp:
    """The few QMP commands the template needs, over QEMU's monitor socket."""

    def __init__(self, path: Path, deadline: float,
                 process: subprocess.Popen[bytes] | None = None) -> None:
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(max(deadline - time.monotonic(), 1.0))
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if process is not None and process.poll() is not None:
                    output = process.stdout.read().decode(errors="replace") \
                        if process.stdout else ""
                    raise VMError(f"QEMU exited at start: {output.strip()[-2000:]}") from None
                if time.monotonic() > deadline:
                    raise VMError("QEMU's monitor socket never appeared") from None
                time.sleep(0.002)
        self.file = self.sock.makefile("rwb")
        self._read()  # the greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.file.readline()
            if not line:
                raise VMError("QEMU closed its monitor")
            message: dict[str, Any] = json.loads(line)
            if "event" not in message:
                return message

    def command(self, name: str, **arguments: Any) -> dict[str, Any]:
        self.file.write(json.dumps({"execute": name, "arguments": arguments}).encode() + b"\n")
        self.file.flush()
        reply = self._read()
        if "error" in reply:
            raise VMError(f"QEMU refused {name}: {reply['error'].get('desc')}")
        result: dict[str, Any] = reply.get("return") or {}
        return result

    def __enter__(self) -> _Qmp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.file.close()
        self.sock.close()


def _die_with_parent() -> None:
    """In the child before exec: die with the parent, so no VM outlives the host process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent already died between fork and prctl
        os._exit(1)


def _system_paths() -> list[str]:
    """The read-only host directories QEMU's binary and its firmware live in."""
    return [path for path in ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
            if os.path.lexists(path)]


def _jailed(argv: list[str], readable: list[Path], writable: list[Path], kvm: bool) -> list[str]:
    """Wrap ``argv`` in bubblewrap: new namespaces, no capabilities, only the given files."""
    command = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--clearenv", "--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/tmp"]
    for system in _system_paths():
        if os.path.islink(system):
            command += ["--symlink", os.readlink(system), system]
        else:
            command += ["--ro-bind", system, system]
    for path in readable:
        command += ["--ro-bind", str(path), str(path)]
    for path in writable:
        command += ["--bind", str(path), str(path)]
    if kvm:
        command += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
    return [*command, "--", *argv]
