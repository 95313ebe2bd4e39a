"""Plain-jnp attention: the references every Pallas kernel is tested against.

Layout everywhere: q [B, Tq, Hq, D], k / v [B, Tk, Hkv, D] with Hq % Hkv == 0.
Grouped-query attention (GQA): query head h reads kv head h // (Hq // Hkv);
the group axis is split out of q with a free reshape, so K/V are never
repeated in memory.

Masking rules (shared with the kernels):
  * ``segment_ids`` [B, Tq] / ``kv_segment_ids`` [B, Tk]: a query attends only
    to keys with the same id (several samples packed into one row).
  * ``causal``: key index <= query index (requires Tq == Tk).
  * A query row with no allowed key outputs exactly 0 (and gets zero grads).
Logits and softmax are f32; the output is cast back to q.dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["mha_reference", "decode_attention_reference", "paged_decode_attention_reference"]


def _masked_softmax_attend(
    s: jax.Array, mask: jax.Array, v: jax.Array, out_dtype: jnp.dtype
) -> jax.Array:
    """softmax(s) @ v over allowed keys; rows with no allowed key give 0.

    s, mask: [B, Hkv, G, Tq, Tk] (f32 / bool); v: [B, Tk, Hkv, D].
    Returns [B, Tq, Hkv, G, D] in out_dtype.
    """
    s = jnp.where(mask, s, -jnp.inf)
    # Softmax is shift invariant: the max needs no gradient (keeps -inf out of
    # the backward pass); empty rows (max = -inf) shift by 0 instead.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)  # [B, Hkv, G, Tq, Tk]
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    o = jnp.einsum(
        "bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return o.astype(out_dtype)


def mha_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Multi-head / grouped-query attention in plain jnp.

    Args:
      q: [B, Tq, Hq, D].
      k, v: [B, Tk, Hkv, D], Hq % Hkv == 0.
      causal: mask keys after the query (index order; needs Tq == Tk).
      segment_ids: [B, Tq] int32 query segment ids (packed rows).
      kv_segment_ids: [B, Tk] key segment ids; defaults to ``segment_ids``.
      sm_scale: logit scale, default 1 / sqrt(D).

    Returns:
      [B, Tq, Hq, D] in q.dtype.
    """
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if causal and tq != tk:
        raise ValueError(f"causal attention needs Tq == Tk, got {tq} and {tk}")
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

    qg = q.reshape(b, tq, hkv, g, d)  # free reshape: head h = kv_head * G + g
    s = jnp.einsum(
        "bqhgd,bkhd->bhgqk", qg.astype(jnp.float32), k.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ) * scale  # [B, Hkv, G, Tq, Tk]

    mask = jnp.ones((b, 1, 1, tq, tk), dtype=bool)
    if causal:
        mask &= (jnp.arange(tq)[:, None] >= jnp.arange(tk)[None, :])[None, None, None]
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask &= (segment_ids[:, :, None] == kv_seg[:, None, :])[:, None, None]
    elif kv_segment_ids is not None:
        raise ValueError("kv_segment_ids given without segment_ids")

    o = _masked_softmax_attend(s, mask, v, q.dtype)  # [B, Tq, Hkv, G, D]
    return o.reshape(b, tq, hq, d)


def decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """One new query token per sequence against a KV cache.

    Args:
      q: [B, Hq, D], the current token's queries.
      k_cache, v_cache: [B, S, Hkv, D].
      lengths: [B] int, number of valid cache entries; the query attends to
        keys 0 .. lengths[b] - 1 (length 0 gives output 0).
      q_segment_ids, kv_segment_ids: optional [B] / [B, S]: key s is visible
        only if kv_segment_ids[b, s] == q_segment_ids[b] (0 rows give 0).
      sm_scale: logit scale, default 1 / sqrt(D).

    Returns:
      [B, Hq, D] in q.dtype.
    """
    b, hq, d = q.shape
    _, s_len, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

    qg = q.reshape(b, 1, hkv, g, d)
    s = jnp.einsum(
        "bqhgd,bkhd->bhgqk", qg.astype(jnp.float32), k_cache.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ) * scale  # [B, Hkv, G, 1, S]
    valid = jnp.arange(s_len)[None, :] < jnp.asarray(lengths)[:, None]  # [B, S]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        valid &= kv_segment_ids == q_segment_ids[:, None]
    mask = valid[:, None, None, None, :]
    o = _masked_softmax_attend(s, mask, v_cache, q.dtype)  # [B, 1, Hkv, G, D]
    return o.reshape(b, hq, d)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """``decode_attention_reference`` on a paged KV cache.

    Args:
      q: [B, Hq, D], the current token's queries.
      k_pages, v_pages: [P, page_size, Hkv, D], the pool every slot's pages
        live in: slot b's position p is row p % page_size of page
        page_table[b, p // page_size].
      page_table: [B, W] int page ids. Entries past a slot's length may hold
        anything (e.g. P, "no page"): ids are clamped into [0, P) and the
        positions they hold are masked by the length, as are the rows of a
        slot's last page past its length.
      lengths: [B] int; the query attends to positions 0 .. lengths[b] - 1.
      sm_scale: logit scale, default 1 / sqrt(D).

    Returns:
      [B, Hq, D] in q.dtype.
    """
    n_pages, page_size, hkv, d = k_pages.shape
    b, width = page_table.shape
    ids = jnp.clip(page_table, 0, n_pages - 1)  # [B, W]
    # Positions past the length hold whatever the pages do (even NaN): zero
    # them, as 0 * NaN in p @ v would otherwise leak through the mask.
    valid = jnp.arange(width * page_size)[None, :] < jnp.asarray(lengths)[:, None]  # [B, W * page]
    valid = valid[:, :, None, None]

    def dense(pages):  # [B, W, page, Hkv, D] -> [B, W * page, Hkv, D]
        return jnp.where(valid, pages[ids].reshape(b, width * page_size, hkv, d), 0)

    return decode_attention_reference(q, dense(k_pages), dense(v_pages), lengths, sm_scale=sm_scale)
