"""wasibox.testing: guest functions, strategies from annotations, fuzzing, the pytest plugin."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import wasibox
import wasibox.testing as wt

from .conftest import PYTHON, child_env

pytestmark = pytest.mark.guest

#: Planted bug: crashes when the input has a NUL right after a digit.
NUL_AFTER_DIGIT = textwrap.dedent("""\
    def parse(s: str) -> int:
        for a, b in zip(s, s[1:]):
            if a.isdigit() and b == "\\x00":
                raise ValueError("NUL after a digit")
        return len(s)
""")

#: Planted quadratic path: every "(" rescans the text before it.
QUADRATIC = textwrap.dedent("""\
    def nesting(s: str) -> int:
        deepest = 0
        for i, c in enumerate(s):
            if c == "(":
                depth = 0
                for d in s[:i]:
                    if d == "(":
                        depth += 1
                    elif d == ")":
                        depth -= 1
                deepest = max(deepest, depth + 1)
        return deepest
""")
#: The costliest example the fuzzer finds must burn this many times the cheapest one's fuel.
QUADRATIC_FUEL_RATIO = 5.0

READS_THE_CLOCK = textwrap.dedent("""\
    import time

    def stamp(x: int) -> float:
        return time.time() + x
""")


def test_guest_function_call_run_and_errors() -> None:
    code = "def div(a: int, b: int) -> float:\n    return a / b\n"
    div = wt.guest_function(code, "div")
    assert div(7, 2) == 3.5
    result = div.run(1, 0)
    assert not result.ok and result.error is not None
    assert result.error.type == "ZeroDivisionError" and result.fuel_used > 0
    with pytest.raises(wasibox.GuestError) as info:
        div(1, 0)
    assert info.value.type == "ZeroDivisionError"
    spin = wt.guest_function("def spin():\n    while True:\n        pass\n", "spin",
                             limits=wasibox.Limits(fuel=20_000_000))
    assert spin.run().limit_exceeded == wasibox.Limit.FUEL
    with pytest.raises(wasibox.LimitExceeded):
        spin()


def test_guest_function_runs_each_call_in_a_fresh_instance() -> None:
    code = "seen = []\ndef f(x):\n    seen.append(x)\n    return len(seen)\n"
    f = wt.guest_function(code, "f")
    assert [f(1), f(2), f(3)] == [1, 1, 1]


def test_strategies_come_from_annotations_without_running_the_code() -> None:
    # Module-level code that would fail (or worse) if the host executed it.
    code = textwrap.dedent("""\
        import os
        os._exit(3)
        from typing import Optional
        def f(a: int, b: "list[str]", c: dict[str, float], d: Optional[bytes],
              e: tuple[int, str], g: bool | None, h, i: Literal["x", "y"] = "x"):
            return None
    """)
    f = wt.guest_function(code, "f")
    assert [name for name, _ in f.parameters] == ["a", "b", "c", "d", "e", "g", "h", "i"]

    @settings(wt.settings_profiles()["wasibox"], max_examples=30, database=None)
    @given(f.strategy())
    def check(args: tuple[object, ...]) -> None:
        a, b, c, d, e, g, _h, i = args
        assert type(a) is int and all(type(x) is str for x in b)  # type: ignore[attr-defined]
        assert all(type(k) is str and type(v) is float for k, v in c.items())  # type: ignore[attr-defined]
        assert d is None or type(d) is bytes
        assert type(e) is tuple and len(e) == 2
        assert g is None or type(g) is bool
        assert i in ("x", "y")

    check()


def test_unknown_annotations_are_usage_errors_unless_overridden() -> None:
    code = "def f(p: Point) -> int:\n    return 0\n"
    with pytest.raises(wasibox.UsageError, match="'p'.*Point"):
        wt.guest_function(code, "f").strategy()
    f = wt.guest_function(code, "f", strategies={"p": st.just([1, 2])})

    @settings(max_examples=3, database=None)
    @given(f.strategy())
    def check(args: tuple[object, ...]) -> None:
        assert args == ([1, 2],)

    check()
    with pytest.raises(wasibox.UsageError, match="no top-level function"):
        wt.guest_function(code, "g")


def test_fuzz_finds_and_shrinks_the_planted_bug() -> None:
    report = wt.fuzz(NUL_AFTER_DIGIT, "parse", max_examples=60, seed=0)
    assert not report.ok
    [failure] = report.failures
    assert failure.kind == "exception" and "NUL after a digit" in failure.message
    assert failure.example == ("0\x00",)
    # The replay line is short (the code and the example are saved to files) and reruns
    # the example with the same failure.
    assert failure.replay.startswith("wasibox fuzz ") and "--replay-file" in failure.replay
    assert "def parse" not in failure.replay and len(failure.replay) < 200
    replay = run_replay_line(failure.replay)
    assert replay.returncode == 1 and "NUL after a digit" in replay.stdout


def run_replay_line(line: str) -> subprocess.CompletedProcess[str]:
    """Run a printed replay line in a shell, as a user would paste it."""
    env = child_env()  # `wasibox` on PATH is this interpreter's, as in the user's shell
    env["PATH"] = os.pathsep.join([os.path.dirname(PYTHON), env.get("PATH", "")])
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env,
                          timeout=120)


def test_replay_lines_carry_the_limits_that_failed(tmp_path: Path) -> None:
    limits = wasibox.Limits(fuel=30_000_000)
    code = "def spin(n: int) -> int:\n    while n > 3:\n        pass\n    return n\n"
    report = wt.fuzz(code, "spin", max_examples=20, limits=limits, replay_dir=tmp_path,
                     check_determinism=False)
    [failure] = report.failures
    assert failure.kind == "limit" and failure.example == (4,)
    assert "--fuel 30000000" in failure.replay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spin-limit.txt", "spin.py"]
    replayed = run_replay_line(failure.replay)
    assert replayed.returncode == 1 and '"limit_exceeded": "fuel"' in replayed.stdout
    fine = run_replay_line(failure.replay.replace(str(tmp_path / "spin-limit.txt"),
                                                  str(tmp_path / "three.txt")))
    assert fine.returncode == 2 and "cannot read" in fine.stderr


@given(st.tuples(wt.PLAIN_DATA, st.floats(), st.lists(st.floats()), wt.BINARY))
@settings(max_examples=200, deadline=None)
def test_saved_examples_read_back_as_they_were(example: tuple[object, ...]) -> None:
    assert repr(wt.read_example(ascii(example))) == repr(example)


def test_fuzz_reports_a_clean_function_as_ok() -> None:
    report = wt.fuzz("def inc(x: int) -> int:\n    return x + 1\n", "inc", max_examples=15)
    assert report.ok and report.examples == 15
    assert report.fuel_ratio < 1.5  # constant work: every example costs about the same
    assert "no failures" in str(report)


def test_fuel_target_finds_the_planted_quadratic_path() -> None:
    report = wt.fuzz(QUADRATIC, "nesting", max_examples=40, check_determinism=False)
    assert report.ok
    assert report.fuel_ratio >= QUADRATIC_FUEL_RATIO, str(report)
    assert report.max_fuel_example is not None and "(" in report.max_fuel_example[0]


def test_fuzz_reports_a_real_clock_as_nondeterministic() -> None:
    report = wt.fuzz(READS_THE_CLOCK, "stamp", max_examples=5, clock="real")
    kinds = {failure.kind for failure in report.failures}
    assert "nondeterministic" in kinds
    failure = next(f for f in report.failures if f.kind == "nondeterministic")
    assert "value" in failure.message and failure.example == (0,)
    virtual = wt.fuzz(READS_THE_CLOCK, "stamp", max_examples=5)
    assert virtual.ok


def test_fuzz_cli_reports_and_replays(tmp_path: Path) -> None:
    guest = tmp_path / "parser.py"
    guest.write_text(NUL_AFTER_DIGIT)
    found = subprocess.run([PYTHON, "-m", "wasibox", "fuzz", str(guest), "--entry", "parse",
                            "--max-examples", "60"], capture_output=True, text=True,
                           env=child_env(), timeout=300)
    assert found.returncode == 1, found.stderr
    assert "NUL after a digit" in found.stdout and "'0\\x00'" in found.stdout
    replay_line = next(line for line in found.stdout.splitlines() if "replay:" in line)
    assert "--replay-file" in replay_line and str(guest) in replay_line
    replayed_line = run_replay_line(replay_line.split("replay:", 1)[1].strip())
    assert replayed_line.returncode == 1 and "NUL after a digit" in replayed_line.stdout
    replayed = subprocess.run([PYTHON, "-m", "wasibox", "fuzz", str(guest), "--entry", "parse",
                               "--replay", "('0\\x00',)"], capture_output=True, text=True,
                              env=child_env(), timeout=120)
    assert replayed.returncode == 1 and '"ValueError"' in replayed.stdout
    fine = subprocess.run([PYTHON, "-m", "wasibox", "fuzz", str(guest), "--entry", "parse",
                           "--replay", "('abc',)"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert fine.returncode == 0 and '"value": 3' in fine.stdout


PLUGIN_TEST = """
import hypothesis

