"""Expert-parallel MoE experts under a device mesh: each device routes only its own tokens.

Without it, GSPMD keeps the grouped-matmul experts' global argsort + gather
unpartitioned, so every device holds temporaries for the whole micro-batch.
Here the experts run inside `jax.shard_map` over the mesh of jax's mesh
context (`sharding.mesh_context`; the learner and `ulorl plan` trace their
steps under it), with the layout of `sharding.DEFAULT_PARAM_RULES`:
tokens [N, D] split over TOKEN_AXES (data, fsdp, expert, context: rows, then the
context shards of each row); expert weights [E, D, F] split experts -> `expert`,
embed -> `fsdp` x `context`, expert_mlp -> `tensor`.

Per device (coordinates d, f, e, t):
1. ZeRO-3: all-gather its E/ep experts over `fsdp` x `context` (the embed dim), once per layer;
2. for each chunk of its local tokens (`lax.map`, each chunk rematerialised):
   all-gather the chunk's tokens and their top-k experts / weights over
   `expert` (the ep devices with the same (d, f) hold the other experts),
   compute the assignments that hit its own E/ep experts (the grouped matmul
   with `expert_offset`, see moe.experts_ragged), and `psum_scatter` over
   `expert`: every token gets the sum over its k experts back on its own device;
3. psum over `tensor` (the down projection is summed over the expert_mlp shards).

Dropless, so buffers are sized for the worst case (every gathered assignment
hits this device's experts): chunk tokens x ep x k rows. Chunks keep that at
most `ROWS_PER_CHUNK` rows, so the working set no longer grows with the
micro-batch. Compute: the grouped matmul is given chunk x ep x k rows of
which ~1/ep are local; rows past sum(group_sizes) are skipped by the Pallas
gmm (which writes them as 0) but may be computed by other ragged_dot lowerings.
The router (and its aux-loss logits) stays outside, partitioned by GSPMD.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ulorl_jax.sharding import (
    DEFAULT_PARAM_RULES,
    MESH_AXES,
    TOKEN_AXES,
    MeshError,
    axis_size,
)

# Gathered (token, expert) assignment rows one device handles at a time (worst case: all local).
# 64k rows x (2 x hidden + 3 x moe_intermediate) bf16 is ~0.8 GB for Qwen3-30B-A3B.
ROWS_PER_CHUNK = 65536


def expert_parallel_mesh() -> jax.sharding.AbstractMesh | None:
    """The context mesh when the experts should run expert-parallel, else None.

    Parallel when jax's mesh context has the MESH_AXES and splits tokens over
    more than one device (TOKEN_AXES); no mesh, another mesh, or one data
    shard: the plain single-program path (GSPMD shards what it can).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    if axis_size(mesh, TOKEN_AXES) == 1:
        return None
    return mesh


