"""verl's policy-loss family as registered pure per-token losses, for any token layout.

Each loss (`POLICY_LOSSES`, chosen by `algorithm.loss_mode`, verl's `actor.policy_loss.loss_mode`) maps
the tokens of a batch to a per-token loss ℓ_t; the aggregation is one weighted sum, Σ_t w_t · ℓ_t, with
the weights of `aggregation_weights` (verl's `agg_loss` modes). The weights are global to a mini-batch
(`ulorl_jax.rl.packing.loss_weights`), so micro-batch losses add up to the mini-batch loss under packing,
micro-batching and gradient accumulation.

Formulas follow verl's `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_vanilla`, `_gspo`,
`_cispo`, `_geo_mean`, `_sapo`), each with its hyperparameters under verl's names:

- vanilla: PPO-clip with clip-higher (clip_ratio_low / clip_ratio_high) and dual-clip (clip_ratio_c) on
  negative advantages; the log-ratio is clamped to [-20, 20] before exp, as verl.
- gspo: the sequence ratio s_i = exp(mean_t log r_it) (clamped at exp(10)), differentiated per token as
  sg(s_i) · π/sg(π), PPO-clipped.
- cispo: −sg(clip(r, 1−ε_low, 1+ε_high)) · Â · log π (the clipped ratio only weights the gradient).
- geo_mean (GMPO): −Â_i · exp(mean_t sgn(Â)·min(sgn(Â)·log r, sgn(Â)·clip(log r, −ε_low, ε_high))) per
  sample, averaged over samples whatever `loss_agg_mode` says (verl takes torch.mean over sequences).
- sapo: −Â · σ(τ(r − 1)) · 4/τ, τ = tau_pos for Â > 0 and tau_neg otherwise.

Sequence-level quantities (gspo's ratio, geo_mean's mean) are segment sums over `sample_index`: a sample
lives whole in one packed row, hence in one micro-batch, so they are exact per micro-batch.

UloRL's DMMPT mask (ULORL.md §3) composes with every mode: a masked token keeps its place in every
denominator and loses its gradient. For the token-level losses its ℓ_t is zeroed (as Eq. 10); for
geo_mean, whose loss is one number per sample, its log-ratio enters the sample's mean under stop_gradient.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ulorl_jax.choices import LOSS_AGG_MODES, POLICY_LOSS_MODES
from ulorl_jax.models.config import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "GSPO_LOG_RATIO_MAX",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "SEQUENCE_LEVEL_AGG_MODES",
    "PolicyLossParams",
    "Segments",
    "aggregation_weights",
    "check_policy_loss_options",
    "policy_token_losses",
    "sample_mean",
]

LOG_RATIO_CLAMP = 20.0  # verl clamps log r to [-20, 20] before exp (vanilla, cispo, sapo)
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's log s_i,t at 10
# gspo / sapo are sequence-level objectives: verl recommends (some versions force) seq-mean-token-mean
SEQUENCE_LEVEL_AGG_MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class PolicyLossParams:
    """The hyperparameters of the policy losses, by verl's names (Python values: jit with them bound)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # dual-clip lower bound of the ratio for Â < 0; None = off
    tau_pos: float = 1.0  # SAPO gate temperature for Â > 0
    tau_neg: float = 1.05  # SAPO gate temperature for Â <= 0


class Segments(NamedTuple):
    """Which sample each token belongs to: sample_index (same shape as the tokens, int) and
    sample_lengths [S] (response tokens |o_i| per sample of the whole mini-batch)."""

    sample_index: jnp.ndarray
    sample_lengths: jnp.ndarray


def sample_mean(x: jnp.ndarray, response: jnp.ndarray, segments: Segments) -> jnp.ndarray:
    """Per token: the mean of x over the response tokens of the token's own sample (|o_i| from
    `segments.sample_lengths`, clamped at 1 as verl). The whole sample must be among the tokens."""
    num = segments.sample_lengths.shape[0]
    idx = segments.sample_index
    sums = jax.ops.segment_sum(jnp.where(response, x, 0.0).reshape(-1), idx.reshape(-1), num_segments=num)
    return (sums / jnp.maximum(segments.sample_lengths, 1.0))[idx]


