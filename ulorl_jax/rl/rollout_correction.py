"""Rollout correction for the train-inference mismatch: verl's `algorithm.rollout_correction` (its
`rollout_corr_helper.py`), here `algorithm.rollout_correction.*`, on the learner's host side.

With log ρ_t = log π_old(t) − log π_rollout(t) (π_old: the learner's policy at the start of the update, POIS's
π_old; π_rollout: the log-probs the rollout recorded while sampling):

- rollout_is ("token" / "sequence"): importance weights ρ_t, or exp(Σ_seq log ρ) on every token of a sample
  (log clamped to ±20), multiplied into each token's loss under stop_gradient. rollout_is_threshold: a float
  truncates them at that value (TIS); "lo_hi" zeroes weights outside [lo, hi] (IcePop).
- rollout_rs: rejection by divergence estimators, comma-separated options (all must pass): token_k1/k2/k3,
  seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 with k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ.
  rollout_rs_threshold: one per option (or one for all); k1 options take "lo_hi" ratio bounds (kept iff
  log lo ≤ k1 ≤ log hi, as verl), k2/k3 an upper bound.

How it composes with UloRL's importance sampling (ULORL.md §2): it is verl's "decoupled" mode with POIS as
its proximal policy: the PPO ratio is π_θ / π_old(POIS), and these weights correct π_old against the policy
that actually sampled each token. Under SAIS π_old *is* π_rollout (verl's "bypass" mode), every ρ is 1 and
the correction is refused as a no-op. Applying it needs π_old before the step, so the learner runs its
forward-only scoring pass whenever rollout correction is on.

The learner applies both as loss weights: IS weights multiply each token's aggregation weight; rejected tokens
get weight 0 and the aggregation is recomputed over the kept tokens (verl passes the rejection-modified
response mask to agg_loss, so its normalisers count kept tokens only). Tokens without recorded rollout
log-probs get ρ = 1. Host-side numpy over the packed [..., L] arrays; samples are found by `sample_index`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ulorl_jax.models.config import ConfigError

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "check_rollout_correction",
    "offpolicy_metrics",
    "parse_is_threshold",
    "parse_rs_thresholds",
    "rollout_is_weights",
    "rollout_rejection_keep",
]

SAFETY_BOUND = 20.0  # verl's bound on log-weights before exp
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
KEY = "algorithm.rollout_correction"


def _number(spec: Any, key: str) -> float:
    try:
        value = float(spec)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={spec!r}: expected a positive number or 'lo_hi'") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{key}={spec!r}: expected positive bounds")
    return value


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """(upper, lower or None): a float is TIS's upper bound, "lo_hi" IcePop's two bounds."""
    key = f"{KEY}.rollout_is_threshold"
    if isinstance(spec, bool) or spec is None:
        raise ConfigError(f"{key}={spec!r}: expected a positive number (truncation) or 'lo_hi' (both bounds)")
    if isinstance(spec, str) and "_" in spec:
        lo, hi = (_number(part, key) for part in spec.split("_", 1))
        if lo > hi:
            raise ConfigError(f"{key}={spec!r}: expected lo <= hi")
        return hi, lo
    return _number(spec, key), None


def _options(rollout_rs: str) -> list[str]:
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    bad = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or bad:
        raise ConfigError(f"{KEY}.rollout_rs={rollout_rs!r}: expected comma-separated options from "
                          f"{list(ROLLOUT_RS_OPTIONS)}")
    return options


def parse_rs_thresholds(rollout_rs: str, spec: Any) -> dict[str, tuple[float | None, float]]:
    """{option: (lower or None, upper)}; k1 options' bounds are ratios ("lo_hi", or a float hi with lo = 1/hi)."""
    key = f"{KEY}.rollout_rs_threshold"
    options = _options(rollout_rs)
    if spec is None or isinstance(spec, bool):
        raise ConfigError(f"{key}={spec!r}: {KEY}.rollout_rs={rollout_rs!r} needs thresholds")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ConfigError(f"{key}={spec!r}: expected one threshold or one per option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for option, s in zip(options, specs):
        if option.endswith("k1"):
            lo, hi = (_number(p, key) for p in s.split("_", 1)) if "_" in s else (1.0 / _number(s, key),
                                                                                   _number(s, key))
            if lo > hi:
                raise ConfigError(f"{key}={spec!r}: expected lo <= hi for {option}")
            out[option] = (lo, hi)
        elif "_" in s:
            raise ConfigError(f"{key}={spec!r}: {option} takes one upper bound, not 'lo_hi'")
        else:
            out[option] = (None, _number(s, key))
    return out


def check_rollout_correction(rollout_is: str | None, rollout_is_threshold: Any, rollout_rs: str | None,
                             rollout_rs_threshold: Any, *, is_mode: str, loss_mode: str) -> None:
    """The options' values and combinations, errors naming the keys."""
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ConfigError(f"{KEY}.rollout_is={rollout_is!r}: expected one of {list(ROLLOUT_IS_LEVELS)} or null")
    if rollout_is is not None:
        parse_is_threshold(rollout_is_threshold)
    if rollout_rs is not None:
        parse_rs_thresholds(rollout_rs, rollout_rs_threshold)
    if rollout_is is None and rollout_rs is None:
        return
    if is_mode == "sais":
        raise ConfigError(f"{KEY} with algorithm.is_mode=sais: SAIS's π_old is the rollout's own log-probs, so every "
                          "correction weight is 1 (verl's bypass mode); use is_mode=pois")
    if loss_mode == "geo_mean":
        raise ConfigError(f"{KEY} with algorithm.loss_mode=geo_mean is not supported (GMPO's loss is one number per "
                          "sample)")


def _segment(values: np.ndarray, idx: np.ndarray, response: np.ndarray, num: int, how: str) -> np.ndarray:
    """Per-sample sum / mean / max of `values` over its response tokens, [num]."""
    v, i = values[response], idx[response]
    if how == "max":
        out = np.full(num, -np.inf)
        np.maximum.at(out, i, v)
        return np.where(np.isfinite(out), out, 0.0)
    sums = np.bincount(i, weights=v, minlength=num)
    if how == "sum":
        return sums
    counts = np.bincount(i, minlength=num)
    return sums / np.maximum(counts, 1)


def rollout_is_weights(log_ratio: np.ndarray, response: np.ndarray, sample_index: np.ndarray, rollout_is: str,
                       threshold: Any) -> tuple[np.ndarray, dict[str, float]]:
    """(weights, zero off the response; verl's rollout_is_* metrics) — verl's compute_rollout_correction_weights
    without batch normalisation."""
    upper, lower = parse_is_threshold(threshold)
    response = response.astype(bool)
    num = int(sample_index.max()) + 1 if sample_index.size else 1
    if rollout_is == "token":
        log_w = log_ratio
    else:
        log_w = _segment(log_ratio, sample_index, response, num, "sum")[sample_index]
    raw = np.where(response, np.exp(np.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND)), 0.0)
    if lower is None:
        weights = np.minimum(raw, upper)
    else:
        weights = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    low_bound = 1.0 / upper if lower is None else lower
    n = max(int(response.sum()), 1)
    metrics = {
        "rollout_is_mean": float(weights[response].sum() / n),
        "rollout_is_max": float(weights[response].max(initial=0.0)),
        "rollout_is_min": float(weights[response].min(initial=0.0)),
        "rollout_is_ratio_fraction_high": float((raw[response] > upper).sum() / n),
        "rollout_is_ratio_fraction_low": float((raw[response] < low_bound).sum() / n),
    }
    clamped = np.clip(weights[response], 0.0, upper)
    mean = clamped.mean() if clamped.size else 0.0
    metrics["rollout_is_eff_sample_size"] = float(1.0 / np.mean((clamped / (mean + 1e-8)) ** 2)) if clamped.size \
        else 0.0
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(((raw[response] < lower) | (raw[response] > upper)).sum() / n)
    return weights, metrics


