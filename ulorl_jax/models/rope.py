"""Rotary position embeddings (RoPE) with optional YaRN scaling.

Matches transformers' `default` and `yarn` rope types: non-interleaved halves
(`rotate_half`), inverse frequencies in float32, and YaRN's attention factor
folded into cos / sin (so it scales both q and k).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): blend interpolated and extrapolated frequencies."""
    factor = float(scaling["factor"])
    original_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations):
        return head_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin attention factor."""
    if scaling:
        return _yarn_inv_freq(head_dim, base, scaling)
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(base) ** exponents)).astype(np.float32), 1.0


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float, dtype):
    """positions [B, T] int -> cos, sin [B, T, head_dim] in `dtype`."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    return (jnp.cos(emb) * attention_factor).astype(dtype), (jnp.sin(emb) * attention_factor).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, H, D]; cos / sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
