"""Grouped matmul (GMM) for MoE experts as Pallas kernels, forward + backward.

Rows of ``lhs`` [M, K] are sorted by group (expert); ``group_sizes`` [G] says
how many consecutive rows each group owns (zeros allowed). Semantics are those
of ``jax.lax.ragged_dot`` (the reference the tests compare against):

    out[rows of g] = lhs[rows of g] @ rhs[g]          rhs [G, K, N], out [M, N]

rows past sum(group_sizes) give 0. Three kernels, all written to the Pallas
GPU/Triton model (grid of programs, ``pl.ds`` slices of whole-array refs,
``lax.fori_loop`` with data-dependent bounds, f32 accumulation, masked
stores) and run with ``interpret=True`` on CPU:

  * ``gmm``      out = lhs @ rhs[g]        grid (visits, N / bn), loop over K.
  * ``gmm`` with transpose_rhs: d_lhs = d_out @ rhs[g]^T, grid (visits, K / bk).
  * ``tgmm``     d_rhs[g] = lhs[rows g]^T @ d_out[rows g], grid (G, K/bk, N/bn),
                 loop over the row tiles of group g only (zero-size group: 0).

Group boundaries need not align with the row tile (megablox-style metadata):
a row tile that straddles groups is *visited* once per group it intersects;
each visit multiplies the whole tile by that group's weights and stores only
its own rows (a masked store), so no two programs write the same row and
nothing is atomically accumulated. A static bound on the number of visits is
ceil(M / bm) + G (one extra visit per group boundary, plus the rows past
sum(group_sizes), which one "zero group" visit writes as 0); unused visit
slots do nothing.

Shapes the kernels see are powers-of-two tiles >= 16 (Triton); M, K and N are
zero-padded to tile multiples here when needed (M padding copies the
activations; K / N padding copies the weights, so on GPU pick dims that are
multiples of the tiles: Qwen3-30B-A3B's 2048 and 768 are).

Verification status: tested on CPU with ``interpret=True`` only. The GPU
(Pallas Triton) lowering has NOT been compiled or run in this session (no
GPU), and the GPU tile defaults are untuned guesses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash_attention import SUPPORTED_DTYPES, _dot_nn, _dot_nt, _dot_tn

__all__ = ["grouped_matmul", "default_gmm_block_sizes", "GroupMetadata", "group_metadata"]

_MIN_BLOCK = 16  # tl.dot needs every matmul dim >= 16


def default_gmm_block_sizes(backend: str | None = None) -> dict[str, int]:
    """Tiles per backend: small on CPU (interpret mode), larger on GPU (untuned)."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        return dict(block_m=64, block_n=128, block_k=64)
    return dict(block_m=16, block_n=32, block_k=32)


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    block_n: int
    block_k: int
    num_groups: int
    rows: int  # unpadded M: group ends are clipped here
    interpret: bool


class GroupMetadata(NamedTuple):
    """Which (row tile, group) pairs the gmm grid visits.

    Groups are numbered 0..G-1 (real), G (rows past sum(group_sizes): output 0)
    and G+1 (empty sentinel for unused visit slots).
    """

    starts: jax.Array  # [G + 2] int32 first row of each group
    ends: jax.Array  # [G + 2] int32 one past its last row
    visit_group: jax.Array  # [V] int32 group of each visit
    visit_tile: jax.Array  # [V] int32 row tile of each visit


def group_metadata(group_sizes: jax.Array, rows: int, rows_padded: int, block_m: int) -> GroupMetadata:
    """Visit lists for ``rows_padded`` rows in tiles of ``block_m``.

    group_sizes [G] (negative sizes count as 0; ends are clipped at ``rows``).
    """
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)  # [G]
    ends = jnp.concatenate([ends, jnp.array([rows_padded, 0], jnp.int32)])  # + zero group, sentinel
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:g]])  # zero group starts at the real end
    starts = jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])  # sentinel [0, 0)
    nonempty = ends > starts
    first = starts // block_m
    tiles = jnp.where(nonempty, (ends - 1) // block_m - first + 1, 0)  # [G + 2]
    visit_end = jnp.cumsum(tiles)
    visit_start = visit_end - tiles
    num_visits = rows_padded // block_m + g  # static bound (see module docstring)
    v = jnp.arange(num_visits, dtype=jnp.int32)
    group = jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32)
    valid = v < visit_end[-1]
    group = jnp.where(valid, jnp.minimum(group, g), g + 1)
    tile = jnp.where(valid, first[group] + v - visit_start[group], 0)
    return GroupMetadata(starts, ends, group, tile.astype(jnp.int32))


