"""verl's policy-loss family and agg_loss modes against an independent torch restatement of verl's code.

The references below are written from verl's `verl/trainer/ppo/core_algos.py` (`agg_loss`,
`compute_policy_loss_vanilla`, `_gspo`, `_cispo`, `_geo_mean`, `_sapo`), in float64 torch with autograd,
not from ours: values, verl's metrics and d loss / d log π are compared on ragged masks with positive,
negative and zero advantages, clipped and dual-clipped tokens. Then the same losses under packing and
micro-batching (the sum of micro-batch losses is the mini-batch loss), and composed with the DMMPT mask.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ulorl_jax.choices import LOSS_AGG_MODES, POLICY_LOSS_MODES
from ulorl_jax.models.config import ConfigError
from ulorl_jax.rl.losses import weighted_policy_loss
from ulorl_jax.rl.policy_losses import (
    Segments,
    aggregation_weights,
    check_policy_loss_options,
)

B, T = 7, 11
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
TAU_POS, TAU_NEG = 1.0, 1.05
SCALE_FACTOR = 16.0
ATOL = RTOL = 1e-6


# ---------------------------------------------------------------------------
# verl, restated in torch (float64)
# ---------------------------------------------------------------------------


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """verl agg_loss with dp_size 1 (global batch = this batch)."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return (loss_mat * loss_mask).sum()
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).double()
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    assert loss_agg_mode == "seq-mean-token-mean"
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).double()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_vanilla(old_log_prob, log_prob, advantages, response_mask, agg, weights):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).double(), response_mask)
    pg_losses3 = -advantages * CLIP_C
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1) * weights
    return verl_agg_loss(pg_losses, response_mask, agg, SCALE_FACTOR), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, agg, weights):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, agg, SCALE_FACTOR)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).double(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.tensor(0.0)


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, agg, weights):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob * weights
    pg_clipfrac = masked_mean((ratio != clipped_ratio).double(), response_mask)
    return verl_agg_loss(pg_losses, response_mask, agg, SCALE_FACTOR), pg_clipfrac, ppo_kl, torch.tensor(0.0)


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, agg, weights):
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -CLIP_LOW, CLIP_HIGH)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_loss = torch.mean(-advantage * ratio)  # verl ignores loss_agg_mode here
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).double(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).double(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, agg, weights):
    tau_pos = torch.as_tensor(TAU_POS, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(TAU_NEG, dtype=advantages.dtype)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages * weights
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return verl_agg_loss(pg_losses, response_mask, agg, SCALE_FACTOR), torch.tensor(0.0), ppo_kl, torch.tensor(0.0)


VERL = {"vanilla": verl_vanilla, "gspo": verl_gspo, "cispo": verl_cispo, "geo_mean": verl_geo_mean,
        "sapo": verl_sapo}


def verl_reference(mode, lp, old, adv, mask, agg, keep=None):
    """(loss, d loss / d lp, pg_clipfrac, ppo_kl, pg_clipfrac_lower) as numpy float64; `keep` multiplies the
    loss matrix as verl's rollout_is_weights do (the DMMPT composition of the token-level losses)."""
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    args = [torch.tensor(x, dtype=torch.float64) for x in (old, adv, mask)]
    weights = torch.ones_like(lp_t) if keep is None else torch.tensor(keep, dtype=torch.float64)
    loss, clipfrac, kl, lower = VERL[mode](args[0], lp_t, args[1], args[2], agg, weights)
    loss.backward()
    return tuple(float(x.detach()) if torch.is_tensor(x) and x.dim() == 0 else x
                 for x in (loss, lp_t.grad.numpy(), clipfrac, kl, lower))


# ---------------------------------------------------------------------------
# Data and ours
# ---------------------------------------------------------------------------


def make_batch(seed, *, empty_row=True):
    """Ragged rows (one empty unless `empty_row` is False), per-sample advantages of both signs and one 0,
    log-ratios up to ±1.6 (clipped, and dual-clipped r > 3 with Â < 0)."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.05, 3.0, (B, T))
    old = lp + rng.normal(0.0, 0.6, (B, T))
    old[0, :3] = lp[0, :3] - 1.4  # r = e^1.4 > 3 ...
    lengths = rng.integers(1, T + 1, B)
    lengths[0] = T
    if empty_row:
        lengths[3] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(size=B)
    adv[0] = -abs(adv[0]) - 0.5  # ... with a negative advantage: dual-clipped
    adv[1] = abs(adv[1]) + 0.5
    adv[2] = 0.0
    adv = np.broadcast_to(adv[:, None], (B, T)).copy()
    return lp, old, adv, mask


def ours(mode, lp, old, adv, mask, agg, *, mask_mode="none", reward=None, layout=None):
    """(loss, d loss / d lp, sums) of weighted_policy_loss on the [B, T] batch, or summed over the micro-batches
    of `layout` (packed rows)."""
    lengths = mask.sum(axis=1).astype(np.float32)
    reward = np.zeros(B, np.float32) if reward is None else reward
    agg_w = "seq-mean-token-mean" if mode == "geo_mean" else agg
    fn = functools.partial(weighted_policy_loss, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, mask_mode=mask_mode,
                           tau=0.9, sigma=0.2, loss_mode=mode, clip_ratio_c=CLIP_C, tau_pos=TAU_POS,
                           tau_neg=TAU_NEG)

    def loss_of(lp_, old_, adv_, m_, idx_, rew_):
        segments = Segments(idx_, jnp.asarray(lengths))
        w = aggregation_weights(m_ > 0, segments, agg_w, SCALE_FACTOR)
        return fn(lp_, old_, adv_, m_, w, rew_, jnp.zeros_like(lp_), segments=segments)

    grad_fn = jax.jit(jax.value_and_grad(loss_of, has_aux=True))
    f32 = functools.partial(np.asarray, dtype=np.float32)
    lp = np.where(mask > 0, lp, -np.inf)  # our padding may hold anything (verl's is finite)
    if layout is None:
        idx = np.broadcast_to(np.arange(B)[:, None], (B, T)).astype(np.int32)
        (loss, sums), g = grad_fn(f32(lp), f32(old), f32(adv), f32(mask), idx, f32(reward[:, None] * mask))
        return float(loss), np.asarray(g, np.float64), {k: float(v) for k, v in sums.items()}
    return layout.run(grad_fn, lp, old, adv, mask, reward)


class PackedLayout:
    """Samples laid head to tail into rows of `row_len`, rows split into micro-batches of `rows` rows."""

    def __init__(self, lengths, row_len, rows):
        self.place, free = [], []
        for n in lengths:
            for r, used in enumerate(free):
                if used + n <= row_len:
                    self.place.append((r, used))
                    free[r] += n
                    break
            else:
                self.place.append((len(free), 0))
                free.append(n)
        self.num_rows = -(-len(free) // rows) * rows
        self.row_len, self.rows = row_len, rows

    def run(self, grad_fn, lp, old, adv, mask, reward):
        shape = (self.num_rows, self.row_len)
        arrays = {k: np.zeros(shape, np.float32) for k in ("lp", "old", "adv", "mask", "reward")}
        arrays["lp"][:] = -np.inf
        idx = np.zeros(shape, np.int32)
        for i, (r, start) in enumerate(self.place):
            n = int(mask[i].sum())
            sl = slice(start, start + n)
            for key, src in (("lp", lp), ("old", old), ("adv", adv)):
                arrays[key][r, sl] = src[i, :n]
            arrays["mask"][r, sl] = 1.0
            arrays["reward"][r, sl] = reward[i]
            idx[r, sl] = i
        loss, grads, sums = 0.0, np.zeros(shape), {}
        for lo in range(0, self.num_rows, self.rows):
            part = slice(lo, lo + self.rows)
            (value, s), g = grad_fn(*(arrays[k][part] for k in ("lp", "old", "adv", "mask")), idx[part],
                                    arrays["reward"][part])
            loss += float(value)
            grads[part] = np.asarray(g)
            for k, v in s.items():
                sums[k] = max(sums.get(k, 0.0), float(v)) if k == "ratio_max" else sums.get(k, 0.0) + float(v)
        unpacked = np.zeros((B, T))
        for i, (r, start) in enumerate(self.place):
            n = int(mask[i].sum())
            unpacked[i, :n] = grads[r, start:start + n]
        return loss, unpacked, sums


def _check(got, want, where):
    loss, grad, sums = got
    ref_loss, ref_grad, clipfrac, kl, lower = want
    tokens = sums["tokens"]
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL, err_msg=f"loss {where}")
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL, err_msg=f"grad {where}")
    np.testing.assert_allclose(sums["pg_clip_tokens"] / tokens, clipfrac, atol=1e-7, err_msg=f"pg_clipfrac {where}")
    np.testing.assert_allclose(sums["pg_clip_lower_tokens"] / tokens, lower, atol=1e-7,
                               err_msg=f"pg_clipfrac_lower {where}")
    np.testing.assert_allclose(sums["ppo_kl_sum"] / tokens, kl, rtol=1e-6, atol=1e-6, err_msg=f"ppo_kl {where}")


CASES = [(mode, agg) for mode in POLICY_LOSS_MODES for agg in (LOSS_AGG_MODES if mode != "geo_mean"
                                                                else ("seq-mean-token-mean",))]


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode,agg", CASES)
def test_loss_metrics_and_gradient_equal_verl(mode, agg):
    saw_dual_clip = saw_clip = False
    for seed in range(3):
        # geo_mean: verl takes torch.mean over every row, ours over the samples (which all have a response)
        lp, old, adv, mask = make_batch(seed, empty_row=mode != "geo_mean")
        want = verl_reference(mode, lp, old, adv, mask, agg)
        _check(ours(mode, lp, old, adv, mask, agg), want, f"{mode} {agg} seed {seed}")
        saw_clip |= want[2] > 0
        saw_dual_clip |= want[4] > 0
    if mode != "sapo":
        assert saw_clip, "no clipped token: the test would check little"
    if mode == "vanilla":
        assert saw_dual_clip, "no dual-clipped token"


@pytest.mark.parametrize("mode,agg", [(m, a) for m, a in CASES if a in ("token-mean", "seq-mean-token-mean",
                                                                          "seq-mean-token-sum-norm")])
def test_packed_micro_batches_sum_to_the_mini_batch_loss(mode, agg):
    """Samples packed several to a row, rows in micro-batches of 2: the micro-batch losses and gradients add up
    to verl's loss of the whole batch (the weights are the mini-batch's, a sequence's tokens one segment)."""
    lp, old, adv, mask = make_batch(5, empty_row=False)
    layout = PackedLayout(mask.sum(axis=1).astype(int), row_len=16, rows=2)
    assert layout.num_rows >= 4 and len({r for r, _ in layout.place}) < B  # packed, several micro-batches
    _check(ours(mode, lp, old, adv, mask, agg, layout=layout), verl_reference(mode, lp, old, adv, mask, agg),
           f"{mode} {agg} packed")


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo", "sapo"])
def test_mpt_mask_composes_as_a_loss_weight(mode):
    """The MPT mask on the token-level losses is verl's loss with the masked tokens' ℓ multiplied by 0 (as
    rollout_is_weights multiply it): same denominators, no gradient on masked tokens."""
    lp, old, adv, mask = make_batch(1)
    lp = np.where(np.random.default_rng(0).random((B, T)) < 0.4, -0.01, lp)  # confident tokens, p > τ = 0.9
    reward = np.array([1, 1, 0, 1, 0, 1, 1], np.float32)
    keep = 1.0 - ((np.exp(lp) >= 0.9) & (reward[:, None] == 1) & (mask > 0))
    assert keep[mask > 0].min() == 0  # some masked tokens
    agg = "seq-mean-token-mean"
    got = ours(mode, lp, old, adv, mask, agg, mask_mode="mpt", reward=reward)
    _check(got, verl_reference(mode, lp, old, adv, mask, agg, keep=keep), f"{mode} mpt")
    assert got[2]["masked_tokens"] == (1.0 - keep)[mask > 0].sum()


def test_geo_mean_mask_removes_gradient_not_value():
    lp, old, adv, mask = make_batch(2, empty_row=False)
    lp = np.where(np.random.default_rng(1).random((B, T)) < 0.4, -0.01, lp)
    reward = np.ones(B, np.float32)
    plain = ours("geo_mean", lp, old, adv, mask, "seq-mean-token-mean")
    masked = ours("geo_mean", lp, old, adv, mask, "seq-mean-token-mean", mask_mode="mpt", reward=reward)
    i_msk = (np.exp(lp) >= 0.9) & (mask > 0)
    assert i_msk.any() and (~i_msk & (mask > 0) & (plain[1] != 0)).any()
    np.testing.assert_allclose(masked[0], plain[0], rtol=1e-6)
    assert (masked[1][i_msk] == 0).all()
    np.testing.assert_allclose(masked[1][~i_msk], plain[1][~i_msk], rtol=1e-6, atol=1e-9)


def test_dual_clip_off_is_ulorl_eq10():
    """clip_ratio_c=None is today's Eq. 10 surrogate: dual-clip changes only Â < 0 tokens with r > c."""
    lp, old, adv, mask = make_batch(0)
    args = [np.asarray(x, np.float32) for x in (lp, old, adv, mask)]
    w = np.asarray(mask / mask.sum(), np.float32)
    zeros = np.zeros_like(args[0])
    on = weighted_policy_loss(*args, w, zeros, zeros, mask_mode="none", clip_ratio_c=3.0)[0]
    off = weighted_policy_loss(*args, w, zeros, zeros, mask_mode="none", clip_ratio_c=None)[0]
    r = np.exp(np.where(mask > 0, lp - old, 0.0))
    surrogate = np.minimum(r * adv, np.clip(r, 1 - 0.2, 1 + 0.2) * adv)
    np.testing.assert_allclose(float(off), -(surrogate * mask).sum() / mask.sum(), rtol=1e-6)
    dual = np.where((adv < 0) & (mask > 0), np.maximum(surrogate, 3.0 * adv), surrogate)
    np.testing.assert_allclose(float(on), -(dual * mask).sum() / mask.sum(), rtol=1e-6)
    assert float(on) != float(off)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_loss_weights_equal_the_aggregation_of_verl(agg):
    """packing.loss_weights (what the learner's pack gives each token) equals verl's agg_loss of a loss matrix
    (seq-mean-token-sum-norm: before the step's division by loss_scale_factor)."""
    from ulorl_jax.rl.packing import TrainSample, loss_weights, pack_samples

    rng = np.random.default_rng(0)
    samples = [TrainSample([1, 2], list(range(3, 3 + n)), 1.0, 1.0) for n in rng.integers(1, 9, 6)]
    packed = pack_samples(samples, 12)
    w = loss_weights(packed, agg)
    losses = rng.normal(size=(len(samples), 8))
    mat = np.zeros((len(samples), 8))
    for i, s in enumerate(samples):
        mat[i, :len(s.response_ids)] = 1.0
    ours_value = 0.0
    for i, (s, (r, start)) in enumerate(zip(samples, packed.placement)):
        p, o = len(s.prompt_ids), len(s.response_ids)
        ours_value += float((w[r, start + p - 1:start + p - 1 + o] * losses[i, :o]).sum())
    ref = verl_agg_loss(torch.tensor(losses), torch.tensor(mat), agg, 1.0).item()
    np.testing.assert_allclose(ours_value, ref, rtol=1e-6)


def test_option_rules_name_the_keys(caplog):
    with pytest.raises(ConfigError, match="algorithm.loss_scale_factor"):
        check_policy_loss_options("vanilla", "seq-mean-token-sum-norm", None)
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.rl.policy_losses"):
        check_policy_loss_options("gspo", "token-mean", None)
    assert "algorithm.loss_mode=gspo with algorithm.loss_agg_mode=token-mean" in caplog.text
    assert "sequence-level" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.rl.policy_losses"):
        check_policy_loss_options("gspo", "seq-mean-token-mean", None)
        check_policy_loss_options("vanilla", "token-mean", None)
    assert not caplog.text
