"""The microVM backend, end to end: real QEMU, the real Debian image, the real guest agent.

Every VM test shares one built image and template (the session fixture builds them with
progress if this machine has none cached). Under TCG each run costs about a second, so the
number of VM runs here is kept small: each test asserts several things about one run.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

import wasibox
from tests.conftest import PYTHON, child_env
from wasibox import Limit, Limits, UsageError
from wasibox.backends.microvm.backend import MicroVMBackend
from wasibox.backends.microvm.image import cached_image_state
from wasibox.backends.microvm.runtime import MicroVMRuntime, microvm_runtime

pytestmark = pytest.mark.microvm

#: Generous limits: under TCG guest code runs 15-30x slower than native.
VM_LIMITS = Limits(timeout_s=60.0, fuel=60 * 10**9)

TRANSFORM = textwrap.dedent("""
    import numpy as np
    import pandas as pd

    def transform(rows):
        frame = pd.DataFrame(rows)
        frame["total"] = frame["qty"] * frame["price"]
        summary = frame.groupby("region")["total"].agg(["sum", "count"]).reset_index()
        return {
            "regions": summary["region"].tolist(),
            "sums": [float(x) for x in summary["sum"]],
            "counts": [int(x) for x in summary["count"]],
            "norm": float(np.linalg.norm(frame["total"].to_numpy())),
        }
