"""What a guest may be granted of the host's files: ``Mount`` (a host directory at a guest
path, read-only or writable with quotas), the checks on a table of mounts, and a mount's
command-line form (``--mount HOST:GUEST[:rw[,c_access]]``, ``--scratch GUEST[:c_access]``).

The threat the files capability mediates, and what it guarantees, open this package
(``wasibox/capabilities/files/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from ..._errors import UsageError
from ..._limits import parse_size
from .refusals import MAX_DEPTH

__all__ = [
    "MAX_DEPTH",
    "MOUNT_METAVAR",
    "STAGING_DIR",
    "Mount",
    "check_mounts",
    "format_mount",
    "guest_path_for",
    "lexical_parts",
    "parse_mount",
    "parse_scratch",
]

#: The directory inside each writable mount that holds its runs' staging trees.
STAGING_DIR = ".wasibox-staging"


@dataclasses.dataclass(frozen=True)
class Mount:
    """A host directory the guest sees at ``guest_path``.

    Read-only unless ``writable``. A writable mount's changes are staged per run and
    published into ``host_path`` only when the run ends ok; it holds at most ``quota_bytes``
    (ints or shorthand such as ``"64MiB"``) in at most ``quota_files`` files and directories.

    ``Mount.scratch("/tmp")`` is a writable directory that starts empty for every run and
    is thrown away when the run ends (``host_path`` is None).

    ``c_access=True`` also shows a writable or scratch mount to C code inside the wasm guest
    (``sqlite3.connect("/out/db.sqlite")``), through a WASI preopen of the run's staging
    tree. Such a run gets a new guest instance rather than a pooled one, and its staging
    holds private copies of the mount's files, copied at the start of every run (instead of
    links), so C code never writes a host file in place; the quotas and refusals are then
    checked on what the tree holds when the run ends (see docs/c-level-files.md).

    Raises UsageError if ``host_path`` is not an existing directory, ``guest_path`` is not
    an absolute path below ``/``, or ``c_access`` is asked of a read-only mount.
    """

    host_path: str | os.PathLike[str] | None
    guest_path: str
    writable: bool = False
    quota_bytes: int | str = 64 * 2**20
    quota_files: int = 10_000
    c_access: bool = False

    @classmethod
    def scratch(cls, guest_path: str = "/tmp", *, quota_bytes: int | str = 64 * 2**20,
                quota_files: int = 10_000, c_access: bool = False) -> Mount:
        """A private, empty, writable directory for each run, discarded when it ends."""
        return cls(None, guest_path, writable=True, quota_bytes=quota_bytes,
                   quota_files=quota_files, c_access=c_access)

    def __post_init__(self) -> None:
        if self.c_access and not self.writable:
            # A preopen of the host directory itself would show C code what the Python view
            # hides (links, FIFOs, other runs' staging): only a private staging tree is safe.
            raise UsageError("c_access needs a writable (or scratch) mount, whose staging "
                             "tree C code can be given; mount it writable with a quota")
        object.__setattr__(self, "c_access", bool(self.c_access))
        if self.host_path is None:
            if not self.writable:
                raise UsageError("a scratch Mount (host_path=None) must be writable")
        else:
            try:
                host = Path(os.fspath(self.host_path)).resolve(strict=True)
            except (OSError, TypeError, ValueError):
                raise UsageError(f"Mount host_path must be an existing directory, not "
                                 f"{self.host_path!r}") from None
            if not host.is_dir():
                raise UsageError(f"Mount host_path must be a directory: {self.host_path!r}")
            object.__setattr__(self, "host_path", host)
        guest = self.guest_path
        if not isinstance(guest, str) or not guest.startswith("/") or "\x00" in guest:
            raise UsageError(f"Mount guest_path must be an absolute path such as '/data', "
                             f"not {guest!r}")
        parts = lexical_parts(guest)
        if not parts:
            raise UsageError("Mount guest_path cannot be '/': mount below it, e.g. '/data'")
        object.__setattr__(self, "guest_path", "/" + "/".join(parts))
        object.__setattr__(self, "writable", bool(self.writable))
        object.__setattr__(self, "quota_bytes", parse_size(self.quota_bytes, "quota_bytes"))
        files = self.quota_files
        if isinstance(files, bool) or not isinstance(files, int) or files <= 0:
            raise UsageError(f"quota_files must be a positive int, not {files!r}")

    @property
    def parts(self) -> tuple[str, ...]:
        return lexical_parts(self.guest_path)


def check_mounts(mounts: Sequence[Mount]) -> tuple[Mount, ...]:
    """Validate a mount table: Mount objects, no guest path inside another, and no writable
    host directory inside another mount's. Raises UsageError."""
    table = tuple(mounts)
    for mount in table:
        if not isinstance(mount, Mount):
            raise UsageError(f"mounts must be wasibox.Mount objects, not {type(mount).__name__}")
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            if _nested(a.parts, b.parts):
                raise UsageError(f"mounts {a.guest_path!r} and {b.guest_path!r} overlap")
            if a.host_path is None or b.host_path is None:
                continue
            if (a.writable or b.writable) and _nested(Path(a.host_path).parts,
                                                      Path(b.host_path).parts):
                raise UsageError(f"the host directories of {a.guest_path!r} and "
                                 f"{b.guest_path!r} overlap, and one of them is writable")
    return table