def test_fixture(wasibox_sandbox):
    assert wasibox_sandbox.run("print(6 * 7)").stdout == "42\\n"

import pytest
@pytest.mark.wasibox(clock="real")
def test_marker(wasibox_sandbox):
    assert wasibox_sandbox.policy.clock == "real"

def test_profiles():
    for name in ("wasibox", "wasibox-quick", "wasibox-ci"):
        assert hypothesis.settings.get_profile(name).deadline is None
"""


def test_pytest_plugin_fixture_and_profiles(tmp_path: Path) -> None:
    (tmp_path / "test_uses_plugin.py").write_text(PLUGIN_TEST)
    result = run_pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


GIVEN_TESTS = """
import pytest
import wasibox
from hypothesis import given, settings, strategies as st

@given(st.integers())
def test_shared_sandbox(wasibox_sandbox, n):
    assert wasibox_sandbox.run(f"print({n} * 2)").stdout == f"{n * 2}\\n"

@settings(max_examples=5)
@pytest.mark.wasibox(limits=wasibox.Limits(fuel=50_000_000),
                     mounts=[wasibox.Mount.scratch("/tmp")])
@given(st.text())
def test_scratch_is_per_run(wasibox_sandbox, text):
    code = "import os; print(os.listdir('/tmp')); open('/tmp/x', 'w').write('1')"
    assert wasibox_sandbox.run(code).stdout == "[]\\n"