""")
ROWS = [{"region": "north", "qty": 2, "price": 3.0}, {"region": "south", "qty": 1, "price": 4.0},
        {"region": "north", "qty": 5, "price": 1.0}]


def _vm_processes(owner: int | None = None) -> list[int]:
    """PIDs of QEMU processes the ``owner`` process (this one by default) started: their run
    directories are named after it, so VMs of other test sessions do not count."""
    marker = f"wasibox-vm-{owner or os.getpid()}-".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if b"qemu-system" in cmdline and marker in cmdline:
            found.append(int(entry))
    return found


def _no_orphans(owner: int | None = None) -> None:
    deadline = time.monotonic() + 10
    while _vm_processes(owner) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _vm_processes(owner) == []


@pytest.fixture(scope="session")
def vm_runtime() -> MicroVMRuntime:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("QEMU is not installed (apt-get install qemu-system-x86)")
    if os.geteuid() != 0 and not cached_image_state().startswith("built"):
        pytest.skip("the microVM image is not built, and building it needs root "
                    "(sudo wasibox microvm build)")
    return microvm_runtime()


@pytest.fixture(scope="session")
def vm(vm_runtime: MicroVMRuntime) -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox(VM_LIMITS, backend="microvm", allow_emulation=True) as sandbox:
        yield sandbox


def test_numpy_and_pandas_run_forced(vm: wasibox.Sandbox, vm_runtime: MicroVMRuntime) -> None:
    result = vm.run(TRANSFORM + "print(transform(ROWS))".replace("ROWS", repr(ROWS)))
    assert result.ok, result
    assert result.backend == "microvm"
    assert result.isolation == vm_runtime.accel
    assert result.isolation in ("kvm", "tcg")
    assert "'regions': ['north', 'south']" in result.stdout
    assert "'sums': [11.0, 4.0]" in result.stdout
    _no_orphans()


def test_call_in_auto_mode_picks_the_microvm(vm_runtime: MicroVMRuntime) -> None:
    with wasibox.Sandbox(VM_LIMITS, allow_emulation=True) as sandbox:
        result = sandbox.run(TRANSFORM, entry="transform", args=[ROWS])
    assert result.ok, result
    assert result.backend == "microvm"
    assert result.value["regions"] == ["north", "south"]
    assert result.value["sums"] == [11.0, 4.0]
    assert result.value["counts"] == [2, 1]
    assert result.value["norm"] == pytest.approx((36 + 16 + 25) ** 0.5)


def test_call_forced_raises_the_guest_error(vm: wasibox.Sandbox) -> None:
    value = vm.call(TRANSFORM, "transform", ROWS)
    assert value["counts"] == [2, 1]
    with pytest.raises(wasibox.GuestError) as caught:
        vm.call("import numpy\ndef f():\n    return numpy.zeros(2) / undefined\n", "f")
    assert caught.value.type == "NameError"
    assert "<sandbox>" in caught.value.traceback
    assert "agent.py" not in caught.value.traceback


def test_auto_mode_keeps_plain_code_on_wasm() -> None:
    with wasibox.Sandbox() as sandbox:
        result = sandbox.run("import json\nprint(json.dumps([1, 2]))")
    assert result.backend == "wasm"
    assert result.isolation == "wasm"
    assert result.stdout == "[1, 2]\n"


def test_requires_selects_the_microvm(vm_runtime: MicroVMRuntime) -> None:
    code = ("import random, sys\nnp = sys.modules['numpy']\n"
            "print(sys.platform, random.random(), np.random.random())")
    with wasibox.Sandbox(VM_LIMITS, requires=["numpy"], allow_emulation=True,
                         entropy="real") as sandbox:
        first, second = sandbox.run(code), sandbox.run(code)
    assert first.backend == second.backend == "microvm"
    assert first.stdout.startswith("linux ")
    # Every VM starts from the same template; its entropy must not: the host reseeds it.
    assert first.stdout != second.stdout


def test_timeout_kills_the_vm(vm_runtime: MicroVMRuntime) -> None:
    limits = VM_LIMITS.replace(timeout_s=15.0)
    with wasibox.Sandbox(limits, backend="microvm", allow_emulation=True) as sandbox:
        result = sandbox.run("print('started', flush=True)\nwhile True:\n    pass")
    assert result.limit_exceeded is Limit.TIMEOUT
    assert not result.ok
    assert result.stdout == "started\n"  # output before the kill is kept
    _no_orphans()


def test_guest_oom_is_reported_as_memory(vm_runtime: MicroVMRuntime) -> None:
    code = textwrap.dedent("""
        hog = []
        while True:
            hog.append(bytearray(16 * 2**20))
    """)
    with wasibox.Sandbox(VM_LIMITS, backend="microvm", allow_emulation=True) as sandbox:
        result = sandbox.run(code)
    assert result.limit_exceeded is Limit.MEMORY, result
    assert result.memory_peak_bytes > 0
    _no_orphans()


def test_output_flood_is_cut_at_the_cap(vm_runtime: MicroVMRuntime) -> None:
    limits = VM_LIMITS.replace(output_bytes=10_000)
    with wasibox.Sandbox(limits, backend="microvm", allow_emulation=True) as sandbox:
        result = sandbox.run("while True:\n    print('x' * 999)")
    assert result.limit_exceeded is Limit.OUTPUT
    assert result.stdout_truncated
    assert len(result.stdout) + len(result.stderr) <= 10_000
    assert result.stdout.startswith("x" * 999)
    _no_orphans()


def test_fork_bomb_is_contained(vm_runtime: MicroVMRuntime) -> None:
    code = textwrap.dedent("""
        import os
        print("bombing", flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    limits = VM_LIMITS.replace(timeout_s=15.0)
    with wasibox.Sandbox(limits, backend="microvm", allow_emulation=True) as sandbox:
        result = sandbox.run(code)
    assert result.limit_exceeded is Limit.TIMEOUT
    assert result.stdout.startswith("bombing")
    _no_orphans()


def test_console_flood_is_refused_or_bounded(vm: wasibox.Sandbox) -> None:
    # The job cannot reach the kernel console (it runs unprivileged); whatever reaches QEMU's
    # console is kept in a bounded ring on the host, and the next run is unaffected.
    code = textwrap.dedent("""
        for path in ("/dev/console", "/dev/kmsg", "/dev/ttyS0", "/dev/tty0", "/dev/hvc0"):
            try:
                with open(path, "wb", buffering=0) as device:
                    for _ in range(200):
                        device.write(b"x" * 50_000)
                print(path, "written")
            except OSError as exc:
                print(path, "refused", type(exc).__name__)
    """)
    result = vm.run(code)
    assert result.ok, result
    assert "written" not in result.stdout, result.stdout
    assert vm.run("print('next')").stdout == "next\n"
    _no_orphans()


def test_no_network_inside_the_vm(vm: wasibox.Sandbox) -> None:
    code = textwrap.dedent("""
        import os, socket
        print(sorted(os.listdir("/sys/class/net")))
        for host, port in [("10.0.2.2", 80), ("169.254.169.254", 80), ("127.0.0.1", 22)]:
            try:
                socket.create_connection((host, port), timeout=3).close()
                print(host, "connected")
            except OSError as exc:
                print(host, "failed", type(exc).__name__)
    """)
    result = vm.run(code)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[0] == "['lo']"  # no network device at all, only loopback
    for host in ("10.0.2.2", "169.254.169.254", "127.0.0.1"):
        assert any(line.startswith(f"{host} failed") for line in lines), result.stdout


def test_guest_is_unprivileged_and_root_is_read_only(vm: wasibox.Sandbox) -> None:
    code = textwrap.dedent("""
        import os
        print(os.getuid(), os.getgid())
        try:
            open("/usr/evil", "w")
        except OSError as exc:
            print("write refused", exc.errno)
        with open("/tmp/scratch", "w") as handle:
            handle.write("ok")
        print(open("/tmp/scratch").read())
    """)
    result = vm.run(code)
    assert result.ok, result
    uid_line, refused, scratch = result.stdout.splitlines()
    assert uid_line == "65534 65534"
    assert refused.startswith("write refused")
    assert scratch == "ok"


def test_tcg_is_refused_without_opt_in(vm_runtime: MicroVMRuntime,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WASIBOX_ALLOW_EMULATION", raising=False)
    backend = MicroVMBackend(runtime_=vm_runtime)
    if vm_runtime.accel == "kvm":
        backend.check_allowed()  # hardware virtualization needs no opt-in
        return
    with pytest.raises(UsageError, match="TCG") as caught:
        with wasibox.Sandbox(VM_LIMITS, backend="microvm") as sandbox:
            sandbox.run("print(1)")
    assert "allow_emulation=True" in str(caught.value)
    assert "WASIBOX_ALLOW_EMULATION=1" in str(caught.value)
    with pytest.raises(UsageError, match="TCG"):
        with wasibox.Sandbox(VM_LIMITS) as sandbox:  # auto mode picks the VM, then refuses
            sandbox.run("import numpy")
    monkeypatch.setenv("WASIBOX_ALLOW_EMULATION", "1")
    MicroVMBackend(runtime_=vm_runtime).check_allowed()


def test_the_cli_refusal_names_the_flag(vm_runtime: MicroVMRuntime) -> None:
    if vm_runtime.accel == "kvm":
        pytest.skip("this machine has KVM: the microVM needs no emulation, so none is refused")
    env = {key: value for key, value in child_env().items()
           if key != "WASIBOX_ALLOW_EMULATION"}
    done = subprocess.run([PYTHON, "-m", "wasibox", "run", "--backend", "microvm", "-c",
                           "print(1)"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "software emulation (TCG)" in done.stderr
    assert "--allow-emulation (wasibox run) or WASIBOX_ALLOW_EMULATION=1" in done.stderr
    assert "Sandbox(" not in done.stderr


def test_memory_below_the_vm_minimum_is_a_usage_error(vm: wasibox.Sandbox) -> None:
    with wasibox.Sandbox(VM_LIMITS.replace(memory_bytes="64MiB"), backend="microvm",
                         allow_emulation=True) as sandbox:
        with pytest.raises(UsageError, match="minimum"):
            sandbox.run("import numpy")


def test_no_vm_survives_its_host_process(vm_runtime: MicroVMRuntime) -> None:
    script = textwrap.dedent("""
        import wasibox
        sandbox = wasibox.Sandbox(wasibox.Limits(timeout_s=120, fuel=10**12),
                                  backend="microvm", allow_emulation=True)
        print("running", flush=True)
        sandbox.run("import time\\ntime.sleep(100)")
    """)
    child = subprocess.Popen([PYTHON, "-c", script], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"running\n"
        deadline = time.monotonic() + 60
        while not _vm_processes(child.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _vm_processes(child.pid), "the VM never started"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    _no_orphans(child.pid)


# -- capabilities over the channel: the same host-side policy code as wasm ---------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
        body = b'{"rows": [1, 2, 3]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def http_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_host_functions_and_http_from_inside_the_vm(vm_runtime: MicroVMRuntime,
                                                     http_server: int) -> None:
    seen: list[int] = []

    def lookup(customer_id: int) -> dict[str, object]:
        seen.append(customer_id)
        return {"id": customer_id, "name": "Ada", "raw": b"\x00\xff"}

    def fails() -> None:
        raise FileNotFoundError(2, "No such file", "/etc/secret/host/path")

    policy = wasibox.HttpPolicy(allow=[f"data.test:{http_server}"],
                                resolver=lambda name: ["127.0.0.1"], allow_loopback=["data.test"])
    code = textwrap.dedent(f"""
        import host, urllib.request
        import numpy as np
        print(host.lookup(7))
        try:
            host.missing()
        except host.CapabilityDenied as exc:
            print("denied", exc)
        try:
            host.fails()
        except host.HostError as exc:
            print("host error", exc.type, "/etc/secret" in exc.message)
        response = host.http.request("GET", "http://data.test:{http_server}/rows")
        print(int(np.sum(response.json()["rows"])))
        with urllib.request.urlopen("http://data.test:{http_server}/rows") as response:
            print(response.status)
        try:
            host.http.request("GET", "http://169.254.169.254/latest/meta-data")
        except host.CapabilityDenied:
            print("metadata denied")
    """)
    with wasibox.Sandbox(VM_LIMITS, allow_emulation=True, http=policy,
                         functions={"lookup": lookup, "fails": fails}) as sandbox:
        result = sandbox.run(code)
    assert result.ok, result
    assert result.backend == "microvm"
    assert seen == [7]  # auto mode chose once, before running: the side effect happened once
    assert result.stdout.splitlines() == [
        "{'id': 7, 'name': 'Ada', 'raw': b'\\x00\\xff'}",
        "denied not permitted by the sandbox's policy",
        "host error FileNotFoundError False",
        "6",
        "200",
        "metadata denied",
    ]
    log = [(event.capability, event.allowed) for event in result.capability_log]
    assert ("function", True) in log and ("function", False) in log
    assert ("http", True) in log and ("http", False) in log


def test_host_call_limit_ends_a_vm_run(vm_runtime: MicroVMRuntime) -> None:
    limits = VM_LIMITS.replace(host_calls=3)
    code = "import host, numpy\nfor i in range(10):\n    host.echo(i)\n    print(i, flush=True)"
    with wasibox.Sandbox(limits, allow_emulation=True,
                         functions={"echo": lambda value: value}) as sandbox:
        result = sandbox.run(code)
    assert result.limit_exceeded is Limit.HOST_CALLS
    assert result.stdout == "0\n1\n2\n"
    assert len(result.capability_log) == 3
    _no_orphans()