def _axes(entry) -> tuple[str, ...]:
    """A partition-spec entry as a tuple of mesh axis names (None -> ())."""
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def chunking(local_tokens: int, ep: int, top_k: int, rows_per_chunk: int = ROWS_PER_CHUNK) -> tuple[int, int]:
    """(chunks, tokens per chunk) for one device's `local_tokens`: chunk x ep x top_k <= rows_per_chunk
    (at least one token per chunk); chunks x tokens per chunk >= local_tokens (the rest is padding)."""
    per_chunk = max(1, min(local_tokens, rows_per_chunk // (ep * top_k)))
    chunks = -(-local_tokens // per_chunk)
    return chunks, -(-local_tokens // chunks)  # even chunks: the padding stays below one token per chunk


def _local_experts(x, weights, experts, w_gate, w_up, w_down, *, local_fn: Callable, ep_axes, embed_axes,
                   mlp_axes, rows_per_chunk: int) -> jnp.ndarray:
    """shard_map body. x [n, D], weights / experts [n, K] (this device's tokens); w_gate / w_up
    [E/ep, D/fsdp, F/tp], w_down [E/ep, F/tp, D/fsdp] -> [n, D] (the MoE output of the local tokens)."""
    n, d = x.shape
    k = experts.shape[1]
    ep = jax.lax.axis_size(ep_axes) if ep_axes else 1
    offset = jax.lax.axis_index(ep_axes) * w_gate.shape[0] if ep_axes else 0  # first local expert
    if embed_axes:  # ZeRO-3: gathered in compute dtype, held in param dtype so chunk gradients sum at its precision
        gather = lambda w, dim: jax.lax.all_gather(w.astype(x.dtype), embed_axes, axis=dim,  # noqa: E731
                                                   tiled=True).astype(w.dtype)
        w_gate, w_up, w_down = gather(w_gate, 1), gather(w_up, 1), gather(w_down, 2)  # [E/ep, D, F/tp] ...

    def chunk(args):  # [c, D], [c, K], [c, K] -> [c, D]
        xg, wg, eg = (jax.lax.all_gather(a, ep_axes, tiled=True) if ep_axes else a for a in args)  # [ep*c, ...]
        y = local_fn(xg, wg, eg, w_gate, w_up, w_down, expert_offset=offset)  # [ep*c, D]: local experts only
        return jax.lax.psum_scatter(y, ep_axes, tiled=True) if ep_axes else y  # [c, D]: sum over all experts

    chunks, per_chunk = chunking(n, ep, k, rows_per_chunk)
    pad = chunks * per_chunk - n  # padding tokens: weight 0
    xs = tuple(jnp.pad(a, ((0, pad), (0, 0))).reshape(chunks, per_chunk, -1) for a in (x, weights, experts))
    y = jax.lax.map(jax.checkpoint(chunk), xs).reshape(chunks * per_chunk, d)[:n]
    return jax.lax.psum(y, mlp_axes) if mlp_axes else y  # down projection summed over expert_mlp shards


def experts_parallel(x, weights, experts, w_gate, w_up, w_down, *, mesh, local_fn: Callable,
                     rows_per_chunk: int | None = None, check_vma: bool = True) -> jnp.ndarray:
    """Expert-parallel experts on `mesh` (an AbstractMesh or Mesh with MESH_AXES).

    x [N, D]; weights / experts [N, K] (router output); w_gate / w_up [E, D, F];
    w_down [E, F, D] -> [N, D], equal to local_fn(x, weights, experts, w_*) on one device.
    local_fn: moe.experts_ragged-like, taking `expert_offset`. rows_per_chunk: default ROWS_PER_CHUNK.
    check_vma: False for a custom-VJP grouped matmul (the CPU's plain-JAX one: its backward returns
    d_rhs summed over the token axes, which vma typing would need declared per axis) and for a Pallas
    local_fn — a pallas_call's out_shape carries no varying-axes type and
    the Pallas interpreter cannot run under checked types (as kernels/pallas/sharded.py for attention); the
    gradients are tested equal to one device both ways (tests/models/test_moe_parallel.py).
    """
    rows_per_chunk = ROWS_PER_CHUNK if rows_per_chunk is None else rows_per_chunk
    rules = DEFAULT_PARAM_RULES
    ep_axes, embed_axes, mlp_axes = (_axes(rules[name]) for name in ("experts", "embed", "expert_mlp"))
    if not set(ep_axes) <= set(TOKEN_AXES) or set(mlp_axes) & set(TOKEN_AXES):
        raise MeshError(f"expert parallelism needs experts sharded over token axes {TOKEN_AXES} and expert_mlp "
                        f"over none of them; rules give experts -> {ep_axes}, expert_mlp -> {mlp_axes}")
    n = x.shape[0]
    shards = axis_size(mesh, TOKEN_AXES)
    pad = -n % shards  # a token count that does not split over the data shards: zero-weight padding tokens
    if pad:
        x, weights, experts = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights, experts))
    tokens = P(TOKEN_AXES, None)
    w_in = P(rules["experts"], rules["embed"], rules["expert_mlp"])  # [E, D, F]
    w_out = P(rules["experts"], rules["expert_mlp"], rules["embed"])  # [E, F, D]
    body = lambda *a: _local_experts(*a, local_fn=local_fn, ep_axes=ep_axes, embed_axes=embed_axes,  # noqa: E731
                                     mlp_axes=mlp_axes, rows_per_chunk=rows_per_chunk)
    y = jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
                      out_specs=tokens, check_vma=check_vma)(x, weights, experts, w_gate, w_up, w_down)
    return y[:n]
