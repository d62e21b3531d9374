"""Isolation: every run starts from the snapshot, however its instance's memory slot was used.

With memory-slot reuse (backends/wasm/slots.py) an instance runs in a slot another run dirtied a
moment ago, reset page by page. A reset that missed a page would show here: each run first
records what it sees (module globals, ``sys.modules``, builtins, other modules' attributes,
the environment, the heap's layout, open descriptors, the virtual clock, the random streams),
then scribbles hypothesis-drawn data over all of it. Every run must see exactly what the
first one saw. It runs on every run path.
"""

from __future__ import annotations

import ast
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from tests.conftest import RUN_PATHS, run_path_backend

pytestmark = pytest.mark.guest

#: The state a run sees, then the scribbling. Fixed text, so every run loads the same code;
#: the drawn data arrives as arguments of fixed sizes, so decoding them allocates the same.
PROGRAM = '''
import builtins, gc, json, os, random, sys, time, types

def _state():
    probe = os.open("/scratch/probe", os.O_WRONLY | os.O_CREAT)
    os.close(probe)
    return {
        "globals": sorted(globals()),
        "modules": sorted(sys.modules),
        "builtins": sorted(dir(builtins)),
        "builtin_reprs": [repr(getattr(builtins, name)) for name in ("abs", "len", "print")],
        "json": sorted(vars(json)),
        "environ": sorted(os.environ.items()),
        "path": list(sys.path),
        "recursion_limit": sys.getrecursionlimit(),
        "gc": [gc.isenabled(), gc.get_threshold()],
        "heap": [id(object()), id(bytearray(4096)), sys.getallocatedblocks()],
        # Descriptors are numbered lowest free first: one an earlier run left open would
        # move the probe's number.
        "probe_fd": probe,
        "clocks": [time.monotonic_ns(), time.time_ns()],
        "random": [random.getrandbits(64), os.urandom(8)],
        "scratch": sorted(os.listdir("/scratch")),
    }

# One string: the reply encoder is pure Python, and lists of names cost it most of the run.
STATE = repr(_state())

def scribble(blob, name, number):
    global LEAK
    LEAK = bytearray(blob) * (1 + number % 4096)
    globals()["g_" + name] = blob
    sys.modules["m_" + name] = types.ModuleType(name)
    setattr(builtins, "b_" + name, number)
    builtins.abs = lambda value: number
    json.wasibox_marker = blob
    os.environ["E_" + name] = str(number)
    sys.path.append("/" + name)
    sys.setrecursionlimit(1000 + number % 5000)
    gc.set_threshold(1 + number % 1000)
    if number % 2:
        gc.disable()
    random.seed(number)
    os.urandom(1 + number % 64)
    time.sleep((number % 1000) / 1e6)
    for index in range(1 + number % 3):  # left open on purpose
        fd = os.open(f"/scratch/{name}{index}", os.O_WRONLY | os.O_CREAT)
        os.write(fd, blob)
    return STATE
'''

#: Ints in [2**45, 2**60) take the same room both in marshal's 15-bit digits (the request)
#: and in CPython's 30-bit ones (the argument), so every request is the same size.
FIRST_ARGS = (bytes(64), "A" * 8, 2**45)


@pytest.fixture(params=RUN_PATHS)
def isolated_sandbox(request: pytest.FixtureRequest) -> wasibox.Sandbox:
    backend = run_path_backend(request.param)
    sandbox = wasibox.Sandbox(backend=backend, mounts=[wasibox.Mount.scratch("/scratch")])
    request.addfinalizer(sandbox.close)
    return sandbox


def test_every_run_sees_the_snapshot_state(isolated_sandbox: wasibox.Sandbox) -> None:
    first = isolated_sandbox.run(PROGRAM, entry="scribble", args=FIRST_ARGS)
    assert first.ok, first.error
    reference = first.value
    state = ast.literal_eval(reference)
    assert not any(name.startswith(("g_", "LEAK")) for name in state["globals"])
    assert not any(name.startswith("m_") for name in state["modules"])
    assert "wasibox_marker" not in state["json"]
    assert state["scratch"] == ["probe"]

    @settings(max_examples=1000, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    # Bytes below 0x80: each is one character of the request, and one byte of it in the
    # UTF-8 that crosses into the guest, so every request crosses at the same size too.
    @given(blob=st.lists(st.integers(0, 127), min_size=64, max_size=64).map(bytes),
           name=st.text(string.ascii_letters, min_size=8, max_size=8),
           number=st.integers(2**45, 2**60 - 1))
    def run(blob: bytes, name: str, number: int) -> None:
        result = isolated_sandbox.run(PROGRAM, entry="scribble", args=(blob, name, number))
        assert result.ok, result.error
        assert result.value == reference

    run()