def rollout_rejection_keep(log_ratio: np.ndarray, response: np.ndarray, sample_index: np.ndarray, rollout_rs: str,
                           threshold: Any) -> tuple[np.ndarray, dict[str, float]]:
    """(keep: bool, True where every option passes (and off the response); verl's rollout_rs_* metrics) —
    verl's compute_rollout_rejection_mask."""
    bounds = parse_rs_thresholds(rollout_rs, threshold)
    response = response.astype(bool)
    num = int(sample_index.max()) + 1 if sample_index.size else 1
    safe = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": np.exp(safe) - 1.0 - safe}
    keep = np.ones(log_ratio.shape, bool)
    n = max(int(response.sum()), 1)
    metrics: dict[str, float] = {}
    for option, (lo, hi) in bounds.items():
        level, estimator = option.rsplit("_", 1)
        value = stats[estimator]
        if level != "token":
            value = _segment(value, sample_index, response, num, level.split("_")[1])[sample_index]
        if lo is not None:  # k1: ratio bounds, compared in log space as verl
            passed = (value >= math.log(lo)) & (value <= math.log(hi))
        else:
            passed = value <= hi
        metrics[f"rollout_rs_{option}_masked_fraction"] = float((~passed & response).sum() / n)
        keep &= passed
    keep |= ~response
    metrics["rollout_rs_masked_fraction"] = float((~keep & response).sum() / n)
    present = np.bincount(sample_index[response], minlength=num) > 0
    rejected = np.bincount(sample_index[response & ~keep], minlength=num) > 0
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected[present].mean()) if present.any() else 0.0
    return keep, metrics


