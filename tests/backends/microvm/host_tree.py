"""What a host directory holds, as the microVM mount tests compare it before and after a run."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from wasibox.capabilities.files.mount import STAGING_DIR

__all__ = ["host_view"]


def host_view(root: Path) -> dict[str, str]:
    """Every entry under ``root`` but the staging area: a link as ``-> target``, a directory
    as ``/``, a ``.txt`` file as its text and any other file as its SHA-256."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(STAGING_DIR):
            continue
        if path.is_symlink():
            found[relative] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[relative] = "/"
        else:
            data = path.read_bytes()
            found[relative] = data.decode() if relative.endswith(".txt") \
                else hashlib.sha256(data).hexdigest()
    return found
