"""The microVM guest image: built from Debian packages once per machine, cached by content.

An image is three files:

* ``vmlinux``: the uncompressed kernel of Debian's ``linux-image-amd64``, extracted from its
  bzImage (it boots through the PVH entry point, ~2.7x faster than the bzImage under TCG);
* ``rootfs.erofs``: a read-only root file system made by ``debootstrap --variant=minbase``
  with python3, numpy, pandas, msgpack and any configured extra Debian Python packages;
* ``initramfs.cpio``: busybox-static, the kernel modules the guest needs (with everything
  they depend on, in load order), ``guest/microvm/init`` and the agent
  ``guest/microvm/agent.py`` with its mount support ``guest/microvm/wasibox_vm_files.py``
  (and the host's dependency-free ``capabilities/files/refusals.py`` it imports), the wasm
  runner's job core ``guest/runner/wasibox_job.py`` and its ``host`` package.

The kernel and root file system are slow to make (a minute or two) and are cached under a key
of their recipe (suite, mirror, package list, this module's recipe version); the initramfs is
made in well under a second and is keyed by the agent, the init script and busybox, so
changing the agent never rebuilds the root file system. Two builds are not byte-identical
(mkfs timestamps, package versions), so a built image is named by the sha256 of its files,
recorded in its manifest; VM snapshots are keyed by those digests.

Building needs root and the Debian tools listed in ``REQUIRED_TOOLS``.

Environment:
    WASIBOX_MICROVM_PACKAGES   extra Debian Python packages for the image, space or comma
                               separated (``python3-scipy python3-sklearn``)
    WASIBOX_DEBIAN_MIRROR      the Debian mirror debootstrap uses
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..._errors import GuestBuildError, UsageError
from ..._guest import cache_dir, file_lock, file_sha256
from ..._progress import Reporter, heartbeat, library_reporter
from ...capabilities.files import refusals

__all__ = ["BASE_PACKAGES", "REQUIRED_TOOLS", "ImageConfig", "VMImage", "cached_image_state",
           "ensure_image", "guest_microvm_sources", "image_modules", "missing_tools", "write_cpio"]

#: Bump when the recipe below changes in a way that changes the built image.
RECIPE_VERSION = "1"
KERNEL_RECIPE_VERSION = "1"
BASE_PACKAGES = ("python3", "python3-numpy", "python3-pandas", "python3-msgpack")
#: Modules the guest loads from the initramfs; their dependencies are added from modules.dep.
#: crc32c_generic is a soft dependency of libcrc32c (erofs), which modules.dep does not list.
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "crc32c_generic", "erofs")
#: Host tool -> the Debian package that provides it.
REQUIRED_TOOLS = {
    "debootstrap": "debootstrap",
    "mkfs.erofs": "erofs-utils",
    "depmod": "kmod",
    "apt-get": "apt",
    "dpkg-deb": "dpkg",
    "busybox": "busybox-static",
}
_PACKAGE_NAME = re.compile(r"^python3-[a-z0-9][a-z0-9.+-]*$")
#: Trimmed from the root file system: documentation and caches nothing at run time reads.
_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
         "usr/share/lintian", "var/cache/apt", "var/lib/apt/lists", "var/log")
_PACKAGE = Path(__file__).resolve().parents[2]  # wasibox/


def guest_microvm_sources() -> Path:
    """``guest/microvm/`` inside an installed wheel, or beside the package in a checkout."""
    for candidate in (_PACKAGE / "_guest_src" / "guest" / "microvm",
                      _PACKAGE.parent / "guest" / "microvm"):
        if (candidate / "agent.py").is_file():
            return candidate
    raise GuestBuildError("the microVM guest sources (guest/microvm/) are missing from this "
                          "installation; reinstall wasibox")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageConfig:
    """What goes into the microVM image.

    ``extra_packages`` are Debian package names of the form ``python3-*`` (for example
    ``python3-scipy``), added to the base set. Raises UsageError for any other name.
    """

    extra_packages: tuple[str, ...] = ()
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"

    def __post_init__(self) -> None:
        packages = tuple(sorted(set(self.extra_packages)))
        for name in packages:
            if not isinstance(name, str) or not _PACKAGE_NAME.match(name):
                raise UsageError(f"extra image packages must be Debian Python packages such as "
                                 f"'python3-scipy', not {name!r}")
        object.__setattr__(self, "extra_packages", packages)

    @classmethod
    def from_environment(cls, extra_packages: Iterable[str] = ()) -> ImageConfig:
        """The configuration named by the environment, plus ``extra_packages``."""
        configured = re.split(r"[\s,]+", os.environ.get("WASIBOX_MICROVM_PACKAGES", "").strip())
        mirror = os.environ.get("WASIBOX_DEBIAN_MIRROR") or cls.mirror
        return cls(extra_packages=(*filter(None, configured), *extra_packages), mirror=mirror)

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*BASE_PACKAGES, *self.extra_packages)))

    def rootfs_key(self) -> str:
        recipe = json.dumps({"recipe": RECIPE_VERSION, "suite": self.suite,
                             "mirror": self.mirror, "packages": self.packages}, sort_keys=True)
        return hashlib.sha256(recipe.encode()).hexdigest()[:24]

    def kernel_key(self) -> str:
        recipe = json.dumps({"recipe": KERNEL_RECIPE_VERSION, "suite": self.suite,
                             "mirror": self.mirror, "modules": GUEST_MODULES}, sort_keys=True)
        return hashlib.sha256(recipe.encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class VMImage:
    """A built image on disk, with the manifest recorded when it was built."""

    kernel: Path
    initramfs: Path
    rootfs: Path
    manifest: dict[str, Any]

    @property
    def digest(self) -> str:
        """One name for the exact kernel, initramfs and root file system."""
        parts = "".join(str(self.manifest["sha256"][name]) for name in ("vmlinux", "rootfs"))
        parts += str(self.manifest["initramfs_sha256"])
        return hashlib.sha256(parts.encode()).hexdigest()

    @property
    def modules(self) -> frozenset[str]:
        """Top-level Python modules importable in the guest."""
        return frozenset(self.manifest.get("python_modules", ()))


def _run(command: Sequence[str], what: str, **kwargs: Any) -> str:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, check=False,
                              **kwargs)
    except OSError as exc:
        raise GuestBuildError(f"{what} failed: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise GuestBuildError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return str(done.stdout)


def missing_tools() -> list[str]:
    """The Debian packages whose tools are missing on this machine."""
    return sorted({package for tool, package in REQUIRED_TOOLS.items()
                   if shutil.which(tool) is None})


def _image_root() -> Path:
    return cache_dir() / "microvm"


def _rootfs_dir(config: ImageConfig) -> Path:
    return _image_root() / f"rootfs-{config.rootfs_key()}"


def _kernel_dir(config: ImageConfig) -> Path:
    return _image_root() / f"kernel-{config.kernel_key()}"


# -- the kernel --------------------------------------------------------------------------------

def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage (xz- or gzip-compressed payload).

    Raises GuestBuildError when no compressed ELF is found.
    """
    for magic, opener in ((b"\xfd7zXZ\x00", lambda: lzma.LZMADecompressor()),
                          (b"\x1f\x8b\x08", lambda: zlib.decompressobj(16 + zlib.MAX_WBITS))):
        start = bzimage.find(magic)
        while start >= 0:
            try:
                data = opener().decompress(bzimage[start:])
            except (lzma.LZMAError, zlib.error):
                data = b""
            if data.startswith(b"\x7fELF"):
                return data
            start = bzimage.find(magic, start + 1)
    raise GuestBuildError("no compressed ELF kernel found in the bzImage")


