"""Memory-slot reuse (backends/wasm/slots.py): on only for the verified library, off otherwise."""

from __future__ import annotations

import gc
import os

import pytest
import wasmtime
from wasmtime import component as cm

from wasibox._guest import GuestArtifact, file_sha256
from wasibox.backends.wasm import engine, slots
from wasibox.backends.wasm.runtime import runtime


def test_slot_reuse_is_on_exactly_when_the_library_is_the_verified_build() -> None:
    decision = runtime().slot_reuse
    verified = (slots.library_sha256() == slots.KNOWN_LIBRARY_SHA256
                and slots._kernel_has_pagemap_scan())
    assert decision.enabled is verified, decision.reason


def test_another_library_build_keeps_the_default_allocator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "library_sha256", lambda: "0" * 64)
    config = wasmtime.Config()
    decision = slots.configure_pooling(config)
    assert not decision.enabled
    assert "SHA-256 differs" in decision.reason


def test_the_environment_can_turn_slot_reuse_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASIBOX_SLOT_REUSE", "0")
    assert slots.configure_pooling(wasmtime.Config()) == slots.SlotReuse(
        False, "turned off by WASIBOX_SLOT_REUSE=0")


def test_the_library_digest_is_cached_and_correct(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path))
    first = slots.library_sha256()
    assert (tmp_path / "wasmtime-library.json").is_file()
    assert slots.library_sha256() == first == file_sha256(slots.library_path())


class CountingPopulator(slots.SlotPopulator):
    """Counts the scans for unseen slots instead of reading /proc/self/maps."""

    scans = 0

    def _populate(self) -> None:
        self.scans += 1


def test_slots_are_scanned_only_when_more_stores_live_than_ever_before(tmp_path) -> None:
    populator = CountingPopulator(tmp_path / "guest.cwasm")
    engine = wasmtime.Engine()
    stores = [wasmtime.Store(engine) for _ in range(3)]
    for store in stores:
        populator.track(store)
    assert populator.scans == 3
    del store
    stores.clear()
    gc.collect()
    # All three are gone: three new ones fit the slots already seen, a fourth does not.
    again = [wasmtime.Store(engine) for _ in range(4)]
    for store in again:
        populator.track(store)
    assert populator.scans == 4


#: A component whose one core instance has a memory with data: its snapshot, in miniature.
TINY_GUEST = """(component
  (core module $m (memory (export "memory") 2) (data (i32.const 65536) "snapshot"))
  (core instance (instantiate $m)))"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_a_guest_compiled_in_this_process_has_its_slots_populated(tmp_path, monkeypatch) -> None:
    # Compiled in memory, the memory image was an anonymous memfd the populator never
    # found: every reset of its slots copied the whole image back.
    monkeypatch.setenv("WASIBOX_CACHE_DIR", str(tmp_path))
    source = tmp_path / "guest.wat"
    source.write_text(TINY_GUEST)
    artifact = GuestArtifact(source, "0" * 64)
    guest_engine = wasmtime.Engine(engine.engine_config())
    component, _ = engine.load_compiled(guest_engine, artifact, lambda message: None)
    assert engine.compiled_path(artifact).is_file()
    store = wasmtime.Store(guest_engine)
    store.set_fuel(engine.INSTANTIATION_FUEL)
    cm.Linker(guest_engine).instantiate(store, component)
    populator = slots.SlotPopulator(engine.compiled_path(artifact).resolve())
    populator.track(store)
    assert populator._populated
