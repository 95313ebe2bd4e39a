"""Blockwise attention in plain JAX: online softmax over key/value blocks, O(T x block) memory.

`attention_impl: blockwise`. The same contract as `attention.xla_attention` (q [B, Tq, Hq, D], k / v
[B, Tk, Hkv, D], GQA without repeating K/V, any `AttentionMask`: segment ids and causal in cache order),
but the [B, H, Tq, Tk] scores are never materialised: queries are split into blocks of `block_q`, keys
into blocks of `block_k`, and each (query block, key block) tile updates a running max, normaliser and
output (the flash-attention recurrence). The backward pass is a custom VJP that recomputes each tile's
probabilities from the saved log-sum-exp, so the backward holds O(T x block) too. Calls with at most one
query block (decode, short rows) take the plain materialised path, which is exactly the same math and
faster there.

Three things keep the plain-XLA tiles fast on CPU (at 8k-token rows, forward 2x and forward + backward
1.5x faster than the first version; benchmarks/results/compare.md):
- the tiles are laid out once as [B, Hkv, G * block, D] (the G query heads of one KV head stacked on the
  rows), so every tile product is a plain batched matmul with no transpose inside the loop;
- a tile the causal rule rules out entirely is skipped, and a tile in which every query sees every key
  (one segment on both sides, all keys at or before the first query: most tiles of a long row) skips
  building and applying the mask;
- the backward walks key blocks outside and query blocks inside, carrying only the key block's dK / dV
  and emitting each tile's dQ as a scan output that is summed once per key block, instead of updating
  one large dQ carry in place inside the loop.

Queries with no visible key (only the padding added here to fill the last block) output 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ulorl_jax.models.attention_xla import (
    ATTENTION_LSE,
    ATTENTION_OUT,
    AttentionMask,
    xla_attention,
)

BLOCK_Q = 256
BLOCK_K = 256
_NEG = -1e30  # finite: exp(_NEG - m) == 0 without inf - inf
_SKIP, _MASKED, _FULL = 0, 1, 2  # what a tile needs


def blockwise_attention(q, k, v, mask: AttentionMask, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """[B, Tq, Hq, D] attention output; see the module docstring."""
    if q.shape[1] <= block_q:
        return xla_attention(q, k, v, mask)
    return _blockwise(q, k, v, mask.q_segment_ids, mask.kv_segment_ids, mask.q_index, block_q, block_k)


def _pad(x, axis: int, multiple: int, value=0):
    extra = (-x.shape[axis]) % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _query_tiles(x, block: int, hkv: int):
    """[B, T, Hq, D] -> [nq, B, Hkv, G * block, D]: a KV head's G query heads stacked on the rows."""
    b, _, hq, d = x.shape
    x = _pad(x, 1, block).reshape(b, -1, block, hkv, hq // hkv, d)
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(x.shape[1], b, hkv, hq // hkv * block, d)


def _from_query_tiles(x, b: int, t: int, hq: int, block: int):
    nq, _, hkv, _, d = x.shape
    x = x.reshape(nq, b, hkv, hq // hkv, block, d).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(b, nq * block, hq, d)[:, :t]


def _key_tiles(x, block: int):
    """[B, T, Hkv, D] -> [nk, B, Hkv, block, D]."""
    b, _, hkv, d = x.shape
    return _pad(x, 1, block).reshape(b, -1, block, hkv, d).transpose(1, 0, 3, 2, 4)


def _from_key_tiles(x, t: int):
    nk, b, hkv, block, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * block, hkv, d)[:, :t]


def _id_tiles(x, block: int, value: int):
    """[B, T] -> [n, B, block], padded with `value`."""
    return _pad(x, 1, block, value).reshape(x.shape[0], -1, block).swapaxes(0, 1)


def _tiles(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    hkv = k.shape[2]
    # The ids depend on q through an integer 0. Under scanned decoder layers the segment ids and positions
    # are the same in every layer: JAX's scan partial evaluation then moves what depends on them alone out
    # of the layer loop, and with it each tile's mask for every tile at once, O(T^2) memory (at 8k tokens,
    # 8 heads: 5.7 GB of temporaries instead of 0.1 GB; tests/models/test_blockwise_attention.py).
    tie = jnp.isnan(q[(0,) * q.ndim]).astype(jnp.int32) * 0
    q_seg, kv_seg, q_index = q_seg + tie, kv_seg + tie, q_index + tie
    # padded queries see nothing (-2 matches no key); padded keys are seen by nobody (-1)
    return (_query_tiles(q, block_q, hkv), _key_tiles(k, block_k), _key_tiles(v, block_k),
            _id_tiles(q_seg, block_q, -2), _id_tiles(kv_seg, block_k, -1), _id_tiles(q_index, block_q, -1))


def _tile_kind(qs, ks, qi, kv_start, block_k: int):
    """_SKIP (no query sees any key: causal in cache order), _FULL (every query sees every key) or _MASKED."""
    one_segment = jnp.all(qs == qs[:, :1]) & jnp.all(ks == qs[:, :1])
    full = one_segment & (kv_start + block_k - 1 <= jnp.min(qi))
    return jnp.where(kv_start > jnp.max(qi), _SKIP, jnp.where(full, _FULL, _MASKED))


def _tile_mask(qs, ks, qi, kv_start, groups: int):
    """[B, 1, G * bq, bk]: whether each query row of the tile may see each key."""
    b, bq = qs.shape
    bk = ks.shape[1]
    kv_pos = kv_start + jnp.arange(bk, dtype=jnp.int32)
    allowed = (qs[:, :, None] == ks[:, None, :]) & (kv_pos[None, None, :] <= qi[:, :, None])  # [B, bq, bk]
    return jnp.broadcast_to(allowed[:, None, None], (b, 1, groups, bq, bk)).reshape(b, 1, groups * bq, bk)


def _tile_dot(a, b):
    """[B, K, R, D] x [B, K, S, D] -> [B, K, R, S] in f32."""
    return jnp.einsum("bkrd,bksd->bkrs", a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    return _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)[0]


def _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5
    qT, kT, vT, qsT, ksT, qiT = _tiles(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)

    def one_q_block(args):
        qb, qs, qi = args  # [B, K, G * bq, D], [B, bq], [B, bq]

        def update(masked: bool, carry, j):
            m, l, acc = carry
            s = _tile_dot(qb, kT[j])  # raw scores; the scale goes into the exponent
            if masked:
                allowed = _tile_mask(qs, ksT[j], qi, j * block_k, g)
                s = jnp.where(allowed, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp((s - m_new[..., None]) * scale)
            if masked:  # a row with nothing visible yet has m_new == _NEG and exp(0) == 1 without this
                p = jnp.where(allowed, p, 0.0)
            corr = jnp.exp((m - m_new) * scale)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(vT.dtype), vT[j], preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        def step(j, carry):
            kind = _tile_kind(qs, ksT[j], qi, j * block_k, block_k)
            return jax.lax.switch(kind, [lambda c: c, lambda c: update(True, c, j), lambda c: update(False, c, j)],
                                  carry)

        rows = (b, hkv, g * block_q)
        init = (jnp.full(rows, _NEG, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros((*rows, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, kT.shape[0], step, init)
        safe = jnp.where(l > 0, l, 1.0)
        out = jnp.where((l > 0)[..., None], acc / safe[..., None], 0.0)
        lse = jnp.where(l > 0, m * scale + jnp.log(safe), jnp.inf)  # inf: p = exp(s - inf) = 0 in the backward
        return out.astype(q.dtype), lse

    out, lse = jax.lax.map(one_q_block, (qT, qsT, qiT))  # [nq, B, K, G * bq, D], [nq, B, K, G * bq]
    out = _from_query_tiles(out, b, tq, hq, block_q)
    return out, (q, k, v, q_seg, kv_seg, q_index, out, lse)


def _forward_vjp(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    out, (*inputs, _, lse) = _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)
    # named so that `trainer.remat: attention` keeps them and the backward does not rerun the loop above
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (*inputs, out, lse)


def _backward(block_q, block_k, res, d_out):
    q, k, v, q_seg, kv_seg, q_index, out, lse = res
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = d**-0.5
    qT, kT, vT, qsT, ksT, qiT = _tiles(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)
    doT = _query_tiles(d_out, block_q, hkv)
    # D_i = rowsum(dO_i * O_i): [nq, B, K, G * bq]
    deltaT = jnp.sum(doT.astype(jnp.float32) * _query_tiles(out, block_q, hkv).astype(jnp.float32), axis=-1)

    def one_k_block(dq, xs):
        kb, vb, ks, j = xs

        def update(masked: bool, dkv, i):
            dk, dv = dkv
            qb, do = qT[i], doT[i]
            p = jnp.exp(_tile_dot(qb, kb) * scale - lse[i][..., None])  # [B, K, G * bq, bk]
            if masked:
                p = jnp.where(_tile_mask(qsT[i], ks, qiT[i], j * block_k, g), p, 0.0)
            dv = dv + jnp.einsum("bkrs,bkrd->bksd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
            ds = p * (_tile_dot(do, vb) - deltaT[i][..., None]) * scale
            dk = dk + jnp.einsum("bkrs,bkrd->bksd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkrs,bksd->bkrd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
            return (dk, dv), dq_i

        def step(dkv, i):
            kind = _tile_kind(qsT[i], ks, qiT[i], j * block_k, block_k)
            skip = lambda c: (c, jnp.zeros(qT.shape[1:], jnp.float32))  # noqa: E731
            return jax.lax.switch(kind, [skip, lambda c: update(True, c, i), lambda c: update(False, c, i)], dkv)

        zeros = jnp.zeros((b, hkv, block_k, d), jnp.float32)
        (dk, dv), dq_tiles = jax.lax.scan(step, (zeros, zeros), jnp.arange(qT.shape[0]))
        return dq + dq_tiles, (dk, dv)

    dq0 = jnp.zeros(qT.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_k_block, dq0, (kT, vT, ksT, jnp.arange(kT.shape[0], dtype=jnp.int32)))
    return (_from_query_tiles(dq, b, tq, hq, block_q).astype(q.dtype), _from_key_tiles(dk, tk).astype(k.dtype),
            _from_key_tiles(dv, tk).astype(v.dtype), None, None, None)


_blockwise.defvjp(_forward_vjp, _backward)
