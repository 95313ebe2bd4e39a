"""A paged KV cache: every slot's keys / values live in fixed-size pages of one shared pool.

Slot b's position p is row `p % page_size` of page `page_table[b, p // page_size]`. A slot holds only the
pages its length needs, so a pool of P pages serves many more slots than P x page_size / max_len when
most samples are short (the long tail of a rollout). Who owns which page is the host's business
(`ulorl_jax.decode.page_pool`); the device sees one page table per call.

Page-table entries past a slot's pages may hold anything, usually `num_pages` (no page): writes through
such an entry are dropped and reads are clamped and masked out by the slot's length. A slot that is idle
(done) still runs through the decode step; its write lands at its frozen length, inside its own pages
(or is dropped when its row is all "no page"), so it never touches another slot's pages.

The XLA path gathers one layer's pages into a dense [B, W x page_size] view and runs the model's usual
attention; `attention_impl: pallas` reads the pages in place (`ulorl_jax.kernels.paged_decode`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PagedKVCache(NamedTuple):
    k: tuple[jnp.ndarray, ...]  # per layer [P, page_size, K, Dh]
    v: tuple[jnp.ndarray, ...]  # per layer [P, page_size, K, Dh]
    page_table: jnp.ndarray  # [B, W] int32 page ids; entries past a slot's pages: any (num_pages = none)
    index: jnp.ndarray  # [B] int32, next position to write (= cached positions)
    position: jnp.ndarray  # [B] int32, RoPE position of the next real token

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        """Positions this call's page table can address: W x page_size."""
        return self.page_table.shape[1] * self.page_size


class PagedLayerKV(NamedTuple):
    """One layer's view of a `PagedKVCache`, as the decode step hands it to the layer."""

    k: jnp.ndarray  # [P, page_size, K, Dh]
    v: jnp.ndarray
    page_table: jnp.ndarray  # [B, W]
    index: jnp.ndarray  # [B]: where this call's first token is written
    owners: tuple[jnp.ndarray, jnp.ndarray] | None = None  # page_owners(page_table), shared by the layers


def init_paged_cache(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype,
                     slots: int, table_width: int) -> PagedKVCache:
    """An empty pool and a page table of `table_width` "no page" entries per slot."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    return PagedKVCache(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                        tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                        jnp.full((slots, table_width), num_pages, jnp.int32),
                        jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32))


def page_addresses(page_table: jnp.ndarray, positions: jnp.ndarray, page_size: int, num_pages: int):
    """(page, row) of each position [B, T] of each slot; positions whose page-table entry lies outside the
    table or holds no page get page id `num_pages` (a scatter with mode="drop" skips them)."""
    col = positions // page_size
    inside = (col >= 0) & (col < page_table.shape[1])
    page = jnp.take_along_axis(page_table, jnp.clip(col, 0, page_table.shape[1] - 1), axis=1)
    page = jnp.where(inside & (page >= 0) & (page < num_pages), page, num_pages)
    return page, positions % page_size


def write_pages(pool: jnp.ndarray, page_table: jnp.ndarray, start: jnp.ndarray, new: jnp.ndarray) -> jnp.ndarray:
    """Write new [B, T, K, Dh] at positions start[b] + t of each slot; pool [P, page_size, K, Dh]."""
    t = new.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    page, row = page_addresses(page_table, positions, pool.shape[1], pool.shape[0])
    return pool.at[page, row].set(new.astype(pool.dtype), mode="drop")


def gather_pages(pool: jnp.ndarray, page_table: jnp.ndarray) -> jnp.ndarray:
    """Every slot's pages as a dense cache [B, W x page_size, K, Dh] (no-page entries read page 0 or the
    last page: masked out by the caller)."""
    b, w = page_table.shape
    pages = jnp.take(pool, jnp.clip(page_table, 0, pool.shape[0] - 1), axis=0)  # [B, W, page, K, Dh]
    return pages.reshape(b, w * pool.shape[1], *pool.shape[2:])


def cached_segments(index: jnp.ndarray, width: int, real: jnp.ndarray) -> jnp.ndarray:
    """The dense cache's segment ids [B, width] for a call appending tokens with `real` [B, T] (1 = real):
    1 below each slot's index, the new tokens' ids at index .. index + T - 1, 0 past them."""
    seg = (jnp.arange(width, dtype=jnp.int32)[None, :] < index[:, None]).astype(jnp.int32)
    write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i,)))
    return write(seg, real.astype(jnp.int32), index)


def insert_rows(cache: PagedKVCache, rows_k, rows_v, lengths: jnp.ndarray, slots: jnp.ndarray) -> PagedKVCache:
    """Copy prefill rows (per layer [R, L, K, Dh], real lengths [R]) into the pages of slots[r] (>= B: a
    padding row, dropped); the slot's index / position become its row's length. Positions past a row's
    pages (its right padding) are dropped or land in its own pages, where decoding overwrites them."""
    b = cache.page_table.shape[0]
    inside = slots < b
    table = jnp.take(cache.page_table, jnp.clip(slots, 0, b - 1), axis=0)  # [R, W]
    table = jnp.where(inside[:, None], table, cache.num_pages)
    zero = jnp.zeros_like(lengths)
    k = tuple(write_pages(pool, table, zero, r) for pool, r in zip(cache.k, rows_k))
    v = tuple(write_pages(pool, table, zero, r) for pool, r in zip(cache.v, rows_v))
    return cache._replace(k=k, v=v, index=cache.index.at[slots].set(lengths, mode="drop"),
                          position=cache.position.at[slots].set(lengths, mode="drop"))


def page_owners(page_table: jnp.ndarray, num_pages: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The page table inverted: for every page of the pool, the slot that owns it (B: nobody) and its
    column in that slot's table (the page holds positions column x page_size ...)."""
    b, w = page_table.shape
    pages = page_table.reshape(-1)
    owner = jnp.full((num_pages,), b, jnp.int32).at[pages].set(
        jnp.repeat(jnp.arange(b, dtype=jnp.int32), w), mode="drop")
    column = jnp.zeros((num_pages,), jnp.int32).at[pages].set(
        jnp.tile(jnp.arange(w, dtype=jnp.int32), b), mode="drop")
    return owner, column


