"""The attention mask every path takes, and the materialised XLA attention: the reference the other
paths (blockwise, Pallas, cuDNN) are tested against and fall back to."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Checkpoint names (`jax.ad_checkpoint.checkpoint_name`) of every path's attention output and of the blockwise
# path's log-sum-exp: the learner's remat policy `attention` saves them, so that the backward pass does not
# rerun the O(T^2) attention forward.
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Who may attend to whom.

    A query (b, t) may attend to key (b, s) iff their segment ids are equal and
    `s <= q_index[b, t]` (causal in cache order). Segment id 0 marks padding
    (and empty cache slots); padded queries only see padding, so their rows
    stay finite and are ignored downstream.
    """

    q_segment_ids: jnp.ndarray  # [B, Tq] int32
    kv_segment_ids: jnp.ndarray  # [B, Tk] int32
    q_index: jnp.ndarray  # [B, Tq] int32: the query's own slot in the key axis
    is_self_attention: bool = True  # keys are exactly the queries (no cache)

    def dense(self) -> jnp.ndarray:
        """Boolean mask [B, Tq, Tk]."""
        tk = self.kv_segment_ids.shape[1]
        same_segment = self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :]
        causal = jnp.arange(tk, dtype=jnp.int32)[None, None, :] <= self.q_index[:, :, None]
        return same_segment & causal


@jax.custom_vjp
def _softmax(scores: jnp.ndarray) -> jnp.ndarray:
    """`jax.nn.softmax` over the last axis, whose backward takes the row sum Σ_s g_s y_s as a contraction:
    XLA:CPU runs autodiff's fused reduce(g * y) over [B, K, G, T, S] about 5x slower (jax 0.10.2)."""
    return jax.nn.softmax(scores, axis=-1)


def _softmax_fwd(scores):
    probs = jax.nn.softmax(scores, axis=-1)
    return probs, probs


def _softmax_bwd(probs, g):
    return (probs * (g - jnp.einsum("...s,...s->...", g, probs)[..., None]),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def xla_attention(q, k, v, mask: AttentionMask) -> jnp.ndarray:
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, tq, hkv, hq // hkv, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (d**-0.5)
    allowed = mask.dense()[:, None, None, :, :]  # [B, 1, 1, T, S]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = _softmax(scores).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, tq, hq, d)
