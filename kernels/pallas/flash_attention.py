"""FlashAttention-2 forward + backward as Pallas kernels (causal, GQA, segments).

Layout: q [B, Tq, Hq, D], k / v [B, Tk, Hkv, D], Hq % Hkv == 0; query head h
reads kv head h // G with G = Hq // Hkv. Masking semantics are those of
``reference.mha_reference``, which the tests compare against forward and
backward.

Kernels (all written against the Pallas GPU/Triton programming model: a grid
of programs, BlockSpecs, ``pl.program_id``, ref indexing with ``pl.ds``,
``lax.fori_loop`` with data-dependent bounds, f32 accumulation):

  * forward   grid (B, Hq, Tq/bq): one q block, online softmax over k blocks;
              writes o and the per-row log-sum-exp (lse) only.
  * dq        grid (B, Hq, Tq/bq): recomputes p = exp(s - lse), loops k blocks.
  * dk / dv   grid (B, Hkv, Tk/bk): one k/v block, loops over q blocks and
              over the G query heads sharing this kv head, so GQA gradients
              are summed in registers and never materialised per q head.
  * delta = rowsum(o * do) (the FA-2 "preprocess") is one fused jnp op.

GQA never repeats K/V in memory: the kv head is picked in the BlockSpec
index_map from the q head. Causal programs skip fully masked blocks through
their loop bounds. Sequence lengths that are not block multiples are padded
here (padded keys masked, outputs sliced); the head dim is zero-padded to a
power of two >= 16 (Triton tensor shapes must be powers of two and tl.dot
needs dims >= 16), which changes no result.

Verification status: every test runs on CPU with ``interpret=True``. The GPU
(Pallas Triton) lowering of this source has NOT been compiled or run in this
session (no GPU was available); the GPU default block sizes / num_warps are
untuned guesses. On GPU, f32 inputs use IEEE f32 dots (Precision.HIGHEST);
bf16 / f16 use the native dot with f32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["flash_attention", "default_block_sizes", "SUPPORTED_DTYPES"]

# Finite stand-in for -inf on masked logits: exp(NEG_INF - m) == 0 without the
# inf - inf = nan of a true -inf when a whole block is masked.
NEG_INF = -1e30
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_MIN_BLOCK = 16  # tl.dot needs every matmul dim >= 16


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) kernel configuration; lengths are the unpadded ones."""

    sm_scale: float
    causal: bool
    has_segments: bool
    q_len: int
    kv_len: int
    q_len_padded: int
    kv_len_padded: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    interpret: bool

    @property
    def kv_mask_needed(self) -> bool:
        # Causal already hides padded keys from every real query (they sit
        # after it), and padded query rows are sliced away and get do = 0.
        return (not self.causal) and self.kv_len_padded != self.kv_len


def default_block_sizes(backend: str | None = None) -> dict[str, int]:
    """Block sizes per backend: small on CPU (interpret mode), larger on GPU.

    GPU values are untuned starting points (not measured in this session).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        return dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64)
    return dict(block_q=32, block_k=32, block_q_bwd=32, block_k_bwd=32)


def _compiler_params(block_a: int, block_b: int) -> plgpu.CompilerParams:
    # Ignored in interpret mode; kept so the same call lowers on Triton.
    return plgpu.CompilerParams(
        num_warps=4 if block_a * block_b < 128 * 128 else 8, num_stages=2
    )


def _precision(dtype) -> lax.Precision:
    # Triton maps DEFAULT f32 dots to TF32; f32 callers get true f32 instead.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T with f32 accumulation: [M, K] x [N, K] -> [M, N]."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())),
        precision=_precision(a.dtype), preferred_element_type=jnp.float32,
    )


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with f32 accumulation: [M, K] x [K, N] -> [M, N]."""
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())),
        precision=_precision(a.dtype), preferred_element_type=jnp.float32,
    )


