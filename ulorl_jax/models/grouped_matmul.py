"""A grouped matmul in plain JAX, blocked over rows: `lax.ragged_dot`'s contract without its dense CPU lowering.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]

Rows are sorted by group: rows [o_g, o_g + size_g) are multiplied by rhs[g]; rows past sum(group_sizes)
give 0 (the trailing group of expert parallelism). XLA:CPU lowers `lax.ragged_dot` (and its transposes in
the backward) to dense work over every group; here the rows are cut into tiles of `block` rows and every
(tile, group) pair that shares rows is one [block, K] x [K, N] matmul, masked to the shared rows: at most
ceil(M / block) + G of them, so the work is the ideal M x K x N plus at most G partial tiles. The backward
is a custom VJP with the same schedule: d_lhs is the grouped matmul of d_out with rhs transposed, d_rhs[g]
accumulates lhs_tile^T @ d_out_tile per pair.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 128


def _schedule(group_sizes: jnp.ndarray, rows: int, block: int):
    """Work items (tile, group, first row, end row), one per (tile, group) pair sharing rows; padded with
    empty items (first == end). The items are the intervals between the merged tile and group boundaries."""
    num_tiles = rows // block
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    # tile starts, group starts and the end of the last group (rows after it give 0): [T + G + 1]
    bounds = jnp.sort(jnp.concatenate([jnp.arange(num_tiles, dtype=jnp.int32) * block, starts, ends[-1:]]))
    first = bounds
    end = jnp.concatenate([bounds[1:], jnp.full((1,), rows, jnp.int32)])
    group = jnp.searchsorted(ends, first, side="right").astype(jnp.int32)  # G: past the last group
    tile = jnp.minimum(first // block, num_tiles - 1)
    end = jnp.minimum(end, (tile + 1) * block)  # an interval never crosses a tile boundary, but keep it safe
    live = (end > first) & (group < g)
    return tile, jnp.minimum(group, g - 1), first, end, live


def _pad_rows(x: jnp.ndarray, block: int) -> jnp.ndarray:
    extra = (-x.shape[0]) % block
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


def _zeros_like_inputs(shape, *inputs) -> jnp.ndarray:
    """f32 zeros that vary over the mesh axes its inputs vary over (inside shard_map a scan's carry must
    keep one type: a plain jnp.zeros would not vary, the matmuls' results do)."""
    anchor = sum(x.reshape(-1)[0].astype(jnp.float32) for x in inputs)
    return jnp.broadcast_to(jnp.where(False, anchor, 0.0), shape)


def _row_mask(tile, first, end, block):
    rows = tile * block + jnp.arange(block, dtype=jnp.int32)
    return ((rows >= first) & (rows < end))[:, None]  # [block, 1]


def _gmm(lhs, rhs, group_sizes, block):
    m = lhs.shape[0]
    lhs_p = _pad_rows(lhs, block)
    tile, group, first, end, live = _schedule(group_sizes, lhs_p.shape[0], block)

    # Every item is computed and masked (no lax.cond: its branches would differ in varying mesh axes
    # inside shard_map); the empty items are at most G + 1.
    def step(out, item):
        t, g, f, e, ok = item
        x = jax.lax.dynamic_slice_in_dim(lhs_p, t * block, block)  # [block, K]
        y = jnp.dot(x, rhs[g], preferred_element_type=jnp.float32)  # [block, N]
        y = jnp.where(_row_mask(t, f, e, block) & ok, y, 0.0)
        cur = jax.lax.dynamic_slice_in_dim(out, t * block, block)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + y, t * block, axis=0), None

    out = _zeros_like_inputs((lhs_p.shape[0], rhs.shape[2]), lhs_p, rhs)
    out, _ = jax.lax.scan(step, out, (tile, group, first, end, live))
    return out[:m].astype(lhs.dtype)


def _tgmm(lhs, d_out, group_sizes, num_groups, block):
    """d_rhs [G, K, N]: per group, lhs_g^T @ d_out_g."""
    lhs_p, d_p = _pad_rows(lhs, block), _pad_rows(d_out, block)
    tile, group, first, end, live = _schedule(group_sizes, lhs_p.shape[0], block)

    def step(acc, item):
        t, g, f, e, ok = item
        x = jnp.where(_row_mask(t, f, e, block) & ok, jax.lax.dynamic_slice_in_dim(lhs_p, t * block, block), 0)
        dy = jax.lax.dynamic_slice_in_dim(d_p, t * block, block)
        return acc.at[g].add(jnp.dot(x.T, dy, preferred_element_type=jnp.float32)), None

    acc = _zeros_like_inputs((num_groups, lhs.shape[1], d_out.shape[1]), lhs_p, d_p)
    acc, _ = jax.lax.scan(step, acc, (tile, group, first, end, live))
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs, rhs, group_sizes, block):
    return _gmm(lhs, rhs, group_sizes, block)


def _grouped_fwd(lhs, rhs, group_sizes, block):
    return _gmm(lhs, rhs, group_sizes, block), (lhs, rhs, group_sizes)


def _grouped_bwd(block, res, d_out):
    lhs, rhs, group_sizes = res
    d_lhs = _gmm(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes, block)
    d_rhs = _tgmm(lhs, d_out, group_sizes, rhs.shape[0], block).astype(rhs.dtype)
    return d_lhs.astype(lhs.dtype), d_rhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(lhs: jnp.ndarray, rhs: jnp.ndarray, group_sizes: jnp.ndarray, *, block: int = BLOCK
                   ) -> jnp.ndarray:
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] int -> [M, N] (see the module doc)."""
    block = max(8, min(block, -(-lhs.shape[0] // 8) * 8))  # no tile larger than the rows (rounded to 8)
    return _grouped(lhs, rhs, group_sizes.astype(jnp.int32), block)
