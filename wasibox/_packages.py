"""Third-party packages for the wasm guest: resolved on the host, built into the snapshot.

``Sandbox(packages=["attrs", "python-dateutil==2.9.0"])`` gives the guest pure-Python
packages. The host resolves the requirements and their dependencies with pip, downloads
wheels only, records each wheel's sha256, and builds a *derived guest*: the base guest's
recipe with the wheels' contents packed into the snapshot and their top-level modules
imported at pre-init (see ``guest/runner/wasibox_packed.py``). A run with packages therefore
starts from a snapshot exactly as a run without does. The derived guest is cached by the
base guest's inputs and the package set's digest (a digest of the wheels' names and
hashes); its sha256 is the guest digest of those runs, so determinism is promised per
(guest digest, package set).

Threats this module mediates: a package index, and every wheel it serves, is untrusted input
to the host.

- No package code ever runs on the host. pip is called with ``--only-binary=:all:``, so it
  never builds a source distribution (no ``setup.py``, no build backend, no build hooks);
  requirements are names and version specifiers only (no URLs or paths, which could name an
  sdist or a local project); and the wheels are unpacked here, by reading the zip, not by an
  installer. Package code runs only inside the guest, in Wasmtime, at pre-init and in runs.
- Only pure-Python wheels (ABI ``none``, platform ``any``) are used; extension modules are
  never copied in, and a package that has only native wheels is a NativeOnlyPackage error.
- Unpacking refuses absolute paths, ``..``, symlinks and a wheel larger, unpacked, than
  ``MAX_UNPACKED_BYTES``: a wheel cannot write outside its build tree.
- A resolved set is cached with each wheel's sha256; a cached wheel whose bytes no longer
  match is fetched again, never used.
- The guest never sees the package cache: the packages are in its snapshot, not mounted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ._errors import NativeOnlyPackage, UsageError
from ._guest import cache_dir, ensure_guest, file_lock, file_sha256
from ._progress import Reporter, library_reporter

# subprocess and zipfile are imported where they are used: `import wasibox` imports this
# module (for Packages), and a run without packages should not pay for them at cold start.
if TYPE_CHECKING:
    import zipfile

__all__ = [
    "GUEST_PYTHON",
    "MAX_UNPACKED_BYTES",
    "PackageSet",
    "Packages",
    "Wheel",
    "guest_digest",
    "packages_from",
    "recorded_set",
    "resolve",
]

#: The Python version of the wasm guest (componentize-py's CPython): wheels are chosen for it.
GUEST_PYTHON = "3.14"
#: A package set's wheels, unpacked, may hold at most this many bytes (a zip bomb's bound).
MAX_UNPACKED_BYTES = 512 * 2**20

# A requirement: a project name, optional extras, optional version specifiers; nothing else
# (no URL, path, marker or pip option), so pip can only look it up on the index.
_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
    r"(?:\[[A-Za-z0-9._-]+(?:\s*,\s*[A-Za-z0-9._-]+)*\])?"
    r"(?:\s*(?:===|==|!=|<=|>=|~=|<|>)\s*[A-Za-z0-9.*+!_-]+"
    r"(?:\s*,\s*(?:===|==|!=|<=|>=|~=|<|>)\s*[A-Za-z0-9.*+!_-]+)*)?$")
_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-\d[^-]*)?"
                         r"-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$")
_NOT_FOUND = re.compile(r"No matching distribution found for (\S+)")
# A wheel file name a journal may name: one path component, nothing but the characters of
# wheel names (so it can only ever name a file inside the package cache).
_SAFE_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]*\.whl$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Packages:
    """Third-party packages for the guest, and where pip finds them.

    ``requirements`` are pip requirements without URLs or markers ("attrs",
    "pyyaml==6.0.2", "cattrs[msgpack]>=24"). ``index_url`` replaces pip's configured index;
    ``find_links`` adds local wheel directories (a wheelhouse); ``no_index=True`` uses only
    them, for machines without an index. By default pip's own configuration decides.

    Raises UsageError for a requirement that is not a name with optional extras and version
    specifiers, or for options of the wrong type.
    """

    requirements: tuple[str, ...]
    index_url: str | None = None
    find_links: tuple[str, ...] = ()
    no_index: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.requirements, str) or not isinstance(self.requirements, Sequence):
            raise UsageError("packages must be a list of requirements, such as ['attrs']")
        for requirement in self.requirements:
            if not isinstance(requirement, str) or not _REQUIREMENT.match(requirement.strip()):
                raise UsageError(
                    f"{requirement!r} is not a package requirement wasibox accepts: give a "
                    "project name with optional extras and version specifiers, such as "
                    "'pyyaml==6.0.2' (no URLs, paths or pip options)")
        if self.index_url is not None and not isinstance(self.index_url, str):
            raise UsageError("index_url must be a str (a package index URL)")
        if isinstance(self.find_links, str) or not all(
                isinstance(link, str | os.PathLike) for link in self.find_links):
            raise UsageError("find_links must be a list of directories or URLs")
        object.__setattr__(self, "requirements",
                           tuple(requirement.strip() for requirement in self.requirements))
        object.__setattr__(self, "find_links", tuple(
            link if "://" in str(link) else os.path.abspath(link) for link in self.find_links))


@dataclasses.dataclass(frozen=True)
class Wheel:
    """One downloaded wheel of a package set: its project, version, file name and sha256."""

    name: str
    version: str
    filename: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class PackageSet:
    """Resolved packages: every wheel with its hash, and the set's digest.

    ``digest`` covers the wheels' file names and hashes only, so the same wheels make the
    same set, however they were asked for.
    """

    wheels: tuple[Wheel, ...]
    digest: str

    @property
    def pins(self) -> tuple[str, ...]:
        """``name==version`` of every wheel, sorted: what ``RunResult.packages`` reports."""
        return tuple(sorted(f"{wheel.name}=={wheel.version}" for wheel in self.wheels))

    def wheel_path(self, wheel: Wheel) -> Path:
        """Where ``wheel`` is kept in the cache."""
        return _packages_dir() / "wheels" / wheel.sha256[:32] / wheel.filename

    def records(self) -> list[dict[str, str]]:
        """Each wheel's file name and sha256: what a journal records to find the exact set
        again (``recorded_set`` reads it back)."""
        return [{"filename": wheel.filename, "sha256": wheel.sha256} for wheel in self.wheels]

    def uncached(self) -> list[Wheel]:
        """The wheels the package cache does not hold with their recorded sha256."""
        return [wheel for wheel in self.wheels if not self.wheel_path(wheel).is_file()
                or file_sha256(self.wheel_path(wheel)) != wheel.sha256]

    def unpack(self, directory: Path) -> None:
        """Unpack the set's wheels into ``directory`` (a site-packages layout).

        Only pure-Python content is written: modules, data files and dist-info; a ``.data``
        directory's purelib/platlib go to the top, its scripts, headers and data are left out,
        and extension modules are skipped. Raises UsageError for a wheel that is not what the
        set recorded (its hash), holds an unsafe path or a symlink, or unpacks past
        MAX_UNPACKED_BYTES.
        """
        import zipfile

        budget = MAX_UNPACKED_BYTES
        for wheel in self.wheels:
            path = self.wheel_path(wheel)
            if file_sha256(path) != wheel.sha256:
                raise UsageError(f"the cached wheel {wheel.filename} does not match its recorded "
                                 "sha256; delete the package cache and resolve again")
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    target = _member_target(info, wheel)
                    if target is None:
                        continue
                    budget -= info.file_size
                    if budget < 0:
                        raise UsageError(f"the package set unpacks to more than "
                                         f"{MAX_UNPACKED_BYTES // 2**20} MiB (at {wheel.filename})")
                    with archive.open(info) as source:
                        # Read at most what the header promised, plus one byte to catch a lie.
                        data = source.read(info.file_size + 1)
                    if len(data) > info.file_size:
                        raise UsageError(f"{wheel.filename}: {info.filename} is larger than its "
                                         "zip header says")
                    destination = directory.joinpath(*target)
                    try:
                        destination.parent.mkdir(parents=True, exist_ok=True)
                        destination.write_bytes(data)
                    except OSError as exc:  # e.g. a file where another member needs a directory
                        raise UsageError(f"{wheel.filename}: cannot unpack {info.filename!r} "
                                         f"({exc.strerror})") from None


def guest_digest(packages: Sequence[str] | Packages | None = None) -> str:
    """The sha256 of the guest component this installation runs (building it if needed).

    With ``packages`` (as ``Sandbox(packages=...)`` takes them), the digest of the guest
    built for that package set, which a Sandbox with those packages runs. Raises
    NativeOnlyPackage and UsageError as Sandbox does for packages.
    """
    wanted = packages_from(packages)
    return ensure_guest(None, resolve(wanted) if wanted is not None else None).digest


def packages_from(value: object) -> Packages | None:
    """``Sandbox(packages=...)`` normalised: None for no packages, else a Packages.

    Raises UsageError for a value that is neither a list of requirements nor a Packages.
    """
    if value is None:
        return None
    if isinstance(value, Packages):
        return value if value.requirements else None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise UsageError("packages must be a list of requirements, such as ['attrs'], or a "
                         "wasibox.Packages")
    return Packages(requirements=tuple(value)) if value else None


def recorded_set(records: object) -> PackageSet:
    """The package set that ``PackageSet.records()`` described (as a journal holds it).

    Nothing is fetched or read: the wheels may or may not be cached (see ``uncached``).
    Raises ValueError, saying what is wrong, unless ``records`` is a non-empty list of
    objects with exactly a pure-Python wheel's file name and a sha256 in hex.
    """
    if not isinstance(records, list) or not records:
        raise ValueError("'wheels' must be a non-empty list")
    wheels = []
    for record in records:
        if not (isinstance(record, dict) and set(record) == {"filename", "sha256"}
                and all(isinstance(value, str) for value in record.values())):
            raise ValueError("each wheel must name exactly its filename and sha256")
        filename, sha256 = record["filename"], record["sha256"]
        match = _WHEEL_NAME.match(filename)
        if (match is None or not _SAFE_FILENAME.match(filename) or match["abi"] != "none"
                or match["platform"] != "any"):
            raise ValueError(f"{filename[:100]!r} is not a pure-Python wheel's file name")
        if not _SHA256.match(sha256):
            raise ValueError(f"the sha256 of {filename} is not 64 hex digits")
        wheels.append(Wheel(match["name"], match["version"], filename, sha256))
    return _package_set(wheels)


def resolve(packages: Packages, progress: Reporter | None = None) -> PackageSet:
    """Resolve ``packages`` to pure-Python wheels, downloading them once.

    A resolution is cached by the request (requirements, index options and the guest's
    Python), with each wheel's sha256; later calls use it without pip, unless a wheel has
    gone or changed. Raises NativeOnlyPackage naming a requirement that has only native
    wheels, and UsageError when pip is missing or cannot resolve the set (with its message).
    """
    report = progress or library_reporter()
    lock = _packages_dir() / "locks" / f"{_request_key(packages)}.json"
    with file_lock(lock.with_suffix(".lock")):
        cached = _read_lock(lock)
        if cached is not None:
            return cached
        report(f"resolving {', '.join(packages.requirements)} for the wasm guest with pip")
        with tempfile.TemporaryDirectory(prefix="wasibox-wheels-") as scratch:
            _download(packages, Path(scratch), report)
            wheels = []
            for path in sorted(Path(scratch).glob("*.whl")):
                wheel = _checked_wheel(path)
                kept = _packages_dir() / "wheels" / wheel.sha256[:32] / wheel.filename
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, kept.with_suffix(".tmp"))
                os.replace(kept.with_suffix(".tmp"), kept)
                wheels.append(wheel)
        package_set = _package_set(wheels)
        staged = lock.with_suffix(".tmp")
        staged.write_text(json.dumps({"requirements": list(packages.requirements),
                                      "wheels": [dataclasses.asdict(w) for w in wheels]},
                                     indent=1))
        os.replace(staged, lock)
        report(f"resolved {len(wheels)} wheels: {', '.join(package_set.pins)}")
        return package_set


# -- internals ----------------------------------------------------------------------------------


def _packages_dir() -> Path:
    return cache_dir() / "packages"


def _request_key(packages: Packages) -> str:
    request = {"requirements": sorted(packages.requirements), "index_url": packages.index_url,
               "find_links": list(packages.find_links), "no_index": packages.no_index,
               "python": GUEST_PYTHON}
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:32]


def _package_set(wheels: Sequence[Wheel]) -> PackageSet:
    ordered = tuple(sorted(wheels, key=lambda wheel: wheel.filename))
    digest = hashlib.sha256("".join(f"{wheel.filename} {wheel.sha256}\n"
                                    for wheel in ordered).encode()).hexdigest()
    return PackageSet(ordered, digest)


def _read_lock(lock: Path) -> PackageSet | None:
    """The cached resolution, if every wheel it lists is still there with its hash."""
    try:
        data = json.loads(lock.read_text())
        wheels = [Wheel(**entry) for entry in data["wheels"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    package_set = _package_set(wheels)
    for wheel in wheels:
        path = package_set.wheel_path(wheel)
        if not path.is_file() or file_sha256(path) != wheel.sha256:
            return None
    return package_set


def _pip_command(packages: Packages, destination: Path, *, pure: bool) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
               "--dest", str(destination), "--no-input", "--disable-pip-version-check",
               "--progress-bar", "off"]
    if pure:
        # Tags a pure-Python wheel for the guest's CPython has: ABI none, platform any.
        command += ["--platform", "any", "--abi", "none", "--implementation", "cp",
                    "--python-version", GUEST_PYTHON]
    else:
        command += ["--no-deps"]
    if packages.index_url is not None:
        command += ["--index-url", packages.index_url]
    for link in packages.find_links:
        command += ["--find-links", str(link)]
    if packages.no_index:
        command += ["--no-index"]
    return command


def _download(packages: Packages, destination: Path, report: Reporter) -> None:
    """pip download the set's pure wheels; raises NativeOnlyPackage / UsageError."""
    import subprocess

    command = [*_pip_command(packages, destination, pure=True), *packages.requirements]
    lines = []
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, errors="replace") as process:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.rstrip())
                if line.startswith(("Collecting", "Downloading", "Saved")):
                    report(line.strip())
    except OSError as exc:
        raise UsageError(f"resolving packages needs pip, which could not start: {exc}") \
            from None
    if process.returncode == 0:
        return
    output = "\n".join(lines)
    if "No module named pip" in output:
        raise UsageError(f"resolving packages needs pip in {sys.executable}'s environment: "
                         "install it with `python -m ensurepip`")
    missing = _NOT_FOUND.search(output)
    if missing is None:
        raise UsageError("pip could not resolve the packages:\n" + "\n".join(lines[-15:]))
    requirement = missing.group(1)
    native = _native_wheel(packages, requirement)
    if native is not None:
        raise NativeOnlyPackage(
            requirement,
            f"{requirement} has only native wheels (such as {native}), and the wasm guest "
            "runs pure-Python wheels only (the microVM does not install packages): give a "
            "pure-Python wheel of it in a wheelhouse (find_links), or leave it out")
    raise UsageError(
        f"no wheel of {requirement} for the wasm guest was found: it may exist only as a "
        "source distribution (which wasibox never builds, so no package code runs on the "
        "host), or not at all; build a pure-Python wheel of it yourself and give its "
        "directory as find_links")


