"""The process-wide microVM runtime: the image, the accelerator, the clean template snapshot
per VM size, and one VM restored from it per run (or session) in a run directory of its own."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._errors import VMError
from ..._guest import cache_dir, file_lock
from ..._limits import Limits
from ..._progress import Reporter, heartbeat, library_reporter
from .channel import Channel, ChannelClosed, ConsoleRing
from .image import ImageConfig, ensure_image, image_modules
from .qemu import Accelerator, Engine, MachineSpec, QemuMicrovm, RunPaths, Template

__all__ = ["ALLOW_EMULATION_ENV", "MIN_MEMORY_BYTES", "TEMPLATE_TIMEOUT_S", "VM", "MicroVMRuntime",
           "cached_accelerator", "default_memory_mib", "emulation_allowed", "listen",
           "microvm_available", "microvm_runtime", "run_directory", "vm_modules"]

#: The smallest VM that boots the agent with numpy and pandas imported, with room to work.
MIN_MEMORY_BYTES = 192 * 2**20
PROBE_TIMEOUT_S = 20.0
TEMPLATE_TIMEOUT_S = 600.0
ALLOW_EMULATION_ENV = "WASIBOX_ALLOW_EMULATION"


def emulation_allowed(explicit: bool | None) -> bool:
    """The caller's choice, else ``WASIBOX_ALLOW_EMULATION=1`` in the environment."""
    if explicit is not None:
        return explicit
    return os.environ.get(ALLOW_EMULATION_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# -- one VM ---------------------------------------------------------------------------------------

class VM:
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


def listen(path: Path) -> socket.socket:
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
def run_directory() -> Iterator[RunPaths]:
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
        with run_directory() as paths, heartbeat(self.progress, "probing KVM"):
            ram = paths.directory / "ram"
            process = self.engine.launch(spec, paths, ram=ram, restore=None, probe=True)
            vm = VM(process, paths, None)
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
            with run_directory() as paths, heartbeat(
                    self.progress, f"booting the microVM template ({spec.accel}, "
                                   f"{spec.memory_mib} MiB; once per machine)"):
                listener = listen(paths.channel)
                process = self.engine.launch(spec, paths, ram=staging / "ram", restore=None)
                vm = VM(process, paths, listener)
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
    def _wait_ready(vm: VM, deadline: float) -> dict[str, Any]:
        try:
            for frame in vm.poll(deadline):
                if frame.get("kind") == "ready":
                    return frame
        except ChannelClosed:
            pass
        raise VMError("the template VM's agent never became ready; console:\n"
                      + vm.console.text()[-3000:])

    def restore(self, memory_mib: int, paths: RunPaths) -> VM:
        """Launch a VM restored from the clean template; its channel is being accepted."""
        template = self.template(memory_mib)
        spec = MachineSpec(self.image, self.accel, memory_mib)
        listener = listen(paths.channel)
        process = self.engine.launch(spec, paths, ram=template.ram, restore=template)
        return VM(process, paths, listener)


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
