"""The epoch ticker, in both its forms: the extension's C thread (which never takes the GIL)
and the Python one the Python run path uses where the extension is unavailable.

Either must advance a real engine's epoch while a run is counted in, keep ticking for
``idle_s`` after the last run ends, then end, and start again with the next run: a run with
no ticker would never reach its deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import wasmtime

from tests.conftest import wait_for
from wasibox.backends.wasm.engine import EPOCH_TICK_S, Ticker, engine_config
from wasibox.backends.wasm.run import address_of
from wasibox.backends.wasm.runtime import runtime

pytestmark = pytest.mark.guest  # the native Ticker comes with the runtime, which builds one

#: A function that loops forever: only an epoch deadline (or fuel) ends it.
SPIN = "(module (func (export \"spin\") (loop br 0)))"
IDLE_S = 0.2


def native_ticker(engine: wasmtime.Engine) -> Any:
    native = runtime().native.module
    if native is None:
        pytest.skip(f"the native extension is unavailable: {runtime().native.reason}")
    return native.Ticker(engine, address_of(engine.ptr()), EPOCH_TICK_S, IDLE_S)


def spin_until_the_deadline(engine: wasmtime.Engine) -> None:
    """Call a spinning function with an epoch deadline one tick ahead: it returns (with a
    trap) only once the epoch has advanced."""
    store = wasmtime.Store(engine)
    store.set_fuel(10**10)  # seconds of spinning: a ticker that never ticks fails, not hangs
    store.set_epoch_deadline(1)
    spin = wasmtime.Instance(store, wasmtime.Module(engine, SPIN), []).exports(store)["spin"]
    assert isinstance(spin, wasmtime.Func)
    with pytest.raises(wasmtime.Trap) as trapped:
        spin(store)
    assert trapped.value.trap_code == wasmtime.TrapCode.INTERRUPT


@pytest.mark.parametrize("make", [Ticker, native_ticker])
def test_a_ticker_ticks_while_runs_are_active_then_ends_and_starts_again(
        make: Callable[[wasmtime.Engine], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("wasibox.backends.wasm.engine.TICKER_IDLE_S", IDLE_S)
    engine = wasmtime.Engine(engine_config())
    ticker = make(engine)
    assert not ticker.running
    for _ in range(2):  # the second time, after the first thread has ended
        with ticker:
            assert ticker.running
            spin_until_the_deadline(engine)
        assert ticker.running  # on for a while after the last run
        assert wait_for(lambda: not ticker.running, seconds=30), "the idle ticker never ended"
