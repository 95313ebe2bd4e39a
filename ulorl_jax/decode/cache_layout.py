"""Where the engine keeps its KV cache: the one interface between the engine and the cache layout.

Two layouts, the same calls:
- dense: one pre-allocated `KVCache` [slots, max_cache_len]; a request's keys / values at positions
  0..length-1 of its slot's row (the reference, and what JetStream's `insert` writes into);
- paged: a `PagedKVCache` (models/paged_kv.py), a pool of fixed-size pages that the slots share through
  a page table; the host decides which slot owns which page (decode/page_pool.py).
The engine (and nothing above it: the rollout never sees a cache) touches the cache only through these
functions:

    init_slots(model, slots, max_len, pages)   an empty cache for every slot (pages: None = dense)
    prefill_cache(model, rows, length)         a dense scratch cache for a prefill batch [rows, length]
    insert_prefix(cache, prefix_cache, slot)   one prefilled request into one slot (JetStream's insert)
    insert_rows(cache, rows_cache, slots)      a prefill batch's rows into their slots, one call;
                                               a slot index >= slots drops the row (padding)
    cache_specs(cache, mesh, rows)             its PartitionSpecs on a mesh

All are pure and jit-safe.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ulorl_jax.decode.page_pool import pages_for
from ulorl_jax.models import paged_kv
from ulorl_jax.models.config import resolve_dtype
from ulorl_jax.models.paged_kv import PagedKVCache
from ulorl_jax.models.qwen3 import KVCache
from ulorl_jax.sharding import DEFAULT_PARAM_RULES, axis_size


class Pages(NamedTuple):
    """A paged cache's size: `num_pages` pages of `page_size` positions."""

    num_pages: int
    page_size: int


def init_slots(model, slots: int, max_len: int, pages: Pages | None = None) -> KVCache | PagedKVCache:
    """An empty cache for `slots` slots of up to `max_len` positions: dense rows, or a pool of pages
    (an empty page table as wide as a slot's most pages; the engine ships the real one with each call)."""
    if pages is None:
        return model.init_cache(slots, max_len)
    cfg = model.config
    return paged_kv.init_paged_cache(cfg.num_hidden_layers, pages.num_pages, pages.page_size,
                                     cfg.num_key_value_heads, cfg.head_dim, resolve_dtype(cfg.dtype), slots,
                                     pages_for(max_len, pages.page_size))


def prefill_cache(model, rows: int, length: int) -> KVCache:
    """A fresh scratch cache for a prefill batch of `rows` rows padded to `length` tokens."""
    return model.init_cache(rows, length)


def insert_prefix(cache: KVCache, prefix: KVCache, slot) -> KVCache:
    """Copy a one-row prefix cache [1, L <= S] into row `slot` of `cache` [B, S]; the rest of the row is
    zeroed (segment id 0: never attended to). Dense caches only (JetStream's orchestrator)."""
    if isinstance(cache, PagedKVCache):
        raise ValueError("a paged KV cache takes prefilled requests through `insert_rows` (PolicyEngine.run); "
                         "JetStream's one-request insert needs kv_cache='dense'")
    s, length = cache.max_len, prefix.max_len

    def put_row(full, row):  # full [B, S, ...], row [1, L, ...] -> slot's row = row, zero-padded to S
        pad = [(0, 0), (0, s - length)] + [(0, 0)] * (row.ndim - 2)
        return jax.lax.dynamic_update_slice_in_dim(full, jnp.pad(row, pad).astype(full.dtype), slot, axis=0)

    return KVCache(
        k=tuple(put_row(a, b) for a, b in zip(cache.k, prefix.k)),
        v=tuple(put_row(a, b) for a, b in zip(cache.v, prefix.v)),
        segment_ids=put_row(cache.segment_ids, prefix.segment_ids),
        index=cache.index.at[slot].set(prefix.index[0]),
        position=cache.position.at[slot].set(prefix.position[0]),
    )


def insert_rows(cache: KVCache | PagedKVCache, rows: KVCache, slots: jnp.ndarray) -> KVCache | PagedKVCache:
    """Copy row r of `rows` [R, L <= S] into row slots[r] of `cache` [B, S] for every r in one scatter;
    rows whose slot is out of range (>= B: padding rows of a prefill batch) are dropped. Keys / values
    are written at positions [0, L) only (a scatter of the rows' size, not of whole slot rows: the
    cost does not grow with max_cache_len); the slot's segment ids are rewritten whole, so whatever
    an earlier request left past L is never attended to (segment id 0)."""
    if isinstance(cache, PagedKVCache):  # into the slots' pages (the rows hold no left padding)
        return paged_kv.insert_rows(cache, rows.k, rows.v, rows.index, slots)
    s = cache.max_len
    length = rows.max_len
    pos = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, L]
    at = (slots[:, None], pos)  # scatter indices [R, L]

    def put(full, part):  # full [B, S, K, Dh], part [R, L, K, Dh]
        return full.at[at].set(part.astype(full.dtype), mode="drop")

    seg = jnp.pad(rows.segment_ids, [(0, 0), (0, s - length)])  # [R, S]
    return KVCache(
        k=tuple(put(a, r) for a, r in zip(cache.k, rows.k)),
        v=tuple(put(a, r) for a, r in zip(cache.v, rows.v)),
        segment_ids=cache.segment_ids.at[slots].set(seg.astype(cache.segment_ids.dtype), mode="drop"),
        index=cache.index.at[slots].set(rows.index, mode="drop"),
        position=cache.position.at[slots].set(rows.position, mode="drop"),
    )


def cache_specs(cache: KVCache | PagedKVCache, mesh, rows) -> KVCache | PagedKVCache:
    """PartitionSpecs: slots over `rows` (mesh axes or None), heads over the kv_heads rule when they
    divide, positions and head_dim whole. A paged pool is shared by every slot, so it is split over heads
    only (each slot shard holds the whole pool of its heads)."""
    heads = DEFAULT_PARAM_RULES["kv_heads"]
    kv_heads = cache.k[0].shape[2] if cache.k else 0
    heads = heads if heads is not None and kv_heads % axis_size(mesh, heads) == 0 else None
    if isinstance(cache, PagedKVCache):
        pool = P(None, None, heads, None)
        return PagedKVCache(k=tuple(pool for _ in cache.k), v=tuple(pool for _ in cache.v),
                            page_table=P(rows, None), index=P(rows), position=P(rows))
    kv = P(rows, None, heads, None)
    return KVCache(k=tuple(kv for _ in cache.k), v=tuple(kv for _ in cache.v), segment_ids=P(rows, None),
                   index=P(rows), position=P(rows))