def _build_kernel(workdir: Path, target: Path, report: Reporter) -> str:
    """Download the Debian kernel, extract vmlinux and the guest's module closure."""
    pattern = re.compile(r"Depends:\s*(linux-image-[0-9][^\s]*)")
    match = pattern.search(subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                                          capture_output=True, text=True).stdout)
    if match is None:  # a machine whose package lists were never fetched (or were cleaned)
        report("fetching the Debian package lists (apt-get update)")
        _run(["apt-get", "update", "-q"], "apt-get update")
        match = pattern.search(_run(["apt-cache", "depends", "linux-image-amd64"],
                                    "apt-cache depends"))
    if match is None:
        raise GuestBuildError("apt-cache could not resolve linux-image-amd64 (run apt-get "
                              "update first)")
    package = match.group(1)
    report(f"downloading {package}")
    _run(["apt-get", "download", package], "apt-get download", cwd=workdir)
    deb = next(workdir.glob(f"{package}_*.deb"))
    tree = workdir / "kernel"
    with heartbeat(report, f"unpacking {package}"):
        _run(["dpkg-deb", "-x", str(deb), str(tree)], "dpkg-deb -x")
    version = package.removeprefix("linux-image-")
    vmlinuz = tree / "boot" / f"vmlinuz-{version}"
    (target / "vmlinux").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
    _run(["depmod", "-b", str(tree), version], "depmod")
    modules_root = tree / "lib" / "modules" / version
    dependencies: dict[str, list[str]] = {}
    for line in (modules_root / "modules.dep").read_text().splitlines():
        module, _, needs = line.partition(":")
        dependencies[module] = needs.split()
    by_name = {Path(path).name.split(".ko")[0].replace("-", "_"): path for path in dependencies}
    order: list[str] = []

    def add(path: str) -> None:
        for needed in reversed(dependencies.get(path, [])):
            add(needed)
        if path not in order:
            order.append(path)

    for name in GUEST_MODULES:
        if name not in by_name:
            raise GuestBuildError(f"the kernel {version} has no module {name}")
        add(by_name[name])
    modules_dir = target / "modules"
    modules_dir.mkdir()
    names = []
    for path in order:
        source = modules_root / path
        name = Path(path).name
        data = source.read_bytes()
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name.removesuffix(".xz")
        (modules_dir / name).write_bytes(data)
        names.append(name)
    (modules_dir / "order").write_text("\n".join(names) + "\n")
    return version


