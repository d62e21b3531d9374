"""Fuzzing guest code under pytest, with hypothesis and the wasibox plugin.

Run: pytest examples/fuzz_under_pytest --hypothesis-profile=wasibox-quick

Every call runs in a fresh sandbox; the guest code is never executed on the host.
"""

import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wasibox
import wasibox.testing as wt

CODE = (pathlib.Path(__file__).parent / "parser.py").read_text(encoding="utf-8")
LIMITS = wasibox.Limits(fuel=200_000_000, timeout_s=5)
parse = wt.guest_function(CODE, "parse_pairs", limits=LIMITS)


@given(parse.strategy())  # arguments drawn from the annotations: parse_pairs(text: str)
def test_any_text_parses_or_is_refused_cleanly(args):
    result = parse.run(*args)
    assert result.limit_exceeded is None, result
    assert result.error is None or result.error.type == "ValueError", result.error


NAMES = st.text("abcdefghij_", min_size=1, max_size=8)
VALUES = st.text("abcdefghij0123456789", max_size=8)


@pytest.mark.wasibox(limits=LIMITS)
@given(st.dictionaries(NAMES, VALUES, max_size=5))
def test_what_is_written_reads_back(wasibox_sandbox, pairs):
    text = ";".join(f"{key}={value}" for key, value in pairs.items())
    assert wasibox_sandbox.call(CODE, "parse_pairs", text) == pairs


def test_the_fuzzer_finds_nothing():
    # Each example twice in fresh sandboxes: exceptions, limits and nondeterminism fail it.
    report = wt.fuzz(CODE, "accepts", max_examples=30, limits=LIMITS)
    assert report.ok, report