def guest_path_for(host_file: str | os.PathLike[str], mounts: Sequence[Mount]) -> str | None:
    """The path at which the guest sees ``host_file`` through ``mounts``, or None if no
    mount shows it (a scratch mount shows no host file)."""
    try:
        target = Path(os.fspath(host_file)).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    for mount in mounts:
        if mount.host_path is None:
            continue
        try:
            inside = target.relative_to(mount.host_path)
        except ValueError:
            continue
        return "/".join((mount.guest_path, *inside.parts))
    return None


def _nested(a: Sequence[str], b: Sequence[str]) -> bool:
    n = min(len(a), len(b))
    return tuple(a[:n]) == tuple(b[:n])


def lexical_parts(path: str) -> tuple[str, ...]:
    """The components of ``path`` with ``.`` and ``..`` resolved without looking at the disk
    (``..`` above the root stays at the root)."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return tuple(parts)


# -- the command line's form: --mount and --scratch ------------------------------------------

#: How ``--mount`` is written: options after the second colon, comma-separated.
MOUNT_METAVAR = "HOST:GUEST[:rw[,c_access]]"
_MOUNT_OPTIONS = frozenset({"ro", "rw", "c_access"})


def parse_mount(text: str) -> Mount:
    """``HOST:GUEST``, optionally followed by ``:`` and comma-separated options, as a Mount.

    The options are ``ro`` (the default) or ``rw``, and ``c_access`` (C code in the guest,
    such as sqlite3, sees the mount too; it needs ``rw``): ``./out:/out:rw,c_access``.
    Raises UsageError for any other shape or option, and as Mount does (a HOST that is not
    a directory, a GUEST that is not absolute).
    """
    host, _, rest = text.partition(":")
    guest, colon, written = rest.partition(":")
    options = written.split(",") if colon else []
    if (not host or not guest or not set(options) <= _MOUNT_OPTIONS
            or len(set(options)) != len(options) or {"ro", "rw"} <= set(options)):
        raise UsageError(f"--mount takes HOST:GUEST, HOST:GUEST:rw or "
                         f"HOST:GUEST:rw,c_access, not {text!r}")
    if "c_access" in options and "rw" not in options:
        raise UsageError(f"--mount {text}: c_access needs a writable mount, whose private "
                         f"staging C code can be given: write {host}:{guest}:rw,c_access")
    return Mount(host, guest, writable="rw" in options, c_access="c_access" in options)


def parse_scratch(text: str) -> Mount:
    """``GUEST`` or ``GUEST:c_access`` (``--scratch``) as a scratch Mount; UsageError for
    any other option, and as Mount does for a GUEST that is not absolute."""
    guest, colon, option = text.partition(":")
    if colon and option != "c_access":
        raise UsageError(f"--scratch takes GUEST or GUEST:c_access, not {text!r}")
    return Mount.scratch(guest, c_access=option == "c_access")


def format_mount(mount: Mount) -> str:
    """The ``--mount`` text that ``parse_mount`` reads back as ``mount`` (quotas aside,
    which have no syntax). Raises UsageError for a scratch mount, which has no host side,
    and for a path holding ``:``, which the text form cannot hold."""
    if mount.host_path is None:
        raise UsageError("a scratch mount has no --mount form: use --scratch GUEST")
    if ":" in f"{mount.host_path}{mount.guest_path}":
        raise UsageError(f"the mount of {mount.host_path} at {mount.guest_path} has no "
                         "--mount form: its paths hold ':'")
    options = ",".join(["rw"] * mount.writable + ["c_access"] * mount.c_access)
    return f"{mount.host_path}:{mount.guest_path}" + (f":{options}" if options else "")
