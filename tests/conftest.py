"""Test-wide setup: 8 fake CPU devices for the multi-device tests, reproducible Hypothesis examples, and the
`jetstream` marker.

XLA reads the flag once, when jax first initialises a backend, so it must be
set here, before any test module imports jax. Single-device tests keep working:
unplaced arrays live on device 0.
"""

import os

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # hypothesis is in the test extras; without it only its tests fail
    _hypothesis_settings = None

# Hypothesis: the same examples on every run and machine (derandomize: drawn from each test's source), so a
# failure in CI reproduces locally with the same command; no example database (nothing written to .hypothesis/).
# HYPOTHESIS_PROFILE=explore draws fresh random examples and keeps failing ones in .hypothesis/ (git-ignored).
if _hypothesis_settings is not None:
    _hypothesis_settings.register_profile("repro", derandomize=True, database=None, print_blob=True)
    _hypothesis_settings.register_profile("explore", print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repro"))

# A test that needs the `jetstream` extra says so in its skipif reason (all do: "google-jetstream is not
# installed (pip install -e '.[jetstream]')"). It gets the `jetstream` marker, so .ci/run's Python 3.11 leg, the
# only one that installs the extra, selects them with `-m "not slow or jetstream"` (tests/test_install.py checks
# that every test file using jetstream_backend's availability check is selected).
JETSTREAM_REASON = "jetstream"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(JETSTREAM_REASON in str(mark.kwargs.get("reason", "")).lower()
               for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.jetstream)
