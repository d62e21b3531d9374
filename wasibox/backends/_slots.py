"""Memory-slot reuse: Wasmtime's pooling allocator, set up so that a reused slot is cheap.

A fresh instance of the guest normally costs ~540 page faults: every page the first call
touches is copied out of the copy-on-write snapshot (about 5 µs each on virtual machines).
The pooling allocator keeps each linear-memory slot mapped between instances, and on reuse
resets only the pages the last instance dirtied, copying them back from the snapshot image,
so a new instance starts with the snapshot's pages already in place and no faults.

Three settings make that work, and each has a fallback:

* ``linear_memory_keep_resident``: reset the slot in place instead of unmapping it. Exposed
  by the C API.
* ``pagemap_scan``: find the dirty pages with the kernel's ``PAGEMAP_SCAN`` ioctl (Linux
  >= 6.7). Without it, keep-resident copies the *whole* kept range back on every reset (8 ms
  at 64 MiB), which is slower than not pooling at all. The C API has **no setter** for it:
  ``wasmtime_pooling_allocation_config_new`` stores it as a tri-state byte at offset 0x85 of
  the config (0 Auto, 1 Yes, 2 No; default No), next to memory protection keys at 0x84. That
  offset belongs to one exact build of the library, so the byte is written only when the
  loaded library's SHA-256 is the known one *and* the bytes 0x84-0x86 read 2, 2, 0 as that
  build leaves them; the value written is Auto, which lets Wasmtime fall back by itself if
  the ioctl fails. On any other library, or a kernel without the ioctl, the pooling allocator
  is not used at all and instances come from the default allocator as before.
* populating each slot's image once: with the scan on, pages of the image mapping that were
  never touched report as written, so every reset would copy the whole image (16+ MiB).
  Reading every page of a slot's image mapping once (``MADV_POPULATE_READ``, Linux >= 5.14)
  fixes that for the slot's lifetime. Where the kernel refuses, nothing is populated and a
  reset costs more, but stays correct.

Copy-on-write (``memory_init_cow``) stays on, and every instance still starts from the
snapshot: the reset restores every dirtied page. ``tests/test_isolation.py`` checks that
over a thousand consecutive runs.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi

from .._guest import cache_dir, file_sha256

__all__ = ["KNOWN_LIBRARY_SHA256", "SlotPopulator", "SlotReuse", "configure_pooling",
           "library_path", "library_sha256", "slot_reuse", "unverified_library"]

#: wasmtime-py 50.0.1's bundled libwasmtime (Wasmtime 50.0.0) for linux-x86_64: the only build
#: whose pooling-config layout (the byte offsets below) has been read and verified.
KNOWN_LIBRARY_SHA256 = "3127ca42fe7cdd3f0a43a358e79177dcfedd46c1746329826403b9d854de6178"
#: Offset of ``memory_protection_keys`` in that build's pooling config; ``pagemap_scan``
#: follows it, then a bool that is false by default.
_TRISTATE_OFFSET = 0x84
_TRISTATE_DEFAULTS = bytes([2, 2, 0])  # mpk No, pagemap_scan No, (bool) false
_PAGEMAP_SCAN_AUTO = 0
#: How much of a slot is reset in place (dirty pages copied back or zeroed, and kept
#: resident) rather than given back to the kernel. Dirtied pages below it stay resident in an
#: idle slot, so it bounds what a memory-hungry run leaves behind per slot. Measured for
#: `print(1+1)` cycles: 0 left all ~550 faults per instance, 8 MiB removed them all (as did
#: 32 and 64 MiB); 64 MiB left ~100 MiB of host memory behind after a compile bomb, 8 MiB ~24.
KEEP_RESIDENT_BYTES = 8 * 2**20
#: The largest memory a slot can hold: all a 32-bit memory can address. The store's own
#: limit (``Limits.memory_bytes``) caps each run below that.
MAX_SLOT_MEMORY_BYTES = 4 * 2**30
_MADV_POPULATE_READ = 22
#: ``_IOWR('f', 16, struct pm_scan_arg)``, the struct being 12 u64 fields.
_PAGEMAP_SCAN = 0xC0606610
_PM_SCAN_ARG_BYTES = 96


@dataclass(frozen=True)
class SlotReuse:
    """Whether the engine reuses memory slots, and why (shown by ``wasibox doctor``)."""

    enabled: bool
    reason: str


def library_path() -> Path:
    """The Wasmtime C library wasmtime-py loaded."""
    return Path(ffi.dll._name)


def library_sha256() -> str:
    """The SHA-256 of the loaded Wasmtime library, cached by its size, mtime and inode.

    Hashing the 30 MB library costs ~80 ms, which a cold start cannot afford every time.
    """
    path = library_path()
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    record = cache_dir() / "wasmtime-library.json"
    try:
        cached = json.loads(record.read_text())
        if cached.get("key") == key and isinstance(cached.get("sha256"), str):
            return str(cached["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    digest = file_sha256(path)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        staged = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(staged, record)
    except OSError:
        pass  # a read-only cache only costs the next process the hash again
    return digest


def unverified_library() -> str | None:
    """Why the loaded Wasmtime library is not the verified build, or None if it is."""
    try:
        digest = library_sha256()
    except OSError as exc:
        return f"the Wasmtime library could not be read ({exc.strerror})"
    if digest != KNOWN_LIBRARY_SHA256:
        return ("this Wasmtime library is not the build whose layout wasibox verified "
                "(its SHA-256 differs)")
    return None


def _kernel_has_pagemap_scan() -> bool:
    """Ask the kernel for an empty PAGEMAP_SCAN: ENOTTY where the ioctl does not exist."""
    argument = bytearray(_PM_SCAN_ARG_BYTES)
    argument[0:8] = _PM_SCAN_ARG_BYTES.to_bytes(8, "little")  # size; the range is empty
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            fcntl.ioctl(pagemap, _PAGEMAP_SCAN, argument)
    except OSError:
        return False
    return True


def slot_reuse() -> SlotReuse:
    """Decide whether this process can reuse memory slots safely, and say why. Never raises."""
    if os.environ.get("WASIBOX_SLOT_REUSE", "1") == "0":
        return SlotReuse(False, "turned off by WASIBOX_SLOT_REUSE=0")
    problem = unverified_library()
    if problem is not None:
        return SlotReuse(False, problem)
    if not _kernel_has_pagemap_scan():
        return SlotReuse(False, "the kernel has no PAGEMAP_SCAN (Linux >= 6.7 needed)")
    pooling = _scanning_pooling_config()
    if pooling is None:
        return SlotReuse(False, "the pooling config's layout is not the verified one")
    ffi.wasmtime_pooling_allocation_config_delete(pooling)
    return SlotReuse(True, "pooling allocator, dirty pages reset by PAGEMAP_SCAN")


def configure_pooling(config: wasmtime.Config) -> SlotReuse:
    """Switch ``config`` to the pooling allocator with a dirty-page reset, if verified safe.

    Returns what was decided. Never raises: any doubt leaves the default allocator in place.
    """
    decision = slot_reuse()
    if not decision.enabled:
        return decision
    pooling = _scanning_pooling_config()
    if pooling is None:  # checked by slot_reuse; kept for the type checker
        return SlotReuse(False, "the pooling config's layout is not the verified one")
    try:
        ffi.wasmtime_pooling_allocation_config_linear_memory_keep_resident_set(
            pooling, KEEP_RESIDENT_BYTES)
        ffi.wasmtime_pooling_allocation_config_max_memory_size_set(
            pooling, MAX_SLOT_MEMORY_BYTES)
        ffi.wasmtime_pooling_allocation_strategy_set(config.ptr(), pooling)
    finally:
        ffi.wasmtime_pooling_allocation_config_delete(pooling)
    return decision


def _scanning_pooling_config() -> Any:
    """A new pooling config with pagemap_scan set to Auto, or None if its bytes are not the
    verified build's defaults (then it is deleted, untouched)."""
    pooling = ffi.wasmtime_pooling_allocation_config_new()
    raw = ctypes.cast(pooling, ctypes.POINTER(ctypes.c_uint8 * 0x88)).contents
    if bytes(raw[_TRISTATE_OFFSET:_TRISTATE_OFFSET + 3]) != _TRISTATE_DEFAULTS:
        ffi.wasmtime_pooling_allocation_config_delete(pooling)
        return None
    raw[_TRISTATE_OFFSET + 1] = _PAGEMAP_SCAN_AUTO
    return pooling


