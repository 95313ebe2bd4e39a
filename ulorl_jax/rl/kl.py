"""KL estimators between the policy and a reference policy, per token: verl's `kl_penalty`
(`verl/trainer/ppo/core_algos.py`), by verl's names (`actor.kl_loss_type`, `algorithm.kl_penalty`).

With d = log π − log π_ref per sampled token:
  k1 / kl:          d
  abs:              |d|
  k2 / mse:         ½ d²
  k3 / low_var_kl:  exp(−d) + d − 1, with −d clamped to [−20, 20] and the result to [−10, 10]
and the straight-through forms `k1+`, `kl+`, `abs+`, `k3+`, `low_var_kl+`: the value of the estimator, the
gradient of k2 (k1's and k3's expected gradients are not the gradient of the KL; k2's is). `k2+` / `mse+`
are k2. Pure jnp, jit-safe with `kind` bound.

Not wired into the learner yet: the frozen reference model (`use_kl_loss`, `use_kl_in_reward`) is to come.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["KL_TYPES", "kl_penalty"]

_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_TYPES = _BASE + tuple(f"{k}+" for k in _BASE)


def _forward(d: jnp.ndarray, base: str) -> jnp.ndarray:
    if base in ("kl", "k1"):
        return d
    if base == "abs":
        return jnp.abs(d)
    if base in ("mse", "k2"):
        return 0.5 * d * d
    neg = jnp.clip(-d, -20.0, 20.0)  # low_var_kl / k3: log(π_ref / π)
    return jnp.clip(jnp.exp(neg) - neg - 1.0, -10.0, 10.0)


def kl_penalty(logprobs: jnp.ndarray, ref_logprobs: jnp.ndarray, kind: str = "low_var_kl") -> jnp.ndarray:
    """Per-token KL estimate of `kind` (KL_TYPES); differentiable in `logprobs`, `ref_logprobs` a constant."""
    if kind not in KL_TYPES:
        raise ValueError(f"kl type {kind!r} is not one of {KL_TYPES}")
    d = logprobs.astype(jnp.float32) - jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32))
    base = kind.removesuffix("+")
    value = _forward(d, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    backward = 0.5 * d * d  # straight-through: k2's gradient, the estimator's value
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(value)
