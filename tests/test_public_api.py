"""The public surface: exactly these names, documented, and no wasmtime types in it."""

from __future__ import annotations

import inspect
import re

import pytest

import wasibox

EXPECTED = {
    "Busy", "CapabilityEvent", "ConfigError", "EmulationRefused", "Failed", "FailedRecord",
    "FileRecord", "FunctionRefused", "GuestBuildError", "GuestError", "GuestException",
    "GuestMismatch", "HttpPolicy", "Limit", "LimitExceeded", "Limits", "Mount",
    "NativeOnlyPackage", "Packages", "RefusedFile",
    "RunHandle", "RunResult", "RunState", "Sandbox", "SandboxClosed", "Session", "SessionEnd",
    "SessionEnded", "Transform", "TransformProgress", "TransformSpec", "UsageError", "VMError",
    "WasiboxError",
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
    for name in ("Busy", "ConfigError", "FunctionRefused", "GuestBuildError", "GuestError",
                 "GuestMismatch", "LimitExceeded", "SandboxClosed", "UsageError", "VMError",
                 "JournalError"):
        assert issubclass(getattr(wasibox, name), wasibox.WasiboxError)
    assert issubclass(wasibox.SandboxClosed, wasibox.UsageError)
    assert issubclass(wasibox.ConfigError, wasibox.UsageError)
    assert issubclass(wasibox.EmulationRefused, wasibox.UsageError)
    assert issubclass(wasibox.GuestDigestMismatch, wasibox.JournalError)
    assert issubclass(wasibox.ReplayMismatch, wasibox.JournalError)
    assert issubclass(wasibox.FunctionRefused, wasibox.UsageError)
    assert issubclass(wasibox.GuestMismatch, wasibox.GuestBuildError)


def test_error_tree_in_the_docstring_is_the_real_one() -> None:
    """The tree drawn in ``wasibox._errors`` names every error class, under its real parent."""
    import wasibox._errors as errors

    tree = (errors.__doc__ or "").split("::\n\n", 1)[1].split("\n\n", 1)[0]
    drawn: dict[str, str | None] = {}
    parents: dict[int, str] = {}  # the column a name starts at -> the last name drawn there
    for line in tree.splitlines():
        match = re.match(r"^[ │├└─]*([A-Z]\w+) ", line)
        if match is None:  # the second line of a comment
            continue
        name, column = match.group(1), match.start(1)
        drawn[name] = parents.get(column - 4)
        parents[column] = name
    classes = {name: getattr(errors, name) for name in errors.__all__
               if isinstance(getattr(errors, name), type)}
    assert set(drawn) == set(classes)
    for name, parent in drawn.items():
        expected = (classes[parent],) if parent else (Exception,)
        assert classes[name].__bases__ == expected, name


def test_failed_is_the_old_name_of_failed_record() -> None:
    assert wasibox.Failed is wasibox.FailedRecord


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