@given(st.integers())
def test_other_fixture_keeps_the_check(wasibox_sandbox, tmp_path, n):
    pass

@pytest.mark.wasibox(workspace=".")
@given(st.integers())
def test_workspace_keeps_the_check(wasibox_sandbox, n):
    pass

@pytest.mark.wasibox(clok="real")
def test_unknown_option(wasibox_sandbox):
    pass

@pytest.mark.wasibox("real")
def test_positional_option(wasibox_sandbox):
    pass
"""


@pytest.mark.parametrize("profile", [None, "wasibox", "wasibox-ci"])
def test_the_fixture_serves_given_tests_where_sharing_is_sound(tmp_path: Path,
                                                               profile: str | None) -> None:
    (tmp_path / "test_given.py").write_text(GIVEN_TESTS)
    chosen = [] if profile is None else [f"--hypothesis-profile={profile}"]
    result = run_pytest(tmp_path, *chosen)
    out = result.stdout
    assert "2 failed, 2 passed, 2 errors" in out, out + result.stderr
    for name in ("test_other_fixture_keeps_the_check", "test_workspace_keeps_the_check"):
        assert f"'test_given.py::{name}' uses a function-scoped fixture" in out
    assert "@pytest.mark.wasibox: " in out and "'clok'" in out
    assert "takes keyword arguments of wasibox.Sandbox" in out


def run_pytest(directory: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """pytest in a child process on ``directory``, with the wasibox plugin loaded."""
    # Installed, wasibox registers the plugin through its pytest11 entry point; naming it
    # again with -p would register it twice. From a source tree that is not installed
    # (only on PYTHONPATH), the entry point is absent and -p loads it.
    installed = any(entry.name == "wasibox"
                    for entry in importlib.metadata.entry_points(group="pytest11"))
    load = [] if installed else ["-p", "wasibox.pytest_plugin"]
    return subprocess.run([PYTHON, "-m", "pytest", "-q", *load, "-p", "no:cacheprovider",
                           *options, str(directory)], capture_output=True, text=True,
                          env=child_env(), timeout=300, cwd=directory)


def test_plugin_is_declared_as_a_pytest11_entry_point() -> None:
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\n' in pyproject
    assert 'wasibox = "wasibox.pytest_plugin"' in pyproject


IDENTITY = "def same(x):\n    return x\n"
RAISE = "def fail(text):\n    raise ValueError(text)\n"


@pytest.fixture(scope="module")
def plain_sandbox() -> Iterator[wasibox.Sandbox]:
    with wasibox.Sandbox() as sandbox:
        yield sandbox


def _fits_msgpack(value: object) -> bool:
    """Whether every int in ``value`` fits msgpack (a call's arguments are msgpack)."""
    if isinstance(value, dict):
        return all(map(_fits_msgpack, value.values()))
    if isinstance(value, list | tuple):
        return all(map(_fits_msgpack, value))
    return not isinstance(value, int) or -2**63 <= value < 2**64


@given(wt.PLAIN_DATA | st.tuples(wt.PLAIN_DATA, wt.PLAIN_DATA) | st.floats())
@settings(max_examples=60, deadline=None)
def test_a_guest_function_returns_what_a_call_returns(plain_sandbox: wasibox.Sandbox,
                                                      value: object) -> None:
    # A batch's reply carries a value as JSON only where JSON gives it back exactly, and
    # with msgpack otherwise (bytes, tuples, NaN): either way, as a call's reply does.
    assume(_fits_msgpack(value))
    result = wt.guest_function(IDENTITY, "same").run(value)
    assert result.ok, result.error
    assert repr(result.value) == repr(plain_sandbox.call(IDENTITY, "same", value))


@given(st.text())
@settings(max_examples=40, deadline=None)
def test_a_guest_function_reports_an_error_as_a_call_does(plain_sandbox: wasibox.Sandbox,
                                                           text: str) -> None:
    # Any text, lone surrogates included, crosses in the batch reply's header.
    result = wt.guest_function(RAISE, "fail").run(text)
    with pytest.raises(wasibox.GuestError) as raised:
        plain_sandbox.call(RAISE, "fail", text)
    assert result.error is not None and result.error.type == "ValueError"
    assert result.error.message == raised.value.message
