"""UloRL policy loss: PPO-clip with clip-higher, DMMPT masking, Eq. 10 aggregation.

ULORL.md §2 (importance sampling under segments) and §3 (dynamic masking of
well-mastered positive tokens). Everything here is a pure function of arrays;
`token_policy_loss` is jit-safe (its options are Python values, so jit it with
them bound, e.g. `functools.partial`), and `validate_loss_inputs` is the
separate, host-side check of concrete arrays.

Shapes: B samples, T token positions (prompt/padding excluded by
`response_mask`). All arithmetic is float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ulorl_jax.choices import ENTROPY_MODES, IS_MODES, LOSS_AGG_MODES, MASK_MODES  # noqa: F401  (re-exported)
from ulorl_jax.rl.policy_losses import PolicyLossParams, Segments, policy_token_losses

# The aggregations `token_policy_loss` ([B, T] arrays) implements; the learner's weighted sum takes all of
# LOSS_AGG_MODES (ulorl_jax.rl.policy_losses.aggregation_weights).
TOKEN_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


def _check_option(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _safe_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """num / den, and 0 where den == 0 (no NaN forward or backward)."""
    safe_den = jnp.where(den > 0, den, 1.0)
    return jnp.where(den > 0, num / safe_den, 0.0)


# ---------------------------------------------------------------------------
# π_old selection (ULORL.md §2)
# ---------------------------------------------------------------------------


def old_logprobs_for(
    is_mode: str,
    *,
    policy_logprobs_at_start: jnp.ndarray | None = None,
    sampling_logprobs: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """The π_old log-probs [B, T] for importance sampling mode `is_mode`.

    - "pois" (pseudo on-policy, the paper's choice): log-probs of the policy at
      the start of this update, so the first update has r == 1 exactly.
    - "sais" (segment-aware): the per-token sampling log-probs recorded by the
      rollout, i.e. of the policy version that generated each token's segment.

    The result is wrapped in stop_gradient: π_old is a constant of the update.
    """
    _check_option("is_mode", is_mode, IS_MODES)
    name, value = (
        ("policy_logprobs_at_start", policy_logprobs_at_start)
        if is_mode == "pois"
        else ("sampling_logprobs", sampling_logprobs)
    )
    if value is None:
        raise ValueError(f"is_mode={is_mode!r} needs {name}, got None")
    return jax.lax.stop_gradient(jnp.asarray(value, jnp.float32))


# ---------------------------------------------------------------------------
# DMMPT mask (ULORL.md §3)
# ---------------------------------------------------------------------------


def mpt_mask(
    logprobs: jnp.ndarray,
    response_mask: jnp.ndarray,
    sample_reward: jnp.ndarray,
    *,
    tau: float = 0.99,
) -> jnp.ndarray:
    """Well-mastered positive tokens [B, T] bool: reward == 1 and p(token) >= τ.

    The test runs on stop_gradient(logprobs): the mask is a selection, not a
    term to differentiate.
    """
    prob = jnp.exp(jax.lax.stop_gradient(logprobs.astype(jnp.float32)))  # [B, T]
    positive = (sample_reward == 1)[:, None]  # [B, 1]
    return positive & (prob >= tau) & response_mask.astype(bool)


def low_entropy_samples(
    sample_entropy: jnp.ndarray,
    response_mask: jnp.ndarray,
    *,
    sigma: float = 0.2,
    entropy_mode: str = "sample",
) -> jnp.ndarray:
    """[B] bool: samples whose MPTs DMMPT masks (entropy below the target σ).

    "sample": H̄_i < σ per sample, as the paper writes I_msk.
    "batch":  one test for the whole batch on the token-weighted mean of H̄_i.
    """
    _check_option("entropy_mode", entropy_mode, ENTROPY_MODES)
    entropy = jax.lax.stop_gradient(sample_entropy.astype(jnp.float32))  # [B]
    if entropy_mode == "sample":
        return entropy < sigma
    lengths = response_mask.astype(jnp.float32).sum(axis=-1)  # |o_i|, [B]
    weighted = jnp.where(lengths > 0, entropy * lengths, 0.0)  # empty samples may carry NaN
    batch_entropy = _safe_div(jnp.sum(weighted), jnp.sum(lengths))
    return jnp.broadcast_to(batch_entropy < sigma, entropy.shape)


def loss_mask(
    logprobs: jnp.ndarray,
    response_mask: jnp.ndarray,
    sample_reward: jnp.ndarray,
    sample_entropy: jnp.ndarray,
    *,
    mask_mode: str = "dmmpt",
    tau: float = 0.99,
    sigma: float = 0.2,
    entropy_mode: str = "sample",
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(I_msk [B, T], mpt [B, T], armed [B]) for `mask_mode`.

    I_msk(i,t) = 1 iff token (i,t) is an MPT and (for "dmmpt") H̄_i < σ.
    `armed` marks the samples whose MPTs are eligible for masking.
    """
    _check_option("mask_mode", mask_mode, MASK_MODES)
    _check_option("entropy_mode", entropy_mode, ENTROPY_MODES)
    mpt = mpt_mask(logprobs, response_mask, sample_reward, tau=tau)
    batch = sample_reward.shape[0]
    if mask_mode == "none":
        armed = jnp.zeros((batch,), bool)
    elif mask_mode == "mpt":
        armed = jnp.ones((batch,), bool)
    else:
        armed = low_entropy_samples(sample_entropy, response_mask, sigma=sigma, entropy_mode=entropy_mode)
    return mpt & armed[:, None], mpt, armed


# ---------------------------------------------------------------------------
# Loss (Eq. 10)
# ---------------------------------------------------------------------------


def clipped_surrogate(
    logprobs: jnp.ndarray,
    old_logprobs: jnp.ndarray,
    advantages: jnp.ndarray,
    response: jnp.ndarray,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â), r), elementwise; all inputs the same shape.

    The log-ratio is zeroed off the response before exp: padding may hold any
    value (even -inf), and this keeps both passes finite there.
    """
    log_ratio = jnp.where(response, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)  # r
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)  # clip-higher: ε_low != ε_high allowed
    return jnp.minimum(ratio * advantages, clipped_ratio * advantages), ratio


def token_policy_loss(
    logprobs: jnp.ndarray,
    old_logprobs: jnp.ndarray,
    advantages: jnp.ndarray,
    response_mask: jnp.ndarray,
    sample_reward: jnp.ndarray,
    sample_entropy: jnp.ndarray,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mask_mode: str = "dmmpt",
    tau: float = 0.99,
    sigma: float = 0.2,
    loss_agg_mode: str = "token-mean",
    entropy_mode: str = "sample",
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """UloRL policy loss, -J of Eq. 10, and scalar metrics.

    J = 1/Σ_i|o_i| · Σ_i Σ_t (1 − I_msk) · min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â)

    Masked tokens still count in the denominator |o_i| (the mask removes their
    gradient, it does not re-weight the others). "seq-mean-token-mean" instead
    divides each sample by its own |o_i| and averages over samples with at
    least one response token. Empty denominators give a loss of 0.

    Args:
      logprobs: [B, T] learner log-probs of the sampled tokens (differentiated).
      old_logprobs: [B, T] π_old log-probs (see `old_logprobs_for`); constant.
      advantages: [B] or [B, T]; constant.
      response_mask: [B, T], 1 on response tokens, 0 on prompt and padding.
      sample_reward: [B] in {0, 1}.
      sample_entropy: [B] mean full-vocab entropy H̄_i of each sample.

    Metrics (all stop_gradient scalars, fractions over response tokens):
      masked_fraction, mpt_fraction; clip_fraction_low / clip_fraction_high:
      tokens where the clipped branch wins the min and differs from the
      unclipped one, i.e. Â < 0 and r < 1−ε_low (low) or Â > 0 and
      r > 1+ε_high (high) — exactly the tokens the clip gives zero gradient;
      ratio_mean, ratio_max (0 with no response tokens); entropy_mean
      (token-weighted mean of H̄_i); dmmpt_armed_fraction (fraction of
      non-empty samples whose MPTs are eligible for masking).
    """
    _check_option("mask_mode", mask_mode, MASK_MODES)
    _check_option("loss_agg_mode", loss_agg_mode, TOKEN_LOSS_AGG_MODES)
    _check_option("entropy_mode", entropy_mode, ENTROPY_MODES)

    response = response_mask.astype(bool)  # [B, T]
    m = response.astype(jnp.float32)
    logprobs = logprobs.astype(jnp.float32)
    old_logprobs = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]  # [B, 1] broadcasts over T
    adv = jnp.broadcast_to(adv, logprobs.shape)  # [B, T]

    surrogate, ratio = clipped_surrogate(logprobs, old_logprobs, adv, response, clip_low=clip_low,
                                         clip_high=clip_high)  # [B, T] each

    i_msk, mpt, armed = loss_mask(
        logprobs,
        response,
        sample_reward,
        sample_entropy,
        mask_mode=mask_mode,
        tau=tau,
        sigma=sigma,
        entropy_mode=entropy_mode,
    )
    keep = m * (1.0 - i_msk.astype(jnp.float32))  # (1 − I_msk) on response tokens
    per_token = jnp.where(keep > 0, surrogate, 0.0)

    lengths = m.sum(axis=-1)  # |o_i|, masked tokens included, [B]
    num_tokens = lengths.sum()  # Σ_i |o_i|
    if loss_agg_mode == "token-mean":  # Eq. 10
        objective = _safe_div(per_token.sum(), num_tokens)
    else:
        per_sample = _safe_div(per_token.sum(axis=-1), lengths)  # [B]
        nonempty = (lengths > 0).astype(jnp.float32)
        objective = _safe_div(jnp.sum(per_sample * nonempty), nonempty.sum())
    loss = -objective

    def token_frac(x: jnp.ndarray) -> jnp.ndarray:
        return _safe_div(jnp.sum(x.astype(jnp.float32) * m), num_tokens)

    entropy = sample_entropy.astype(jnp.float32)
    nonempty_b = lengths > 0
    metrics = {
        "masked_fraction": token_frac(i_msk),
        "mpt_fraction": token_frac(mpt),
        "clip_fraction_low": token_frac((adv < 0) & (ratio < 1.0 - clip_low)),
        "clip_fraction_high": token_frac((adv > 0) & (ratio > 1.0 + clip_high)),
        "ratio_mean": token_frac(ratio),
        "ratio_max": jnp.max(jnp.where(response, ratio, 0.0)),
        "entropy_mean": _safe_div(jnp.sum(jnp.where(nonempty_b, entropy * lengths, 0.0)), num_tokens),
        "dmmpt_armed_fraction": _safe_div(
            jnp.sum((armed & nonempty_b).astype(jnp.float32)), nonempty_b.sum().astype(jnp.float32)
        ),
    }
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    return loss, metrics


def weighted_policy_loss(
    logprobs: jnp.ndarray,
    old_logprobs: jnp.ndarray,
    advantages: jnp.ndarray,
    response_mask: jnp.ndarray,
    token_weight: jnp.ndarray,
    token_reward: jnp.ndarray,
    token_sample_entropy: jnp.ndarray,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mask_mode: str = "dmmpt",
    tau: float = 0.99,
    sigma: float = 0.2,
    loss_mode: str = "vanilla",
    clip_ratio_c: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    segments: Segments | None = None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """Eq. 10 (or verl's `loss_mode`) for any token layout (packed rows, micro-batches) as a weighted sum.

    loss = Σ_t w_t · (1 − I_msk,t) · ℓ_t, with ℓ_t = −min(r_t·Â_t, clip(r_t, 1−ε_low, 1+ε_high)·Â_t) for
    "vanilla" (dual-clipped at −Â·clip_ratio_c for Â < 0 when clip_ratio_c is set) and the losses of
    `ulorl_jax.rl.policy_losses` otherwise (geo_mean, one loss per sample, masks by stop_gradient).

    Every input has the same shape (e.g. [R, L]); per-sample quantities come
    per token: `token_reward` and `token_sample_entropy` are the reward and
    H̄_i of the token's own sample (for entropy_mode="batch" pass the batch
    entropy on every token). `token_weight` carries the aggregation
    (`ulorl_jax.rl.packing.loss_weights`: 1/Σ|o_i| for token-mean), so losses
    of micro-batches add up to the loss of their mini-batch, and with
    token-mean weights this equals `token_policy_loss` on the unpacked batch.
    `segments` (which sample each token is) is needed by gspo and geo_mean.

    Returns (loss, sums): token counts and sums that also add up over
    micro-batches (tokens, masked_tokens, mpt_tokens, clip_low_tokens,
    clip_high_tokens, ratio_sum; verl's pg_clipfrac / pg_clipfrac_lower numerators pg_clip_tokens /
    pg_clip_lower_tokens and ppo_kl_sum = Σ (log π_old − log π)) and ratio_max.
    """
    _check_option("mask_mode", mask_mode, MASK_MODES)
    shape = logprobs.shape
    response = response_mask.astype(bool)
    # One token = one "sample" of length 1 for the mask helpers: [N, 1] with per-token reward / H̄.
    i_msk, mpt, _ = loss_mask(
        logprobs.reshape(-1, 1), response.reshape(-1, 1), token_reward.reshape(-1),
        token_sample_entropy.reshape(-1), mask_mode=mask_mode, tau=tau, sigma=sigma, entropy_mode="sample",
    )
    i_msk, mpt = i_msk.reshape(shape), mpt.reshape(shape)
    params = PolicyLossParams(clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_ratio_c,
                              tau_pos=tau_pos, tau_neg=tau_neg)
    per_token, ratio, clip_stats = policy_token_losses(loss_mode, logprobs, old_logprobs, advantages, response,
                                                       response & ~i_msk, segments, params)
    loss = jnp.sum(jnp.where(response, token_weight.astype(jnp.float32) * per_token, 0.0))
    adv = jnp.asarray(advantages, jnp.float32)
    log_ratio = jnp.where(response, logprobs.astype(jnp.float32) - old_logprobs.astype(jnp.float32), 0.0)

    def count(x: jnp.ndarray) -> jnp.ndarray:
        return jnp.sum((x & response).astype(jnp.float32))

    sums = {
        "tokens": count(response),
        "masked_tokens": count(i_msk),
        "mpt_tokens": count(mpt),
        "clip_low_tokens": count((adv < 0) & (ratio < 1.0 - clip_low)),
        "clip_high_tokens": count((adv > 0) & (ratio > 1.0 + clip_high)),
        "pg_clip_tokens": count(clip_stats["pg_clip"]),
        "pg_clip_lower_tokens": count(clip_stats["pg_clip_lower"]),
        "ppo_kl_sum": -jnp.sum(log_ratio),
        "ratio_sum": jnp.sum(ratio),
        "ratio_max": jnp.max(ratio),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, sums)


# ---------------------------------------------------------------------------
# Diagnostics and host-side validation
# ---------------------------------------------------------------------------


def logprob_mismatch_sums(
    sampling_logprobs: jnp.ndarray,
    learner_logprobs: jnp.ndarray,
    response_mask: jnp.ndarray,
) -> dict[str, jnp.ndarray]:
    """The rollout-vs-learner log-prob gap as sums that add over micro-batches: mismatch_abs_sum
    (sum of |learner - sampling| over the mask's tokens), mismatch_tokens, mismatch_abs_max. The one
    definition: the learner's step (in jit), its forward-only pre-scoring pass (on host arrays) and
    `logprob_mismatch` all call it."""
    response = jnp.asarray(response_mask) > 0
    diff = jnp.asarray(learner_logprobs, jnp.float32) - jnp.asarray(sampling_logprobs, jnp.float32)
    abs_diff = jnp.where(response, jnp.abs(diff), 0.0)
    return {
        "mismatch_abs_sum": jnp.sum(abs_diff),
        "mismatch_tokens": jnp.sum(response.astype(jnp.float32)),
        "mismatch_abs_max": jnp.max(abs_diff, initial=0.0),
    }


def logprob_mismatch(
    sampling_logprobs: jnp.ndarray,
    learner_logprobs: jnp.ndarray,
    response_mask: jnp.ndarray,
) -> dict[str, jnp.ndarray]:
    """Rollout-vs-learner log-prob gap over response tokens.

    The first thing to check when ratios look wrong: both sides must score the
    same tokens at the same sampling temperature. Returns mean_abs_logprob_diff
    and max_ratio = max exp(|diff|) (1 with no response tokens).
    """
    sums = logprob_mismatch_sums(sampling_logprobs, learner_logprobs, response_mask)
    return {
        "mean_abs_logprob_diff": _safe_div(sums["mismatch_abs_sum"], sums["mismatch_tokens"]),
        "max_ratio": jnp.exp(sums["mismatch_abs_max"]),
    }


def _concrete(name: str, x: Any) -> np.ndarray:
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(
            f"validate_loss_inputs needs concrete arrays, got a tracer for {name}; call it outside jit"
        ) from None


def validate_loss_inputs(
    logprobs: Any,
    old_logprobs: Any,
    advantages: Any,
    response_mask: Any,
    sample_reward: Any,
    sample_entropy: Any,
    *,
    mask_mode: str = "dmmpt",
    loss_agg_mode: str = "token-mean",
    entropy_mode: str = "sample",
) -> None:
    """Host-side checks of `token_policy_loss` inputs; raises ValueError.

    Call outside jit on concrete arrays. Checks shapes, options, finiteness
    (of [B, T] inputs on response tokens only: the loss ignores the rest, and
    padding often holds -inf), response_mask in {0, 1} and, when masking is
    on, sample_reward in {0, 1}.
    """
    _check_option("mask_mode", mask_mode, MASK_MODES)
    _check_option("loss_agg_mode", loss_agg_mode, TOKEN_LOSS_AGG_MODES)
    _check_option("entropy_mode", entropy_mode, ENTROPY_MODES)
    arrays = {
        "logprobs": _concrete("logprobs", logprobs),
        "old_logprobs": _concrete("old_logprobs", old_logprobs),
        "advantages": _concrete("advantages", advantages),
        "response_mask": _concrete("response_mask", response_mask),
        "sample_reward": _concrete("sample_reward", sample_reward),
        "sample_entropy": _concrete("sample_entropy", sample_entropy),
    }
    lp = arrays["logprobs"]
    if lp.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {lp.shape}")
    bt, b = lp.shape, lp.shape[:1]
    expected = {
        "old_logprobs": (bt,),
        "response_mask": (bt,),
        "advantages": (b, bt),
        "sample_reward": (b,),
        "sample_entropy": (b,),
    }
    for name, shapes in expected.items():
        if arrays[name].shape not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{name} has shape {arrays[name].shape}, expected {want} (logprobs is {bt})")

    mask = arrays["response_mask"]
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("response_mask must hold only 0/1 (or bool) values")
    response = mask.astype(bool)
    for name, x in arrays.items():
        if name == "response_mask":
            continue
        values = x[response] if x.shape == bt else x
        if not np.isfinite(values).all():
            raise ValueError(f"{name} contains NaN or inf" + (" on response tokens" if x.shape == bt else ""))
    if mask_mode != "none" and not np.isin(arrays["sample_reward"], (0, 1)).all():
        bad = np.unique(arrays["sample_reward"][~np.isin(arrays["sample_reward"], (0, 1))])
        raise ValueError(f"sample_reward must be in {{0, 1}} when mask_mode={mask_mode!r}; found {bad[:5].tolist()}")