def aggregation_weights(response: jnp.ndarray, segments: Segments, loss_agg_mode: str,
                        loss_scale_factor: float | None = None) -> jnp.ndarray:
    """float32 per-token weights w (zero off the response) with verl's agg_loss = Σ_t w_t · ℓ_t.

    With T = Σ_i |o_i| and N the number of samples with |o_i| > 0 (both over the mini-batch):
      token-mean: 1/T;  token-sum: 1;  seq-mean-token-sum: 1/N;  seq-mean-token-mean: 1/(N·|o_i|);
      seq-mean-token-sum-norm: 1/(N·loss_scale_factor) (verl: the seq-mean of token sums divided by a
      constant, by default the padded response length; None here means 1).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    m = response.astype(jnp.float32)
    lengths = segments.sample_lengths.astype(jnp.float32)
    if loss_agg_mode == "token-mean":
        return m / jnp.maximum(lengths.sum(), 1.0)
    if loss_agg_mode == "token-sum":
        return m
    n = jnp.maximum(jnp.sum((lengths > 0).astype(jnp.float32)), 1.0)
    if loss_agg_mode == "seq-mean-token-mean":
        return m / (jnp.maximum(lengths, 1.0)[segments.sample_index] * n)
    scale = 1.0 if loss_agg_mode == "seq-mean-token-sum" or loss_scale_factor is None else loss_scale_factor
    return m / (n * scale)


def check_policy_loss_options(loss_mode: str, loss_agg_mode: str, loss_scale_factor: float | None) -> None:
    """Cross-option rules, by the run config's keys: an error for what cannot work, a warning (logged) for
    the combinations verl warns about."""
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        raise ConfigError("algorithm.loss_agg_mode=seq-mean-token-sum-norm needs algorithm.loss_scale_factor (a "
                          "constant divisor; the run config defaults it to rollout.global_max_len, verl's padded "
                          "response length)")
    if loss_mode in ("gspo", "sapo") and loss_agg_mode not in SEQUENCE_LEVEL_AGG_MODES:
        log.warning("algorithm.loss_mode=%s with algorithm.loss_agg_mode=%s: %s is a sequence-level objective and "
                    "verl aggregates it with seq-mean-token-mean; a token-level aggregation weights long responses "
                    "more", loss_mode, loss_agg_mode, loss_mode)
    if loss_mode == "geo_mean" and loss_agg_mode != "seq-mean-token-mean":
        log.warning("algorithm.loss_mode=geo_mean ignores algorithm.loss_agg_mode=%s: GMPO's loss is one number per "
                    "sample, averaged over the samples (as verl)", loss_agg_mode)


# ---------------------------------------------------------------------------
# The losses: (logprobs, old_logprobs, advantages, response, keep, segments, params)
#   -> (ℓ per token, zero off `keep`; the token ratio r; {"pg_clip": bool, "pg_clip_lower": bool} per token)
# ---------------------------------------------------------------------------

LossFn = Callable[..., tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]]
POLICY_LOSSES: dict[str, LossFn] = {}


def register_policy_loss(name: str) -> Callable[[LossFn], LossFn]:
    def decorator(fn: LossFn) -> LossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def _token_ratio(log_ratio: jnp.ndarray) -> jnp.ndarray:
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _ppo_clip(ratio, adv, params: PolicyLossParams):
    """verl's max(−Â·r, −Â·clip(r, 1−ε_low, 1+ε_high)) and its pg_clipfrac test (clipped branch larger)."""
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    return jnp.maximum(loss1, loss2), loss2 > loss1


@register_policy_loss("vanilla")
def vanilla_loss(logprobs, old_logprobs, adv, response, keep, segments, params: PolicyLossParams):
    ratio = _token_ratio(logprobs - old_logprobs)
    clipped_loss, clip = _ppo_clip(ratio, adv, params)
    if params.clip_ratio_c is None:
        loss, lower = clipped_loss, jnp.zeros_like(clip)
    else:  # dual-clip: for Â < 0 the loss is at most −Â·c
        bound = -adv * params.clip_ratio_c
        lower = (clipped_loss > bound) & (adv < 0)
        loss = jnp.where(adv < 0, jnp.minimum(bound, clipped_loss), clipped_loss)
    return jnp.where(keep, loss, 0.0), ratio, {"pg_clip": clip, "pg_clip_lower": lower}


