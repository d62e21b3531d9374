"""Reproducible guest: an independent build of the same sources behaves identically."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

import wasibox
from tests.conftest import PYTHON, child_env
from wasibox._guest import _recipe

pytestmark = pytest.mark.guest

PROBE = """
import random
print(list({'a', 'b', 'c', 'd'}), list({'x', 'y', 'z'}), hash('abc'), hash(b'abc'))
print(random.random(), {frozenset({'p', 'q'}): 1})
"""

CHILD = """
import json, sys, wasibox
r = wasibox.run(sys.stdin.read())
print(json.dumps({"stdout": r.stdout, "fuel": r.fuel_used, "digest": wasibox.guest_digest()}))
"""


def test_independent_build_behaves_identically(tmp_path: Path) -> None:
    env = child_env()
    env["WASIBOX_CACHE_DIR"] = str(tmp_path / "cache")  # nothing cached: build from scratch
    fresh = subprocess.run([PYTHON, "-c", CHILD], input=PROBE, capture_output=True, text=True,
                           env=env, timeout=900)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "building the guest" in fresh.stderr  # progress was shown while it built
    rebuilt = json.loads(fresh.stdout)
    here = wasibox.run(PROBE)
    assert here.ok
    assert rebuilt["stdout"] == here.stdout
    assert rebuilt["fuel"] == here.fuel_used


def test_guest_digest_is_a_sha256() -> None:
    digest = wasibox.guest_digest()
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert digest == wasibox.guest_digest()


def test_the_c_stack_limit_is_written_where_cpython_recorded_it(tmp_path: Path) -> None:
    recipe = _recipe()
    top, margin = recipe.SHADOW_STACK_TOP, recipe.STACK_MARGIN_BYTES
    component = tmp_path / "guest.wasm"
    component.write_bytes(b"head" + struct.pack("<III", top, 2 * margin, margin) + b"tail")
    recipe._fit_c_stack_limit(component)
    soft = top - recipe.C_STACK_BYTES
    assert component.read_bytes() == (
        b"head" + struct.pack("<III", top, soft, soft - margin) + b"tail")


@pytest.mark.parametrize("times", [0, 2])
def test_a_snapshot_without_exactly_one_c_stack_record_fails_the_build(
        tmp_path: Path, times: int) -> None:
    recipe = _recipe()
    record = struct.pack("<III", recipe.SHADOW_STACK_TOP, 2 * recipe.STACK_MARGIN_BYTES,
                         recipe.STACK_MARGIN_BYTES)
    component = tmp_path / "guest.wasm"
    component.write_bytes(b"x".join([b"data"] + [record] * times))
    before = component.read_bytes()
    with pytest.raises(recipe.BuildError, match="C-stack limits were not found exactly once"):
        recipe._fit_c_stack_limit(component)
    assert component.read_bytes() == before