def _compiler_params() -> plgpu.CompilerParams:
    # Ignored in interpret mode; kept so the same call lowers on Triton.
    return plgpu.CompilerParams(num_warps=4, num_stages=3)


# --------------------------------------------------------------------------
# gmm: out[rows of g] = lhs[rows of g] @ rhs[g]   (or @ rhs[g]^T)
# --------------------------------------------------------------------------
def _gmm_kernel(vg_ref, vt_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref,
                *, bm: int, bc: int, bo: int, n_contract: int, num_groups: int,
                transpose_rhs: bool):
    """One visit (row tile, group) x one tile of output columns.

    bm: row tile; bc: contraction tile; bo: output column tile.
    """
    v, j = pl.program_id(0), pl.program_id(1)
    group = vg_ref[v]
    tile = vt_ref[v]
    start, end = starts_ref[group], ends_ref[group]
    rows = pl.ds(tile * bm, bm)
    cols = pl.ds(j * bo, bo)
    row_idx = tile * bm + jnp.arange(bm)
    own = (row_idx >= start) & (row_idx < end)  # [bm] rows this visit writes
    rhs_group = jnp.minimum(group, num_groups - 1)  # zero group / sentinel read nothing

    def body(c, acc):
        cs = pl.ds(c * bc, bc)
        a = lhs_ref[rows, cs]  # [bm, bc]
        if transpose_rhs:
            return acc + _dot_nt(a, rhs_ref[rhs_group, cols, cs])  # 'mc,oc->mo'
        return acc + _dot_nn(a, rhs_ref[rhs_group, cs, cols])  # 'mc,co->mo'

    # zero group: acc stays 0. (Not jnp.where(cond, k, 0): Pallas' Triton lowering types a select of two
    # literals as i1, and the scf.for then fails to verify on the GPU: 'lowerBound, upperBound, step
    # have same type'.)
    steps = (group < num_groups).astype(jnp.int32) * (n_contract // bc)
    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bo), jnp.float32))
    plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype),
                mask=jnp.broadcast_to(own[:, None], (bm, bo)))


def _gmm(lhs, rhs, meta: GroupMetadata, cfg: _Config, *, transpose_rhs: bool,
         out_dtype) -> jax.Array:
    """lhs [Mp, C] x rhs [G, C, O] (or [G, O, C] transposed) -> [Mp, O]."""
    m, c = lhs.shape
    o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # Forward: contraction K (block_k), output N (block_n); transposed: swapped.
    bc, bo = (cfg.block_n, cfg.block_k) if transpose_rhs else (cfg.block_k, cfg.block_n)
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_gmm_kernel, bm=cfg.block_m, bc=bc, bo=bo, n_contract=c,
                          num_groups=cfg.num_groups, transpose_rhs=transpose_rhs),
        grid=(meta.visit_group.shape[0], o // bo),
        in_specs=[whole] * 6,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
        compiler_params=_compiler_params(),
        interpret=cfg.interpret,
        name="grouped_matmul_t" if transpose_rhs else "grouped_matmul",
    )(meta.visit_group, meta.visit_tile, meta.starts, meta.ends, lhs, rhs)


