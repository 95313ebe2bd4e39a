"""Test-wide setup: 8 fake CPU devices for the multi-device tests.

XLA reads the flag once, when jax first initialises a backend, so it must be
set here, before any test module imports jax. Single-device tests keep working:
unplaced arrays live on device 0.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
