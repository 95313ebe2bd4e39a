"""Attention implementations the model can call, selected by `attention_impl`.

Every implementation takes q [B, Tq, Hq, D], k / v [B, Tk, Hkv, D] (GQA: Hq is
a multiple of Hkv, K/V are never repeated in memory) and an `AttentionMask`,
and returns [B, Tq, Hq, D].

- `xla`: plain einsum + masked softmax in float32; the reference.
- `blockwise`: plain JAX, online softmax over key/value blocks with a recomputing custom VJP: O(T x block)
  memory in forward and backward (`blockwise_attention.py`); calls with one query block use `xla`.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` on GPU.
- `pallas`: the kernels in `ulorl_jax.kernels`: flash attention for the
  training forward (splash attention on TPU); in the KV-cache path, one new
  token per slot (generation) runs the split-KV decode kernel with the cache's
  segment ids (left padding stays masked); multi-token prefill into a cache
  uses `blockwise` (logged once).

A backend that cannot serve a call falls back to `blockwise` (the default: `xla` for calls of one query
block, e.g. decode) and logs why, once.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp

from ulorl_jax.models.attention_xla import (  # noqa: F401  (re-exported)
    ATTENTION_LSE,
    ATTENTION_OUT,
    AttentionMask,
    xla_attention,
)
from ulorl_jax.models.fallback import warn_once

log = logging.getLogger(__name__)


AttentionFn = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray, AttentionMask], jnp.ndarray]


def cudnn_attention(q, k, v, mask: AttentionMask) -> jnp.ndarray:
    if jax.default_backend() != "gpu":
        warn_once(log, "cudnn-platform", f"attention_impl=cudnn needs a GPU (backend is {jax.default_backend()}); using blockwise")
        return blockwise_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], implementation="cudnn")


def pallas_attention(q, k, v, mask: AttentionMask) -> jnp.ndarray:
    if not mask.is_self_attention and q.shape[1] != 1:
        warn_once(log, "pallas-prefill", "attention_impl=pallas: multi-token prefill into a KV cache "
                  "has no kernel (the decode kernel takes one query per slot); using blockwise")
        return blockwise_attention(q, k, v, mask)
    try:
        from ulorl_jax import kernels
    except ImportError as err:  # pragma: no cover - depends on the install
        warn_once(log, "pallas-import", f"attention_impl=pallas unavailable ({err}); using blockwise")
        return blockwise_attention(q, k, v, mask)
    if not hasattr(kernels, "attention"):
        warn_once(log, "pallas-missing", "attention_impl=pallas: ulorl_jax.kernels has no attention(); "
                  "using blockwise")
        return blockwise_attention(q, k, v, mask)
    if not mask.is_self_attention:
        # Generation: one query per slot at cache slot q_index; it may see slots
        # 0..q_index of its own segment (the dense mask's rule, as lengths + ids).
        out = kernels.decode(q[:, 0], k, v, mask.q_index[:, 0] + 1, q_segment_ids=mask.q_segment_ids[:, 0],
                             kv_segment_ids=mask.kv_segment_ids, impl="pallas")  # [B, H, Dh]
        return out[:, None]
    return kernels.attention(q, k, v, causal=True, segment_ids=mask.q_segment_ids, impl="pallas")


def blockwise_attention(q, k, v, mask: AttentionMask) -> jnp.ndarray:
    from ulorl_jax.models.blockwise_attention import blockwise_attention as blockwise

    return blockwise(q, k, v, mask)


def paged_attention(impl: str, q, k_pages, v_pages, page_table, mask: AttentionMask, owners=None) -> jnp.ndarray:
    """Attention over a paged KV cache (models/paged_kv.py): q [B, T, Hq, D], pools [P, page, Hkv, D],
    page_table [B, W], `mask` over the pages' dense view [B, W x page]. One query per slot (decode): `pallas`
    reads the pages in place (`kernels.paged_decode`), `xla` / `blockwise` read every page once by its owner
    (`paged_kv.ragged_decode_attention`); every other call gathers the pages into a dense view and runs
    `impl` on it."""
    if impl == "pallas" and q.shape[1] == 1:
        try:
            from ulorl_jax import kernels
        except ImportError as err:  # pragma: no cover - depends on the install
            warn_once(log, "pallas-import", f"attention_impl=pallas unavailable ({err}); using blockwise")
        else:
            if hasattr(kernels, "paged_decode"):
                # Slot b may see positions 0..q_index (its cache plus this token); an idle slot's output
                # is ignored by the engine.
                return kernels.paged_decode(q[:, 0], k_pages, v_pages, page_table, mask.q_index[:, 0] + 1,
                                            impl="pallas")[:, None]
    from ulorl_jax.models.paged_kv import gather_pages, ragged_decode_attention

    if q.shape[1] == 1 and impl in ("xla", "blockwise"):
        # Decode: read each page once, by its owner (the gather below costs slots x the longest sample).
        return ragged_decode_attention(q[:, 0], k_pages, v_pages, page_table, mask.q_index[:, 0] + 1,
                                       owners)[:, None]
    k = gather_pages(k_pages, page_table).astype(q.dtype)
    v = gather_pages(v_pages, page_table).astype(q.dtype)
    return get_attention_impl(impl)(q, k, v, mask)


_IMPLS: dict[str, AttentionFn] = {"xla": xla_attention, "cudnn": cudnn_attention, "pallas": pallas_attention,
                                  "blockwise": blockwise_attention}


def register_attention_impl(name: str, fn: AttentionFn) -> None:
    """Plug in another attention backend under `attention_impl=name`."""
    _IMPLS[name] = fn


def get_attention_impl(name: str) -> AttentionFn:
    if name not in _IMPLS:
        raise ValueError(f"attention_impl={name!r} is not registered; available: {sorted(_IMPLS)}")
    return _IMPLS[name]
