"""TPU routes: JAX's own Pallas TPU kernels behind our attention / GMM contracts.

On TPU, ``attention_impl="pallas"`` runs splash attention
(``jax.experimental.pallas.ops.tpu.splash_attention``) and
``moe_impl="pallas"`` runs megablox ``gmm``
(``jax.experimental.pallas.ops.tpu.megablox``), so one config serves GPU and
TPU. Both modules are imported lazily (inside the functions): importing
``ulorl_jax.kernels`` never touches TPU code, and a JAX without them fails
only when a TPU route is actually taken.

Adapters (ours -> theirs):
  * splash: q [B, T, Hq, D] -> [B, Hq, T, D] (vmapped over B), the 1/sqrt(D)
    logit scale folded into q (splash applies none), GQA handled by splash
    (``is_mqa=False`` with fewer kv heads), causal -> ``CausalMask`` per head,
    segment ids -> ``SegmentIds(q, kv)``. T is padded to a multiple of the
    block (128); padded positions get their own segment id, so they never
    mix with real tokens and every row keeps an allowed key (splash needs that).
  * megablox: rows padded to a multiple of the row tile (megablox requires
    it); rows past sum(group_sizes), which megablox leaves unwritten, set to
    0 as ragged_dot does; output in lhs.dtype.

Verification status: the routing and these adapters are tested on CPU by
running the same kernels with ``interpret=True`` (numerics vs our
references). They have NOT been run on a TPU in this session.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["splash_attention", "make_splash_kernel", "megablox_gmm", "splash_problem",
           "SPLASH_BLOCK"]

SPLASH_BLOCK = 128  # sequence padding unit and smallest splash tile


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def splash_problem(q, k, v, causal: bool, segment_ids) -> str | None:
    """Reason splash attention cannot serve this call, or None."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"splash needs k.shape == v.shape and matching batch / head_dim: {q.shape}, {k.shape}, {v.shape}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"splash needs one dtype for q/k/v, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[1] != k.shape[1]:
        return f"splash route is wired for self-attention only (Tq {q.shape[1]} != Tk {k.shape[1]})"
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        return f"segment_ids shape {segment_ids.shape} != {q.shape[:2]}"
    return None


def _block(t_padded: int) -> int:
    for block in (512, 256, SPLASH_BLOCK):
        if t_padded % block == 0:
            return block
    raise AssertionError(t_padded)  # t_padded is a multiple of SPLASH_BLOCK


def make_splash_kernel(*, causal: bool, num_heads: int, seq_len: int, block: int, interpret: bool):
    """One splash kernel for a [Hq, seq_len, D] example (mask built here)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (seq_len, seq_len)
    head_mask = sm.CausalMask(shape) if causal else sm.FullMask(shape)
    mask = sm.MultiHeadMask([head_mask] * num_heads)
    sizes = sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )
    return sk.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Our attention contract on splash attention.

    q [B, T, Hq, D], k / v [B, T, Hkv, D], segment_ids [B, T] -> [B, T, Hq, D].
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    t_p = _round_up(t, SPLASH_BLOCK)
    seg = segment_ids
    if t_p != t and (seg is not None or not causal):
        # Padded keys must be invisible to real queries: give them their own id.
        real = jnp.zeros((b, t), jnp.int32) if seg is None else seg.astype(jnp.int32)
        pad_id = jnp.min(real) - 1
        seg = jnp.concatenate([real, jnp.broadcast_to(pad_id, (b, t_p - t)).astype(jnp.int32)], axis=1)
    elif seg is not None:
        seg = seg.astype(jnp.int32)
    # (Causal without segments: padded keys sit after every real query.)

    def to_heads_major(x):  # [B, T, H, D] -> [B, H, Tp, D]
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, t_p - t), (0, 0))) if t_p != t else x

    kernel = make_splash_kernel(causal=causal, num_heads=hq, seq_len=t_p, block=_block(t_p),
                                interpret=interpret)
    qh = to_heads_major(q * jnp.asarray(scale, q.dtype))
    kh, vh = to_heads_major(k), to_heads_major(v)
    if seg is None:
        out = jax.vmap(kernel)(qh, kh, vh)
    else:
        out = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=sk.SegmentIds(s_, s_)))(
            qh, kh, vh, seg)  # [B, Hq, Tp, D]
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(q.dtype)


def megablox_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiling: tuple[int, int, int] = (128, 128, 128),
    interpret: bool = False,
) -> jax.Array:
    """``lax.ragged_dot`` contract on megablox gmm: lhs [M, K], rhs [G, K, N] -> [M, N]."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = lhs.shape
    n = rhs.shape[2]
    tm = min(tiling[0], _round_up(m, 8))
    tk, tn = min(tiling[1], k), min(tiling[2], n)
    m_p = _round_up(m, tm)
    lhs_p = jnp.pad(lhs, ((0, m_p - m), (0, 0))) if m_p != m else lhs
    out = gmm(lhs_p, rhs, group_sizes.astype(jnp.int32), lhs.dtype, (tm, tk, tn), None, None, False, interpret)
    # megablox leaves rows past sum(group_sizes) unwritten; ragged_dot gives 0.
    covered = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(covered[:, None], out[:m], 0)
