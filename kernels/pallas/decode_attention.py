"""Flash-decoding: one query token per sequence against a long KV cache.

q [B, Hq, D], k_cache / v_cache [B, S, Hkv, D], lengths [B]: sequence b
attends to cache entries 0 .. lengths[b] - 1 (semantics of
``reference.decode_attention_reference``). Optional segment ids
(``q_segment_ids`` [B], ``kv_segment_ids`` [B, S]) further restrict it to
entries of its own segment: that is how a left-padded prompt's padding
(segment 0 in the model's KV cache) stays invisible to the real tokens.

A single query row gives too little parallelism per (batch, head), so the KV
axis is split into ``num_splits`` chunks handled by independent programs
(grid (B, Hkv, num_splits)). Each program computes, for the G = Hq / Hkv query
heads that share its kv head (one [G, D] tile, so K/V are read once per
group), a partial softmax-weighted output and its log-sum-exp over its chunk,
visiting only the k blocks below lengths[b]. A jnp log-sum-exp combine merges
the chunks.

Shapes the kernel sees are powers of two (Triton requirement) with every dot
dim >= 16: the query group is zero-padded to max(16, next_pow2(G)) rows, the
head dim to max(16, next_pow2(D)). If S is not a multiple of block_k the cache
is padded, which copies it: allocate caches in multiples of block_k.

Verification status: tested on CPU with ``interpret=True`` only; the GPU
(Pallas Triton) lowering has NOT been compiled or run in this session, and the
GPU defaults (block_k, num_splits, num_warps) are untuned guesses. Forward
only (inference); not differentiable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash_attention import NEG_INF, SUPPORTED_DTYPES, _dot_nn, _dot_nt

__all__ = ["decode_attention", "default_decode_params"]

_MIN_DIM = 16


def default_decode_params(backend: str | None = None) -> dict[str, int]:
    """(num_splits, block_k) per backend; GPU values are untuned guesses."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        return dict(num_splits=16, block_k=64)
    return dict(num_splits=4, block_k=32)


def _decode_kernel(
    *refs, sm_scale: float, block_k: int, blocks_per_split: int, n_blocks: int,
    has_segments: bool,
):
    if has_segments:
        len_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref = refs
    else:
        len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        qseg_ref = kseg_ref = None
    split = pl.program_id(2)
    length = len_ref[()]  # scalar int32
    q = q_ref[...]  # [Gp, D]: the query heads of one kv head

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [Gp, D] f32, [Gp], [Gp]
        ks = pl.ds(j * block_k, block_k)
        k = k_ref[ks, :]  # [bk, D]
        v = v_ref[ks, :]  # [bk, D]
        s = _dot_nt(q, k) * sm_scale  # 'gd,kd->gk' [Gp, bk] f32
        valid = (j * block_k + jnp.arange(block_k)) < length  # [bk]
        if has_segments:
            valid = valid & (kseg_ref[ks] == qseg_ref[()])  # own segment only
        mask = jnp.broadcast_to(valid[None, :], s.shape)
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [Gp, bk]
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)  # 'gk,kd->gd'
        return acc, m_new, l_new

    # This split owns k blocks [first, last); stop at the sequence length.
    first = split * blocks_per_split
    last = jnp.minimum((split + 1) * blocks_per_split, n_blocks)
    last = jnp.minimum(last, lax.div(length + block_k - 1, block_k))
    last = jnp.maximum(last, first)
    gp, d = q.shape
    init = (
        jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), NEG_INF, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, last, body, init)
    empty = l == 0.0  # nothing valid in this chunk: weight 0 in the combine
    o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _combine(o_part: jax.Array, lse_part: jax.Array) -> jax.Array:
    """Merge chunk results: o_part [B, H, N, G, D], lse_part [B, H, N, G]."""
    lse_max = jnp.max(lse_part, axis=2, keepdims=True)  # [B, H, 1, G]
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)  # all-empty rows
    w = jnp.exp(lse_part - lse_max)  # [B, H, N, G]; empty chunks -> 0
    denom = jnp.sum(w, axis=2)  # [B, H, G]
    o = jnp.einsum("bhng,bhngd->bhgd", w, o_part)  # [B, H, G, D]
    return o / jnp.where(denom == 0.0, 1.0, denom)[..., None]


