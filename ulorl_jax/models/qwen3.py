"""Qwen3 dense and Qwen3-MoE decoders in Flax NNX, exact against transformers.

Shapes: B batch, T new tokens, S key/cache length, D hidden, H query heads,
K kv heads, Dh head dim, F MLP width, V vocab.

Three ways in:
- `model(tokens, ...)` -> logits [B, T, V] (the DESIGN.md contract);
- `model.forward(tokens, ...)` -> `ForwardOutput` (hidden states, logits
  optional, router logits and the MoE auxiliary loss) for the learner;
- `model.decode_step(tokens, cache, ...)` -> (logits, cache): incremental
  decoding over a pre-allocated `KVCache`, prefill chunks and single tokens alike.

Masking is described by segment ids (0 = padding) and positions: padded
batches pass `attention_mask`, packed rows pass `segment_ids` (positions then
restart at each segment unless given).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ulorl_jax.models.attention import (
    ATTENTION_OUT,
    AttentionMask,
    get_attention_impl,
    paged_attention,
)
from ulorl_jax.models.config import ModelConfig, resolve_dtype
from ulorl_jax.models.context_attention import context_parallel_attention
from ulorl_jax.models.fallback import warn_once
from ulorl_jax.models.layer_scan import scan_layers, unscannable
from ulorl_jax.models.moe import SparseMoeBlock, load_balancing_loss
from ulorl_jax.models.paged_kv import (
    PagedKVCache,
    PagedLayerKV,
    cached_segments,
    page_owners,
    write_pages,
)
from ulorl_jax.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from ulorl_jax.sharding import constrain, context_mesh, context_size, param_shardings

log = logging.getLogger(__name__)


class KVCache(NamedTuple):
    """Pre-allocated per-slot cache. A pytree: pass it in and out of jit."""

    k: tuple[jnp.ndarray, ...]  # per layer [B, S, K, Dh]
    v: tuple[jnp.ndarray, ...]  # per layer [B, S, K, Dh]
    segment_ids: jnp.ndarray  # [B, S] int32, 0 = empty / padding
    index: jnp.ndarray  # [B] int32, next slot to write
    position: jnp.ndarray  # [B] int32, RoPE position of the next real token

    @property
    def max_len(self) -> int:
        return self.segment_ids.shape[1]


class ForwardOutput(NamedTuple):
    hidden: jnp.ndarray  # [B, T, D] after the final norm
    logits: jnp.ndarray | None  # [B, T, V]
    router_logits: tuple[jnp.ndarray, ...]  # per MoE layer [B*T, E]
    aux_loss: jnp.ndarray  # scalar load-balancing loss (unscaled), 0 for dense models


def _normal(rngs: nnx.Rngs, shape, dtype, axes):
    return nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        # As transformers: normalise in float32, cast back, then scale.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention with per-head q_norm / k_norm (Qwen3) and RoPE."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        pdtype = resolve_dtype(config.param_dtype)
        self.config = config
        self.q_proj = _normal(rngs, (d, h, dh), pdtype, ("embed", "q_heads", "head_dim"))
        self.k_proj = _normal(rngs, (d, k, dh), pdtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _normal(rngs, (d, k, dh), pdtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _normal(rngs, (h, dh, d), pdtype, ("q_heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(dh, config.rms_norm_eps, pdtype)
        self.k_norm = RMSNorm(dh, config.rms_norm_eps, pdtype)

    def __call__(self, x, cos, sin, mask: AttentionMask, kv=None):
        """x [B, T, D]. Without `kv`, keys are this call's tokens. With `kv` =
        (k_cache, v_cache, write_index [B]) the new keys are written into the
        cache first and attention runs over the whole cache."""
        dt = x.dtype
        q = self.q_norm(jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt)))  # [B, T, H, Dh]
        k = self.k_norm(jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt)))  # [B, T, K, Dh]
        v = jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = None
        if isinstance(kv, PagedLayerKV):
            return self._paged(q, k, v, mask, kv, dt)
        if kv is not None:
            k_cache, v_cache, index = kv
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0, 0)))
            k = write(k_cache, k.astype(k_cache.dtype), index)  # [B, S, K, Dh]
            v = write(v_cache, v.astype(v_cache.dtype), index)
            new_kv = (k, v)
            k, v = k.astype(dt), v.astype(dt)
        mesh = context_mesh()
        if kv is None and context_size(mesh) > 1:  # rows split over `context` (models/context_attention.py)
            out = context_parallel_attention(self.config.attention_impl, q, k, v, mask, mesh)
        else:
            out = get_attention_impl(self.config.attention_impl)(q, k, v, mask)  # [B, T, H, Dh]
        out = checkpoint_name(out, ATTENTION_OUT)  # kept by the remat policy `attention`
        return jnp.einsum("bthk,hkd->btd", out, self.o_proj[...].astype(dt)), new_kv

    def _paged(self, q, k, v, mask: AttentionMask, kv: PagedLayerKV, dt):
        """Append k / v to the slots' pages, then attend over them (models/paged_kv.py)."""
        k_pool = write_pages(kv.k, kv.page_table, kv.index, k)
        v_pool = write_pages(kv.v, kv.page_table, kv.index, v)
        out = paged_attention(self.config.attention_impl, q, k_pool, v_pool, kv.page_table, mask, kv.owners)
        return jnp.einsum("bthk,hkd->btd", out, self.o_proj[...].astype(dt)), (k_pool, v_pool)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        pdtype = resolve_dtype(config.param_dtype)
        self.gate_proj = _normal(rngs, (d, f), pdtype, ("embed", "mlp"))
        self.up_proj = _normal(rngs, (d, f), pdtype, ("embed", "mlp"))
        self.down_proj = _normal(rngs, (f, d), pdtype, ("mlp", "embed"))

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))  # [B, T, F]
        return h @ self.down_proj[...].astype(dt)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pdtype = resolve_dtype(config.param_dtype)
        self.is_moe = config.is_moe_layer(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pdtype)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pdtype)
        self.mlp = SparseMoeBlock(config, rngs=rngs) if self.is_moe else MLP(config, rngs=rngs)

    def __call__(self, x, cos, sin, mask, kv=None):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        x = x + attn_out
        h = self.post_attention_layernorm(x)
        router_logits = None
        if self.is_moe:
            h, router_logits = self.mlp(h)
        else:
            h = self.mlp(h)
        return x + h, new_kv, router_logits


