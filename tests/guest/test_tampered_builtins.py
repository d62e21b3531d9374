"""A program that deletes or replaces builtins still gets its whole output and a correct reply.

The runner flushes the program's output and writes its reply after the program, in the same
interpreter. A one-shot run's plain reply is written without putting the builtins back, so
that path must not use them; every other path (an exception, an exit, a value to encode, a
session's next call) restores them first. Checked on both run paths, with hypothesis choosing
which builtins go and how the program ends.
"""

from __future__ import annotations

import builtins

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox

pytestmark = pytest.mark.guest

#: Builtin names the guest's CPython has too (dunder names are the interpreter's own
#: machinery, not what a program's code looks up).
NAMES = sorted(name for name in vars(builtins) if not name.startswith("__"))
#: How the program ends, after tampering: the reply each ending must give.
ENDINGS = ("end", "exit", "raise", "value")

PROGRAM = """\
import builtins, sys
write, remove, replace = sys.stdout.write, delattr, setattr
stop, failure = SystemExit, ValueError
def f():
    return [1, 'two', b'3']
print('before')
for name in {names!r}:
    if {replace!r}:
        replace(builtins, name, None)
    else:
        remove(builtins, name)
write('after\\n')
sys.stderr.write('err\\n')
if {ending!r} == 'exit':
    raise stop(3)
if {ending!r} == 'raise':
    raise failure('boom')
"""


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=12, unique=True),
       replace=st.booleans(), ending=st.sampled_from(ENDINGS))
def test_a_program_that_tampers_with_builtins_gets_its_output_and_reply(
        run_path_sandbox: wasibox.Sandbox, names: list[str], replace: bool,
        ending: str) -> None:
    code = PROGRAM.format(names=names, replace=replace, ending=ending)
    result = run_path_sandbox.run(code, entry="f" if ending == "value" else None)
    assert result.stdout == "before\nafter\n"
    assert result.stderr.endswith("err\n")
    assert result.limit_exceeded is None
    if ending == "end":
        assert (result.ok, result.exit_code, result.error, result.value) == (True, 0, None, None)
    elif ending == "exit":
        assert (result.exit_code, result.error) == (3, None)
    elif ending == "raise":
        assert result.error is not None
        assert (result.exit_code, result.error.type, result.error.message) == (
            1, "ValueError", "boom")
        assert "raise failure('boom')" in result.error.traceback
    else:
        assert (result.ok, result.value) == (True, [1, "two", b"3"])


def test_a_session_call_after_tampering_sees_the_pristine_builtins() -> None:
    with wasibox.Sandbox() as sb, sb.session() as session:
        first = session.run("import builtins\ndel builtins.len\nbuiltins.abs = None\n"
                            "print('tampered')")
        assert (first.ok, first.stdout) == (True, "tampered\n")
        second = session.run("print(len('abc'), abs(-2))")
        assert (second.ok, second.stdout) == (True, "3 2\n")