# -- the root file system ----------------------------------------------------------------------

def _build_rootfs(config: ImageConfig, workdir: Path, target: Path,
                  report: Reporter) -> tuple[list[str], dict[str, str]]:
    root = workdir / "root"
    command = ["debootstrap", "--variant=minbase", f"--include={','.join(config.packages)}",
               config.suite, str(root), config.mirror]
    log = workdir / "debootstrap.log"
    started = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(1.0)
            lines = log.read_text(errors="replace").strip().splitlines()
            step = lines[-1].removeprefix("I: ") if lines else "starting"
            report(f"debootstrap: {step[:60]} ({time.monotonic() - started:.0f}s)")
    if process.returncode != 0:
        tail = log.read_text(errors="replace").strip()[-2000:]
        raise GuestBuildError(f"debootstrap failed (exit {process.returncode}):\n{tail}")
    for relative in _TRIM:
        shutil.rmtree(root / relative, ignore_errors=True)
    for mountpoint in ("proc", "sys", "dev", "tmp", "run"):
        (root / mountpoint).mkdir(exist_ok=True)
    listing = _run(["chroot", str(root), "/usr/bin/python3", "-c",
                    "import json, pkgutil, sys; print(json.dumps(sorted("
                    "{m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names))))"],
                   "listing the guest's Python modules")
    versions_text = _run(["chroot", str(root), "dpkg-query", "-W", "-f",
                          "${Package} ${Version}\\n", *config.packages],
                         "listing package versions")
    versions = dict(line.split(" ", 1) for line in versions_text.strip().splitlines())
    with heartbeat(report, "packing the root file system (erofs, lz4hc)"):
        _run(["mkfs.erofs", "-zlz4hc", "-T0", "--all-root", str(target / "rootfs.erofs"),
              str(root)], "mkfs.erofs")
    return json.loads(listing), versions


# -- the initramfs -----------------------------------------------------------------------------

