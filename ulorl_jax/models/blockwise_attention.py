"""Blockwise attention in plain JAX: online softmax over key/value blocks, O(T x block) memory.

`attention_impl: blockwise`. The same contract as `attention.xla_attention` (q [B, Tq, Hq, D], k / v
[B, Tk, Hkv, D], GQA without repeating K/V, any `AttentionMask`: segment ids and causal in cache order),
but the [B, H, Tq, Tk] scores are never materialised: queries are split into blocks of `block_q`, keys
into blocks of `block_k`, and each (query block, key block) pair that the causal rule does not rule out
(a key block that starts after the query block's last visible slot is skipped) updates a running max,
normaliser and output (the flash-attention recurrence). The backward pass is a custom VJP that
recomputes each block's probabilities from the saved log-sum-exp, so the backward holds O(T x block)
too. Calls with at most one query block (decode, short rows) take the plain materialised path, which
is exact the same math and faster there.

Queries with no visible key (only the padding added here to fill the last block) output 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ulorl_jax.models.attention_xla import AttentionMask, xla_attention

BLOCK_Q = 256
BLOCK_K = 256
_NEG = -1e30  # finite: exp(_NEG - m) == 0 without inf - inf


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


def _blocks(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    """Padded, blocked views: q [nq, B, bq, K, G, D], k / v [nk, B, bk, K, D], ids per block."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    q = _pad(q, 1, block_q).reshape(b, -1, block_q, hkv, hq // hkv, d).swapaxes(0, 1)
    k = _pad(k, 1, block_k).reshape(b, -1, block_k, hkv, d).swapaxes(0, 1)
    v = _pad(v, 1, block_k).reshape(b, -1, block_k, hkv, d).swapaxes(0, 1)
    # padded queries see nothing (-2 matches no key); padded keys are seen by nobody (-1)
    q_seg = _pad(q_seg, 1, block_q, -2).reshape(b, -1, block_q).swapaxes(0, 1)
    kv_seg = _pad(kv_seg, 1, block_k, -1).reshape(b, -1, block_k).swapaxes(0, 1)
    q_index = _pad(q_index, 1, block_q, -1).reshape(b, -1, block_q).swapaxes(0, 1)
    return q, k, v, q_seg, kv_seg, q_index


def _scores(qb, kb, qs, ks, qi, kv_start, scale):
    """Masked scores [B, K, G, bq, bk] (f32) of one block pair and the mask."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
    kv_pos = kv_start + jnp.arange(kb.shape[1], dtype=jnp.int32)
    allowed = (qs[:, :, None] == ks[:, None, :]) & (kv_pos[None, None, :] <= qi[:, :, None])  # [B, bq, bk]
    allowed = allowed[:, None, None]
    return jnp.where(allowed, s, _NEG), allowed


def _visible(qi, kv_start):
    """Whether any query of the block may see a key at or after kv_start (causal in cache order)."""
    return kv_start <= jnp.max(qi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    return _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)[0]


def _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5
    qB, kB, vB, qsB, ksB, qiB = _blocks(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)
    nk = kB.shape[0]

    def one_q_block(args):
        qb, qs, qi = args  # [B, bq, K, G, D], [B, bq], [B, bq]

        def step(j, carry):
            m, l, acc = carry

            def update(carry):
                m, l, acc = carry
                s, allowed = _scores(qb, kB[j], qs, ksB[j], qi, j * block_k, scale)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [B, K, G, bq]
                p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                l = l * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vB.dtype), vB[j], preferred_element_type=jnp.float32)
                return m_new, l, acc * corr[..., None] + pv

            return jax.lax.cond(_visible(qi, j * block_k), update, lambda c: c, carry)

        init = (jnp.full((b, hkv, g, block_q), _NEG, jnp.float32), jnp.zeros((b, hkv, g, block_q), jnp.float32),
                jnp.zeros((b, hkv, g, block_q, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, nk, step, init)
        safe = jnp.where(l > 0, l, 1.0)
        out = jnp.where((l > 0)[..., None], acc / safe[..., None], 0.0)  # [B, K, G, bq, D]
        lse = jnp.where(l > 0, m + jnp.log(safe), jnp.inf)  # inf: p = exp(s - inf) = 0 in the backward
        return out, lse

    out, lse = jax.lax.map(one_q_block, (qB, qsB, qiB))  # [nq, B, K, G, bq, D], [nq, B, K, G, bq]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, -1, hq, d)[:, :tq].astype(q.dtype)
    return out, (q, k, v, q_seg, kv_seg, q_index, out, lse)


def _forward_vjp(q, k, v, q_seg, kv_seg, q_index, block_q, block_k):
    return _forward(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)


def _backward(block_q, block_k, res, d_out):
    q, k, v, q_seg, kv_seg, q_index, out, lse = res
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = d**-0.5
    qB, kB, vB, qsB, ksB, qiB = _blocks(q, k, v, q_seg, kv_seg, q_index, block_q, block_k)
    nq, nk = qB.shape[0], kB.shape[0]
    doB = _pad(d_out, 1, block_q).reshape(b, nq, block_q, hkv, g, d).swapaxes(0, 1)
    oB = _pad(out, 1, block_q).reshape(b, nq, block_q, hkv, g, d).swapaxes(0, 1)
    # D_i = rowsum(dO_i * O_i): [nq, B, K, G, bq]
    deltaB = jnp.einsum("nbqkgd,nbqkgd->nbkgq", doB.astype(jnp.float32), oB.astype(jnp.float32))

    def one_k_block(carry, xs):
        dq = carry  # [nq, B, bq, K, G, D] f32
        kb, vb, ks, j = xs

        def step(i, inner):
            dq, dk, dv = inner

            def update(inner):
                dq, dk, dv = inner
                s, allowed = _scores(qB[i], kb, qsB[i], ks, qiB[i], j * block_k, scale)
                p = jnp.where(allowed, jnp.exp(s - lse[i][..., None]), 0.0)  # [B, K, G, bq, bk]
                do = doB[i]
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", do, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - deltaB[i][..., None]) * scale
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qB.dtype), qB[i],
                                     preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
                return dq.at[i].add(dq_i), dk, dv

            return jax.lax.cond(_visible(qiB[i], j * block_k), update, lambda c: c, inner)

        zeros_kv = jnp.zeros((b, block_k, hkv, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, nq, step, (dq, zeros_kv, zeros_kv))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qB.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_k_block, dq0, (kB, vB, ksB, jnp.arange(nk, dtype=jnp.int32)))
    dq = dq.swapaxes(0, 1).reshape(b, -1, hq, d)[:, :tq].astype(q.dtype)
    dk = dk.swapaxes(0, 1).reshape(b, -1, hkv, d)[:, :tk].astype(k.dtype)
    dv = dv.swapaxes(0, 1).reshape(b, -1, hkv, d)[:, :tk].astype(v.dtype)
    return dq, dk, dv, None, None, None


_blockwise.defvjp(_forward_vjp, _backward)
