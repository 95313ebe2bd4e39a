"""Which accelerator the dispatchers target, as one function tests can replace.

``backend()`` is the only place ``ulorl_jax.kernels`` asks JAX for the
platform when choosing an implementation, so a CPU test can monkeypatch it
(``monkeypatch.setattr(platform, "backend", lambda: "tpu")``) and check the
TPU routing without a TPU. ``interpret_default()`` asks the *real* platform:
a kernel picked for an injected backend still runs in the Pallas interpreter
when the process actually runs on CPU.
"""

from __future__ import annotations

import jax

__all__ = ["backend", "interpret_default"]


def backend() -> str:
    """Platform used for kernel selection: "cpu", "gpu" or "tpu"."""
    return jax.default_backend()


def interpret_default() -> bool:
    """Run Pallas kernels in interpret mode: true when JAX really runs on CPU."""
    return jax.default_backend() == "cpu"
