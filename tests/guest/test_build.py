"""Reproducible guest: an independent build of the same sources behaves identically."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import wasibox
from tests.conftest import PYTHON, child_env

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