def write_cpio(entries: Iterable[tuple[str, int, bytes]], out: Path) -> None:
    """Write a newc cpio archive of ``(path, mode, data)``; directories have mode S_IFDIR.

    Timestamps and owners are zero, so the same entries always give the same bytes.
    """
    def header(ino: int, mode: int, size: int, name: bytes) -> bytes:
        fields = [ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name) + 1, 0]
        raw = b"070701" + b"".join(b"%08X" % value for value in fields) + name + b"\0"
        return raw + b"\0" * (-len(raw) % 4)

    with open(out, "wb") as sink:
        for ino, (path, mode, data) in enumerate(entries, start=1):
            sink.write(header(ino, mode, len(data), path.encode()))
            sink.write(data + b"\0" * (-len(data) % 4))
        sink.write(header(0, 0, 0, b"TRAILER!!!"))


def _initramfs_inputs(base: Path) -> list[tuple[str, int, bytes]]:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise GuestBuildError("busybox is missing: install the Debian package busybox-static")
    sources = guest_microvm_sources()
    directory, executable = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o755
    regular = stat.S_IFREG | 0o644
    entries: list[tuple[str, int, bytes]] = [
        (name, directory, b"") for name in ("bin", "dev", "proc", "sys", "newroot", "modules")]
    entries.append(("bin/busybox", executable, Path(busybox).read_bytes()))
    entries.append(("init", executable, (sources / "init").read_bytes()))
    entries.append(("agent.py", regular, (sources / "agent.py").read_bytes()))
    entries.append(("wasibox_vm_files.py", regular,
                    (sources / "wasibox_vm_files.py").read_bytes()))
    # The host's own refusal reasons and depth limit, so the VM reports what the host would.
    entries.append(("wasibox_refusals.py", regular, Path(refusals.__file__).read_bytes()))
    # The wasm runner's job core, unchanged: the agent runs each job with the same code.
    entries.append(("wasibox_job.py", regular,
                    (sources.parent / "runner" / "wasibox_job.py").read_bytes()))
    # The wasm guest's `import host` module, unchanged: the agent gives it the same channel.
    entries.append(("host", directory, b""))
    for module in sorted((sources.parent / "runner" / "host").glob("*.py")):
        entries.append((f"host/{module.name}", regular, module.read_bytes()))
    for module in sorted((base / "modules").iterdir()):
        entries.append((f"modules/{module.name}", regular, module.read_bytes()))
    return entries


# -- putting it together -----------------------------------------------------------------------

def _load(kernel_dir: Path, rootfs_dir: Path) -> VMImage | None:
    kernel_path, manifest_path = kernel_dir / "kernel.json", rootfs_dir / "manifest.json"
    if not (kernel_path.is_file() and manifest_path.is_file()):
        return None
    entries = _initramfs_inputs(kernel_dir)
    key = hashlib.sha256()
    for path, mode, data in entries:
        key.update(f"{path}\0{mode}\0{len(data)}\0".encode())
        key.update(data)
    initramfs_digest = key.hexdigest()
    initramfs = kernel_dir / f"initramfs-{initramfs_digest[:16]}.cpio"
    if not initramfs.is_file():
        staged = Path(tempfile.mkstemp(dir=kernel_dir, suffix=".tmp")[1])
        write_cpio(entries, staged)
        os.replace(staged, initramfs)
    kernel = json.loads(kernel_path.read_text())
    manifest = json.loads(manifest_path.read_text())
    manifest.update(kernel=kernel["kernel"], initramfs_sha256=initramfs_digest,
                    sha256=dict(manifest["sha256"], vmlinux=kernel["sha256"]))
    return VMImage(kernel=kernel_dir / "vmlinux", initramfs=initramfs,
                   rootfs=rootfs_dir / "rootfs.erofs", manifest=manifest)


_loaded: dict[str, VMImage] = {}


