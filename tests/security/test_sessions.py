"""A session's guest is as hostile as a run's, and it has more time to prepare.

Between calls it can rewrite the runner it shares an interpreter with. Whatever it does, each
later call is still bounded by that call's limits, its replies are still untrusted, nothing of
it reaches an ordinary run or another session, and the host stays intact.
"""

from __future__ import annotations

import string
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import Limit, SessionEnd

pytestmark = pytest.mark.guest

SUBVERT = ("import sys\nrunner = sys.modules['wasibox_guest']\n"
           "job_core = sys.modules['wasibox_job']\n")


@pytest.fixture(scope="module")
def sandbox() -> Iterator[wasibox.Sandbox]:
    # Fuel runs out long before the deadline, even on a loaded machine, so each case ends
    # at the limit it is about.
    with wasibox.Sandbox(wasibox.Limits(timeout_s=1, fuel=10**8)) as sb:
        yield sb


@pytest.mark.parametrize("patch, limit", [
    # The next call spins before the host's code ever runs.
    ("runner._execute = lambda request, streams: [0 for _ in iter(int, 1)]", Limit.FUEL),
    # It sleeps through the host's clock: still cut at the call's deadline.
    ("import time\nrunner._execute = lambda request, streams: time.sleep(3600)", Limit.TIMEOUT),
    # It never starts the fuel meter, and spins where it would have: compiling is then
    # metered too, never less.
    ("runner._start = lambda: [0 for _ in iter(int, 1)]", Limit.FUEL),
])
def test_a_subverted_runner_is_still_bounded_by_each_call(sandbox: wasibox.Sandbox,
                                                          patch: str, limit: Limit) -> None:
    with sandbox.session() as session:
        assert session.run(SUBVERT + patch).ok
        result = session.run("print('never')")
        assert result.limit_exceeded is limit and result.stdout == ""
        assert session.ended is SessionEnd.LIMIT
    assert sandbox.run("print('fine')").stdout == "fine\n"


def test_a_forged_reply_in_a_session_is_a_protocol_error(sandbox: wasibox.Sandbox) -> None:
    with sandbox.session() as session:
        # This call's own reply is already the forged one.
        assert not session.run(SUBVERT + "job_core.encode_reply = lambda *fields: '[' * 10**6").ok
        result = session.run("pass")
        assert result.error is not None and result.error.type == "ProtocolError"
        # The guest harmed only itself: its session goes on, bounded as before.
        assert session.ended is None
        assert session.run("while True: pass").limit_exceeded is Limit.FUEL


def test_a_session_cannot_plant_state_for_ordinary_runs(sandbox: wasibox.Sandbox) -> None:
    with sandbox.session() as session:
        planted = session.run(SUBVERT + "import builtins, json\nbuiltins.planted = 1\n"
                              "json.dumps = lambda *a, **k: 'planted'\n"
                              "job_core.SESSION['namespace'] = {'planted': 1}")
        assert planted.ok
        for _ in range(3):  # pooled and fresh instances alike
            probe = sandbox.run("import builtins, json\n"
                                "print(hasattr(builtins, 'planted'), json.dumps(1))")
            assert probe.stdout == "False 1\n"
        with sandbox.session() as other:
            assert other.run("print('planted' in dir())").stdout == "False\n"


NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=3).map(lambda name: "v_" + name)
STEPS = st.lists(st.one_of(
    st.tuples(st.just("set"), NAMES, st.integers(-2**70, 2**70)),
    st.tuples(st.just("del"), NAMES, st.just(0)),
    st.tuples(st.just("raise"), NAMES, st.integers(-2**70, 2**70)),
    st.tuples(st.just("exit"), NAMES, st.integers(0, 255)),
), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_a_session_behaves_like_one_program(sandbox: wasibox.Sandbox,
                                            steps: list[tuple[str, str, int]]) -> None:
    """Whatever mix of assignments, deletions, exceptions and exits its calls make, a session's
    namespace is what running the same cells in one interpreter would leave."""
    model: dict[str, int] = {}
    with sandbox.session() as session:
        for action, name, value in steps:
            if action == "set":
                result = session.run(f"{name} = {value}")
                assert result.ok
                model[name] = value
            elif action == "del":
                result = session.run(f"del {name}")
                assert (result.error is None) == (name in model)
                model.pop(name, None)
            elif action == "raise":
                # The assignment before the exception stays, as in any interpreter.
                result = session.run(f"{name} = {value}\nraise ValueError({name})")
                assert result.error is not None and result.error.type == "ValueError"
                model[name] = value
            else:
                result = session.run(f"import sys\nsys.exit({value})")
                assert result.exit_code == value
            assert session.ended is None
        shown = session.run("print(sorted((k, v) for k, v in globals().items() "
                            "if k.startswith('v_')))")
        assert shown.stdout == f"{sorted(model.items())}\n"
