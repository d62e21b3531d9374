"""How a RunResult shows itself: a short ``repr`` and a small HTML table for Jupyter."""

from __future__ import annotations

import html.parser

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wasibox
from wasibox import GuestException, Limit, RunResult


class _Tags(html.parser.HTMLParser):
    """Collects the tags and the text of an HTML fragment."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.tags.add(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def result(stdout: str = "", stderr: str = "", error: GuestException | None = None,
           limit: Limit | None = None, value: object = None) -> RunResult:
    return RunResult(ok=error is None and limit is None, exit_code=0 if error is None else 1,
                     stdout=stdout, stderr=stderr, stdout_truncated=False,
                     stderr_truncated=False, error=error, limit_exceeded=limit,
                     fuel_used=1_234_567, memory_peak_bytes=20 * 2**20, duration_s=0.0021,
                     backend="wasm", value=value)


@pytest.mark.guest
def test_a_real_run_shows_its_outcome(sandbox: wasibox.Sandbox) -> None:
    ok = sandbox.run("print(6 * 7)")
    assert repr(ok).startswith("<RunResult ok fuel_used=") and "stdout='42\\n'" in repr(ok)
    assert "<th style=\"text-align:left\">status</th>" in ok._repr_html_()
    failed = sandbox.run("raise ValueError('bad <input>')")
    assert "ValueError: bad <input>" in repr(failed)
    assert "ValueError: bad &lt;input&gt;" in failed._repr_html_()
    spun = sandbox.run("while True: pass")
    assert repr(spun).startswith(f"<RunResult exceeded its {spun.limit_exceeded} limit")


@given(text=st.text(), other=st.text(), value=st.none() | st.text() | st.integers())
@settings(max_examples=200, deadline=None)
def test_guest_text_never_becomes_markup_and_the_repr_stays_short(
        text: str, other: str, value: object) -> None:
    shown = result(stdout=text, stderr=other, value=value,
                   error=GuestException(type=other[:30] or "E", message=text, traceback=""))
    parser = _Tags()
    parser.feed(shown._repr_html_())
    parser.close()
    assert parser.tags <= {"table", "tr", "th", "td", "pre"}
    assert text[:2000] in "".join(parser.text)
    assert len(repr(shown)) < 700
