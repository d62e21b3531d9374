"""The Wasmtime backend: CPython compiled to WASI 0.2, one fresh instance per run.

This package is the only code that imports ``wasmtime``. Its modules, one job each:

* ``engine``: one ``Engine`` per process (fuel and epoch interruption on; the proposals the
  guest does not need off), the ticker thread that advances the epoch while runs are active,
  and the compiled guest, cached as a ``.cwasm`` keyed by the guest digest, the wasmtime
  version and the engine settings, and loaded with ``Component.deserialize_file`` (~ms, vs
  ~20 s to compile);
* ``runtime``: the per-process runtime, with a small pool of instances made ahead of demand
  on a background thread, so a run pays only for its call. Every instance serves exactly one
  run and is then dropped. Before an instance serves a run, it is *primed*: it runs one
  fixed, trusted job (``PRIMING_JOB``). The first call into a fresh instance spends most of
  its time in page faults into the copy-on-write snapshot and in wasmtime's lazy table
  initialisation, not in Python; priming moves that cost off the request's path when the
  instance comes from the pool. Every instance is primed the same way, pooled or made
  inline, so fuel stays deterministic, and no user code ever ran in it;
* ``run``: one run's host-side state (its bounded output, its clocks and its entropy, its
  host-call channel, the journal tape of what it was handed) and the call into the guest;
* ``host``: the host functions the guest imports. ``wasi:clocks/*`` and
  ``wasi:random/random`` are defined there in full, shadowing wasmtime's own, so a guest sees
  only the virtual clock and seeded entropy unless the policy grants the real ones, and so no
  WASI call can block past the deadline. The host-call channel (host functions and mediated
  HTTP) is wired there too; its checks and policy live in ``capabilities/hostcall.py`` and
  ``capabilities/http.py``, shared by every backend;
* ``compiler``: each Sandbox's programs, compiled once in a long-lived instance and kept;
* ``traps``: Wasmtime's own errors converted to wasibox results, in one place (``classify``);
* ``backend``: ``WasmBackend``, the seam (``backends/base.py``) for Wasmtime, and its
  sessions;
* ``native/``, ``slots``, ``stack``: the native run path's C extension, memory-slot reuse,
  and running guests on a native stack deep enough for Wasmtime's stack limit.

Two run paths give the same behaviour: the *native* one (the default where it can be built)
makes the guest call and serves the host functions every run uses in C, with the GIL
released (``native/``); the *Python* one does both through wasmtime-py. Files, host
functions and HTTP are Python on both. ``WASIBOX_RUN_PATH`` or ``WasmBackend(run_path=...)``
choose. Memory slots are reused between instances where that is verified safe (``slots``).
"""