# `owner_rows` multiplies by a one-hot [P, B] matrix up to this many entries and gathers above it.
ONE_HOT_MAX_ENTRIES = 1 << 16


def owner_rows(x: jnp.ndarray, owner: jnp.ndarray) -> jnp.ndarray:
    """x[owner] for rows x [B, N] and owner [P] in [0, B]; an owner of B (a page nobody owns) gets a row of
    zeros or of slot B - 1 (its positions are masked out by the caller).

    For a pool of up to `ONE_HOT_MAX_ENTRIES` pages x slots this is a matmul with a one-hot [P, B] matrix:
    exact (one product by 1 per output), and XLA:CPU runs a gather element by element (25 us per layer
    for 130 pages x 64 values in the tiny bench's decode step, a fifth of the step). Larger pools
    gather: the matmul's work grows with slots x pages. A non-finite row (a broken model) then reaches
    every page through the matmul, instead of its own slot's only."""
    b = x.shape[0]
    if owner.shape[0] * b > ONE_HOT_MAX_ENTRIES:
        return jnp.take(x, jnp.clip(owner, 0, b - 1), axis=0)
    hot = (owner[:, None] == jnp.arange(b, dtype=owner.dtype)[None, :]).astype(x.dtype)  # [P, B]
    return jnp.dot(hot, x, preferred_element_type=x.dtype)


def ragged_decode_attention(q: jnp.ndarray, k_pages: jnp.ndarray, v_pages: jnp.ndarray, page_table: jnp.ndarray,
                            lengths: jnp.ndarray, owners: tuple[jnp.ndarray, jnp.ndarray] | None = None
                            ) -> jnp.ndarray:
    """One query per slot, q [B, Hq, D], against its pages: every page of the pool is read once, by the slot
    that owns it, and each slot's softmax is taken over its own pages (segment max / sum by owner). The work
    is the pool's size whatever the slots' lengths and the table's width, where gathering [B, W x page_size]
    costs slots x the longest sample. Slot b sees positions 0 .. lengths[b] - 1; a slot with none gets 0."""
    b, hq, d = q.shape
    num_pages, page, hkv, _ = k_pages.shape
    g = hq // hkv
    owner, column = page_owners(page_table, num_pages) if owners is None else owners
    positions = column[:, None] * page + jnp.arange(page, dtype=jnp.int32)[None, :]  # [P, page]
    seen = jnp.take(lengths, jnp.clip(owner, 0, b - 1))[:, None]
    valid = (owner < b)[:, None] & (positions < seen)  # [P, page]
    qp = owner_rows(q.reshape(b, hq * d), owner).reshape(num_pages, hkv, g, d)  # [P, K, G, D]
    # One batched matmul per KV head, batched over pages only: with (page, head) batch dims the pool's
    # [P, page, K, D] layout needs a transposed copy per layer (10 % of the tiny bench's decode step at K = 1).
    scores = jnp.stack([jnp.einsum("pgd,prd->pgr", qp[:, h], k_pages[:, :, h].astype(q.dtype),
                                   preferred_element_type=jnp.float32) for h in range(hkv)], axis=1)
    scores = jnp.where(valid[:, None, None, :], scores * (d ** -0.5), -jnp.inf)  # [P, K, G, page]
    top = jax.ops.segment_max(jnp.max(scores, axis=-1), owner, num_segments=b)  # [B, K, G]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(scores - jnp.take(top, jnp.clip(owner, 0, b - 1), axis=0)[..., None])  # 0 where masked
    total = jax.ops.segment_sum(jnp.sum(p, axis=-1), owner, num_segments=b)  # [B, K, G]
    pv = jnp.stack([jnp.einsum("pgr,prd->pgd", p[:, h].astype(v_pages.dtype), v_pages[:, :, h],
                               preferred_element_type=jnp.float32) for h in range(hkv)], axis=1)
    out = jax.ops.segment_sum(pv, owner, num_segments=b)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, hq, d).astype(q.dtype)
