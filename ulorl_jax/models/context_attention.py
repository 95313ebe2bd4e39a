"""Self-attention of packed rows split over the `context` mesh axis (context parallelism).

The learner's rows [B, L] arrive in the load-balanced layout of `context_layout` and are split along the
token axis over `context`: shard i holds chunks i and 2C-1-i of every row. Attention is the one place a
token needs the rest of its row, so here, inside `jax.shard_map` over jax's mesh context:

1. each shard all-gathers the row's keys, values and segment ids over `context` (GQA keeps this small: at
   128k tokens a Qwen3-30B-A3B layer's K and V are 4 heads x 128 x 2 bytes x 2 = 2 KiB per token, 256 MiB
   per row) and puts them back in natural order (static slices, `context_layout.natural_order`);
2. its own queries attend to them with their natural positions as the causal index (the `AttentionMask`
   rule "key slot <= q_index and the same segment": exactly what one device computes, for samples that
   cross shard boundaries and several samples per row alike);
3. the backward pass is the transpose: dQ stays local, dK / dV are reduce-scattered back to the shards
   that own them (the all-gather's transpose).

Work per shard: `blockwise` skips the key tiles past its query tiles, so with the load-balanced layout
every shard computes the same number of tiles (`context_layout.causal_tiles`); `xla` computes the full
[2c, L] scores on each shard (balanced too, and O(L^2 / C) memory as on one device). The Pallas flash
kernel and cuDNN take causal attention with Tq == Tk only, not queries at given positions against a
longer key axis, so under context parallelism `pallas` and `cudnn` run `blockwise` (logged once).
Heads stay split over `tensor` (GQA groups whole, as kernels/pallas/sharded.py).
"""

from __future__ import annotations

import functools
import logging

import jax
from jax.sharding import PartitionSpec as P

from ulorl_jax.models.attention import AttentionMask, get_attention_impl
from ulorl_jax.models.context_layout import (
    check_row_len,
    natural_order,
    shard_positions,
)
from ulorl_jax.models.fallback import warn_once
from ulorl_jax.sharding import (
    BATCH_AXES,
    CONTEXT_AXIS,
    DEFAULT_PARAM_RULES,
    MeshError,
    axis_size,
)

log = logging.getLogger(__name__)

# attention_impl -> what runs on each context shard (queries at given positions against the whole row)
SHARD_IMPLS = {"xla": "xla", "blockwise": "blockwise", "pallas": "blockwise", "cudnn": "blockwise"}


def context_parallel_attention(impl: str, q, k, v, mask: AttentionMask, mesh) -> jax.Array:
    """q [B, L, Hq, D], k / v [B, L, Hkv, D] and `mask` (self-attention over packed rows, segment ids)
    of rows in the load-balanced layout, on `mesh` (context > 1) -> [B, L, Hq, D] in the same layout,
    equal to `impl` on the natural rows on one device."""
    context = mesh.shape[CONTEXT_AXIS]
    b, row_len = q.shape[:2]
    check_row_len(row_len, context, what="attention row length")
    if b % axis_size(mesh, BATCH_AXES):
        raise MeshError(f"context-parallel attention: {b} rows do not split over the data shards "
                        f"{BATCH_AXES} = {axis_size(mesh, BATCH_AXES)}")
    heads = DEFAULT_PARAM_RULES["q_heads"]
    if q.shape[2] % axis_size(mesh, heads) or k.shape[2] % axis_size(mesh, heads):
        raise MeshError(f"attention with {q.shape[2]} query heads and {k.shape[2]} kv heads does not split over "
                        f"mesh axis {heads!r} of size {axis_size(mesh, heads)}")
    shard_impl = SHARD_IMPLS.get(impl, impl)
    if shard_impl != impl:
        warn_once(log, f"context-{impl}", f"attention_impl={impl} under context parallelism (mesh.context="
                  f"{context}): its kernel takes no query positions against a longer key axis; using "
                  f"{shard_impl} on each context shard")
    tokens = P(BATCH_AXES, CONTEXT_AXIS)
    qkv = P(BATCH_AXES, CONTEXT_AXIS, heads, None)
    body = functools.partial(_shard_attention, impl=shard_impl, context=context, row_len=row_len)
    return jax.shard_map(body, mesh=mesh, in_specs=(qkv, qkv, qkv, tokens), out_specs=qkv,
                         check_vma=False)(q, k, v, mask.q_segment_ids)


def _shard_attention(q, k, v, segment_ids, *, impl: str, context: int, row_len: int):
    """shard_map body: q [b, L/C, h, D] (this shard's two chunks), k / v [b, L/C, hk, D], ids [b, L/C]."""
    gather = lambda x: natural_order(jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True), context)
    k_row, v_row, ids_row = gather(k), gather(v), gather(segment_ids)  # the whole row, natural order
    positions = shard_positions(jax.lax.axis_index(CONTEXT_AXIS), row_len, context)  # [L/C]
    q_index = jax.numpy.broadcast_to(positions, segment_ids.shape)
    mask = AttentionMask(segment_ids, ids_row, q_index, is_self_attention=False)
    return get_attention_impl(impl)(q, k_row, v_row, mask)
