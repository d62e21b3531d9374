"""A plain run's request, sent flat (see wasibox/_wire.py), at its edges: every seed the flat
form carries and the one it leaves to the map, text that is not ASCII, a NUL in the code and
a lone surrogate, which only the map carries. Each reads as a native CPython reads it."""

from __future__ import annotations

import random

import pytest

import wasibox
from tests.conftest import RUN_PATHS, run_path_backend

pytestmark = pytest.mark.guest

SAMPLE = "import random\nprint(random.random())"


@pytest.mark.parametrize("path", RUN_PATHS)
# 0: the snapshot's own generator, which a run with seed 0 (the default) takes as it is.
@pytest.mark.parametrize("seed", [0, 1, -5, 2**64 - 1, -(2**64) + 1, 2**64, -(2**70)])
def test_a_plain_run_is_seeded_as_the_policy_says(path: str, seed: int) -> None:
    with wasibox.Sandbox(backend=run_path_backend(path), seed=seed) as sandbox:
        result = sandbox.run(SAMPLE)
    assert result.ok, result.error
    assert result.stdout == f"{random.Random(seed).random()}\n"


@pytest.mark.parametrize("path", RUN_PATHS)
def test_a_plain_run_with_real_entropy_reseeds_from_it(path: str) -> None:
    with wasibox.Sandbox(backend=run_path_backend(path), entropy="real") as sandbox:
        first, second = sandbox.run(SAMPLE), sandbox.run(SAMPLE)
    assert first.ok and second.ok
    assert first.stdout != second.stdout


@pytest.mark.parametrize("path", RUN_PATHS)
@pytest.mark.parametrize("code, stdout", [
    ("print('h\\u00e9llo \\u20ac \\U0001f600', len('\\u00e9\\u20ac'))",
     "h\u00e9llo \u20ac \U0001f600 2\n"),
    ("print('\u00e9\u20ac\U0001f600')  # \u00e9", "\u00e9\u20ac\U0001f600\n"),
    ("print(repr('\\x00\\x01'))", "'\\x00\\x01'\n"),
])
def test_a_plain_run_reads_its_code_as_written(path: str, code: str, stdout: str) -> None:
    with wasibox.Sandbox(backend=run_path_backend(path)) as sandbox:
        result = sandbox.run(code)
    assert result.ok, result.error
    assert result.stdout == stdout


@pytest.mark.parametrize("path", RUN_PATHS)
@pytest.mark.parametrize("code", ["pass\x00", "s = '\ud800'"])  # a lone surrogate: the map
def test_code_cpython_cannot_compile_fails_as_it_fails_there(path: str, code: str) -> None:
    with pytest.raises((SyntaxError, UnicodeEncodeError)) as native:
        compile(code, "<sandbox>", "exec")
    with wasibox.Sandbox(backend=run_path_backend(path)) as sandbox:
        result = sandbox.run(code)
    assert result.error is not None
    assert (result.error.type, result.error.message) == (native.type.__name__,
                                                         str(native.value))


@pytest.mark.parametrize("path", RUN_PATHS)
def test_a_plain_run_finds_the_streams_and_argv_every_run_gets(path: str) -> None:
    # The flat form's runner sets none of these itself: the snapshot and the priming did.
    code = ("import sys\n"
            "print(sys.argv, sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering,"
            " sys.stderr.line_buffering, sys.stdout is not sys.stderr)\n"
            "sys.stderr.write('to stderr')\n"
            "sys.argv.append('changed')")
    with wasibox.Sandbox(backend=run_path_backend(path)) as sandbox:
        first, second = sandbox.run(code), sandbox.run(code)
    for result in (first, second):
        assert result.ok, result.error
        assert result.stdout == "[''] utf-8 backslashreplace False True True\n"
        assert result.stderr == "to stderr"


def test_a_session_call_gets_back_the_streams_and_argv_the_last_one_replaced() -> None:
    with wasibox.Sandbox() as sandbox, sandbox.session() as session:
        assert session.run("import io, sys\nsys.stdout = sys.stderr = io.StringIO()\n"
                           "sys.argv = ['replaced']\nprint('lost')").ok
        result = session.run("import sys\nprint(sys.argv)\nsys.stderr.write('e')")
    assert result.ok, result.error
    assert (result.stdout, result.stderr) == ("['']\n", "e")
