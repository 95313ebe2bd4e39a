"""Token sampling: temperature, top-k, top-p, greedy; with the log-probs RL needs.

Log-prob convention (shared with the learner, see DESIGN.md / models/logprobs.py):
- `logprob` = log softmax(logits / T)[token] for T > 0: the full,
  temperature-scaled policy, with no top-k / top-p. This is what the learner
  recomputes with `temperature=T`, and what SAIS (ULORL.md §2) records as
  pi_old for the token. For T == 0 (greedy) it is log softmax(logits)[token].
- `sampling_logprob` = log-prob under the distribution actually sampled from,
  after top-k then top-p renormalisation (transformers applies them in the
  same order). Greedy picks with probability 1, so it is 0 there. With the
  train defaults (top-k off, top-p 1.0) the two are equal.

Defaults follow ULORL.md §4: train T=0.85, top-p 1.0, top-k off; eval T=0.85,
top-k 20, top-p 0.95.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Hashable, so jitted functions take it as a static argument."""

    temperature: float = 0.85
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p change the distribution (sampling_logprob != logprob)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


TRAIN_SAMPLING = SamplingParams(0.85, 0, 1.0)
EVAL_SAMPLING = SamplingParams(0.85, 20, 0.95)
GREEDY = SamplingParams(0.0, 0, 1.0)


def filter_logits(scaled: jnp.ndarray, top_k: int, top_p: float) -> jnp.ndarray:
    """Top-k then top-p on temperature-scaled logits [..., V]; dropped tokens get -inf.

    Top-k keeps every token whose logit is >= the k-th largest (ties kept).
    Top-p keeps the smallest prefix of tokens, in descending probability, whose
    mass reaches `top_p`: a token is kept iff the mass strictly before it is
    < top_p (so the most likely token is always kept).
    """
    neg_inf = jnp.array(-jnp.inf, scaled.dtype)
    v = scaled.shape[-1]
    if 0 < top_k < v:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]  # [..., 1]
        scaled = jnp.where(scaled >= kth, scaled, neg_inf)
    if top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # [..., V] descending
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < top_p
        keep = jnp.zeros_like(keep_sorted)
        keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
        scaled = jnp.where(keep, scaled, neg_inf)
    return scaled


def argmax_last(x: jnp.ndarray) -> jnp.ndarray:
    """`jnp.argmax(x, axis=-1)` as int32, ties and NaN included (the first maximum; a NaN counts as the
    maximum), written as two plain reductions. XLA:CPU runs argmax's paired (value, index) reduce
    element by element: 48 us for [16, 512] logits against 5 us for this, which the decode step pays
    once per token."""
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one
    hit = (x == top) | jnp.isnan(x)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def categorical(keys: jnp.ndarray, logits: jnp.ndarray) -> jnp.ndarray:
    """One draw per row of logits [B, V] with keys [B] (typed) or [B, 2] (raw): the tokens of
    `jax.vmap(jax.random.categorical)(keys, logits)`, bit for bit (its Gumbel noise, then `argmax_last`
    in place of its argmax)."""
    noise = jax.vmap(lambda k, row: jax.random.gumbel(k, row.shape, row.dtype))(keys, logits)
    return argmax_last(noise + logits)


def _is_batched_key(key: jnp.ndarray) -> bool:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2  # raw uint32 keys [B, 2]


def sample_tokens(logits: jnp.ndarray, key: jnp.ndarray, params: SamplingParams):
    """logits [B, V]; key: one PRNG key (split over rows) or one per row ([B] typed
    or [B, 2] raw uint32). Returns (tokens [B] int32, logprobs [B] f32,
    sampling_logprobs [B] f32), following the convention in the module doc.
    Pure and jit-safe (`params` is static)."""
    logits = logits.astype(jnp.float32)
    if params.greedy:
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
        tokens = argmax_last(logits)
        lp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        return tokens, lp, jnp.zeros_like(lp)
    scaled = logits / params.temperature  # [B, V]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    sampled_from = filter_logits(scaled, params.top_k, params.top_p) if params.filtered else scaled
    keys = key if _is_batched_key(key) else jax.random.split(key, logits.shape[0])
    tokens = categorical(keys, sampled_from)  # [B]
    lp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if not params.filtered:
        return tokens, lp, lp
    slp = jnp.take_along_axis(jax.nn.log_softmax(sampled_from, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, lp, slp