def _dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a.T @ b with f32 accumulation: [K, M] x [K, N] -> [M, N]."""
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())),
        precision=_precision(a.dtype), preferred_element_type=jnp.float32,
    )


def _block_mask(
    cfg: _Config,
    q_idx: jax.Array,
    k_idx: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
) -> jax.Array | None:
    """[bq, bk] bool of allowed (query, key) pairs, or None if all allowed."""
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if cfg.causal:
        mask = q_idx[:, None] >= k_idx[None, :]
    if cfg.kv_mask_needed:
        mask = _and(mask, jnp.broadcast_to((k_idx < cfg.kv_len)[None, :],
                                           (q_idx.shape[0], k_idx.shape[0])))
    if q_seg is not None:
        mask = _and(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _causal_k_blocks(cfg: _Config, q_block: jax.Array, bq: int, bk: int, nk: int):
    """Number of k blocks a q block must visit (causal: up to its diagonal)."""
    if not cfg.causal:
        return nk
    return jnp.minimum(lax.div((q_block + 1) * bq + bk - 1, bk), nk)


# --------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------
def _fwd_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        qseg_ref = kseg_ref = None
    bq, bk = cfg.block_q, cfg.block_k
    nk = cfg.kv_len_padded // bk
    i = pl.program_id(2)

    q = q_ref[...]  # [bq, D]
    q_idx = i * bq + jnp.arange(bq)  # [bq]
    q_seg = None if qseg_ref is None else qseg_ref[...]  # [bq]

    def body(j, carry):
        acc, m_prev, l_prev = carry  # [bq, D] f32, [bq], [bq]
        ks = pl.ds(j * bk, bk)
        k = k_ref[ks, :]  # [bk, D]
        v = v_ref[ks, :]  # [bk, D]
        s = _dot_nt(q, k) * cfg.sm_scale  # 'qd,kd->qk' [bq, bk] f32
        k_seg = None if kseg_ref is None else kseg_ref[ks]
        mask = _block_mask(cfg, q_idx, j * bk + jnp.arange(bk), q_seg, k_seg)
        if mask is not None:
            s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [bq]
        alpha = jnp.exp(m_prev - m_new)  # rescales the old partial sums
        p = jnp.exp(s - m_new[:, None])  # [bq, bk]
        if mask is not None:
            p = jnp.where(mask, p, 0.0)  # a fully masked row has m_new = NEG_INF
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)  # 'qk,kd->qd'
        return acc, m_new, l_new

    d = q.shape[-1]
    init = (
        jnp.zeros((bq, d), jnp.float32),
        jnp.full((bq,), NEG_INF, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(0, _causal_k_blocks(cfg, i, bq, bk, nk), body, init)
    empty = l == 0.0  # query with no allowed key: output 0, lse = +inf
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _fwd(q, k, v, seg, cfg: _Config):
    """Padded inputs -> (o [B, Tq, Hq, D], lse [B, Hq, Tq] f32)."""
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    g = hq // hkv
    bq, bk = cfg.block_q, cfg.block_k
    grid = (b, hq, tq // bq)
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
        pl.BlockSpec((None, tk, None, d), lambda bi, h, i: (bi, 0, lax.div(h, g), 0)),
        pl.BlockSpec((None, tk, None, d), lambda bi, h, i: (bi, 0, lax.div(h, g), 0)),
    ]
    args = [q, k, v]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq), lambda bi, h, i: (bi, i)),
            pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0)),
        ]
        args += [seg, seg]
    out_specs = [
        pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((b, hq, tq), jnp.float32),
    ]
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(bq, bk),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)
    return o, lse


# --------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------
def _dq_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
        qseg_ref = kseg_ref = None
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    nk = cfg.kv_len_padded // bk
    i = pl.program_id(2)

    q = q_ref[...]  # [bq, D]
    do = do_ref[...]  # [bq, D]
    lse = lse_ref[...]  # [bq] f32
    delta = delta_ref[...]  # [bq] f32
    q_idx = i * bq + jnp.arange(bq)
    q_seg = None if qseg_ref is None else qseg_ref[...]

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k = k_ref[ks, :]  # [bk, D]
        v = v_ref[ks, :]
        s = _dot_nt(q, k) * cfg.sm_scale  # [bq, bk]
        k_seg = None if kseg_ref is None else kseg_ref[ks]
        mask = _block_mask(cfg, q_idx, j * bk + jnp.arange(bk), q_seg, k_seg)
        if mask is not None:
            s = jnp.where(mask, s, NEG_INF)
        p = jnp.exp(s - lse[:, None])  # [bq, bk]; empty rows: lse = inf -> 0
        dp = _dot_nt(do, v)  # 'qd,kd->qk' [bq, bk]
        ds = p * (dp - delta[:, None]) * cfg.sm_scale  # dL/ds * scale
        return dq + _dot_nn(ds.astype(k.dtype), k)  # 'qk,kd->qd' [bq, D]

    dq = lax.fori_loop(
        0, _causal_k_blocks(cfg, i, bq, bk, nk), body,
        jnp.zeros(q.shape, jnp.float32),
    )
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, group: int):
    if cfg.has_segments:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref,
         dk_ref, dv_ref) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
        qseg_ref = kseg_ref = None
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    nq = cfg.q_len_padded // bq
    j = pl.program_id(2)

    k = k_ref[...]  # [bk, D]
    v = v_ref[...]  # [bk, D]
    k_idx = j * bk + jnp.arange(bk)
    k_seg = None if kseg_ref is None else kseg_ref[...]

    def q_block(i, carry):
        qs = pl.ds(i * bq, bq)
        q_seg = None if qseg_ref is None else qseg_ref[qs]
        mask = _block_mask(cfg, i * bq + jnp.arange(bq), k_idx, q_seg, k_seg)

        def head(h, carry):  # the G query heads that share this kv head
            dk, dv = carry  # [bk, D] f32 each
            q = q_ref[qs, h, :]  # [bq, D]
            do = do_ref[qs, h, :]  # [bq, D]
            lse = lse_ref[h, qs]  # [bq]
            delta = delta_ref[h, qs]  # [bq]
            s = _dot_nt(q, k) * cfg.sm_scale  # [bq, bk]
            if mask is not None:
                s = jnp.where(mask, s, NEG_INF)
            p = jnp.exp(s - lse[:, None])  # [bq, bk]
            dv = dv + _dot_tn(p.astype(do.dtype), do)  # 'qk,qd->kd' [bk, D]
            dp = _dot_nt(do, v)  # [bq, bk]
            ds = p * (dp - delta[:, None]) * cfg.sm_scale
            dk = dk + _dot_tn(ds.astype(q.dtype), q)  # 'qk,qd->kd' [bk, D]
            return dk, dv

        return lax.fori_loop(0, group, head, carry)

    # Causal: q blocks that end before this k block starts are fully masked.
    lo = lax.div(j * bk, bq) if cfg.causal else 0
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, nq, q_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd(q, k, v, seg, o, lse, do, cfg: _Config):
    """Padded inputs + residuals -> (dq, dk, dv)."""
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    g = hq // hkv
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    # FA-2 preprocess: delta_i = sum_d o_id * do_id, one fused elementwise op.
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32)
    )  # [B, Hq, Tq]
    compiler_params = _compiler_params(bq, bk)

    # dq: one program per (batch, q head, q block), loops over k blocks.
    q_spec = pl.BlockSpec((None, bq, None, d), lambda bi, h, i: (bi, i, h, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda bi, h, i: (bi, 0, lax.div(h, g), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [q, k, v, do, lse, delta]
    if cfg.has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda bi, h, i: (bi, i)),
                     pl.BlockSpec((None, tk), lambda bi, h, i: (bi, 0))]
        args += [seg, seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(b, hq, tq // bq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*args)

    # dk, dv: one program per (batch, kv head, k block); the G q heads of the
    # group are read as one [Tq, G, D] block and summed inside the kernel.
    qg_spec = pl.BlockSpec((None, tq, g, d), lambda bi, h, j: (bi, 0, h, 0))
    k_spec = pl.BlockSpec((None, bk, None, d), lambda bi, h, j: (bi, j, h, 0))
    rowg_spec = pl.BlockSpec((None, g, tq), lambda bi, h, j: (bi, h, 0))
    in_specs = [qg_spec, k_spec, k_spec, qg_spec, rowg_spec, rowg_spec]
    args = [q, k, v, do, lse, delta]
    if cfg.has_segments:
        in_specs += [pl.BlockSpec((None, tq), lambda bi, h, j: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda bi, h, j: (bi, j))]
        args += [seg, seg]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, group=g),
        grid=(b, hkv, tk // bk),
        in_specs=in_specs,
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dkdv",
    )(*args)
    return dq, dk, dv


# --------------------------------------------------------------------------
# custom_vjp on padded arrays; padding / slicing stays outside (plain autodiff)
# --------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_padded(q, k, v, seg, cfg: _Config):
    return _fwd(q, k, v, seg, cfg)[0]


def _flash_padded_fwd(q, k, v, seg, cfg: _Config):
    o, lse = _fwd(q, k, v, seg, cfg)
    return o, (q, k, v, seg, o, lse)  # only o and lse are saved beyond inputs


def _flash_padded_bwd(cfg: _Config, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _bwd(q, k, v, seg, o, lse, do, cfg)
    return dq, dk, dv, None  # segment ids are integers: no cotangent


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _fit_block(block: int, length: int, name: str) -> int:
    if block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two >= {_MIN_BLOCK}")
    # Never pad a short sequence up to a large block.
    return min(block, max(_MIN_BLOCK, pl.next_power_of_2(length)))


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "block_q", "block_k", "block_q_bwd",
                     "block_k_bwd", "interpret"),
)
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Fused attention with a Pallas forward and FlashAttention-2 backward.

    Args:
      q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D], Hq % Hkv == 0, one dtype out
        of float32 / bfloat16 / float16 for all three.
      causal: key index <= query index (needs Tq == Tk).
      segment_ids: [B, T] int32 (needs Tq == Tk); queries attend only to keys
        of the same segment. A query with no allowed key outputs 0.
      sm_scale: logit scale, default 1 / sqrt(D).
      block_q, block_k: forward tile sizes (powers of two >= 16);
      block_q_bwd, block_k_bwd: tiles of the dq and dk/dv kernels. None picks
        ``default_block_sizes()`` for the default backend. Blocks are capped
        at the (power-of-two rounded) sequence length.
      interpret: run the Pallas interpreter; None means "on CPU".

    Returns:
      [B, Tq, Hq, D] in q.dtype. Differentiable in q, k, v (custom VJP).
    """
    b, tq, hq, d = q.shape
    bk_, tk, hkv, dk_ = k.shape
    if k.shape != v.shape or bk_ != b or dk_ != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q/k/v dtypes must match and be one of f32/bf16/f16, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if (causal or segment_ids is not None) and tq != tk:
        raise ValueError(f"causal / segment_ids need Tq == Tk, got {tq}, {tk}")
    if segment_ids is not None and segment_ids.shape != (b, tq):
        raise ValueError(f"segment_ids shape {segment_ids.shape} != {(b, tq)}")

    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    defaults = default_block_sizes()
    pick = lambda given, name: defaults[name] if given is None else given  # noqa: E731
    bq = _fit_block(pick(block_q, "block_q"), tq, "block_q")
    bk = _fit_block(pick(block_k, "block_k"), tk, "block_k")
    bqb = _fit_block(pick(block_q_bwd, "block_q_bwd"), tq, "block_q_bwd")
    bkb = _fit_block(pick(block_k_bwd, "block_k_bwd"), tk, "block_k_bwd")
    tq_p = _round_up(tq, max(bq, bqb))  # powers of two: max == lcm
    tk_p = _round_up(tk, max(bk, bkb))
    d_p = max(_MIN_BLOCK, pl.next_power_of_2(d))

    cfg = _Config(
        sm_scale=float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale),
        causal=causal, has_segments=segment_ids is not None,
        q_len=tq, kv_len=tk, q_len_padded=tq_p, kv_len_padded=tk_p,
        block_q=bq, block_k=bk, block_q_bwd=bqb, block_k_bwd=bkb,
        interpret=bool(interpret),
    )
    # Zero padding: extra head-dim columns change no dot product; padded keys
    # are masked (or causally invisible); padded query rows are sliced off.
    qp = _pad_axis(_pad_axis(q, 3, d_p), 1, tq_p)
    kp = _pad_axis(_pad_axis(k, 3, d_p), 1, tk_p)
    vp = _pad_axis(_pad_axis(v, 3, d_p), 1, tk_p)
    seg = None
    if segment_ids is not None:
        seg = _pad_axis(segment_ids.astype(jnp.int32), 1, max(tq_p, tk_p), value=-1)
    o = _flash_padded(qp, kp, vp, seg, cfg)  # [B, Tq_p, Hq, D_p]
    return o[:, :tq, :, :d]
