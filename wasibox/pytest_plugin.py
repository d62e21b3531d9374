"""The wasibox pytest plugin (entry point ``pytest11``), active once wasibox is installed.

* ``wasibox_sandbox``: a fixture giving a ``wasibox.Sandbox`` with default limits, closed
  after the test. ``@pytest.mark.wasibox(...)`` takes the keyword arguments of
  ``wasibox.Sandbox`` (``limits``, ``seed``, ``clock``, ``entropy``, ``backend``,
  ``mounts``, ``workspace``, ``http``, ``functions``, ``allow_emulation``, ``requires``,
  ``max_concurrency``, ``max_queue``) and passes them to it; anything else fails the test
  with a UsageError naming the marker.
* With ``@given``: every ``run``/``call`` of a Sandbox is a fresh interpreter, so one
  sandbox serves all of a test's examples, each independent of the others. The plugin
  therefore suppresses hypothesis's ``function_scoped_fixture`` health check for a test
  whose only function-scoped argument is ``wasibox_sandbox`` and whose sandbox keeps no
  files between runs (no ``workspace``, no writable host ``mounts``; scratch mounts are
  fine). Any other function-scoped fixture, or state that outlives a run, keeps the
  health check, as it should.
* Hypothesis settings profiles that suit fuzzing with a fresh sandbox per example
  (``wasibox``, ``wasibox-quick``, ``wasibox-ci``; see ``wasibox.testing.settings_profiles``),
  chosen as usual with ``--hypothesis-profile=wasibox-ci``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["pytest_collection_modifyitems", "pytest_configure", "wasibox_sandbox"]

_FIXTURE = "wasibox_sandbox"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wasibox(**options): keyword arguments of wasibox.Sandbox for the "
                   "wasibox_sandbox fixture (limits=, clock=, mounts=, ...)")
    try:
        import hypothesis
    except ImportError:  # profiles only matter to hypothesis users
        return
    from .testing import settings_profiles

    for name, profile in settings_profiles().items():
        hypothesis.settings.register_profile(name, profile)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Let ``@given`` tests share ``wasibox_sandbox`` across examples where that is sound."""
    try:
        import hypothesis
    except ImportError:
        return
    for item in items:
        if isinstance(item, pytest.Function) and _FIXTURE in item.fixturenames \
                and hypothesis.is_hypothesis_test(item.obj) and _shares_soundly(item):
            test = getattr(item.obj, "__func__", item.obj)
            # The attribute hypothesis's own plugin and @settings read and write.
            current: hypothesis.settings = getattr(
                test, "_hypothesis_internal_use_settings", None) or hypothesis.settings()
            test._hypothesis_internal_use_settings = hypothesis.settings(
                current, suppress_health_check=[
                    *current.suppress_health_check,
                    hypothesis.HealthCheck.function_scoped_fixture])


def _shares_soundly(item: pytest.Function) -> bool:
    """Whether ``wasibox_sandbox`` is the test's only function-scoped argument and its
    sandbox keeps no files from one run to the next."""
    arguments = inspect.signature(item.function).parameters
    definitions = item._fixtureinfo.name2fixturedefs
    for name in arguments:
        if name != _FIXTURE and name in definitions and \
                definitions[name][-1].scope == "function":
            return False
    marker = item.get_closest_marker("wasibox")
    options = dict(marker.kwargs) if marker is not None else {}
    if options.get("workspace") is not None:
        return False
    from .capabilities.files.mount import Mount

    mounts = options.get("mounts", ())
    return isinstance(mounts, list | tuple) and all(
        isinstance(mount, Mount) and (mount.host_path is None or not mount.writable)
        for mount in mounts)


def _options(item: pytest.Item) -> dict[str, Any]:
    """The keyword arguments of the test's ``@pytest.mark.wasibox``; UsageError for
    positional ones."""
    marker = item.get_closest_marker("wasibox")
    if marker is None:
        return {}
    if marker.args:
        from ._errors import UsageError

        raise UsageError("@pytest.mark.wasibox takes keyword arguments of wasibox.Sandbox "
                         f"(limits=..., clock=...), not positional ones: {marker.args!r}")
    return dict(marker.kwargs)


@pytest.fixture
def wasibox_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A wasibox.Sandbox for this test, with the options of ``@pytest.mark.wasibox``.

    Raises UsageError for an option ``wasibox.Sandbox`` does not take.
    """
    import wasibox

    options = _options(request.node)
    try:
        sandbox = wasibox.Sandbox(**options)
    except TypeError as exc:  # an unknown keyword
        raise wasibox.UsageError(f"@pytest.mark.wasibox: {exc}; it takes the keyword "
                                 "arguments of wasibox.Sandbox") from None
    with sandbox:
        yield sandbox
