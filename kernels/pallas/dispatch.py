"""``attention``: the one entry point models call; picks an implementation.

impl:
  * "pallas": ``flash_attention`` (interpret mode on CPU, Triton on GPU);
              on TPU JAX's splash attention (``tpu.splash_attention``).
  * "xla":    ``mha_reference`` (plain jnp, XLA fuses it).
  * "cudnn":  ``jax.nn.dot_product_attention(implementation="cudnn")`` on GPU.

A request a backend cannot serve falls back to "xla" and logs why (logger
``ulorl_jax.kernels.dispatch``, WARNING) rather than returning something
silently different. Checks run at trace time, so under ``jax.jit`` the message
appears once per compilation, not once per step.

``decode`` does the same for one query token per sequence against a KV
cache: "pallas" is ``decode_attention`` (split-KV) on CPU / GPU; on TPU there
is no decode kernel yet and it falls back to "xla" with a logged reason.
``paged_decode`` is the same over a paged KV cache (pages of one shared pool,
a page table per slot): "pallas" is ``paged_decode_attention``, "xla"
``paged_decode_attention_reference`` (gathers the pages into a dense cache).

``gmm`` does the same for the MoE grouped matmul: "pallas" is
``grouped_matmul`` on CPU / GPU and megablox ``gmm`` on TPU; "ragged" is
``jax.lax.ragged_dot`` (the reference).

Under a device mesh (jax's mesh context, as ``sharding.mesh_context`` sets
it) the "pallas" kernels run inside ``jax.shard_map``, one call per (batch,
head) shard (``sharded.py``): GSPMD cannot partition a ``pallas_call`` and
would otherwise replicate it. "cudnn" and "xla" are partitioned by XLA.

The platform comes from ``platform.backend()``, which tests replace to check
the TPU routing on CPU.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from ulorl_jax.sharding import context_mesh

from . import platform, sharded, tpu
from .decode_attention import decode_attention
from .flash_attention import SUPPORTED_DTYPES, flash_attention
from .grouped_matmul import grouped_matmul
from .paged_decode_attention import paged_decode_attention
from .reference import (
    decode_attention_reference,
    mha_reference,
    paged_decode_attention_reference,
)

__all__ = ["attention", "IMPLS", "decode", "paged_decode", "gmm", "GMM_IMPLS"]

IMPLS = ("pallas", "xla", "cudnn")
GMM_IMPLS = ("pallas", "ragged")
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
    backend = platform.backend()
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
    backend = platform.backend()
    if backend != "gpu":
        return f"cuDNN attention needs a GPU, default backend is {backend!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bf16 / f16, got {q.dtype}"
    if segment_ids is not None:
        return "segment_ids are not wired to the cuDNN path"
    return None


def _fallback(impl: str, reason: str, what: str = "attention", to: str = "xla") -> None:
    logger.warning("%s impl=%r falls back to %r: %s", what, impl, to, reason)


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

    if platform.backend() == "tpu":
        reason = tpu.splash_problem(q, k, v, causal, segment_ids)
        kernel = lambda q, k, v, seg: tpu.splash_attention(  # noqa: E731
            q, k, v, causal=causal, segment_ids=seg, sm_scale=sm_scale, interpret=platform.interpret_default())
    else:
        reason = _pallas_problem(q, k, v, causal, segment_ids)
        kernel = lambda q, k, v, seg: flash_attention(  # noqa: E731
            q, k, v, causal=causal, segment_ids=seg, sm_scale=sm_scale)
    if reason is not None:
        _fallback(impl, reason)
        return xla()
    mesh = context_mesh()  # a pallas_call is opaque to GSPMD: split it by hand
    if mesh is None:
        return kernel(q, k, v, segment_ids)
    return sharded.shard_attention(kernel, q, k, v, segment_ids, mesh=mesh)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "pallas") -> jax.Array:
    """Grouped matmul, ``jax.lax.ragged_dot`` contract: lhs [M, K] rows sorted by
    group, rhs [G, K, N], group_sizes [G] -> [M, N] in lhs.dtype.

    impl "pallas": ``grouped_matmul`` (CPU interpret / GPU Triton) or megablox
    on TPU; "ragged": ``jax.lax.ragged_dot``. Unsupported cases fall back to
    ragged_dot with a logged reason.
    """
    if impl not in GMM_IMPLS:
        raise ValueError(f"unknown grouped matmul impl {impl!r}; allowed: {GMM_IMPLS}")
    ragged = lambda: jax.lax.ragged_dot(lhs, rhs, group_sizes)  # noqa: E731
    if impl == "ragged":
        return ragged()
    backend = platform.backend()
    if lhs.dtype != rhs.dtype or lhs.dtype not in SUPPORTED_DTYPES:
        reason = f"kernel needs one dtype in f32/bf16/f16 for lhs / rhs, got {lhs.dtype}, {rhs.dtype}"
    elif backend == "tpu":
        return tpu.megablox_gmm(lhs, rhs, group_sizes, interpret=platform.interpret_default())
    elif backend in ("cpu", "gpu"):
        return grouped_matmul(lhs, rhs, group_sizes)
    else:
        reason = f"no Pallas grouped matmul for backend {backend!r}"
    _fallback(impl, reason, what="grouped matmul", to="ragged")
    return ragged()


def decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    impl: str = "pallas",
) -> jax.Array:
    """One query token per sequence against a KV cache (see ``decode_attention``).

    q [B, Hq, D]; caches [B, S, Hkv, D]; lengths [B]; optional q_segment_ids [B]
    and kv_segment_ids [B, S] -> [B, Hq, D]. impl "pallas" or "xla".
    """
    if impl not in ("pallas", "xla"):
        raise ValueError(f"unknown decode attention impl {impl!r}; allowed: ('pallas', 'xla')")
    xla = lambda: decode_attention_reference(  # noqa: E731
        q, k_cache, v_cache, lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    if impl == "xla":
        return xla()
    backend = platform.backend()
    if backend not in ("cpu", "gpu"):
        reason = f"no Pallas decode attention kernel for backend {backend!r} (GPU/Triton and CPU interpret only)"
    elif not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in SUPPORTED_DTYPES:
        reason = f"kernel needs one dtype in f32/bf16/f16, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    elif k_cache.shape != v_cache.shape or k_cache.shape[0] != q.shape[0] or k_cache.shape[3] != q.shape[2]:
        reason = f"kernel needs k.shape == v.shape and matching batch / head_dim: {q.shape}, {k_cache.shape}"
    else:
        kernel = lambda q, k, v, n, q_seg, kv_seg: decode_attention(  # noqa: E731
            q, k, v, n, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
        mesh = context_mesh()  # as for attention(): split the custom call by slot and head
        if mesh is None:
            return kernel(q, k_cache, v_cache, lengths, q_segment_ids, kv_segment_ids)
        return sharded.shard_decode_attention(kernel, q, k_cache, v_cache, lengths, q_segment_ids,
                                              kv_segment_ids, mesh=mesh)
    _fallback(impl, reason, what="decode attention")
    return xla()


def paged_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    impl: str = "pallas",
) -> jax.Array:
    """One query token per slot against a paged KV cache (see ``paged_decode_attention``).

    q [B, Hq, D]; pools [P, page_size, Hkv, D]; page_table [B, W]; lengths [B] -> [B, Hq, D].
    impl "pallas" or "xla". Under a mesh the pools are split over kv heads only (replicated over the
    slot axes), q / page_table / lengths over the slot axes.
    """
    if impl not in ("pallas", "xla"):
        raise ValueError(f"unknown paged decode attention impl {impl!r}; allowed: ('pallas', 'xla')")
    xla = lambda: paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths)  # noqa: E731
    if impl == "xla":
        return xla()
    backend = platform.backend()
    if backend not in ("cpu", "gpu"):
        reason = (f"no Pallas paged decode attention kernel for backend {backend!r} "
                  "(GPU/Triton and CPU interpret only)")
    elif not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in SUPPORTED_DTYPES:
        reason = f"kernel needs one dtype in f32/bf16/f16, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
    elif (k_pages.shape != v_pages.shape or k_pages.shape[3] != q.shape[2]
          or page_table.shape[0] != q.shape[0] or lengths.shape != q.shape[:1]):
        reason = (f"kernel needs k_pages.shape == v_pages.shape, matching head_dim and one page-table row and "
                  f"length per slot: q {q.shape}, pages {k_pages.shape}, table {page_table.shape}, "
                  f"lengths {lengths.shape}")
    else:
        mesh = context_mesh()  # as for decode(): split the custom call by slot and head
        if mesh is None:
            return paged_decode_attention(q, k_pages, v_pages, page_table, lengths)
        return sharded.shard_paged_decode_attention(paged_decode_attention, q, k_pages, v_pages, page_table,
                                                    lengths, mesh=mesh)
    _fallback(impl, reason, what="paged decode attention")
    return xla()
