"""The guest artifact: where its sources are, building it once, and caching it.

The guest component is built from ``guest/`` (its WIT contracts are in ``guest/wit/``) by
``guest/build.py``, then cached under the user cache directory keyed by a digest of every
build input. Its sha256 -- ``guest_digest()`` -- names the exact interpreter that runs guest
code: results, fuel and determinism are promised per digest.

Environment:
    WASIBOX_CACHE_DIR   where built and compiled guests are kept (default: the user cache dir)
    WASIBOX_GUEST       use this prebuilt guest component instead of building one
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ._errors import GuestBuildError, UsageError
from ._progress import Reporter, library_reporter

if TYPE_CHECKING:
    from ._packages import PackageSet

__all__ = ["GuestArtifact", "cache_dir", "cached_guest_state", "cached_package_guests",
           "ensure_guest", "file_lock", "file_sha256", "guest_digest", "installed_version"]

_PACKAGE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class GuestArtifact:
    """A built guest component on disk and its sha256."""

    path: Path
    digest: str


def cache_dir() -> Path:
    """The directory wasibox caches built and compiled guests in."""
    configured = os.environ.get("WASIBOX_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "wasibox"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` so only one process builds the same thing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _guest_sources() -> Path:
    """``guest/`` inside an installed wheel, or beside the package in a source checkout."""
    for candidate in (_PACKAGE / "_guest_src" / "guest", _PACKAGE.parent / "guest"):
        if (candidate / "build.py").is_file():
            return candidate
    raise GuestBuildError("the guest sources (guest/build.py) are missing from this "
                          "installation; reinstall wasibox")


@functools.cache
def _recipe() -> ModuleType:
    path = _guest_sources() / "build.py"
    spec = importlib.util.spec_from_file_location("wasibox_guest_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's contents, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_built: dict[str, GuestArtifact] = {}


def ensure_guest(progress: Reporter | None = None,
                 packages: PackageSet | None = None) -> GuestArtifact:
    """Return the guest component, building it first if this machine has none cached.

    With ``packages``, the guest derived for that package set: the same recipe with the
    set's wheels packed into the snapshot, cached by the base inputs and the set's digest.
    Building takes a minute or two and reports progress to ``progress`` (stderr by
    default). Raises GuestBuildError when the build fails, with the step that failed and
    its output, and UsageError when ``WASIBOX_GUEST`` names a prebuilt guest and packages
    are asked for (a prebuilt guest cannot be derived from).
    """
    prebuilt = os.environ.get("WASIBOX_GUEST")
    if prebuilt and packages is not None:
        raise UsageError("WASIBOX_GUEST names a prebuilt guest, which cannot take packages: "
                         "unset it to let wasibox build the guest for a package set")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            raise GuestBuildError(f"WASIBOX_GUEST names {prebuilt!r}, which is not a file")
        return GuestArtifact(path, file_sha256(path))
    recipe = _recipe()
    try:
        key = recipe.inputs_digest()
    except recipe.BuildError as exc:
        raise GuestBuildError(str(exc)) from None
    directory = cache_dir() / "guest" / key[:24]
    if packages is not None:
        key += "-" + packages.digest
        directory = directory.with_name(f"{directory.name}-{packages.digest[:24]}")
    if key in _built:
        return _built[key]
    path, digest_file = directory / "guest.wasm", directory / "guest.sha256"
    if not (path.is_file() and digest_file.is_file()):
        report = progress if progress is not None else library_reporter()
        with file_lock(directory.with_suffix(".lock")):
            if not (path.is_file() and digest_file.is_file()):
                digest = _build(recipe, path, report, packages)
                staged = digest_file.with_suffix(".tmp")
                staged.write_text(digest + "\n")
                os.replace(staged, digest_file)
    artifact = GuestArtifact(path, digest_file.read_text().strip())
    _built[key] = artifact
    return artifact


def _build(recipe: ModuleType, path: Path, report: Reporter,
           packages: PackageSet | None) -> str:
    """Build the guest (for ``packages``, if given) into ``path``; return its sha256."""
    try:
        if packages is None:
            report("building the guest (once per machine; `wasibox prepare` does it "
                   "ahead of time)")
            digest: str = recipe.build(path, report)
            return digest
        report(f"building the guest for packages {', '.join(packages.pins)} (once per "
               "package set; `wasibox prepare --package ...` does it ahead of time)")
        with tempfile.TemporaryDirectory(prefix="wasibox-site-") as scratch:
            site = Path(scratch) / "site"
            packages.unpack(site)
            digest = recipe.build(path, report, site=site)
        path.with_name("packages.json").write_text(json.dumps(
            {"digest": packages.digest, "packages": list(packages.pins)}) + "\n")
        return digest
    except recipe.BuildError as exc:
        raise GuestBuildError(str(exc)) from None


def installed_version(dist: str) -> str:
    """The installed version of a distribution (cheaply: no importlib.metadata import)."""
    try:
        version: str = _recipe().installed_version(dist)
    except _recipe().BuildError as exc:
        raise GuestBuildError(str(exc)) from None
    return version


def guest_digest() -> str:
    """The sha256 of the guest component this installation runs (building it if needed)."""
    return ensure_guest(progress=None).digest


def cached_guest_state() -> str:
    """A one-line description of the guest cache, for ``wasibox doctor`` (never builds)."""
    try:
        key = _recipe().inputs_digest()
    except Exception as exc:  # doctor reports; it must not fail on a broken install
        return f"unavailable ({exc})"
    directory = cache_dir() / "guest" / key[:24]
    digest_file = directory / "guest.sha256"
    if digest_file.is_file():
        return f"built, sha256 {digest_file.read_text().strip()} ({directory})"
    return f"not built yet (run `wasibox prepare`; cache: {directory})"


def cached_package_guests() -> list[str]:
    """One line per guest built for a package set on this guest's base, for ``wasibox
    doctor``: the set's packages, its digest and the guest's sha256 (never builds)."""
    try:
        key = _recipe().inputs_digest()
    except Exception:  # noqa: BLE001 - cached_guest_state already reports the failure
        return []
    lines = []
    for directory in sorted((cache_dir() / "guest").glob(f"{key[:24]}-*")):
        try:
            described = json.loads((directory / "packages.json").read_text())
            digest = (directory / "guest.sha256").read_text().strip()
            lines.append(f"{', '.join(described['packages'])}: set {described['digest'][:16]}"
                         f", guest sha256 {digest}")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a build in progress, or a damaged entry that the next build replaces
    return lines
