"""Host functions under attack, beyond tests/capabilities/test_hostcall.py (which covers malformed
payloads, length lies, depth bombs, names and the call limits): functions that raise
BaseException, call floods and oversized payloads measured against the host's memory, and
blocking functions abandoned by timed-out runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import wasibox
from tests.capabilities.test_hostcall import RAW_CHANNEL
from tests.conftest import wait_for
from tests.security.conftest import HostBaseline, run_in_child_host, take_baseline
from wasibox import Limit

pytestmark = pytest.mark.guest


def raises_system_exit() -> None:
    raise SystemExit(3)


def raises_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def raises_generator_exit() -> None:
    raise GeneratorExit


BLOCKING: list[int] = []  # one entry per call of blocks() still sleeping


def blocks() -> int:
    BLOCKING.append(1)
    try:
        time.sleep(1.0)
    finally:
        BLOCKING.pop()
    return 1


def echo(*args: Any) -> Any:
    return list(args)


FUNCTIONS = {"system_exit": raises_system_exit, "keyboard_interrupt": raises_keyboard_interrupt,
             "generator_exit": raises_generator_exit, "blocks": blocks, "echo": echo}


@pytest.fixture(scope="module")
def sb() -> Iterator[wasibox.Sandbox]:
    limits = wasibox.Limits(timeout_s=5, fuel=2_000_000_000, host_calls=300)
    with wasibox.Sandbox(limits, functions=FUNCTIONS) as sandbox:
        yield sandbox


@pytest.fixture()
def host(sb: wasibox.Sandbox) -> HostBaseline:
    assert sb.call("import host\ndef f():\n    return host.echo(1)", "f") == [1]  # warm worker
    return take_baseline(sb)


@pytest.mark.parametrize("name", ["system_exit", "keyboard_interrupt", "generator_exit"])
def test_a_host_function_raising_base_exception_cannot_end_the_host(
        sb: wasibox.Sandbox, host: HostBaseline, name: str) -> None:
    r = sb.run(f"import host\ntry:\n    host.{name}()\nexcept host.HostError as exc:\n"
               "    print(exc.type)\n")
    assert r.ok, r.error
    assert r.stdout.strip() in ("SystemExit", "KeyboardInterrupt", "GeneratorExit")
    host.assert_unaffected(sb)


def test_a_call_flood_ends_at_the_call_limit(sb: wasibox.Sandbox, host: HostBaseline) -> None:
    r = sb.run("import host\nwhile True:\n    host.echo(1)\n")
    assert r.limit_exceeded is Limit.HOST_CALLS
    host.assert_unaffected(sb)


def test_runs_that_abandon_a_blocking_function_do_not_accumulate_threads() -> None:
    # A run that times out inside a host function ends at its deadline; the function's
    # worker thread cannot be killed and finishes on its own (1 s here), then idles in the
    # pool. Abandoned calls cost at most one thread each while they block, and the idle
    # workers are reused: a second wave of six adds no thread to the first wave's six.
    limits = wasibox.Limits(timeout_s=0.3)
    with wasibox.Sandbox(limits, functions=FUNCTIONS) as sandbox:
        assert sandbox.call("import host\ndef f():\n    return host.echo(1)", "f") == [1]
        before = len(workers())
        peaks = []
        for _ in range(2):
            for _ in range(6):
                assert sandbox.run("import host\nhost.blocks()").limit_exceeded is \
                    Limit.TIMEOUT
            peaks.append(len(workers()))
            # The abandoned functions return (however loaded the machine), then their
            # workers go back to idle.
            assert wait_for(lambda: not BLOCKING, seconds=30)
            time.sleep(0.2)
        assert peaks[0] <= before + 6 and peaks[1] <= peaks[0]
        assert sandbox.run("print(1)").ok


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wasibox-host-call"]


def test_an_oversized_payload_costs_the_host_a_bounded_multiple_of_it() -> None:
    # The payload is refused from its length, but wasmtime-py has already lifted it out of
    # the guest by then (see test_exhaustion.py): a bounded, transient cost.
    size = 24 * 2**20
    code = RAW_CHANNEL + f"send('echo', '\\x92\\x91\\xdb' + 'x' * {size})\n"
    # Room for the payload four times over (its text, the concatenation, the lifted copy)
    # beside the ~34 MiB the guest starts with: at 128 MiB the guest ran out of memory in
    # its string conversion, which aborts, before it could send (1-2 MiB short).
    report = run_in_child_host(code, memory_bytes="136MiB", host_call_bytes="1MiB")
    assert report["limit"] == "host_calls" and report["next_ok"]
    assert report["peak_growth_bytes"] < 8 * size  # type: ignore[operator]


#: A 4 MiB payload that claims 2**32 - 1 elements and holds millions of empty lists.
_HOSTILE_PAYLOAD = "'\\x92\\xdd\\xff\\xff\\xff\\xff' + '\\x90' * (4 * 2**20 - 6)"


@pytest.mark.parametrize("payload, limits", [
    (_HOSTILE_PAYLOAD, {}),  # ends at host_total_bytes (64 calls) or the deadline
    ("'\\x92\\x90\\x80'", {"host_calls": 10**8}),  # ends at the deadline
], ids=["4 MiB hostile payloads", "millions of small calls"])
def test_a_call_flood_to_a_name_never_granted_ends_in_time_and_bounded(
        payload: str, limits: dict[str, object]) -> None:
    code = RAW_CHANNEL + f"payload = {payload}\nwhile True:\n    send('not_granted', payload)\n"
    report = run_in_child_host(code, timeout_s=1, fuel=10**12, memory_bytes="128MiB",
                               **limits)
    assert report["limit"] in ("host_calls", "timeout") and report["next_ok"], report
    assert report["wall_s"] < 4 * 1  # type: ignore[operator]  # generous: not 4x the timeout
    # Every call that reached the host before the deadline was refused by its name.
    log = report["log"]
    assert isinstance(log, list) and all(
        target == "not_granted" and not allowed for target, allowed in log)
    # The guest's own memory, and each payload lifted out of it (a few transient copies):
    # never decoded, which would have cost a quarter of a gigabyte per call.
    assert report["peak_growth_bytes"] < (128 + 8 * 4) * 2**20  # type: ignore[operator]
