"""Paged flash-decoding: one query token per slot against a paged KV cache.

q [B, Hq, D]; k_pages / v_pages [P, page_size, Hkv, D], one pool of pages
shared by every slot; page_table [B, W] int32; lengths [B]. Slot b's logical
position p lives at row p % page_size of page page_table[b, p // page_size],
and its query attends to positions 0 .. lengths[b] - 1 (semantics of
``reference.paged_decode_attention_reference``: the dense kernel's, on the
slot's pages gathered in table order). Table entries from
ceil(lengths[b] / page_size) on may hold anything, e.g. P as "no page": they
are never visited, and every id the kernel does read is clamped into
[0, P) before it indexes the pool. Rows of the slot's last page past its
length may hold anything too (a recycled page's old K/V, even NaN): they are
masked out of both the logits and V.

Same scheme as the dense kernel (``decode_attention.py``): grid
(B, Hkv, num_splits); each program takes the G = Hq / Hkv query heads of one
kv head (one [G, D] tile, so each page's K/V is read once per group), walks
its share of the slot's table one page at a time (page id loaded from the
table inside the kernel, the page read from the pool with a dynamic index:
Pallas Triton has no scalar prefetch), stops at the slot's last page, and
writes a partial output and its log-sum-exp; the dense kernel's jnp combine
merges the splits. The pool is never gathered or copied into a dense cache.

Shapes the kernel sees are powers of two with every dot dim >= 16 (Triton):
the query group is zero-padded to max(16, next_pow2(G)), the head dim to
max(16, next_pow2(D)), the page to max(16, next_pow2(page_size)) rows
(padded rows masked). Padding the head dim or the page copies the whole pool
on every call: allocate pools with both already powers of two >= 16. The
Triton lowering addresses the pool with int32 offsets, so one pool must hold
fewer than 2**31 elements (P * page_size * Hkv * D).

Verification status: tested on CPU with ``interpret=True`` only, against the
jnp reference. The GPU (Pallas Triton) lowering is exported for CUDA and its
Triton modules pass MLIR's verifier in tests/kernel_tests/
test_kernels_cuda_lowering.py, but it has NOT been compiled to PTX or run on a
GPU, and the GPU defaults (num_splits, num_warps, num_stages) are untuned
guesses. Forward only (inference); not differentiable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .decode_attention import _combine
from .flash_attention import NEG_INF, SUPPORTED_DTYPES, _dot_nn, _dot_nt

__all__ = ["paged_decode_attention", "default_paged_decode_params"]

_MIN_DIM = 16


def default_paged_decode_params(backend: str | None = None) -> dict[str, int]:
    """Tuning knobs per backend; GPU values are untuned guesses."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        return dict(num_splits=8, num_warps=4, num_stages=2)
    return dict(num_splits=2, num_warps=4, num_stages=2)