@register_policy_loss("gspo")
def gspo_loss(logprobs, old_logprobs, adv, response, keep, segments, params: PolicyLossParams):
    seq_log_ratio = sample_mean(logprobs - old_logprobs, response, segments)  # log s_i on every token
    log_s = logprobs - jax.lax.stop_gradient(logprobs) + jax.lax.stop_gradient(seq_log_ratio)
    seq_ratio = jnp.exp(jnp.minimum(log_s, GSPO_LOG_RATIO_MAX))  # s_i,t
    loss, clip = _ppo_clip(seq_ratio, adv, params)
    zero = jnp.zeros_like(clip)
    return jnp.where(keep, loss, 0.0), _token_ratio(logprobs - old_logprobs), {"pg_clip": clip, "pg_clip_lower": zero}


@register_policy_loss("cispo")
def cispo_loss(logprobs, old_logprobs, adv, response, keep, segments, params: PolicyLossParams):
    ratio = _token_ratio(logprobs - old_logprobs)
    clipped = jnp.clip(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss = -jax.lax.stop_gradient(clipped) * adv * logprobs
    return jnp.where(keep, loss, 0.0), ratio, {"pg_clip": ratio != clipped, "pg_clip_lower": jnp.zeros_like(keep)}


@register_policy_loss("geo_mean")
def geo_mean_loss(logprobs, old_logprobs, adv, response, keep, segments, params: PolicyLossParams):
    log_ratio = logprobs - old_logprobs  # unclamped, as verl
    sign = jnp.sign(adv)
    clamped = jnp.clip(log_ratio, -params.clip_ratio_low, params.clip_ratio_high)
    token_term = sign * jnp.minimum(sign * log_ratio, sign * clamped)
    token_term = jnp.where(keep, token_term, jax.lax.stop_gradient(token_term))  # DMMPT: no gradient
    seq_ratio = jnp.exp(sample_mean(token_term, response, segments))
    seq_adv = sample_mean(adv, response, segments)
    loss = jnp.where(response, -seq_adv * seq_ratio, 0.0)  # the sample's loss on each of its tokens
    was_clipped = log_ratio != clamped
    stats = {"pg_clip": was_clipped & (adv > 0), "pg_clip_lower": was_clipped & (adv < 0)}
    return loss, _token_ratio(log_ratio), stats


@register_policy_loss("sapo")
def sapo_loss(logprobs, old_logprobs, adv, response, keep, segments, params: PolicyLossParams):
    ratio = _token_ratio(logprobs - old_logprobs)
    tau = jnp.where(adv > 0, params.tau_pos, params.tau_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    zero = jnp.zeros_like(keep)
    return jnp.where(keep, -gate * adv, 0.0), ratio, {"pg_clip": zero, "pg_clip_lower": zero}


assert tuple(POLICY_LOSSES) == POLICY_LOSS_MODES, "choices.POLICY_LOSS_MODES names the registered losses"


def policy_token_losses(loss_mode: str, logprobs: jnp.ndarray, old_logprobs: jnp.ndarray, advantages: jnp.ndarray,
                        response: jnp.ndarray, keep: jnp.ndarray, segments: Segments | None,
                        params: PolicyLossParams) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, jnp.ndarray]]:
    """(ℓ per token, token ratio r, per-token clip indicators) of `loss_mode`; all arrays one shape.

    Off the response every input may hold anything (padding log-probs may be -inf): the log-probs are
    zeroed there first. `keep` (⊆ response) are the tokens whose loss counts (DMMPT's 1 − I_msk).
    `segments` is needed by the sequence-level modes (gspo, geo_mean).
    """
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(f"loss_mode={loss_mode!r} is not one of {POLICY_LOSS_MODES}")
    if segments is None and loss_mode in ("gspo", "geo_mean"):
        raise ValueError(f"loss_mode={loss_mode!r} is sequence-level: it needs the tokens' segments")
    response = response.astype(bool)
    keep = keep.astype(bool) & response
    logprobs = jnp.where(response, logprobs.astype(jnp.float32), 0.0)
    old = jax.lax.stop_gradient(jnp.where(response, old_logprobs.astype(jnp.float32), 0.0))
    adv = jax.lax.stop_gradient(jnp.where(response, advantages.astype(jnp.float32), 0.0))
    loss, ratio, stats = POLICY_LOSSES[loss_mode](logprobs, old, adv, response, keep, segments, params)
    return loss, jnp.where(response, ratio, 0.0), {k: v & response for k, v in stats.items()}