def _native_wheel(packages: Packages, requirement: str) -> str | None:
    """The file name of a native wheel of ``requirement`` for this host, if it has one."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="wasibox-wheels-") as scratch:
        command = [*_pip_command(packages, Path(scratch), pure=False), requirement]
        result = subprocess.run(command, capture_output=True, text=True, errors="replace",
                                stdin=subprocess.DEVNULL, check=False)
        found = sorted(Path(scratch).glob("*.whl"))
        return found[0].name if result.returncode == 0 and found else None


def _checked_wheel(path: Path) -> Wheel:
    """The Wheel for a downloaded file; NativeOnlyPackage unless its tags are pure."""
    match = _WHEEL_NAME.match(path.name)
    if match is None:
        raise UsageError(f"pip returned {path.name}, which is not a wheel file name")
    if match["abi"] != "none" or match["platform"] != "any":
        raise NativeOnlyPackage(match["name"], f"{path.name} is a native wheel; the wasm "
                                "guest runs pure-Python wheels only")
    return Wheel(match["name"], match["version"], path.name, file_sha256(path))


def _member_target(info: zipfile.ZipInfo, wheel: Wheel) -> tuple[str, ...] | None:
    """Where a wheel member goes, as path parts under the site; None to leave it out."""
    name = info.filename
    parts = tuple(name.split("/"))
    if name.endswith("/"):
        return None  # a directory entry: directories are made for the files in them
    if (not name or name.startswith("/") or "\\" in name or "\x00" in name or ":" in parts[0]
            or any(part in ("", ".", "..") for part in parts)):
        raise UsageError(f"{wheel.filename} holds an unsafe path: {name!r}")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise UsageError(f"{wheel.filename} holds a symlink: {name!r}")
    if parts[0].endswith(".data"):
        if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
            return None  # scripts, headers and data files are not importable
        parts = parts[2:]
    if parts[-1].endswith((".so", ".pyd", ".dylib", ".dll")) or "__pycache__" in parts:
        return None
    return parts
