"""One behaviour, two run paths: the native path (C) and the Python path give the same result.

Each program below exercises host functions the native path serves in C (output and its cap,
the clocks, sleeping, both entropy interfaces, exit, fuel, timeouts, refused WASI polls) and
runs on both paths; stdout, stderr, the outcome, the value and ``fuel_used`` must be equal.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from tests.conftest import PYTHON, child_env, run_path_backend
from wasibox.backends.base import Job, Policy
from wasibox.backends.wasm import native as native_ext
from wasibox.backends.wasm import runtime as wasm_runtime
from wasibox.backends.wasm.backend import WasmBackend
from wasibox.backends.wasm.runtime import RUN_PATH_ENV, WasmRuntime, runtime

pytestmark = pytest.mark.guest

PROGRAMS = {
    "print": "print(1+1)",
    "clocks": "import time\nprint(time.time(), time.monotonic_ns(), time.perf_counter())\n"
              "time.sleep(0.25)\nprint(time.time_ns(), time.get_clock_info('monotonic'))",
    "entropy": "import os, random\nprint(os.urandom(37).hex(), random.random())\n"
               "random.seed()\nprint(random.getrandbits(70))",
    "stderr": "import sys\nsys.stderr.write('warn\\n')\nprint('\\xe9\\xff', end='')",
    "exit": "import sys\nprint('bye')\nsys.exit(3)",
    "os_exit": "import os\nos._exit(4)",
    "raise": "raise KeyError('k')",
    "fuel": "while True: pass",
    "timeout": "import time\ntime.sleep(5)",
    "output_cap": "print('x' * 5000)",
    "wasi_output": "import os\nos.write(1, b'a' * 3000)\nos.write(2, b'\\xff' * 3000)",
    "poll": "import select\nselect.select([], [], [], 0.001)",
    "value": "def f(n):\n    import os\n    return [n, os.urandom(n)]",
}
LIMITS = wasibox.Limits(fuel=200_000_000, timeout_s=2, output_bytes=4096)


@pytest.fixture(scope="module")
def both_backends() -> Iterator[tuple[WasmBackend, WasmBackend]]:
    backends = (WasmBackend(run_path="python"), run_path_backend("native"))
    yield backends
    for backend in backends:
        backend.close()


@pytest.fixture(scope="module")
def both_paths() -> Iterator[tuple[wasibox.Sandbox, wasibox.Sandbox]]:
    native = run_path_backend("native")
    with (wasibox.Sandbox(LIMITS, backend=WasmBackend(run_path="python")) as python_sb,
          wasibox.Sandbox(LIMITS, backend=native) as native_sb):
        yield python_sb, native_sb


def _observed(result: wasibox.RunResult) -> tuple[Any, ...]:
    error = result.error and (result.error.type, result.error.message)
    return (result.stdout, result.stderr, result.ok, result.limit_exceeded, result.exit_code,
            error, result.value, result.fuel_used, result.stdout_truncated)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_both_paths_give_the_same_result(
        both_paths: tuple[wasibox.Sandbox, wasibox.Sandbox], name: str) -> None:
    code = PROGRAMS[name]
    entry, args = ("f", (5,)) if name == "value" else (None, ())
    python_result, native_result = (sb.run(code, entry=entry, args=args) for sb in both_paths)
    assert _observed(native_result) == _observed(python_result)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(-(2**80), 2**80), size=st.integers(0, 3000),
       text=st.text(max_size=40))
def test_seeded_entropy_and_output_agree_for_any_seed(
        both_backends: tuple[WasmBackend, WasmBackend], seed: int, size: int,
        text: str) -> None:
    code = ("import os, random, sys\n"
            "def f(size, text):\n"
            "    random.seed()\n"  # from the entropy capability, seeded by the policy
            "    print(text, random.random(), os.urandom(size).hex())\n"
            "    sys.stderr.write(text * 50)\n"
            "    return os.urandom(3)\n")
    job = Job(op="call", code=code, entry="f", args=(size, text), limits=LIMITS,
              policy=Policy(seed=seed))
    python_outcome, native_outcome = (backend.execute(job) for backend in both_backends)
    assert (dataclasses.replace(native_outcome, duration_s=0)
            == dataclasses.replace(python_outcome, duration_s=0))


#: Replies at the edges of the plain form, which a plain run reads in C (native path) and
#: the Python path reads with a regular expression or the JSON parser: forged by the guest.
EDGE_REPLIES = [
    '{"exit_code":0,"memory_error":false,"heap_top":0}',
    '{"exit_code":255,"memory_error":true,"heap_top":18446744073709551615}',
    '{"exit_code":256,"memory_error":false,"heap_top":0}',
    '{"exit_code":01,"memory_error":false,"heap_top":0}',
    '{"exit_code":7,"memory_error":false,"heap_top":18446744073709551616}',
    '{"exit_code":7,"memory_error":false,"heap_top":99999999999999999999}',
    '{"exit_code":7,"memory_error":false,"heap_top":123456789012345678901}',
    '{"exit_code":3,"memory_error":false,"heap_top":5} ',
    '{"exit_code":3,"memory_error":false,"heap_top":5',
    '{"exit_code":3, "memory_error":false,"heap_top":5}',
    '{"exit_code":3,"memory_error":fals,"heap_top":5}',
    '{"exit_code":0,"memory_error":false,"heap_top":-1}',
    '{"exit_code":0,"memory_error":false,"heap_top":0,"error":{"type":"MemoryError",'
    '"message":"","traceback":""}}',
    '{"exit_code":1,"memory_error":true,"heap_top":0,"error":{"type":"MemoryError",'
    '"message":"","traceback":""}}',
    '{"exit_code":\u0030,"memory_error":false,"heap_top":0}',
    '{"exit_code":0,"memory_error":false,"heap_top":0}\u00e9',
]


@pytest.mark.parametrize("reply", EDGE_REPLIES)
def test_both_paths_read_a_forged_reply_alike(
        both_paths: tuple[wasibox.Sandbox, wasibox.Sandbox], reply: str) -> None:
    code = ("import sys\n"
            f"sys.modules['wasibox_job'].encode_reply = lambda *fields: {reply!r}\n")
    python_result, native_result = (sb.run(code) for sb in both_paths)
    assert native_result.memory_peak_bytes == python_result.memory_peak_bytes
    assert _observed(native_result) == _observed(python_result)


#: Programs whose plain run (``run(code)``) takes the prepared path on the native run path,
#: compared with the same run through the general path (``limits={}`` narrows nothing).
PLAIN_PROGRAMS = {
    **PROGRAMS,
    "open": "open('/etc/passwd')",
    "host_call": "import host\nhost.lookup(1)",
    "memory": "x = bytearray(10**9)",
    "recursion": "def f(n): return f(n + 1)\nf(0)",
    "syntax": "def (",
    "unicode": "print('\\udc80 \\u00e9', end='')",
}


@pytest.mark.parametrize("name", sorted(PLAIN_PROGRAMS))
def test_a_plain_run_is_the_general_run(name: str) -> None:
    native = run_path_backend("native")
    with wasibox.Sandbox(LIMITS, backend=native) as sb:
        assert sb._plain is not None, "a plain run on the native path takes the prepared path"
        plain, general = sb.run(PLAIN_PROGRAMS[name]), sb.run(PLAIN_PROGRAMS[name], limits={})
    assert _observed(plain) == _observed(general)
    assert (plain.memory_peak_bytes, plain.stderr_truncated) == (
        general.memory_peak_bytes, general.stderr_truncated)
    assert [(event.capability, event.target, event.allowed, event.reason)
            for event in plain.capability_log] == [
        (event.capability, event.target, event.allowed, event.reason)
        for event in general.capability_log]


def test_the_native_path_is_the_default_where_it_is_built() -> None:
    native = runtime().native
    assert (runtime().run_path == "native") is (native.module is not None), native.reason


def test_a_native_backend_without_the_extension_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime()
    monkeypatch.setattr(rt, "native", type(rt.native)(None, "no C compiler found"))
    with pytest.raises(wasibox.UsageError, match="no C compiler found"):
        WasmBackend(rt, run_path="native")
    with pytest.raises(wasibox.UsageError, match="'auto', 'native' or 'python'"):
        WasmBackend(rt, run_path="fast")  # type: ignore[arg-type]


def test_without_a_c_compiler_the_extension_is_reported_unavailable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "wasibox-no-such-compiler")
    build = native_ext.load(lambda message: None)
    assert build.module is None and "no C compiler found" in build.reason


def test_a_failing_compile_is_reported_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    build = native_ext.load(lambda message: None)
    assert build.module is None and "the C compiler failed" in build.reason
    assert not list((tmp_path / "native").rglob("*.so*"))


def test_where_the_extension_is_unavailable_the_python_path_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wasm_runtime, "load_native", lambda progress: native_ext.NativeBuild(
        None, "no C compiler found (set CC, or install gcc)"))
    rt = WasmRuntime(pool_size=0)
    assert rt.run_path == "python"
    with wasibox.Sandbox(backend=WasmBackend(rt)) as sb:
        assert sb.run("print(1+1)").stdout == "2\n"
    with pytest.raises(wasibox.UsageError, match="no C compiler found"):
        WasmRuntime(pool_size=0, run_path="native")


#: A child that imports wasmtime from another directory, loads the cached extension, and traps.
_OTHER_COPY_CHILD = """
import wasibox, wasmtime
from wasibox.backends.wasm.runtime import runtime
assert runtime().run_path == "native", runtime().native.reason
with wasibox.Sandbox() as sb:
    result = sb.run("while True: pass", limits={"fuel": 10**7})
libraries = {line.split()[4] for line in open("/proc/self/maps") if "_libwasmtime" in line}
print(wasmtime.__file__, result.ok, result.fuel_used, len(libraries))
"""


def test_the_extension_binds_to_the_library_of_whichever_environment_loads_it(
        tmp_path: Path) -> None:
    """The cache is shared by every environment of a user, so an extension built in one must
    call the library of another that loads it. Linked by an rpath to the first, it loaded a
    second copy of Wasmtime there, and the first trap aborted the process (a Wasmtime panic)."""
    if runtime().native.module is None:
        pytest.skip(f"the native run path is unavailable: {runtime().native.reason}")
    import wasmtime  # noqa: PLC0415 - only its location is wanted
    other = tmp_path / "other-environment"
    shutil.copytree(Path(wasmtime.__file__).parent, other / "wasmtime")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(other), env["PYTHONPATH"]])
    env[RUN_PATH_ENV] = "native"
    done = subprocess.run([PYTHON, "-c", _OTHER_COPY_CHILD], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    module, ok, fuel_used, copies = done.stdout.split()
    assert module.startswith(str(other)), "the child must use the other copy of wasmtime"
    assert (ok, fuel_used, copies) == ("False", str(10**7), "1")