def _paged_decode_kernel(
    len_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
    sm_scale: float, page_size: int, pages_per_split: int, num_pages: int,
):
    split = pl.program_id(2)
    length = len_ref[()]  # scalar int32
    q = q_ref[...]  # [Gp, Dp]: the query heads of one kv head
    rows = k_ref.shape[1]  # page_size padded to a power of two >= 16
    row = jnp.arange(rows, dtype=jnp.int32)

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [Gp, Dp] f32, [Gp], [Gp]
        # Clamped: a corrupt id can only read a wrong page of this pool, never outside it.
        page = jnp.clip(table_ref[j], 0, num_pages - 1)
        valid = (row < page_size) & (j * page_size + row < length)  # [rows]
        k = k_ref[page]  # [rows, Dp]
        # Rows past the length (stale data of the page's last owner) must not reach p @ v, even as 0 * NaN.
        v = jnp.where(jnp.broadcast_to(valid[:, None], v_ref.shape[1:]), v_ref[page], 0)  # [rows, Dp]
        s = _dot_nt(q, k) * sm_scale  # 'gd,kd->gk' [Gp, rows] f32
        mask = jnp.broadcast_to(valid[None, :], s.shape)
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [Gp, rows]
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)  # 'gk,kd->gd'
        return acc, m_new, l_new

    # This split owns table entries [first, last); stop at the slot's last page.
    n_table = table_ref.shape[0]
    first = split * pages_per_split
    last = jnp.minimum((split + 1) * pages_per_split, n_table)
    last = jnp.minimum(last, lax.div(length + page_size - 1, page_size))
    last = jnp.maximum(last, first)
    gp, dp = q.shape
    init = (
        jnp.zeros((gp, dp), jnp.float32),
        jnp.full((gp,), NEG_INF, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, last, body, init)
    empty = l == 0.0  # nothing valid in this split: weight 0 in the combine
    o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


@functools.partial(
    jax.jit,
    static_argnames=("num_splits", "num_warps", "num_stages", "sm_scale", "interpret"),
)
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Split-KV decode attention over a paged KV cache, with GQA.

    Args:
      q: [B, Hq, D] queries of the current token.
      k_pages, v_pages: [P, page_size, Hkv, D], Hq % Hkv == 0, same dtype as q.
      page_table: [B, W] int, slot b's pages in position order; entries past
        its last page are ignored (any value).
      lengths: [B] int, positions each slot attends to (clipped to
        [0, W * page_size]; length 0 gives output 0).
      sm_scale: logit scale, default 1 / sqrt(D).
      num_splits: parallel chunks of the page table (capped at W).
      num_warps, num_stages: Triton launch parameters (GPU only).
      interpret: run the Pallas interpreter; None means "on CPU".

    Returns:
      [B, Hq, D] in q.dtype.
    """
    b, hq, d = q.shape
    n_pages, page_size, hkv, d2 = k_pages.shape
    if v_pages.shape != k_pages.shape or d2 != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k_pages {k_pages.shape}, "
                         f"v_pages {v_pages.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_table must be [B, W] and lengths [B] with B={b}, got "
                         f"{page_table.shape}, {lengths.shape}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q/k/v dtypes must match and be f32/bf16/f16, got "
                         f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    defaults = default_paged_decode_params()
    num_splits = defaults["num_splits"] if num_splits is None else num_splits
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")

    width = page_table.shape[1]
    g = hq // hkv
    gp = max(_MIN_DIM, pl.next_power_of_2(g))
    dp = max(_MIN_DIM, pl.next_power_of_2(d))
    rows = max(_MIN_DIM, pl.next_power_of_2(page_size))
    num_splits = min(num_splits, width)
    pages_per_split = -(-width // num_splits)
    scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)

    # [B, Hq, D] -> [B, Hkv, G, D] is a free reshape (head h = kv_head * G + g).
    qg = q.reshape(b, hkv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))  # [B, Hkv, Gp, Dp]
    kp, vp = k_pages, v_pages
    if rows != page_size or dp != d:  # copies the pool (see the module docstring)
        pad = ((0, 0), (0, rows - page_size), (0, 0), (0, dp - d))
        kp, vp = jnp.pad(kp, pad), jnp.pad(vp, pad)
    table = page_table.astype(jnp.int32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, width * page_size)

    # Each program sees its kv head of the whole pool and its slot's table row.
    pool_spec = pl.BlockSpec((n_pages, rows, None, dp), lambda bi, h, sp: (0, 0, h, 0))
    o_part, lse_part = pl.pallas_call(
        functools.partial(
            _paged_decode_kernel, sm_scale=scale, page_size=page_size,
            pages_per_split=pages_per_split, num_pages=n_pages,
        ),
        grid=(b, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, h, sp: (bi,)),  # lengths [B] -> scalar
            pl.BlockSpec((None, width), lambda bi, h, sp: (bi, 0)),  # page_table row
            pl.BlockSpec((None, None, gp, dp), lambda bi, h, sp: (bi, h, 0, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, dp), lambda bi, h, sp: (bi, h, sp, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, sp: (bi, h, sp, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=bool(interpret),
        name="paged_decode_attention_split_kv",
    )(lengths, table, qg, kp, vp)

    o = _combine(o_part, lse_part)  # [B, Hkv, Gp, Dp] f32
    return o[:, :, :g, :d].reshape(b, hq, d).astype(q.dtype)
