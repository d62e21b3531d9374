"""docs/configuration.md is generated from the config models and cannot drift from them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, child_env
from wasibox.services import config_reference as _config_reference
from wasibox.services.config import Config, HttpConfig, LimitsConfig, MountConfig, TenantConfig
from wasibox.services.config_reference import config_reference

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_checked_in_reference_is_what_the_models_say() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == config_reference(), (
        "docs/configuration.md is stale: regenerate it with "
        "`wasibox config-reference > docs/configuration.md`")


def test_every_key_of_every_model_is_listed_with_its_default() -> None:
    text = config_reference()
    for model in (TenantConfig, LimitsConfig, MountConfig, HttpConfig):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, (model.__name__, name)
    assert "## `[[tenants.NAME.mounts]]`" in text
    assert "| `max_concurrency` | integer, >= 1, <= 256 | `2` |" in text
    assert "| `max_response_bytes` | size | `\"10MiB\"` |" in text
    for table in Config.model_fields:
        assert f"## `[{table}" in text


def test_a_key_without_a_meaning_or_a_stale_meaning_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    meanings = dict(_config_reference.MEANINGS)
    del meanings["tenants.NAME.limits.fuel"]
    monkeypatch.setattr(_config_reference, "MEANINGS", meanings)
    with pytest.raises(LookupError, match=r"tenants\.NAME\.limits\.fuel has no meaning"):
        config_reference()
    meanings["tenants.NAME.limits.fuel"] = "CPU budget."
    meanings["tenants.NAME.limits.gone"] = "a key that was removed"
    with pytest.raises(LookupError, match="no longer have"):
        config_reference()


def test_the_cli_prints_the_reference() -> None:
    done = subprocess.run([PYTHON, "-m", "wasibox", "config-reference"], capture_output=True,
                          text=True, env=child_env(), timeout=60)
    assert done.returncode == 0 and done.stdout == config_reference()
