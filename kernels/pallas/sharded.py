"""Pallas attention under a device mesh: one kernel call per (batch, head) shard.

A ``pallas_call`` is a custom call GSPMD cannot partition, so under ``jax.jit``
on a mesh it is replicated: every device gathers q / k / v / o (and the
backward's dq / dk / dv) for the whole micro-batch and all heads. Here the
kernel runs inside ``jax.shard_map`` over jax's mesh context
(``sharding.context_mesh()``, set by ``sharding.mesh_context``: the learner and
``ulorl plan`` trace under it), with the activation layout the model's
parameters imply (``sharding.DEFAULT_PARAM_RULES``):

  q [B, T, Hq, D], k / v [B, T, Hkv, D]: batch -> BATCH_AXES (data, fsdp,
  expert), heads -> the ``q_heads`` / ``kv_heads`` rule (``tensor``),
  sequence and head_dim unsplit; segment_ids [B, T] follow the batch.

Attention is independent per (row, head), so each device just runs the kernel
on its block: no collectives. Head shards keep GQA groups whole: device t
holds q heads [t Hq/tp, (t+1) Hq/tp) and kv heads [t Hkv/tp, (t+1) Hkv/tp),
and q head h reads kv head h // (Hq / Hkv) in both numberings. The kernels'
custom VJPs run per shard too (shard_map is differentiable).

cuDNN attention (``jax.nn.dot_product_attention(implementation="cudnn")``)
needs none of this: JAX registers it with ``custom_partitioning`` rules that
split batch and heads.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from ulorl_jax.sharding import BATCH_AXES, DEFAULT_PARAM_RULES, MeshError, axis_size, batch_axes_for

__all__ = ["batch_axes_for", "shard_attention", "shard_decode_attention", "shard_paged_decode_attention"]

logger = logging.getLogger(__name__)

# kernel(q, k, v, segment_ids) -> o, all in the shapes above (segment_ids may be None).
Kernel = Callable[[jax.Array, jax.Array, jax.Array, "jax.Array | None"], jax.Array]


def _head_axes(q_heads: int, kv_heads: int, mesh):
    """Partition-spec entry of the head dim (the q_heads rule), after checking both head counts divide."""
    axes = DEFAULT_PARAM_RULES["q_heads"]
    if axes != DEFAULT_PARAM_RULES["kv_heads"]:
        raise MeshError(f"sharded attention needs q and kv heads on the same mesh axes; rules give "
                        f"q_heads -> {axes!r}, kv_heads -> {DEFAULT_PARAM_RULES['kv_heads']!r}")
    size = axis_size(mesh, axes)
    if q_heads % size or kv_heads % size:
        raise MeshError(f"attention with {q_heads} query heads and {kv_heads} kv heads does not split over "
                        f"mesh axes {axes!r} of size {size}: both head counts must be multiples of {size}")
    return axes


def shard_attention(kernel: Kernel, q: jax.Array, k: jax.Array, v: jax.Array,
                    segment_ids: jax.Array | None, *, mesh) -> jax.Array:
    """`kernel` on `mesh`, one call per (batch, head) block.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D]; segment_ids [B, T] or None
    -> [B, T, Hq, D], equal to kernel(q, k, v, segment_ids) on one device.
    Raises MeshError when Hq or Hkv does not divide over the head axes.
    """
    batch_axes = batch_axes_for(q.shape[0], mesh)
    if axis_size(mesh, batch_axes) < axis_size(mesh, BATCH_AXES):
        logger.warning("sharded attention: batch %d does not divide over %s %s; rows split over %s only",
                       q.shape[0], BATCH_AXES, tuple(mesh.shape[a] for a in BATCH_AXES), batch_axes)
    heads = _head_axes(q.shape[2], k.shape[2], mesh)
    rows = batch_axes or None
    qkv = P(rows, None, heads, None)
    if segment_ids is None:
        body, args, in_specs = (lambda q, k, v: kernel(q, k, v, None)), (q, k, v), (qkv, qkv, qkv)
    else:
        body, args, in_specs = kernel, (q, k, v, segment_ids), (qkv, qkv, qkv, P(rows, None))
    # check_vma=False: a pallas_call's out_shape carries no varying-axes type (Pallas refuses the
    # check without one). Nothing here needs it: the output of every shard is its own block, and a
    # copy over axes the rows could not split over (replicated inputs) is the same on each device.
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=qkv, check_vma=False)(*args)


# decode_kernel(q [B, Hq, D], k / v [B, S, Hkv, D], lengths [B], q_segment_ids [B] | None,
#               kv_segment_ids [B, S] | None) -> [B, Hq, D]
DecodeKernel = Callable[..., jax.Array]


def shard_decode_attention(kernel: DecodeKernel, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           lengths: jax.Array, q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None,
                           *, mesh) -> jax.Array:
    """The decode kernel on `mesh`, one call per (slot, head) block: slots over the BATCH_AXES that
    divide them, heads over the head axes; each device reads only its slots' KV cache (otherwise GSPMD
    would gather every slot's cache to every device for the replicated custom call)."""
    rows = batch_axes_for(q.shape[0], mesh) or None
    heads = _head_axes(q.shape[1], k_cache.shape[2], mesh)
    per_slot, cache = P(rows), P(rows, None, heads, None)
    optional = [(x, spec) for x, spec in ((q_segment_ids, per_slot), (kv_segment_ids, P(rows, None)))
                if x is not None]

    def body(q, k, v, lengths, *segments):
        it = iter(segments)
        q_seg = next(it) if q_segment_ids is not None else None
        kv_seg = next(it) if kv_segment_ids is not None else None
        return kernel(q, k, v, lengths, q_seg, kv_seg)

    out = P(rows, heads, None)
    return jax.shard_map(body, mesh=mesh, in_specs=(out, cache, cache, per_slot, *(s for _, s in optional)),
                         out_specs=out, check_vma=False)(q, k_cache, v_cache, lengths, *(x for x, _ in optional))


# paged_kernel(q [B, Hq, D], k / v pages [P, page_size, Hkv, D], page_table [B, W], lengths [B]) -> [B, Hq, D]
PagedDecodeKernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def shard_paged_decode_attention(kernel: PagedDecodeKernel, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table: jax.Array, lengths: jax.Array, *, mesh) -> jax.Array:
    """The paged decode kernel on `mesh`, one call per (slot, head) block: q, page_table and lengths split
    by slot over the BATCH_AXES that divide them, heads over the head axes. The pools are split over kv
    heads only: any slot may own any page, so every device of a head shard keeps that shard's whole pool
    (the page ids stay global; nothing is renumbered)."""
    rows = batch_axes_for(q.shape[0], mesh) or None
    heads = _head_axes(q.shape[1], k_pages.shape[2], mesh)
    out, pool = P(rows, heads, None), P(None, None, heads, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(out, pool, pool, P(rows, None), P(rows)),
                         out_specs=out, check_vma=False)(q, k_pages, v_pages, page_table, lengths)
