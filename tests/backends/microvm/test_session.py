"""Sessions on the microVM backend: one VM, and one interpreter in it, for a session's life.

Real QEMU, the real image and agent; under TCG each call costs a fraction of a second, so
the calls are few and each asserts several things.
"""

from __future__ import annotations

import pytest

import wasibox
from wasibox import Limit, Limits, SessionEnd, SessionEnded
from wasibox.backends.microvm.backend import FUEL_PER_CPU_SECOND
from wasibox.backends.microvm.runtime import MicroVMRuntime

from .test_backend import VM_LIMITS, _no_orphans, vm_runtime  # noqa: F401 - the fixture

pytestmark = pytest.mark.microvm


def test_a_session_keeps_its_vm_and_interpreter(vm_runtime: MicroVMRuntime) -> None:  # noqa: F811
    with wasibox.Sandbox(VM_LIMITS, backend="microvm", allow_emulation=True) as sandbox:
        with sandbox.session() as session:
            first = session.run("import numpy as np\nimport random\na = np.arange(4)\n"
                                "r = random.random()")
            assert first.ok, first
            assert first.isolation in ("kvm", "tcg") and first.backend == "microvm"
            second = session.run("a = a * 2\nprint(int(a.sum()), random.random() != r)")
            assert second.stdout == "12 True\n"
            failed = session.run("raise KeyError('k')")
            assert failed.error is not None and failed.error.type == "KeyError"
            assert session.ended is None  # an exception does not end it
            # Each call has its own CPU budget: a loop past one second of it ends the session.
            stopped = session.run("while True: pass",
                                  limits={"fuel": FUEL_PER_CPU_SECOND, "timeout_s": 30})
            assert stopped.limit_exceeded is Limit.FUEL
            assert session.ended is SessionEnd.LIMIT
            with pytest.raises(SessionEnded, match="fuel limit"):
                session.run("print(a)")
        with sandbox.session() as fresh:  # a new session is a new VM, from the template
            assert fresh.run("print('a' in dir())").stdout == "False\n"
    _no_orphans()


def test_a_microvm_session_refuses_mounts(vm_runtime: MicroVMRuntime,  # noqa: F811
                                          tmp_path: object) -> None:
    limits = Limits(timeout_s=60.0, fuel=60 * 10**9)
    with wasibox.Sandbox(limits, backend="microvm", allow_emulation=True,
                         workspace=str(tmp_path)) as sandbox:
        with pytest.raises(wasibox.UsageError, match="cannot use mounts yet"):
            sandbox.session()
    _no_orphans()
