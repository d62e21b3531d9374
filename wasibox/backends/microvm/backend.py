"""The microVM backend: code that needs native extensions runs in a VM with its own kernel.

Each run gets a VM restored copy-on-write from a clean template snapshot, taken once after
the guest agent (``guest/microvm/agent.py``) imported numpy and pandas; the VM is killed when
the run ends, so no state carries over. The agent speaks the wasm runner's message shapes, so
``RunResult`` is built by the same host code for both backends.

The engine sits behind a small seam (``Engine``): ``QemuMicrovm`` drives QEMU's ``microvm``
machine, which is what Debian provides; a Firecracker driver would implement the same four
methods (its jailer, vsock and native snapshots map onto them).

Threat model, in layers:

* **The guest kernel.** Guest code runs as an unprivileged user in its own kernel; a kernel
  exploit gains the VM, not the host. The VM has *no network device at all* (never QEMU user
  networking, which exposes host loopback), a read-only root file system, RAM-backed /tmp
  inside its memory cap, and one virtio-serial port to the agent.
* **The accelerator.** With KVM, QEMU's device model is the boundary QEMU's security policy
  covers. Under TCG (software emulation, used where KVM cannot run the guest) QEMU's policy
  says it is *not* a security boundary, so wasibox refuses TCG unless the caller opts in
  (``Sandbox(allow_emulation=True)`` or ``WASIBOX_ALLOW_EMULATION=1``), and reports
  ``r.isolation`` (``"kvm"`` or ``"tcg"``) on every result.
* **Around QEMU.** QEMU runs with ``-sandbox on`` (seccomp: no spawning, no privilege
  changes), ``-nodefaults``, inside bubblewrap: new user, PID, network, IPC and UTS
  namespaces, all capabilities dropped, a fresh ``/dev`` and ``/tmp``, and of the host's files
  only the read-only system directories QEMU's binary needs, the image files (read-only) and
  the run's own directory with its sockets. The VM dies with its parent (``PR_SET_PDEATHSIG``
  on bubblewrap, ``--die-with-parent`` inside it), so no orphan VM outlives the host.
* **The host.** Everything from the guest is untrusted: frames are size-checked before they
  are decoded, the reply is checked by the shared wire code, the output cap and the timeout
  are enforced by the host whatever the agent says, and the console is kept in a bounded ring.

Capabilities: host functions and mediated HTTP travel over the VM's channel. The child runs
the wasm guest's own ``import host`` module (``guest/runner/host/``) over a pipe to the
agent, which relays each call as a frame; the host answers it with the same
``HostCalls``/``HttpGate`` code the wasm backend uses, so policy, limits and the capability
log are identical. Mounts are copied in over the channel (no host directory or disk reaches
the VM) and a writable mount's changes come back the same way, into the run's staging, which
the wasm backend's own code publishes only if the run ends ok (``backends/microvm/files.py``).

Residual risk: QEMU 7.2 cannot open the template's RAM file read-only and still map it
writable-private, so a QEMU compromised by a guest could write to the template file it was
restored from. The template is mapped private (``share=off``), so the guest itself cannot.

Limits: ``timeout_s`` kills the VM; ``memory_bytes`` is the VM's RAM (a guest OOM is reported
as ``"memory"``); ``output_bytes`` is enforced by the agent and again here; ``fuel`` has no
meaning in a VM, so it becomes a guest CPU-time budget of ``fuel / FUEL_PER_CPU_SECOND``
seconds (``RLIMIT_CPU``), reported as ``"fuel"`` when hit, and ``fuel_used`` is the CPU time
used at the same rate (not deterministic).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import math
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgpack

from ..._control import RunControl, RunState
from ..._errors import EmulationRefused, UsageError, VMError
from ..._events import CapabilityEvent
from ..._guest import cache_dir, file_lock
from ..._limits import Limit, Limits
from ..._progress import Reporter, heartbeat, library_reporter
from ..._result import GuestException, Outcome
from ..._wire import unpack
from ...capabilities.files.session import FileSession
from ...capabilities.hostcall import HostCalls, StopRun
from ...capabilities.http import HttpGate
from ..base import Backend, BackendSession, Job, Policy
from .files import CopyIn, CopyOut, QuotaExceeded
from .image import ImageConfig, VMImage, ensure_image, image_modules

__all__ = ["ALLOW_EMULATION_ENV", "FUEL_PER_CPU_SECOND", "MIN_MEMORY_BYTES", "Engine",
           "MicroVMBackend", "MicroVMRuntime", "QemuMicrovm", "cached_accelerator",
           "default_memory_mib", "emulation_allowed", "microvm_available", "microvm_runtime",
           "vm_modules"]

Accelerator = Literal["kvm", "tcg"]
#: Fuel is wasm's CPU budget; in a VM it becomes guest CPU seconds at this rate: what the wasm
#: guest burned per CPU second in a pure-Python loop on the reference machine (1.4-1.8e9).
FUEL_PER_CPU_SECOND = 1_500_000_000
#: The smallest VM that boots the agent with numpy and pandas imported, with room to work.
MIN_MEMORY_BYTES = 192 * 2**20
CONSOLE_RING_BYTES = 64 * 2**10
#: Largest frame accepted from the guest: the reply limit, base64-encoded, plus framing.
MAX_FRAME_BYTES = 90 * 2**20
#: Most elements one frame from the guest may decode to: a files frame of 1024 entries of at
#: most 5 items each, with room to spare. Checked before the frame is decoded.
MAX_FRAME_ELEMENTS = 8192
#: Deepest nesting of a frame: a files frame's map, its entries, an entry.
MAX_FRAME_DEPTH = 3
PROBE_TIMEOUT_S = 20.0
TEMPLATE_TIMEOUT_S = 600.0
ALLOW_EMULATION_ENV = "WASIBOX_ALLOW_EMULATION"
_PR_SET_PDEATHSIG = 1
#: The guest's virtual wall clock starts here unless the policy grants the real clock.
VIRTUAL_EPOCH_NS = 1_704_067_200 * 10**9


def emulation_allowed(explicit: bool | None) -> bool:
    """The caller's choice, else ``WASIBOX_ALLOW_EMULATION=1`` in the environment."""
    if explicit is not None:
        return explicit
    return os.environ.get(ALLOW_EMULATION_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# -- the channel ---------------------------------------------------------------------------------

class ChannelClosed(Exception):
    """The guest side of the channel went away."""


class Channel:
    """Length-prefixed msgpack frames over a connected stream socket (host side)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def send(self, message: dict[str, Any]) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def feed(self) -> bool:
        """Read what is available into the buffer; False at end of stream."""
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        self._buffer += data
        return True

    def frames(self) -> Iterator[dict[str, Any]]:
        """Decode every complete frame in the buffer; raises ValueError (ProtocolError for
        a frame that is not plain msgpack within ``MAX_FRAME_ELEMENTS`` and
        ``MAX_FRAME_DEPTH``)."""
        while len(self._buffer) >= 4:
            (size,) = struct.unpack(">I", self._buffer[:4])
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"the guest sent a {size}-byte frame (the cap is "
                                 f"{MAX_FRAME_BYTES})")
            if len(self._buffer) < 4 + size:
                return
            raw = bytes(self._buffer[4:4 + size])
            del self._buffer[:4 + size]
            message, _ = unpack(raw, "a frame from the guest", MAX_FRAME_ELEMENTS,
                                MAX_FRAME_DEPTH)
            if not isinstance(message, dict):
                raise ValueError("a frame from the guest is not a map")
            yield message


class ConsoleRing:
    """The VM's serial console: only the last ``size`` bytes are kept."""

    def __init__(self, size: int = CONSOLE_RING_BYTES) -> None:
        self._data: collections.deque[bytes] = collections.deque()
        self._size = size
        self._held = 0

    def append(self, data: bytes) -> None:
        self._data.append(data)
        self._held += len(data)
        while self._held > self._size and len(self._data) > 1:
            self._held -= len(self._data.popleft())

    def text(self) -> str:
        return b"".join(self._data)[-self._size:].decode("utf-8", "replace")


# -- the engine seam -----------------------------------------------------------------------------

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


# -- one VM ---------------------------------------------------------------------------------------

class _VM:
    """A launched VM, its console ring and its channel; killing it is idempotent."""

    def __init__(self, process: subprocess.Popen[bytes], paths: RunPaths,
                 listener: socket.socket | None) -> None:
        self.process = process
        self.paths = paths
        self.listener = listener
        self.console = ConsoleRing()
        self.channel: Channel | None = None
        self.selector = selectors.DefaultSelector()
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        self.selector.register(process.stdout, selectors.EVENT_READ, "console")
        if listener is not None:
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, "listener")

    def poll(self, deadline: float) -> Iterator[dict[str, Any]]:
        """Wait until ``deadline`` for frames; yields them. Raises ChannelClosed at EOF."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            events = self.selector.select(min(remaining, 1.0))
            for key, _ in events:
                if key.data == "console":
                    self._read_console()
                elif key.data == "listener":
                    assert self.listener is not None
                    try:
                        connection, _ = self.listener.accept()
                    except BlockingIOError:
                        continue
                    connection.setblocking(False)
                    self.selector.unregister(self.listener)
                    self.channel = Channel(connection)
                    self.selector.register(connection, selectors.EVENT_READ, "channel")
                elif key.data == "channel":
                    assert self.channel is not None
                    alive = self.channel.feed()
                    yield from self.channel.frames()
                    if not alive:
                        raise ChannelClosed
            if self.process.poll() is not None and not events:
                self._read_console()
                raise ChannelClosed

    def _read_console(self) -> None:
        assert self.process.stdout is not None
        try:
            data = os.read(self.process.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.console.append(data)
        else:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.process.stdout)

    def send(self, message: dict[str, Any], deadline: float | None = None) -> None:
        """Send one frame, waiting at most until ``deadline`` (TimeoutError after it);
        ChannelClosed if the VM has gone."""
        assert self.channel is not None
        if deadline is None:
            self.channel.sock.setblocking(True)
        else:
            self.channel.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            self.channel.send(message)
        except TimeoutError:
            raise
        except OSError:
            raise ChannelClosed from None
        finally:
            self.channel.sock.setblocking(False)

    def stop(self) -> None:
        """Kill the VM now, from any thread; ``kill`` still reaps it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()
        with contextlib.suppress(Exception):
            self._read_console()
        self.selector.close()
        if self.channel is not None:
            self.channel.sock.close()
        if self.listener is not None:
            self.listener.close()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _listen(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    return listener


_RUN_PREFIX = "wasibox-vm-"


def _reap_stale_run_directories() -> None:
    """Remove run directories left by host processes that died (their VMs died with them)."""
    for entry in Path(tempfile.gettempdir()).glob(f"{_RUN_PREFIX}*-*"):
        owner = entry.name.removeprefix(_RUN_PREFIX).partition("-")[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


@contextlib.contextmanager
def _run_directory() -> Iterator[RunPaths]:
    directory = Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-"))
    try:
        yield RunPaths(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- the process-wide runtime --------------------------------------------------------------------

class MicroVMRuntime:
    """Image, engine, accelerator and templates: made once per process, shared by sandboxes."""

    def __init__(self, config: ImageConfig | None = None, *, engine: Engine | None = None,
                 progress: Reporter | None = None) -> None:
        self.progress = progress or library_reporter()
        _reap_stale_run_directories()
        self.engine = engine or QemuMicrovm()
        self.image = ensure_image(config, self.progress)
        self.accel = self._accelerator()
        self._templates: dict[int, Template] = {}
        self._lock = threading.Lock()

    # -- accelerator ---------------------------------------------------------------------
    def _accelerator(self) -> Accelerator:
        forced = os.environ.get("WASIBOX_MICROVM_ACCEL", "").strip().lower()
        if forced in ("kvm", "tcg"):
            return forced  # type: ignore[return-value]
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            return "tcg"
        record = cache_dir() / "microvm" / "accelerator.json"
        key = f"{_boot_id()} {self.engine.identity()} {self.image.digest}"
        with contextlib.suppress(OSError, ValueError, KeyError):
            saved = json.loads(record.read_text())
            if saved["key"] == key and saved["accel"] in ("kvm", "tcg"):
                return saved["accel"]  # type: ignore[no-any-return]
        accel: Accelerator = "kvm" if self._probe_kvm() else "tcg"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"key": key, "accel": accel}))
        return accel

    def _probe_kvm(self) -> bool:
        """Boot the guest kernel under KVM, time-boxed: does it reach user space?"""
        spec = MachineSpec(self.image, "kvm", 128)
        with _run_directory() as paths, heartbeat(self.progress, "probing KVM"):
            ram = paths.directory / "ram"
            process = self.engine.launch(spec, paths, ram=ram, restore=None, probe=True)
            vm = _VM(process, paths, None)
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            try:
                while time.monotonic() < deadline and process.poll() is None:
                    with contextlib.suppress(ChannelClosed):
                        for _ in vm.poll(min(deadline, time.monotonic() + 0.2)):
                            pass
                    if "wasibox-probe-ok" in vm.console.text():
                        return True
                return "wasibox-probe-ok" in vm.console.text()
            finally:
                vm.kill()

    # -- templates -----------------------------------------------------------------------
    def template(self, memory_mib: int) -> Template:
        """The clean template for a VM of this size, made (and cached on disk) if needed."""
        with self._lock:
            cached = self._templates.get(memory_mib)
            if cached is not None:
                return cached
        spec = MachineSpec(self.image, self.accel, memory_mib)
        key = hashlib.sha256("\0".join([
            self.image.digest, self.engine.device_config(spec), self.accel,
        ]).encode()).hexdigest()[:24]
        directory = cache_dir() / "microvm" / "templates" / key
        template = Template(directory / "ram", directory / "state", key)
        if not (template.ram.is_file() and template.state.is_file()):
            with file_lock(directory.with_suffix(".lock")):
                if not (template.ram.is_file() and template.state.is_file()):
                    self._make_template(spec, template)
        with self._lock:
            self._templates[memory_mib] = template
        return template

    def _make_template(self, spec: MachineSpec, template: Template) -> None:
        directory = template.ram.parent
        staging = directory.with_name(directory.name + f".{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        started = time.monotonic()
        deadline = started + TEMPLATE_TIMEOUT_S
        try:
            with _run_directory() as paths, heartbeat(
                    self.progress, f"booting the microVM template ({spec.accel}, "
                                   f"{spec.memory_mib} MiB; once per machine)"):
                listener = _listen(paths.channel)
                process = self.engine.launch(spec, paths, ram=staging / "ram", restore=None)
                vm = _VM(process, paths, listener)
                try:
                    ready = self._wait_ready(vm, deadline)
                    self.engine.save(paths, staging / "state", deadline)
                finally:
                    vm.kill()
            (staging / "meta.json").write_text(json.dumps({
                "python": ready.get("python"), "boot_seconds": round(
                    time.monotonic() - started, 2), "accel": spec.accel}))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.progress(f"made the microVM template in {time.monotonic() - started:.1f}s "
                      "(cached)")

    @staticmethod
    def _wait_ready(vm: _VM, deadline: float) -> dict[str, Any]:
        try:
            for frame in vm.poll(deadline):
                if frame.get("kind") == "ready":
                    return frame
        except ChannelClosed:
            pass
        raise VMError("the template VM's agent never became ready; console:\n"
                      + vm.console.text()[-3000:])

    def restore(self, memory_mib: int, paths: RunPaths) -> _VM:
        """Launch a VM restored from the clean template; its channel is being accepted."""
        template = self.template(memory_mib)
        spec = MachineSpec(self.image, self.accel, memory_mib)
        listener = _listen(paths.channel)
        process = self.engine.launch(spec, paths, ram=template.ram, restore=template)
        return _VM(process, paths, listener)


def default_memory_mib() -> int:
    """The VM size a run with default limits gets (its template is the one built ahead)."""
    return math.ceil(Limits().memory_bytes / 2**20)


def cached_accelerator() -> str:
    """What the accelerator probe found on this machine, for ``wasibox doctor``."""
    forced = os.environ.get("WASIBOX_MICROVM_ACCEL", "").strip().lower()
    if forced in ("kvm", "tcg"):
        return f"{forced} (forced by WASIBOX_MICROVM_ACCEL)"
    if not os.path.exists("/dev/kvm"):
        return "tcg: /dev/kvm does not exist (no hardware virtualization reaches this machine)"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg: this user cannot open /dev/kvm read-write (add it to the kvm group)"
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads((cache_dir() / "microvm" / "accelerator.json").read_text())
        if saved["key"].startswith(_boot_id()):
            if saved["accel"] == "kvm":
                return "kvm (probed on this boot: the guest kernel boots under KVM)"
            # /dev/kvm opens, yet the probe VM never reached user space: typically a VM
            # whose hypervisor offers nested KVM without what the guest kernel needs.
            return (f"tcg (probed on this boot): /dev/kvm opens, but the guest kernel did "
                    f"not boot under KVM within {PROBE_TIMEOUT_S:g}s, as in a VM whose "
                    "nested KVM is not usable")
    return "not probed yet (`wasibox microvm build` probes it)"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


_runtime: MicroVMRuntime | None = None
_runtime_lock = threading.Lock()


def microvm_runtime(progress: Reporter | None = None) -> MicroVMRuntime:
    """The process-wide microVM runtime, made on first use (building the image if needed)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = MicroVMRuntime(progress=progress)
        return _runtime


def vm_modules() -> frozenset[str]:
    """Top-level modules the microVM image has (never builds it)."""
    if _runtime is not None:
        return _runtime.image.modules
    return image_modules()


def microvm_available() -> bool:
    """True if this machine has what the microVM backend needs to start (QEMU)."""
    return shutil.which("qemu-system-x86_64") is not None


# -- the backend ----------------------------------------------------------------------------------

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
        with _run_directory() as paths:
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

        Raises EmulationRefused as ``execute`` does, UsageError for a memory cap below the
        VM's minimum and for mounts (a microVM session cannot copy them in and out yet).
        """
        self.check_allowed()
        _check_memory(limits)
        if files is not None:
            raise UsageError("a microVM session cannot use mounts yet; use the wasm backend "
                             "for a session with mounts, or Sandbox.run for each call")
        return _MicroVMSession(self, limits)

    def _drive(self, vm: _VM, request: dict[str, Any], calls: HostCalls, output_bytes: int,
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
    """

    def __init__(self, backend: MicroVMBackend, limits: Limits) -> None:
        self._backend = backend
        self._memory_bytes = limits.memory_bytes
        memory_mib = math.ceil(limits.memory_bytes / 2**20)
        runtime = backend.runtime
        runtime.template(memory_mib)
        self._directory = contextlib.ExitStack()
        paths = self._directory.enter_context(_run_directory())
        try:
            self._vm: _VM | None = runtime.restore(memory_mib, paths)
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
        started = time.perf_counter()
        log: list[CapabilityEvent] = []
        control.enter(RunState.RUNNING)
        detach = control.on_cancel(vm.stop)
        try:
            outcome = self._backend._drive(
                vm, request, _host_calls(job, log), job.limits.output_bytes,
                self._memory_bytes, time.monotonic() + job.limits.timeout_s, started)
        finally:
            detach()
        outcome = _settled(outcome, control, log)
        if outcome.reply is None or outcome.limit_exceeded is not None \
                or outcome.fault is not None:
            self.close()  # the agent's interpreter is gone, or cannot be trusted to go on
        return outcome

    def close(self) -> None:
        vm, self._vm = self._vm, None
        if vm is not None:
            vm.kill()
            self._directory.close()


