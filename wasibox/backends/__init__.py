"""Engines behind the Sandbox: ``base.Backend`` is the seam, ``wasm`` the default engine."""