@functools.partial(
    jax.jit, static_argnames=("num_splits", "block_k", "sm_scale", "interpret")
)
def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    num_splits: int | None = None,
    block_k: int | None = None,
    sm_scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Split-KV decode attention (flash-decoding) with GQA.

    Args:
      q: [B, Hq, D] queries of the current token.
      k_cache, v_cache: [B, S, Hkv, D], Hq % Hkv == 0, same dtype as q.
      lengths: [B] int, valid cache entries per sequence (clipped to [0, S];
        length 0 gives output 0).
      q_segment_ids, kv_segment_ids: optional [B] / [B, S] int (both or
        neither): entry s is visible only if kv_segment_ids[b, s] ==
        q_segment_ids[b]. A query with no visible entry outputs 0.
      num_splits: parallel chunks of the KV axis (capped at S / block_k).
      block_k: keys per inner step, a power of two >= 16.
      sm_scale: logit scale, default 1 / sqrt(D).
      interpret: run the Pallas interpreter; None means "on CPU".

    Returns:
      [B, Hq, D] in q.dtype.
    """
    b, hq, d = q.shape
    b2, s_len, hkv, d2 = k_cache.shape
    if v_cache.shape != k_cache.shape or b2 != b or d2 != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k_cache.shape}, "
                         f"v {v_cache.shape}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q/k/v dtypes must match and be f32/bf16/f16, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    has_segments = q_segment_ids is not None
    if has_segments != (kv_segment_ids is not None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if has_segments and (q_segment_ids.shape != (b,) or kv_segment_ids.shape != (b, s_len)):
        raise ValueError(f"segment ids must be q [B]={(b,)} and kv [B, S]={(b, s_len)}, got "
                         f"{q_segment_ids.shape}, {kv_segment_ids.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    defaults = default_decode_params()
    block_k = defaults["block_k"] if block_k is None else block_k
    num_splits = defaults["num_splits"] if num_splits is None else num_splits
    if block_k < _MIN_DIM or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= {_MIN_DIM}")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    block_k = min(block_k, max(_MIN_DIM, pl.next_power_of_2(s_len)))

    g = hq // hkv
    gp = max(_MIN_DIM, pl.next_power_of_2(g))
    dp = max(_MIN_DIM, pl.next_power_of_2(d))
    s_p = -(-s_len // block_k) * block_k
    n_blocks = s_p // block_k
    num_splits = min(num_splits, n_blocks)
    blocks_per_split = -(-n_blocks // num_splits)
    scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)

    # [B, Hq, D] -> [B, Hkv, G, D] is a free reshape (head h = kv_head * G + g).
    qg = q.reshape(b, hkv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))  # [B, Hkv, Gp, Dp]
    kc, vc = k_cache, v_cache
    if s_p != s_len or dp != d:
        pad = ((0, 0), (0, s_p - s_len), (0, 0), (0, dp - d))
        kc, vc = jnp.pad(kc, pad), jnp.pad(vc, pad)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, s_len)

    kv_spec = pl.BlockSpec((None, s_p, None, dp), lambda bi, h, sp: (bi, 0, h, 0))
    row_spec = pl.BlockSpec((None,), lambda bi, h, sp: (bi,))  # [B] -> scalar
    in_specs = [
        row_spec,  # lengths
        pl.BlockSpec((None, None, gp, dp), lambda bi, h, sp: (bi, h, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    args = [lengths, qg, kc, vc]
    if has_segments:
        kseg = kv_segment_ids.astype(jnp.int32)
        if s_p != s_len:
            kseg = jnp.pad(kseg, ((0, 0), (0, s_p - s_len)))  # past every length anyway
        in_specs += [row_spec, pl.BlockSpec((None, s_p), lambda bi, h, sp: (bi, 0))]
        args += [q_segment_ids.astype(jnp.int32), kseg]
    o_part, lse_part = pl.pallas_call(
        functools.partial(
            _decode_kernel, sm_scale=scale, block_k=block_k,
            blocks_per_split=blocks_per_split, n_blocks=n_blocks,
            has_segments=has_segments,
        ),
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, dp), lambda bi, h, sp: (bi, h, sp, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, sp: (bi, h, sp, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=bool(interpret),
        name="decode_attention_split_kv",
    )(*args)

    o = _combine(o_part, lse_part)  # [B, Hkv, Gp, Dp] f32
    return o[:, :, :g, :d].reshape(b, hq, d).astype(q.dtype)
