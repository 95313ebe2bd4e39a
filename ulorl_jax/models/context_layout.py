"""The load-balanced token layout of context parallelism (the `context` mesh axis).

Under causal attention the work of a query grows with its position, so cutting a row of L tokens into C
contiguous pieces gives the last shard 2C - 1 times the work of the first. Instead the row is cut into
2C chunks of c = L / (2C) tokens and context shard i holds chunks i and 2C - 1 - i (the layout
Megatron-LM's and MaxText's context parallelism use). A query at position p sees p + 1 keys, so chunk i's
queries see (i + 1/2) c^2 + c/2 (key, query) pairs and chunk 2C - 1 - i's (2C - i - 1/2) c^2 + c/2: every
shard sees exactly 2C c^2 + c of them.

The learner lays its packed rows out this way on the host (`to_layout`): position j of a laid-out row
holds token `order[j]` of the natural row, and a plain split of the laid-out token axis over the
`context` axis hands shard i its two chunks. Everything in a decoder layer except attention works token
by token, so only attention needs to know (models/context_attention.py): it gathers the keys and values
of the whole row, puts them back in natural order (`natural_order`) and gives each local query its
natural position (`shard_positions`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ulorl_jax.sharding import MeshError


def check_row_len(row_len: int, context: int, what: str = "trainer.row_len") -> None:
    """A row of `row_len` tokens must cut into 2 x `context` equal chunks (two per context shard)."""
    if context < 1:
        raise MeshError(f"mesh.context={context}: must be >= 1")
    if context == 1:
        return
    chunks = 2 * context
    if row_len < chunks:
        raise MeshError(f"{what}={row_len} is shorter than the {chunks} chunks mesh.context={context} cuts a row "
                        f"into (two per context shard): use a smaller mesh.context or longer rows")
    if row_len % chunks:
        raise MeshError(f"{what}={row_len} does not divide into 2 x mesh.context = {chunks} equal chunks (the "
                        f"load-balanced causal layout gives each context shard two); use a multiple of {chunks}, "
                        f"e.g. {row_len + (-row_len) % chunks}")


def shard_chunks(shard: int, context: int) -> tuple[int, int]:
    """The two chunks (of 2 x context) that context shard `shard` holds, in layout order."""
    return shard, 2 * context - 1 - shard


def layout_order(row_len: int, context: int) -> np.ndarray:
    """[row_len] int: the natural position of the token at each position of a laid-out row."""
    check_row_len(row_len, context)
    c = row_len // (2 * context)
    chunks = [chunk for shard in range(context) for chunk in shard_chunks(shard, context)]
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks]).astype(np.int32)


def to_layout(x: np.ndarray, context: int, axis: int = -1) -> np.ndarray:
    """Natural rows -> the load-balanced layout along `axis` (host arrays; identity for context 1)."""
    if context == 1:
        return x
    return np.take(x, layout_order(x.shape[axis], context), axis=axis)


def from_layout(x: np.ndarray, context: int, axis: int = -1) -> np.ndarray:
    """The load-balanced layout -> natural rows along `axis` (the inverse of `to_layout`)."""
    if context == 1:
        return x
    return np.take(x, np.argsort(layout_order(x.shape[axis], context)), axis=axis)


def natural_order(x: jnp.ndarray, context: int, axis: int = 1) -> jnp.ndarray:
    """A whole laid-out row gathered over the context shards (shard-major along `axis`) -> natural order.
    Static slices, no gather: chunk k < C is shard k's first chunk, chunk k >= C shard 2C-1-k's second."""
    if context == 1:
        return x
    axis = axis % x.ndim
    shape = x.shape
    split = x.reshape(*shape[:axis], context, 2, shape[axis] // (2 * context), *shape[axis + 1:])
    first = jnp.take(split, 0, axis=axis + 1)  # [.., C, c, ..]: chunks 0 .. C-1
    second = jnp.flip(jnp.take(split, 1, axis=axis + 1), axis=axis)  # chunks C .. 2C-1
    return jnp.concatenate([first, second], axis=axis).reshape(shape)


def shard_positions(shard, row_len: int, context: int) -> jnp.ndarray:
    """[row_len / context] int32: the natural positions of the tokens context shard `shard` (an int or a
    traced `lax.axis_index`) holds, in layout order."""
    c = row_len // (2 * context)
    local = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([shard * c + local, (2 * context - 1 - shard) * c + local])


def causal_pairs(row_len: int, context: int, balanced: bool = True) -> np.ndarray:
    """[context] int: the (query, key) pairs with key <= query that each context shard's queries cover in
    one causal row, with the load-balanced layout or (balanced=False) contiguous pieces. The attention work
    per shard of a kernel that skips what the causal rule rules out."""
    pieces = 2 * context if balanced else context
    c = row_len // pieces
    per_piece = np.array([k * c * c + c * (c + 1) // 2 for k in range(pieces)], dtype=np.int64)
    if not balanced:
        return per_piece
    return np.array([per_piece[list(shard_chunks(s, context))].sum() for s in range(context)])


def causal_tiles(row_len: int, context: int, block_q: int, block_k: int, balanced: bool = True) -> np.ndarray:
    """[context] int: the (query block, key block) tiles blockwise attention computes on each context
    shard (a tile is skipped when its first key is past its last query), with the load-balanced layout or
    contiguous pieces."""
    positions = layout_order(row_len, context) if balanced else np.arange(row_len)
    per_shard = positions.reshape(context, -1)
    out = []
    for pos in per_shard:
        last_q = np.array([pos[i:i + block_q].max() for i in range(0, len(pos), block_q)])
        out.append(int(np.sum(last_q // block_k + 1)))
    return np.array(out)
