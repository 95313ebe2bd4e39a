"""UloRL policy loss (Eq. 10, DMMPT) against a plain NumPy formula."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.rl import (
    logprob_mismatch,
    logprob_mismatch_sums,
    old_logprobs_for,
    token_policy_loss,
    validate_loss_inputs,
)

B, T = 6, 12
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # clip-higher: asymmetric
TAU, SIGMA = 0.99, 0.2
KINDS = ("mixed", "all_positive", "empty_row", "all_empty")


# ---------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------


def numpy_eq10(lp, old, adv, mask, reward, ent, *, mask_mode, loss_agg_mode, entropy_mode):
    """Eq. 10 with loops, float64. Returns (loss, I_msk, counts dict)."""
    lp, old, adv, ent = (np.asarray(x, np.float64) for x in (lp, old, adv, ent))
    mask = np.asarray(mask).astype(bool)
    b, t = lp.shape
    lengths = mask.sum(axis=1)
    if entropy_mode == "batch":
        h_batch = (ent * lengths).sum() / lengths.sum() if lengths.sum() > 0 else 0.0
        low = [h_batch < SIGMA] * b
    else:
        low = [ent[i] < SIGMA for i in range(b)]
    i_msk = np.zeros((b, t), bool)
    per_sample = np.zeros(b)
    counts = dict(mpt=0, masked=0, clip_low=0, clip_high=0)
    ratios = []
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            a = adv[i] if adv.ndim == 1 else adv[i, j]
            r = np.exp(lp[i, j] - old[i, j])
            ratios.append(r)
            unclipped, clipped = r * a, min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH) * a
            counts["clip_low"] += int(a < 0 and r < 1 - CLIP_LOW)
            counts["clip_high"] += int(a > 0 and r > 1 + CLIP_HIGH)
            is_mpt = reward[i] == 1 and np.exp(lp[i, j]) >= TAU
            counts["mpt"] += int(is_mpt)
            masked = is_mpt and (mask_mode == "mpt" or (mask_mode == "dmmpt" and low[i]))
            i_msk[i, j] = masked
            counts["masked"] += int(masked)
            if not masked:
                per_sample[i] += min(unclipped, clipped)
    if loss_agg_mode == "token-mean":
        j_obj = per_sample.sum() / lengths.sum() if lengths.sum() > 0 else 0.0
    else:
        nonempty = lengths > 0
        j_obj = (per_sample[nonempty] / lengths[nonempty]).mean() if nonempty.any() else 0.0
    counts["ratio_mean"] = float(np.mean(ratios)) if ratios else 0.0
    counts["ratio_max"] = float(np.max(ratios)) if ratios else 0.0
    counts["tokens"] = int(lengths.sum())
    return -j_obj, i_msk, counts


def jnp_eq10(lp, old, adv, mask, i_msk, *, loss_agg_mode):
    """Eq. 10 straight from the formula, given a precomputed I_msk (no grad through it)."""
    adv = adv[:, None] if adv.ndim == 1 else adv
    r = jnp.exp(lp - old)
    surr = jnp.minimum(r * adv, jnp.clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
    w = mask * (1.0 - i_msk)
    if loss_agg_mode == "token-mean":
        return -jnp.sum(w * surr) / jnp.maximum(mask.sum(), 1.0)
    lengths = mask.sum(axis=1)
    per_sample = jnp.sum(w * surr, axis=1) / jnp.maximum(lengths, 1.0)
    nonempty = (lengths > 0).astype(jnp.float32)
    return -jnp.sum(per_sample * nonempty) / jnp.maximum(nonempty.sum(), 1.0)


@functools.cache
def jnp_eq10_grad(loss_agg_mode):
    """Jitted d(jnp_eq10)/d(logprobs), compiled once per aggregation mode."""
    return jax.jit(jax.grad(functools.partial(jnp_eq10, loss_agg_mode=loss_agg_mode)))


def make_batch(seed, *, kind, adv_2d, entropy_target):
    rng = np.random.default_rng(seed)
    # Well-mastered candidates (p >= 0.995) and clearly-uncertain tokens (p <= 0.82),
    # kept away from τ so float32 and float64 agree on the MPT test.
    confident = rng.random((B, T)) < 0.5
    lp = np.where(confident, -rng.uniform(0.0, 0.005, (B, T)), -rng.uniform(0.2, 4.0, (B, T)))
    old = lp + rng.normal(0.0, 0.3, (B, T))  # ratios both inside and outside the clip range
    lengths = rng.integers(3, T + 1, B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    reward = rng.integers(0, 2, B).astype(np.float32)
    reward[:2] = (1, 0)
    if kind == "all_positive":
        reward[:] = 1
    if kind == "empty_row":
        mask[1] = 0
    if kind == "all_empty":
        mask[:] = 0
    ent = rng.uniform(0.05, 0.35, B)
    ent[0] = 0.05  # at least one positive sample below σ ...
    ent[2] = 0.35  # ... and one sample above
    tok = mask.sum(axis=1)
    if tok.sum() > 0:  # shift so the token-weighted batch entropy is clearly on one side of σ
        ent = ent + entropy_target - (ent * tok).sum() / tok.sum()
    adv = rng.normal(size=(B, T) if adv_2d else (B,))
    return tuple(np.asarray(x, np.float32) for x in (lp, old, adv, mask, reward, ent))


# ---------------------------------------------------------------------------
# Loss value, metrics and gradient against the references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("adv_2d", [False, True], ids=["adv_B", "adv_BT"])
@pytest.mark.parametrize("entropy_mode", ["sample", "batch"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mask_mode", ["none", "mpt", "dmmpt"])
def test_loss_matches_numpy_eq10(mask_mode, loss_agg_mode, entropy_mode, adv_2d):
    opts = dict(mask_mode=mask_mode, loss_agg_mode=loss_agg_mode, entropy_mode=entropy_mode)
    loss_fn = functools.partial(
        token_policy_loss, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tau=TAU, sigma=SIGMA, **opts
    )
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    ref_grad_fn = jnp_eq10_grad(loss_agg_mode)
    saw_masking = False
    for seed, kind, target in itertools.product(range(2), KINDS, (0.12, 0.28)):
        lp, old, adv, mask, reward, ent = make_batch(seed, kind=kind, adv_2d=adv_2d, entropy_target=target)
        validate_loss_inputs(lp, old, adv, mask, reward, ent, **opts)
        ref_loss, i_msk, counts = numpy_eq10(lp, old, adv, mask, reward, ent, **opts)
        (loss, metrics), grad = value_and_grad(lp, old, adv, mask, reward, ent)
        where = f"seed={seed} kind={kind} entropy_target={target}"

        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6, err_msg=where)
        n = max(counts["tokens"], 1)
        np.testing.assert_allclose(metrics["masked_fraction"], counts["masked"] / n, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(metrics["mpt_fraction"], counts["mpt"] / n, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(metrics["clip_fraction_low"], counts["clip_low"] / n, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(metrics["clip_fraction_high"], counts["clip_high"] / n, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(metrics["ratio_mean"], counts["ratio_mean"], rtol=1e-5, err_msg=where)
        np.testing.assert_allclose(metrics["ratio_max"], counts["ratio_max"], rtol=1e-5, err_msg=where)
        ent_ref = (ent * mask.sum(1)).sum() / n
        np.testing.assert_allclose(metrics["entropy_mean"], ent_ref, rtol=1e-5, atol=1e-7, err_msg=where)

        ref_grad = ref_grad_fn(lp, old, adv, mask, i_msk.astype(np.float32))
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7, err_msg=where)
        # Masked (I_msk = 1) and non-response tokens get exactly zero gradient.
        grad = np.asarray(grad)
        assert np.all(grad[i_msk] == 0.0), where
        assert np.all(grad[mask == 0] == 0.0), where
        if kind == "all_empty":
            assert float(loss) == 0.0 and np.all(grad == 0.0), where
        saw_masking |= counts["masked"] > 0

    # Guard against a vacuous test: masking modes must actually mask something.
    assert saw_masking == (mask_mode != "none")


def test_dmmpt_per_sample_vs_batch_entropy():
    """Per-sample mode masks MPTs only of low-entropy samples; batch mode all-or-nothing."""
    lp = np.full((3, 4), -0.001, np.float32)  # every token is confident
    mask = np.ones((3, 4), np.float32)
    reward = np.array([1, 1, 0], np.float32)
    ent = np.array([0.1, 0.5, 0.1], np.float32)  # token-weighted batch mean 0.233 > σ
    adv = np.ones(3, np.float32)
    args = (lp, lp, adv, mask, reward, ent)
    loss_fn = jax.jit(token_policy_loss, static_argnames=("mask_mode", "entropy_mode"))
    _, m = loss_fn(*args, mask_mode="dmmpt", entropy_mode="sample")
    assert float(m["masked_fraction"]) == pytest.approx(4 / 12)  # sample 0 only
    assert float(m["mpt_fraction"]) == pytest.approx(8 / 12)
    _, m = loss_fn(*args, mask_mode="dmmpt", entropy_mode="batch")
    assert float(m["masked_fraction"]) == 0.0
    loss, m = loss_fn(*args, mask_mode="mpt", entropy_mode="sample")
    assert float(m["masked_fraction"]) == pytest.approx(8 / 12)
    # Masked tokens stay in the denominator: only sample 2's 4 tokens contribute, over 12.
    assert float(loss) == pytest.approx(-4 / 12)


def test_clip_fraction_definition():
    """Clipped = the clipped branch wins the min: Â>0 & r>1+ε_high, or Â<0 & r<1−ε_low."""
    ratio = np.array([[1.5, 0.5, 1.5, 0.5, 1.1]], np.float32)
    adv = np.array([[1.0, -1.0, -1.0, 1.0, 1.0]], np.float32)
    lp = np.log(ratio)
    old = np.zeros_like(lp)
    mask = np.ones_like(lp)
    loss_fn = jax.jit(functools.partial(token_policy_loss, clip_low=0.2, clip_high=0.28))
    _, m = loss_fn(lp, old, adv, mask, np.zeros(1), np.zeros(1))
    assert float(m["clip_fraction_high"]) == pytest.approx(1 / 5)
    assert float(m["clip_fraction_low"]) == pytest.approx(1 / 5)


def test_no_gradient_through_constants():
    lp, old, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=True, entropy_target=0.12)
    grad_fn = jax.jit(jax.grad(lambda o, a, e: token_policy_loss(lp, o, a, mask, reward, e)[0], argnums=(0, 1, 2)))
    grads = grad_fn(old, adv, ent)
    for g in grads:
        assert np.all(np.asarray(g) == 0.0)


def test_padding_with_inf_is_harmless():
    lp, old, adv, mask, reward, ent = make_batch(1, kind="empty_row", adv_2d=False, entropy_target=0.12)
    lp_pad = np.where(mask > 0, lp, -np.inf).astype(np.float32)
    old_pad = np.where(mask > 0, old, -np.inf).astype(np.float32)
    value_and_grad = jax.jit(jax.value_and_grad(token_policy_loss, has_aux=True))
    (loss, metrics), grad = value_and_grad(lp_pad, old_pad, adv, mask, reward, ent)
    (loss_ref, _), _ = value_and_grad(lp, old, adv, mask, reward, ent)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    validate_loss_inputs(lp_pad, old_pad, adv, mask, reward, ent)  # padding is not checked
    # An empty sample's H̄_i may be NaN (0/0 upstream); it must not reach the batch entropy.
    ent_nan = ent.copy()
    ent_nan[1] = np.nan  # sample 1 has no response tokens in "empty_row"
    batch_fn = jax.jit(functools.partial(token_policy_loss, entropy_mode="batch"))
    loss_nan, metrics_nan = batch_fn(lp, old, adv, mask, reward, ent_nan)
    loss_ok, metrics_ok = batch_fn(lp, old, adv, mask, reward, ent)
    assert float(loss_nan) == float(loss_ok)
    assert float(metrics_nan["entropy_mean"]) == float(metrics_ok["entropy_mean"])


# ---------------------------------------------------------------------------
# Importance sampling (POIS / SAIS) and the mismatch diagnostic
# ---------------------------------------------------------------------------


def test_pois_first_update_ratio_is_exactly_one():
    lp, sampling, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    old = old_logprobs_for("pois", policy_logprobs_at_start=lp, sampling_logprobs=sampling)
    loss_fn = functools.partial(token_policy_loss, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, mask_mode="none")
    (loss, m), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(lp, old, adv, mask, reward, ent)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_fraction_low"]) == 0.0 and float(m["clip_fraction_high"]) == 0.0
    # r == 1: the gradient is the plain policy gradient −Â / Σ|o_i| on every response token.
    np.testing.assert_allclose(grad, -adv[:, None] * mask / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(loss, -(adv[:, None] * mask).sum() / mask.sum(), rtol=1e-5)


def test_sais_uses_sampling_logprobs():
    lp, sampling, *_ = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    old = old_logprobs_for("sais", policy_logprobs_at_start=lp, sampling_logprobs=sampling)
    np.testing.assert_array_equal(old, sampling)


def test_old_logprobs_for_errors():
    with pytest.raises(ValueError, match=r"is_mode='tis'.*\('pois', 'sais'\)"):
        old_logprobs_for("tis", policy_logprobs_at_start=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="sampling_logprobs"):
        old_logprobs_for("sais", policy_logprobs_at_start=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="policy_logprobs_at_start"):
        old_logprobs_for("pois", sampling_logprobs=np.zeros((1, 2)))


def test_logprob_mismatch_matches_numpy():
    rng = np.random.default_rng(0)
    sampling = rng.normal(size=(3, 7)).astype(np.float32)
    learner = sampling + rng.normal(0, 0.1, (3, 7)).astype(np.float32)
    mask = (rng.random((3, 7)) < 0.6).astype(np.float32)
    learner[mask == 0] = 100.0  # off-response values must not count
    out = jax.jit(logprob_mismatch)(sampling, learner, mask)
    diff = np.abs(learner - sampling)[mask > 0]
    np.testing.assert_allclose(out["mean_abs_logprob_diff"], diff.mean(), rtol=1e-5)
    np.testing.assert_allclose(out["max_ratio"], np.exp(diff.max()), rtol=1e-5)
    # The sums the learner adds over micro-batches: two halves add up to the whole, host arrays or jit.
    halves = [logprob_mismatch_sums(sampling[i], learner[i], mask[i]) for i in (slice(0, 1), slice(1, 3))]
    whole = jax.jit(logprob_mismatch_sums)(sampling, learner, mask)
    np.testing.assert_allclose(sum(float(h["mismatch_abs_sum"]) for h in halves), diff.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(whole["mismatch_abs_sum"]), diff.sum(), rtol=1e-5)
    assert float(whole["mismatch_tokens"]) == sum(float(h["mismatch_tokens"]) for h in halves) == diff.size
    assert float(whole["mismatch_abs_max"]) == max(float(h["mismatch_abs_max"]) for h in halves)
    np.testing.assert_allclose(float(whole["mismatch_abs_max"]), diff.max(), rtol=1e-6)


# ---------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [("mask_mode", "always"), ("loss_agg_mode", "seq-mean"), ("entropy_mode", "token")],
)
def test_bad_option_names_option_and_allowed(option, value):
    lp, old, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    with pytest.raises(ValueError, match=rf"{option}='{value}' is not one of \("):
        token_policy_loss(lp, old, adv, mask, reward, ent, **{option: value})
    with pytest.raises(ValueError, match=rf"{option}='{value}'"):
        validate_loss_inputs(lp, old, adv, mask, reward, ent, **{option: value})


def test_shape_mismatch_names_argument_and_shapes():
    lp, old, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(6, 11\).*\(6, 12\)"):
        validate_loss_inputs(lp, old[:, :-1], adv, mask, reward, ent)
    with pytest.raises(ValueError, match=r"advantages has shape \(5,\)"):
        validate_loss_inputs(lp, old, adv[:-1], mask, reward, ent)
    with pytest.raises(ValueError, match=r"sample_entropy has shape \(6, 1\)"):
        validate_loss_inputs(lp, old, adv, mask, reward, ent[:, None])
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        validate_loss_inputs(lp[0], old, adv, mask, reward, ent)


def test_nan_and_reward_errors():
    lp, old, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    bad = old.copy()
    bad[0, 0] = np.nan  # position 0 is always a response token (lengths >= 3)
    with pytest.raises(ValueError, match="old_logprobs contains NaN or inf"):
        validate_loss_inputs(lp, bad, adv, mask, reward, ent)
    bad_adv = adv.copy()
    bad_adv[2] = np.inf
    with pytest.raises(ValueError, match="advantages contains NaN or inf"):
        validate_loss_inputs(lp, old, bad_adv, mask, reward, ent)
    half = reward.copy()
    half[0] = 0.5
    with pytest.raises(ValueError, match=r"sample_reward must be in \{0, 1\}.*0.5"):
        validate_loss_inputs(lp, old, adv, mask, half, ent, mask_mode="dmmpt")
    validate_loss_inputs(lp, old, adv, mask, half, ent, mask_mode="none")  # no MPT test, any reward


def test_validate_inside_jit_says_so():
    lp, old, adv, mask, reward, ent = make_batch(0, kind="mixed", adv_2d=False, entropy_target=0.12)
    with pytest.raises(ValueError, match="outside jit"):
        jax.jit(lambda x: validate_loss_inputs(x, old, adv, mask, reward, ent))(lp)
