"""``attention``: the one entry point models call; picks an implementation.

impl:
  * "pallas": ``flash_attention`` (interpret mode on CPU, Triton on GPU).
  * "xla":    ``mha_reference`` (plain jnp, XLA fuses it).
  * "cudnn":  ``jax.nn.dot_product_attention(implementation="cudnn")`` on GPU.

A request a backend cannot serve falls back to "xla" and logs why (logger
``ulorl_jax.kernels.dispatch``, WARNING) rather than returning something
silently different. Checks run at trace time, so under ``jax.jit`` the message
appears once per compilation, not once per step.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .flash_attention import SUPPORTED_DTYPES, flash_attention
from .reference import mha_reference

__all__ = ["attention", "IMPLS"]

IMPLS = ("pallas", "xla", "cudnn")
logger = logging.getLogger(__name__)

# Untested beyond this on GPU (register pressure of the [block, D] tiles).
_PALLAS_MAX_HEAD_DIM = 256


def _shape_problem(q, k, v, causal, segment_ids) -> str | None:
    """Reason the inputs break the attention contract itself (both impls)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"expected [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}"
    if q.shape[2] % k.shape[2]:
        return f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}"
    if causal and q.shape[1] != k.shape[1]:
        return f"causal needs equal q / kv lengths, got {q.shape[1]} and {k.shape[1]}"
    return None


def _pallas_problem(q, k, v, causal, segment_ids) -> str | None:
    """Reason ``flash_attention`` cannot serve this call, or None."""
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        return (f"no Pallas attention kernel for backend {backend!r} "
                "(GPU/Triton and CPU interpret only)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return ("kernel needs k.shape == v.shape and matching batch / head_dim: "
                f"{q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"kernel needs one dtype in f32/bf16/f16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if segment_ids is not None:
        if q.shape[1] != k.shape[1]:
            return "segment_ids with different q / kv lengths"
        if segment_ids.shape != q.shape[:2]:
            return f"segment_ids shape {segment_ids.shape} != {q.shape[:2]}"
    if backend == "gpu" and q.shape[3] > _PALLAS_MAX_HEAD_DIM:
        return f"head_dim {q.shape[3]} > {_PALLAS_MAX_HEAD_DIM}"
    return None


def _cudnn_problem(q, k, v, causal, segment_ids) -> str | None:
    backend = jax.default_backend()
    if backend != "gpu":
        return f"cuDNN attention needs a GPU, default backend is {backend!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bf16 / f16, got {q.dtype}"
    if segment_ids is not None:
        return "segment_ids are not wired to the cuDNN path"
    return None


def _fallback(impl: str, reason: str) -> None:
    logger.warning("attention impl=%r falls back to 'xla': %s", impl, reason)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    impl: str = "pallas",
    sm_scale: float | None = None,
) -> jax.Array:
    """Multi-head / grouped-query attention.

    Args:
      q: [batch, seq_q, heads, head_dim].
      k, v: [batch, seq_kv, kv_heads, head_dim]; heads % kv_heads == 0 (GQA).
      causal: key index <= query index.
      segment_ids: [batch, seq] int32; attend only within equal ids (packing).
      impl: one of "pallas", "xla", "cudnn" (see module docstring).
      sm_scale: logit scale, default 1 / sqrt(head_dim).

    Returns:
      [batch, seq_q, heads, head_dim] in q.dtype; rows with no allowed key
      are 0.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; allowed: {IMPLS}")
    problem = _shape_problem(q, k, v, causal, segment_ids)
    if problem is not None:
        raise ValueError(problem)
    xla = lambda: mha_reference(  # noqa: E731
        q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
    if impl == "xla":
        return xla()

    if impl == "cudnn":
        reason = _cudnn_problem(q, k, v, causal, segment_ids)
        if reason is None:
            try:
                return jax.nn.dot_product_attention(
                    q, k, v, scale=sm_scale, is_causal=causal, implementation="cudnn")
            except (NotImplementedError, ValueError, RuntimeError) as err:
                reason = f"jax.nn.dot_product_attention(cudnn) refused: {err}"
        _fallback(impl, reason)
        return xla()

    reason = _pallas_problem(q, k, v, causal, segment_ids)
    if reason is not None:
        _fallback(impl, reason)
        return xla()
    return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                           sm_scale=sm_scale)
