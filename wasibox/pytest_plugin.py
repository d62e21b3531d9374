"""The wasibox pytest plugin (entry point ``pytest11``), active once wasibox is installed.

* ``wasibox_sandbox``: a fixture giving a fresh ``wasibox.Sandbox`` with default limits,
  closed after the test. Mark a test ``@pytest.mark.wasibox(limits=..., clock=...)`` to
  pass options to it.
* Hypothesis settings profiles that suit fuzzing with a fresh sandbox per example
  (``wasibox``, ``wasibox-quick``, ``wasibox-ci``; see ``wasibox.testing.settings_profiles``),
  chosen as usual with ``--hypothesis-profile=wasibox-ci``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["pytest_configure", "wasibox_sandbox"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wasibox(**options): options for the wasibox_sandbox fixture's Sandbox")
    try:
        import hypothesis
    except ImportError:  # profiles only matter to hypothesis users
        return
    from .testing import settings_profiles

    for name, profile in settings_profiles().items():
        hypothesis.settings.register_profile(name, profile)


@pytest.fixture
def wasibox_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh wasibox.Sandbox for this test (options from ``@pytest.mark.wasibox``)."""
    import wasibox

    marker = request.node.get_closest_marker("wasibox")
    options = dict(marker.kwargs) if marker is not None else {}
    with wasibox.Sandbox(**options) as sandbox:
        yield sandbox