# On CPU, the full logits of more than this many positions (`forward`'s, and `decode_step`'s for a long
# prefill chunk) are computed in pieces of the token axis of about this many positions each. As one matmul,
# XLA:CPU fuses the final norm into it and holds a second logits-sized buffer outside its own accounting:
# `model(tokens)` at 1 x 8,192 positions, vocab 2,048 grew RSS by 193 MiB, in pieces by 133, and ran no
# slower (benchmarks/results/compare.md).
CPU_LOGITS_PIECE = 4096


def project_logits(hidden: jnp.ndarray, lm_head: jnp.ndarray) -> jnp.ndarray:
    """hidden [B, T, D] @ lm_head [D, V] -> logits [B, T, V]; in pieces of the T axis on CPU (see
    CPU_LOGITS_PIECE; other backends' compilers place one matmul's output well)."""
    b, t, _ = hidden.shape
    if jax.default_backend() != "cpu" or b * t <= CPU_LOGITS_PIECE:
        return hidden @ lm_head
    step = max(1, CPU_LOGITS_PIECE // b)
    return jnp.concatenate([hidden[:, i:i + step] @ lm_head for i in range(0, t, step)], axis=1)


def positions_from_segments(segment_ids: jnp.ndarray) -> jnp.ndarray:
    """Positions restarting at 0 at each new segment: [B, T] -> [B, T]."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    is_start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=1)
    return idx - start


class Qwen3ForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        pdtype = resolve_dtype(config.param_dtype)
        self.config = config
        self.embed_tokens = _normal(rngs, (config.vocab_size, config.hidden_size), pdtype, ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pdtype)
        if not config.tie_word_embeddings:
            self.lm_head = _normal(rngs, (config.hidden_size, config.vocab_size), pdtype, ("embed", "vocab"))
        inv_freq, attention_factor = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self._inv_freq = tuple(float(f) for f in inv_freq)  # host constant, not a parameter
        self._rope_factor = attention_factor

    # -- pieces the learner reuses -----------------------------------------------------

    def lm_head_weight(self) -> jnp.ndarray:
        """[D, V]: the output projection (the embedding transposed when tied)."""
        return self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def _embed(self, tokens):
        dt = resolve_dtype(self.config.dtype)
        # Under a mesh the table's embed dim is gathered first (ZeRO-3), so the lookup follows the tokens'
        # batch sharding. An fsdp-sharded embed dim would otherwise either shard the activations on D with
        # the whole batch on every device, or make the gradient's scatter-add replicate d(x) [B, T, D]
        # ("Involuntary full rematerialization" from the SPMD partitioner).
        table = constrain(self.embed_tokens[...], ("vocab", None))  # [V, D]
        return jnp.take(table, tokens, axis=0).astype(dt)

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self._inv_freq, self._rope_factor, dtype)

    # -- full forward -----------------------------------------------------------------

    def forward(self, tokens, *, positions=None, segment_ids=None, attention_mask=None,
                compute_logits: bool = True, remat_policy=None, scan: bool = False) -> ForwardOutput:
        """tokens [B, T] int32. `attention_mask` [B, T] (1 = real) for padded
        batches; `segment_ids` [B, T] (>0, 0 = padding) for packed rows.
        Default positions: per segment (packed), else count of real tokens before.

        The one training / scoring forward (the learner calls it): `remat_policy` (a
        `jax.checkpoint_policies` policy, None = keep every activation) wraps each decoder layer
        in `nnx.remat`, so the backward pass keeps one layer's activations at a time; `scan` runs
        the layers as one `lax.scan` over their stacked weights (models/layer_scan.py; models
        whose layers differ run unrolled, with a warning).

        Context parallelism: traced under a mesh context (`sharding.mesh_context`) whose `context` axis is
        > 1, the rows must come in the load-balanced layout of models/context_layout.py (the learner lays
        them out so), with `positions` and `segment_ids` given in that layout."""
        b, t = tokens.shape
        if context_size() > 1 and (positions is None or segment_ids is None):
            raise ValueError("forward under a mesh with context > 1 needs positions and segment_ids in the "
                             "load-balanced layout (models/context_layout.py); natural-order defaults would be "
                             "wrong")
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
            if positions is None:
                positions = jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0)
        elif positions is None:
            positions = positions_from_segments(segment_ids)
        segment_ids = segment_ids.astype(jnp.int32)
        x = self._embed(tokens)
        cos, sin = self._rope(positions, x.dtype)
        x, router_logits = self._packed_layers(x, cos, sin, segment_ids, remat_policy, scan)
        hidden = self.norm(x)
        logits = project_logits(hidden, self.lm_head_weight().astype(hidden.dtype)) if compute_logits else None
        aux = jnp.zeros((), jnp.float32)
        if router_logits:  # padding (segment 0) is left out, as transformers does with attention_mask
            aux = load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok,
                                      segment_ids.reshape(-1) != 0)
        return ForwardOutput(hidden, logits, tuple(router_logits), aux)

    def _packed_layers(self, x, cos, sin, segment_ids, remat_policy, scan: bool) -> tuple[jnp.ndarray, list]:
        """The decoder layers over packed rows (self-attention within segments) -> (x, router logits)."""
        b, t = segment_ids.shape
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def layer_fn(layer, x, cos, sin, seg, idx):  # the mask is built inside: remat / scan take arrays
            y, _, router_logits = layer(x, cos, sin, AttentionMask(seg, seg, idx, is_self_attention=True))
            return y, router_logits

        reason = unscannable(self.layers) if scan else None
        if scan and reason is None:
            x, stacked = scan_layers(self.layers, layer_fn, x, cos, sin, segment_ids, idx, policy=remat_policy,
                                     dtype=x.dtype)
            return x, [] if stacked is None else list(stacked)  # MoE: router logits [L, B*T, E]
        if scan:
            warn_once(log, "scan_layers", f"scan_layers: running the layers unrolled ({reason})")
        call = layer_fn if remat_policy is None else nnx.remat(layer_fn, policy=remat_policy)
        router_logits = []
        for layer in self.layers:
            x, rl = call(layer, x, cos, sin, segment_ids, idx)
            if rl is not None:
                router_logits.append(rl)
        return x, router_logits

    def __call__(self, tokens, *, positions=None, segment_ids=None, attention_mask=None) -> jnp.ndarray:
        return self.forward(tokens, positions=positions, segment_ids=segment_ids,
                            attention_mask=attention_mask).logits

    # -- incremental decode -----------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        dtype = resolve_dtype(dtype or cfg.dtype)
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        return KVCache(zeros, zeros, jnp.zeros((batch, max_len), jnp.int32),
                       jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))

    def decode_step(self, tokens, cache: KVCache | PagedKVCache, *, attention_mask=None, positions=None):
        """Append tokens [B, T] to each slot's cache and return (logits [B, T, V], cache).

        T may be a prompt chunk (prefill) or 1 (generation). `attention_mask`
        marks padding inside `tokens` (e.g. left-padded prompts); padded tokens
        take cache slots but are never attended to by real tokens. The caller
        keeps `cache.index + T <= cache.max_len` (the engine checks it). A `PagedKVCache`
        (models/paged_kv.py) takes the same call; its slots hold no left padding."""
        b, t = tokens.shape
        real = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        if positions is None:
            positions = cache.position[:, None] + jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
        q_index = cache.index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        paged = isinstance(cache, PagedKVCache)
        if paged:  # every position below a slot's index is real (the engine never left-pads a paged slot)
            kv_segments = cached_segments(cache.index, cache.max_len, real)
        else:
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i,)))
            kv_segments = write(cache.segment_ids, real, cache.index)  # [B, S]
        mask = AttentionMask(real, kv_segments, q_index, is_self_attention=False)
        x = self._embed(tokens)
        cos, sin = self._rope(positions, x.dtype)
        new_k, new_v = [], []
        owners = page_owners(cache.page_table, cache.num_pages) if paged else None  # once, not per layer
        for i, layer in enumerate(self.layers):
            kv = PagedLayerKV(cache.k[i], cache.v[i], cache.page_table, cache.index, owners) if paged else \
                (cache.k[i], cache.v[i], cache.index)
            x, (k, v), _ = layer(x, cos, sin, mask, kv=kv)
            new_k.append(k)
            new_v.append(v)
        hidden = self.norm(x)
        logits = project_logits(hidden, self.lm_head_weight().astype(hidden.dtype))  # a prefill chunk may be long
        moved = dict(k=tuple(new_k), v=tuple(new_v), index=cache.index + t,
                     position=cache.position + jnp.sum(real, axis=1))
        return logits, cache._replace(**moved) if paged else cache._replace(segment_ids=kv_segments, **moved)


def init_model(config: ModelConfig, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised model on the default device (`init_sharded`: directly on a mesh)."""
    return Qwen3ForCausalLM(config, rngs=nnx.Rngs(params=seed))


def init_sharded(config: ModelConfig, mesh: jax.sharding.Mesh, rules: dict | None = None,
                 seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised model created directly in its shardings on `mesh` (no full copy on one
    device); the same weights as `init_model(config, seed)`."""

    def create():
        return Qwen3ForCausalLM(config, rngs=nnx.Rngs(params=seed))

    abstract = nnx.eval_shape(create)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)
