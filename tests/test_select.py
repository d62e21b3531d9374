"""The host's static import scan (wasibox/_select.py), where it runs on many threads at once."""

from __future__ import annotations

import concurrent.futures
import gc
import time
from collections.abc import Iterator

import pytest

from wasibox._select import imported_modules

# Nested, so that turning its tree into Python objects recurses: CPython 3.11 tracks that
# depth in interpreter-wide state, which two threads parsing at once used to corrupt.
NESTED = "x = " + "[" * 40 + "1" + "]" * 40 + "\n"


@pytest.fixture
def collector_switches_threads() -> Iterator[None]:
    """Make every garbage collection (which happens in the middle of a parse) hand the GIL
    to another thread, as a busy host with guest callbacks on other threads does."""
    def switch(phase: str, info: dict[str, int]) -> None:
        time.sleep(0)

    threshold = gc.get_threshold()
    gc.callbacks.append(switch)
    gc.set_threshold(50)
    try:
        yield
    finally:
        gc.callbacks.remove(switch)
        gc.set_threshold(*threshold)


def _scan(index: int) -> set[str]:
    # A different source each time, so that the scan's cache cannot hide a parse.
    return imported_modules(f"import json\nfrom os import path\n{NESTED}y = {index}\n")


@pytest.mark.usefixtures("collector_switches_threads")
def test_scans_on_many_threads_at_once_all_succeed() -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(_scan, range(3000)))
    assert all(found == {"json", "os"} for found in results)


def test_a_cached_scan_cannot_be_changed_by_its_caller() -> None:
    first = imported_modules("import csv\n")
    first.add("numpy")
    assert imported_modules("import csv\n") == {"csv"}
