"""The public surface: exactly these names, documented, and no wasmtime types in it."""

from __future__ import annotations

import inspect

import pytest

import wasibox

EXPECTED = {
    "Busy", "CapabilityEvent", "ConfigError", "EmulationRefused", "Failed", "FileRecord",
    "GuestBuildError", "GuestError", "GuestException", "HttpPolicy", "Limit", "LimitExceeded",
    "Limits", "Mount",
    "RefusedFile", "RunHandle", "RunResult", "RunState", "Sandbox", "SandboxClosed",
    "Session", "SessionEnd", "SessionEnded", "Transform", "TransformProgress",
    "TransformSpec", "UsageError", "WasiboxError",
    "guest_digest", "run",
    # Journals and replay (docs/journal.md).
    "GuestDigestMismatch", "Journal", "JournalError", "ReplayMismatch", "ReplayReport",
    "replay",
}


def test_exported_names() -> None:
    assert set(wasibox.__all__) == EXPECTED
    for name in EXPECTED:
        obj = getattr(wasibox, name)
        assert obj.__doc__, f"{name} has no docstring"
        assert obj.__module__ == "wasibox", name


def test_error_tree_has_one_root() -> None:
    for name in ("Busy", "ConfigError", "GuestBuildError", "GuestError", "LimitExceeded",
                 "SandboxClosed", "UsageError", "JournalError"):
        assert issubclass(getattr(wasibox, name), wasibox.WasiboxError)
    assert issubclass(wasibox.SandboxClosed, wasibox.UsageError)
    assert issubclass(wasibox.ConfigError, wasibox.UsageError)
    assert issubclass(wasibox.EmulationRefused, wasibox.UsageError)
    assert issubclass(wasibox.GuestDigestMismatch, wasibox.JournalError)
    assert issubclass(wasibox.ReplayMismatch, wasibox.JournalError)


def test_no_wasmtime_type_in_public_signatures() -> None:
    for name in ("Sandbox", "run", "Limits", "RunResult"):
        obj = getattr(wasibox, name)
        targets = [obj] + [m for _, m in inspect.getmembers(obj, inspect.isfunction)]
        for target in targets:
            assert "wasmtime" not in str(inspect.signature(target)), target


def test_limit_is_a_str_enum() -> None:
    assert wasibox.Limit.FUEL == "fuel"
    assert {limit.value for limit in wasibox.Limit} == {"fuel", "timeout", "memory", "output",
                                                     "host_calls", "cancelled"}


def test_limits_normalise_shorthand_once() -> None:
    limits = wasibox.Limits(memory_bytes="64MiB", output_bytes="1k", timeout_s=2)
    assert limits.memory_bytes == 64 * 2**20
    assert limits.output_bytes == 1000
    assert limits.timeout_s == 2.0 and isinstance(limits.timeout_s, float)


@pytest.mark.parametrize("field, value", [
    ("fuel", 0), ("fuel", -5), ("fuel", 1.5), ("fuel", True),
    ("memory_bytes", "lots"), ("memory_bytes", 0), ("timeout_s", float("nan")),
    ("timeout_s", 0), ("output_bytes", -1), ("source_bytes", "1 parsec"),
])
def test_bad_limits_are_usage_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(wasibox.UsageError, match=field):
        wasibox.Limits(**{field: value})  # type: ignore[arg-type]


def test_bad_sandbox_options_are_usage_errors() -> None:
    with pytest.raises(wasibox.UsageError, match="clock"):
        wasibox.Sandbox(clock="sundial")  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="entropy"):
        wasibox.Sandbox(entropy="dice")  # type: ignore[arg-type]
    with pytest.raises(wasibox.UsageError, match="backend"):
        wasibox.Sandbox(backend="firecracker")  # type: ignore[arg-type]