def ensure_image(config: ImageConfig | None = None,
                 progress: Reporter | None = None) -> VMImage:
    """Return the microVM image, building it first if this machine has none cached.

    Building takes a few minutes (mostly debootstrap) and reports progress to ``progress``
    (stderr by default). Raises GuestBuildError when a tool is missing, when not run as
    root, or when a build step fails (with the step and its output).
    """
    config = config or ImageConfig.from_environment()
    kernel_dir, rootfs_dir = _kernel_dir(config), _rootfs_dir(config)
    cache_key = f"{kernel_dir}:{rootfs_dir}"
    cached = _loaded.get(cache_key)
    if cached is not None:
        return cached
    image = _load(kernel_dir, rootfs_dir)
    if image is None:
        report = progress or library_reporter()
        for directory, build in ((kernel_dir, _build_kernel_dir), (rootfs_dir, _build_rootfs_dir)):
            with file_lock(directory.with_suffix(".lock")):
                if not (directory / "ready").is_file():
                    _check_build_tools()
                    _staged_build(config, directory, build, report)
        image = _load(kernel_dir, rootfs_dir)
        assert image is not None
    _loaded[cache_key] = image
    return image


def _check_build_tools() -> None:
    missing = missing_tools()
    if missing:
        raise GuestBuildError("building the microVM image needs these Debian packages: "
                              f"{' '.join(missing)} (apt-get install {' '.join(missing)})")
    if os.geteuid() != 0:
        raise GuestBuildError("building the microVM image needs root (debootstrap and chroot); "
                              "run `sudo wasibox microvm build` once")


def _staged_build(config: ImageConfig, directory: Path, build: Any, report: Reporter) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix="build-") as scratch:
        workdir = Path(scratch)
        target = workdir / "out"
        target.mkdir()
        build(config, workdir, target, report)
        (target / "ready").write_text("")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(target, directory)


def _build_kernel_dir(config: ImageConfig, workdir: Path, target: Path,
                      report: Reporter) -> None:
    started = time.monotonic()
    version = _build_kernel(workdir, target, report)
    (target / "kernel.json").write_text(json.dumps({
        "kernel": version, "sha256": file_sha256(target / "vmlinux"),
        "build_seconds": round(time.monotonic() - started, 1)}))
    report(f"built the guest kernel {version} in {time.monotonic() - started:.1f}s (cached)")


def _build_rootfs_dir(config: ImageConfig, workdir: Path, target: Path,
                      report: Reporter) -> None:
    started = time.monotonic()
    report(f"building the microVM root file system (once per machine): "
           f"{' '.join(config.packages)}")
    modules, versions = _build_rootfs(config, workdir, target, report)
    manifest: dict[str, Any] = {
        "recipe": RECIPE_VERSION,
        "suite": config.suite,
        "packages": versions,
        "python_modules": modules,
        "sha256": {"rootfs": file_sha256(target / "rootfs.erofs")},
        "rootfs_bytes": (target / "rootfs.erofs").stat().st_size,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    report(f"built the root file system in {manifest['build_seconds']}s "
           f"({manifest['rootfs_bytes'] / 2**20:.0f} MiB, cached)")


def image_modules(config: ImageConfig | None = None) -> frozenset[str]:
    """Top-level Python modules the image has (or will have, if it is not built yet).

    Read from the built image's manifest; before the first build, derived from the package
    names (``python3-foo`` provides ``foo``). Never builds anything.
    """
    try:
        config = config or ImageConfig.from_environment()
    except UsageError:
        return frozenset()
    manifest = _rootfs_dir(config) / "manifest.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        return frozenset(json.loads(manifest.read_text())["python_modules"])
    return frozenset(name.removeprefix("python3-").replace("-", "_")
                     for name in config.packages if name != "python3")


def cached_image_state(config: ImageConfig | None = None) -> str:
    """A one-line description of the microVM image cache, for ``wasibox doctor``."""
    try:
        config = config or ImageConfig.from_environment()
    except UsageError as exc:
        return f"misconfigured ({exc})"
    rootfs_dir, kernel_dir = _rootfs_dir(config), _kernel_dir(config)
    manifest, kernel = rootfs_dir / "manifest.json", kernel_dir / "kernel.json"
    if manifest.is_file() and kernel.is_file():
        data = json.loads(manifest.read_text())
        return (f"built, kernel {json.loads(kernel.read_text())['kernel']}, root file system "
                f"{data['rootfs_bytes'] / 2**20:.0f} MiB ({rootfs_dir})")
    missing = missing_tools()
    hint = f"; needs: apt-get install {' '.join(missing)}" if missing else ""
    return f"not built yet (run `wasibox microvm build`{hint})"