def offpolicy_metrics(old_logprobs: np.ndarray, rollout_logprobs: np.ndarray, response: np.ndarray,
                      sample_index: np.ndarray) -> dict[str, float]:
    """verl's compute_offpolicy_metrics: kl, k3_kl, training / rollout (log-)ppl, log_ppl_diff, chi2_token,
    chi2_seq, over the samples present."""
    response = response.astype(bool)
    if not response.any():
        return {}
    num = int(sample_index.max()) + 1
    present = np.bincount(sample_index[response], minlength=num) > 0
    mean_train = _segment(old_logprobs, sample_index, response, num, "mean")[present]
    mean_rollout = _segment(rollout_logprobs, sample_index, response, num, "mean")[present]
    log_ratio = (old_logprobs - rollout_logprobs)[response]
    log_ppl_diff = mean_rollout - mean_train
    seq_sum = _segment(old_logprobs - rollout_logprobs, sample_index, response, num, "sum")[present]
    return {
        "training_ppl": float(np.exp(-mean_train).mean()),
        "training_log_ppl": float((-mean_train).mean()),
        "kl": float(-log_ratio.mean()),
        "k3_kl": float((np.exp(log_ratio) - log_ratio - 1).mean()),
        "rollout_ppl": float(np.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(np.abs(log_ppl_diff).mean()),
        "ppl_ratio": float(np.exp(log_ppl_diff).mean()),
        "chi2_token": float((np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) ** 2).mean() - 1.0),
        "chi2_seq": float(np.exp(2.0 * np.clip(seq_sum, -SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0),
    }


def correct_loss_weights(batch: dict, *, loss_agg_mode: str, rollout_is: str | None, rollout_is_threshold: Any,
                         rollout_rs: str | None, rollout_rs_threshold: Any) -> tuple[np.ndarray, dict[str, float]]:
    """A packed learner batch's (numpy, π_old in "old_logprobs") loss weights with the correction applied, and
    the metrics under verl's names ("rollout_corr/..."). Rejected tokens leave the aggregation (its
    normalisers are recomputed over the kept tokens); IS weights multiply the rest."""
    from ulorl_jax.rl.policy_losses import Segments, aggregation_weights

    response = np.asarray(batch["response_mask"]) > 0
    known = response & (np.asarray(batch["has_rollout_logprobs"]) > 0)
    old = np.asarray(batch["old_logprobs"], np.float64)
    rollout = np.asarray(batch["rollout_logprobs"], np.float64)
    idx = np.asarray(batch["sample_index"])
    log_ratio = np.where(known, old - rollout, 0.0)
    metrics = offpolicy_metrics(old, rollout, known, idx)
    keep = np.ones(response.shape, bool)
    if rollout_rs is not None:
        keep, rs_metrics = rollout_rejection_keep(log_ratio, known, idx, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    kept = response & keep
    lengths = np.bincount(idx[kept], minlength=len(batch["sample_lengths"])).astype(np.float32)
    weights = np.asarray(aggregation_weights(kept, Segments(idx, lengths), loss_agg_mode), np.float64)
    if rollout_is is not None:
        is_weights, is_metrics = rollout_is_weights(log_ratio, known, idx, rollout_is, rollout_is_threshold)
        weights = weights * np.where(known, is_weights, 1.0)
        metrics.update(is_metrics)
    return weights.astype(np.float32), {f"rollout_corr/{k}": v for k, v in metrics.items()}
