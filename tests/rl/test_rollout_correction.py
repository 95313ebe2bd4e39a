"""Rollout correction (IS weights, rejection, off-policy metrics) against verl's rollout_corr_helper.py restated
in torch, on ragged samples; then through the learner's loss weights and the config keys."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ulorl_jax.models.config import ConfigError
from ulorl_jax.rl.rollout_correction import (
    ROLLOUT_RS_OPTIONS,
    check_rollout_correction,
    correct_loss_weights,
    offpolicy_metrics,
    rollout_is_weights,
    rollout_rejection_keep,
)

B, T = 6, 9
SAFETY = 20.0


def masked_mean(x, m, axis=None):
    return (x * m).sum() / m.sum() if axis is None else (x * m).sum(axis) / m.sum(axis)


def verl_is_weights(log_ratio, mask, rollout_is, threshold):
    """verl compute_rollout_correction_weights (no batch normalisation)."""
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(x) for x in threshold.split("_"))
    else:
        lower, upper = None, float(threshold)
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY, SAFETY))
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        raw = torch.exp(torch.clamp(s, -SAFETY, SAFETY)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def verl_rejection_mask(log_ratio, mask, rollout_rs, threshold):
    """verl compute_rollout_rejection_mask (the mask only)."""
    options = [o.strip() for o in rollout_rs.split(",")]
    specs = [s.strip() for s in str(threshold).split(",")]
    specs = specs * len(options) if len(specs) == 1 else specs
    safe = torch.clamp(log_ratio, -SAFETY, SAFETY)
    stats = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    combined = torch.ones_like(mask)
    for option, spec in zip(options, specs):
        est = option[-2:]
        if est == "k1":
            lo, hi = spec.split("_") if "_" in spec else (str(1.0 / float(spec)), spec)
            lo, hi = math.log(float(lo)), math.log(float(hi))
        else:
            hi = float(spec)
        x = stats[est]
        if option.startswith("seq_sum"):
            x = (x * mask).sum(-1, keepdim=True).expand_as(mask)
        elif option.startswith("seq_mean"):
            x = masked_mean(x, mask, -1).unsqueeze(-1).expand_as(mask)
        elif option.startswith("seq_max"):
            mx = x.masked_fill(~mask.bool(), float("-inf")).max(-1).values
            x = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx).unsqueeze(-1).expand_as(mask)
        keep = (x >= lo) & (x <= hi) if est == "k1" else x <= hi
        combined = combined * keep.double()
    return mask * combined


def make(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    rollout = -rng.uniform(0.05, 3.0, (B, T))
    old = rollout + rng.normal(0.0, 0.25, (B, T))
    old[1] = rollout[1] + 0.02  # a sample close to on-policy
    return old, rollout, mask


def _flat_layout(mask):
    """Our functions take any layout with a sample index: the [B, T] batch itself, sample i on row i."""
    return np.broadcast_to(np.arange(B)[:, None], mask.shape)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.2, "0.8_1.25"])
def test_is_weights_equal_verl(level, threshold):
    for seed in range(3):
        old, rollout, mask = make(seed)
        log_ratio = (old - rollout) * mask
        got, metrics = rollout_is_weights(log_ratio, mask > 0, _flat_layout(mask), level, threshold)
        want = verl_is_weights(torch.tensor(log_ratio), torch.tensor(mask), level, threshold).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(metrics["rollout_is_mean"], want[mask > 0].mean(), rtol=1e-12)


@pytest.mark.parametrize("option", ROLLOUT_RS_OPTIONS)
def test_rejection_equals_verl(option):
    threshold = "0.8_1.25" if option.endswith("k1") else (0.05 if option.startswith("seq_sum") else 0.02)
    rejected_some = False
    for seed in range(4):
        old, rollout, mask = make(seed)
        log_ratio = (old - rollout) * mask
        keep, metrics = rollout_rejection_keep(log_ratio, mask > 0, _flat_layout(mask), option, threshold)
        want = verl_rejection_mask(torch.tensor(log_ratio), torch.tensor(mask), option, threshold).numpy()
        np.testing.assert_array_equal(keep & (mask > 0), want > 0, err_msg=f"{option} seed {seed}")
        np.testing.assert_allclose(metrics["rollout_rs_masked_fraction"], 1 - want.sum() / mask.sum(), rtol=1e-12)
        rejected_some |= bool((want < mask).any())
    assert rejected_some, f"{option}: nothing rejected, the test would check little"


def test_chained_options_must_all_pass():
    old, rollout, mask = make(0)
    log_ratio = (old - rollout) * mask
    spec, threshold = "token_k2,seq_max_k3", "0.05,0.03"
    keep, _ = rollout_rejection_keep(log_ratio, mask > 0, _flat_layout(mask), spec, threshold)
    want = verl_rejection_mask(torch.tensor(log_ratio), torch.tensor(mask), spec, threshold).numpy()
    np.testing.assert_array_equal(keep & (mask > 0), want > 0)


def test_offpolicy_metrics_equal_verl():
    old, rollout, mask = make(1)
    got = offpolicy_metrics(old, rollout, mask > 0, _flat_layout(mask))
    o, r, m = (torch.tensor(x) for x in (old, rollout, mask))
    mean_train, mean_rollout = masked_mean(o, m, -1), masked_mean(r, m, -1)
    log_ratio = o - r
    want = {
        "training_ppl": torch.exp(-mean_train).mean(), "kl": masked_mean(r - o, m),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, m), "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "log_ppl_diff": (mean_rollout - mean_train).mean(), "ppl_ratio": torch.exp(mean_rollout - mean_train).mean(),
        "chi2_token": masked_mean(torch.exp(log_ratio) ** 2, m) - 1.0,
        "chi2_seq": torch.exp(2.0 * (log_ratio * m).sum(-1)).mean() - 1.0,
    }
    for key, value in want.items():
        np.testing.assert_allclose(got[key], float(value), rtol=1e-10, err_msg=key)


def test_loss_weights_give_verls_corrected_loss():
    """Σ w_t ℓ_t with the corrected weights of a packed batch = verl's agg_loss(ℓ · is_weights, rejection-modified
    mask), token-mean and seq-mean-token-mean: the normalisers count the kept tokens only."""
    from test_policy_losses import verl_agg_loss

    from ulorl_jax.rl.packing import TrainSample, pack_samples

    old, rollout, mask = make(2)
    lengths = mask.sum(1).astype(int)
    samples = [TrainSample([1, 2], [3] * n, 1.0, 1.0, list(rollout[i, :n])) for i, n in enumerate(lengths)]
    packed = pack_samples(samples, 24)
    batch = packed.arrays()
    batch["old_logprobs"] = batch["rollout_logprobs"].copy()
    for i, (s, (r, start)) in enumerate(zip(samples, packed.placement)):
        batch["old_logprobs"][r, start + 1:start + 1 + lengths[i]] = old[i, :lengths[i]]
    losses = np.random.default_rng(0).normal(size=(B, T))
    for agg in ("token-mean", "seq-mean-token-mean"):
        w, metrics = correct_loss_weights(batch, loss_agg_mode=agg, rollout_is="token", rollout_is_threshold=1.2,
                                          rollout_rs="seq_mean_k3", rollout_rs_threshold=0.03)
        ours = sum(float((w[r, start + 1:start + 1 + n] * losses[i, :n]).sum())
                   for i, (n, (r, start)) in enumerate(zip(lengths, packed.placement)))
        lr, m = torch.tensor((old - rollout) * mask), torch.tensor(mask)
        kept = verl_rejection_mask(lr, m, "seq_mean_k3", 0.03)
        assert 0 < kept.sum() < m.sum()
        is_w = verl_is_weights(lr, m, "token", 1.2)
        want = verl_agg_loss(torch.tensor(losses) * is_w, kept, agg).item()
        np.testing.assert_allclose(ours, want, rtol=1e-6, err_msg=agg)
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - float(kept.sum() / m.sum()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(rollout_is="tok"), r"algorithm.rollout_correction.rollout_is='tok'"),
    (dict(rollout_is="token", rollout_is_threshold="2_1"), r"rollout_is_threshold='2_1': expected lo <= hi"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_rs="seq_mean_k4", rollout_rs_threshold=0.1), r"rollout_rs='seq_mean_k4'"),
    (dict(rollout_rs="seq_mean_k3"), "rollout_rs_threshold=None"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "token_k2 takes one upper bound"),
    (dict(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.1,0.2,0.3"), "one per option"),
    (dict(rollout_is="token", is_mode="sais"), "is_mode=sais"),
    (dict(rollout_is="token", loss_mode="geo_mean"), "loss_mode=geo_mean"),
])
def test_bad_values_and_combinations_name_the_key(kwargs, match):
    args = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                is_mode="pois", loss_mode="vanilla")
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        check_rollout_correction(args.pop("rollout_is"), args.pop("rollout_is_threshold"), args.pop("rollout_rs"),
                                 args.pop("rollout_rs_threshold"), **args)


@pytest.mark.slow
def test_learner_applies_the_correction_and_logs_verls_metrics():
    """POIS + token TIS + seq_mean_k3 rejection through Learner.update: the scoring pass runs (one update), the
    metrics carry verl's rollout_corr/ names, and a rejected-everything threshold leaves nothing to learn."""
    import jax
    from learner_utils import DENSE, random_samples, small_config

    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rl.learner import Learner

    model = init_model(tiny_config("qwen3", **DENSE), seed=0)
    samples = random_samples(3, 6)
    learner = Learner(model, small_config(mask_mode="none", rollout_is="token", rollout_is_threshold=2.0,
                                          rollout_rs="seq_mean_k3", rollout_rs_threshold=1e-9))
    before = jax.tree.map(np.asarray, learner.params)
    m = learner.update(samples)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0  # the random rollout log-probs are far off
    assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean"} <= set(m)
    assert m["pg_loss"] == 0.0 and m["grad_norm"] == 0.0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(learner.params)):
        np.testing.assert_array_equal(x, np.asarray(y))  # weight decay 0, zero gradient: AdamW does not move