# --------------------------------------------------------------------------
# tgmm: d_rhs[g] = lhs[rows of g]^T @ d_out[rows of g]
# --------------------------------------------------------------------------
def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, bm: int, bk: int, bn: int):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    first = start // bm
    last = jnp.where(end > start, lax.div(end + bm - 1, bm), first)  # zero-size group: no tiles

    def body(t, acc):
        rows = pl.ds(t * bm, bm)
        row_idx = t * bm + jnp.arange(bm)
        own = ((row_idx >= start) & (row_idx < end))[:, None]  # [bm, 1]
        a = jnp.where(own, lhs_ref[rows, pl.ds(i * bk, bk)], 0)  # [bm, bk], other groups' rows -> 0
        b = dout_ref[rows, pl.ds(j * bn, bn)]  # [bm, bn]
        return acc + _dot_tn(a, b)  # 'mk,mn->kn'

    acc = lax.fori_loop(first, last, body, jnp.zeros((bk, bn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm(lhs, dout, meta: GroupMetadata, cfg: _Config, out_dtype) -> jax.Array:
    """lhs [Mp, K], dout [Mp, N] -> [G, K, N]."""
    _, k = lhs.shape
    n = dout.shape[1]
    bk, bn = cfg.block_k, cfg.block_n
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=cfg.block_m, bk=bk, bn=bn),
        grid=(cfg.num_groups, k // bk, n // bn),
        in_specs=[whole] * 4,
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((cfg.num_groups, k, n), out_dtype),
        compiler_params=_compiler_params(),
        interpret=cfg.interpret,
        name="grouped_matmul_tgmm",
    )(meta.starts, meta.ends, lhs, dout)


# --------------------------------------------------------------------------
# custom_vjp on padded arrays; padding / slicing stays outside (plain autodiff)
# --------------------------------------------------------------------------
def _metadata(group_sizes, m_padded: int, cfg: _Config) -> GroupMetadata:
    return group_metadata(group_sizes, cfg.rows, m_padded, cfg.block_m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_padded(lhs, rhs, group_sizes, cfg: _Config):
    meta = _metadata(group_sizes, lhs.shape[0], cfg)
    return _gmm(lhs, rhs, meta, cfg, transpose_rhs=False, out_dtype=lhs.dtype)


def _gmm_padded_fwd(lhs, rhs, group_sizes, cfg: _Config):
    meta = _metadata(group_sizes, lhs.shape[0], cfg)
    out = _gmm(lhs, rhs, meta, cfg, transpose_rhs=False, out_dtype=lhs.dtype)
    return out, (lhs, rhs, meta)


def _gmm_padded_bwd(cfg: _Config, res, dout):
    lhs, rhs, meta = res
    d_lhs = _gmm(dout, rhs, meta, cfg, transpose_rhs=True, out_dtype=lhs.dtype)  # [Mp, K]
    d_rhs = _tgmm(lhs, dout, meta, cfg, out_dtype=rhs.dtype)  # [G, K, N]
    return d_lhs, d_rhs, None  # group sizes are integers: no cotangent


_gmm_padded.defvjp(_gmm_padded_fwd, _gmm_padded_bwd)


def _fit_block(block: int, length: int, name: str) -> int:
    if block < _MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two >= {_MIN_BLOCK}")
    return min(block, max(_MIN_BLOCK, pl.next_power_of_2(length)))


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    size = x.shape[axis]
    extra = -size % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped matmul over group-sorted rows, same contract as ``lax.ragged_dot``.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], one matrix per group; same dtype as lhs (f32/bf16/f16).
      group_sizes: [G] int, consecutive row counts (zeros allowed; rows past
        the sum output 0; a sum above M is clipped at M).
      block_m, block_n, block_k: tiles (powers of two >= 16) over rows, output
        columns and the contraction; None picks ``default_gmm_block_sizes()``.
      interpret: run the Pallas interpreter; None means "on CPU".

    Returns:
      [M, N] in lhs.dtype (f32 accumulation). Differentiable in lhs and rhs
      (custom VJP: d_lhs and d_rhs are Pallas grouped matmuls too).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if k2 != k or group_sizes.shape[0] != g:
        raise ValueError(f"shape mismatch: lhs {lhs.shape}, rhs {rhs.shape}, "
                         f"group_sizes {group_sizes.shape}")
    if lhs.dtype != rhs.dtype or lhs.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"lhs / rhs dtypes must match and be f32/bf16/f16, got {lhs.dtype}, {rhs.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    defaults = default_gmm_block_sizes()
    pick = lambda given, name: defaults[name] if given is None else given  # noqa: E731
    cfg = _Config(
        block_m=_fit_block(pick(block_m, "block_m"), m, "block_m"),
        block_n=_fit_block(pick(block_n, "block_n"), n, "block_n"),
        block_k=_fit_block(pick(block_k, "block_k"), k, "block_k"),
        num_groups=g, rows=m, interpret=bool(interpret),
    )
    # Zero padding: extra K columns add 0 to every dot; extra rows / N columns
    # are sliced off (and get zero cotangents).
    lhs_p = _pad_to(_pad_to(lhs, 0, cfg.block_m), 1, cfg.block_k)  # [Mp, Kp]
    rhs_p = _pad_to(_pad_to(rhs, 1, cfg.block_k), 2, cfg.block_n)  # [G, Kp, Np]
    out = _gmm_padded(lhs_p, rhs_p, group_sizes.astype(jnp.int32), cfg)  # [Mp, Np]
    return out[:m, :n]