class SlotPopulator:
    """Reads every page of each memory slot's snapshot mapping once (MADV_POPULATE_READ).

    The mappings are found in ``/proc/self/maps`` as private writable mappings of the
    compiled guest file. Reading that file costs ~1 ms, so it is read only when more
    instances are alive at once than ever before: the pool hands a slot back to the next
    instance of the same component, so only then can an unseen slot be in use.
    """

    def __init__(self, compiled: Path) -> None:
        self._suffix = f" {compiled}"
        self._populated: set[int] = set()
        self._live = 0
        self._most_live = 0
        self._lock = threading.Lock()
        #: The weak references that count live stores (each must outlive its store).
        self._stores: set[weakref.ref[wasmtime.Store]] = set()
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        #: Set when the kernel refuses MADV_POPULATE_READ; then nothing more is tried.
        self.refused = False

    def track(self, store: wasmtime.Store) -> None:
        """Count ``store``'s instance while it lives; populate any slot not yet populated."""
        with self._lock:
            self._live += 1
            new_high = self._live > self._most_live and not self.refused
            self._most_live = max(self._most_live, self._live)
        # A weak reference with a callback, not weakref.finalize: finalizers live in one
        # registry that the interpreter iterates at exit, and a pool thread adding one then
        # made that iteration fail ("dictionary changed size during iteration").
        ref = weakref.ref(store, self._dropped)
        with self._lock:
            self._stores.add(ref)
        if new_high:
            self._populate()

    def _dropped(self, ref: weakref.ref[wasmtime.Store]) -> None:
        with self._lock:
            self._stores.discard(ref)
            self._live -= 1

    def _populate(self) -> None:
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                lines = [line for line in maps if line.rstrip("\n").endswith(self._suffix)]
        except OSError:
            return
        for line in lines:
            span, perms = line.split()[:2]
            if perms != "rw-p":
                continue
            start, end = (int(part, 16) for part in span.split("-"))
            with self._lock:
                if start in self._populated or self.refused:
                    continue
                self._populated.add(start)
            if (self._madvise(start, end - start, _MADV_POPULATE_READ) != 0
                    and ctypes.get_errno() == errno.EINVAL):
                self.refused = True  # a kernel before 5.14: resets copy more, nothing else
