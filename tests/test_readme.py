"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.guest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 4


# dask's parquet reader calls pandas with inplace=True, which pandas 3.1 deprecates; the
# README shows the reader as users call it, so that third-party deprecation is not an error.
@pytest.mark.filterwarnings("ignore:The inplace keyword in DataFrame")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(BLOCKS[index], f"README.md example {index + 1}", "exec"), {})
