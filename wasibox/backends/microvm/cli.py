"""The ``wasibox microvm`` commands and the microVM rows of ``wasibox doctor``."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from typing import Any

__all__ = ["add_microvm_command", "doctor_rows"]

_BUILD_HELP = """\
Build the microVM guest image now (about 1-3 minutes, needs root and the Debian packages
debootstrap, erofs-utils, kmod and busybox-static), probe which accelerator really works
(KVM, or QEMU's software emulation TCG), and make the template snapshot the runs restore
from. Everything is cached by content; running this again is instant.

Extra Debian Python packages go in with --package (repeatable) or the environment variable
WASIBOX_MICROVM_PACKAGES, e.g. WASIBOX_MICROVM_PACKAGES="python3-scipy".
"""


def add_microvm_command(commands: Any) -> None:
    """Add ``wasibox microvm ...`` to the CLI's subcommands."""
    microvm = commands.add_parser(
        "microvm", help="build and inspect the microVM backend (for numpy, pandas, ...)",
        description="The microVM backend runs code that needs native extensions in a VM "
                    "with its own kernel, behind the same API.")
    actions = microvm.add_subparsers(dest="microvm_command", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="build the guest image and template snapshot now, with progress",
        description=_BUILD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    build.add_argument("--package", action="append", default=[], metavar="DEBIAN_PACKAGE",
                       help="an extra Debian Python package for the image (python3-*)")
    build.add_argument("--no-template", action="store_true",
                       help="only build the image; skip the accelerator probe and template")
    build.set_defaults(handler=_cmd_build)


def _cmd_build(args: argparse.Namespace) -> int:
    from ..._progress import stderr_reporter
    from .image import ImageConfig, ensure_image
    from .runtime import MIN_MEMORY_BYTES, MicroVMRuntime, default_memory_mib

    report = stderr_reporter(min_interval_s=2.0)
    config = ImageConfig.from_environment(args.package)
    started = time.perf_counter()
    image = ensure_image(config, report)
    print(f"image {image.digest[:24]} kernel {image.manifest['kernel']} "
          f"rootfs {image.rootfs.stat().st_size / 2**20:.0f} MiB")
    print("packages " + json.dumps(image.manifest["packages"]))
    if not args.no_template:
        runtime = MicroVMRuntime(config, progress=report)
        print(f"accelerator {runtime.accel}")
        template = runtime.template(default_memory_mib())
        print(f"template {template.key} (minimum VM memory {MIN_MEMORY_BYTES // 2**20} MiB)")
    report(f"ready in {time.perf_counter() - started:.1f}s")
    return 0


def doctor_rows() -> list[tuple[str, str]]:
    """What ``wasibox doctor`` says about the microVM backend (never builds anything)."""
    from .image import cached_image_state, missing_tools
    from .runtime import ALLOW_EMULATION_ENV, cached_accelerator, emulation_allowed

    qemu = shutil.which("qemu-system-x86_64")
    jail = shutil.which("bwrap")
    missing = missing_tools()
    return [
        ("qemu", qemu or "not installed (apt-get install qemu-system-x86)"),
        ("bubblewrap", jail or "not installed (apt-get install bubblewrap)"),
        ("microvm image", cached_image_state()),
        ("microvm build tools", "all present" if not missing
         else f"missing: apt-get install {' '.join(missing)}"),
        ("microvm accelerator", cached_accelerator()),
        ("microvm emulation", "allowed" if emulation_allowed(None)
         else f"refused unless allowed: wasibox run --allow-emulation, {ALLOW_EMULATION_ENV}=1 "
              "in the environment, or Sandbox(allow_emulation=True)"),
    ]
