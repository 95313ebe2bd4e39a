"""Sampling: greedy, temperature, top-k / top-p against plain NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.decode.sampling import EVAL_SAMPLING, GREEDY, TRAIN_SAMPLING, SamplingParams, sample_tokens


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_allowed_probs(logits, p: SamplingParams):
    """The sampling distribution after top-k then top-p, written independently (NumPy)."""
    z = logits / p.temperature
    keep = np.ones_like(z, bool)
    if p.top_k:
        kth = np.sort(z)[::-1][p.top_k - 1]
        keep &= z >= kth
    probs = np.exp(np_log_softmax(np.where(keep, z, -np.inf)))
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        kept = np.zeros_like(keep)
        kept[order] = before < p.top_p
        keep &= kept
        probs = np.exp(np_log_softmax(np.where(keep, z, -np.inf)))
    return keep, probs


def test_defaults_follow_the_paper():
    assert (TRAIN_SAMPLING.temperature, TRAIN_SAMPLING.top_k, TRAIN_SAMPLING.top_p) == (0.85, 0, 1.0)
    assert SamplingParams() == TRAIN_SAMPLING
    assert (EVAL_SAMPLING.temperature, EVAL_SAMPLING.top_k, EVAL_SAMPLING.top_p) == (0.85, 20, 0.95)


def test_greedy_is_argmax_with_unscaled_logprob():
    logits = np.random.default_rng(0).normal(size=(5, 31)).astype(np.float32) * 3
    tok, lp, slp = sample_tokens(jnp.asarray(logits), jax.random.PRNGKey(0), GREEDY)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(lp), np_log_softmax(logits)[np.arange(5), logits.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(slp), 0.0)


def test_temperature_logprob_is_full_scaled_policy():
    logits = np.random.default_rng(1).normal(size=(64, 23)).astype(np.float32) * 2
    p = SamplingParams(0.7)
    tok, lp, slp = (np.asarray(x) for x in sample_tokens(jnp.asarray(logits), jax.random.PRNGKey(3), p))
    ref = np_log_softmax(logits / 0.7)[np.arange(64), tok]
    np.testing.assert_allclose(lp, ref, atol=1e-5)
    np.testing.assert_array_equal(slp, lp)  # no filtering: the two coincide


def test_seeded_and_reproducible():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(128, 50)).astype(np.float32))
    a = sample_tokens(logits, jax.random.PRNGKey(7), EVAL_SAMPLING)[0]
    b = sample_tokens(logits, jax.random.PRNGKey(7), EVAL_SAMPLING)[0]
    c = sample_tokens(logits, jax.random.PRNGKey(8), EVAL_SAMPLING)[0]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # Per-row keys ([B, 2] raw or typed) give the same as the keys they are.
    keys = jax.random.split(jax.random.PRNGKey(7), 128)
    d = sample_tokens(logits, keys, EVAL_SAMPLING)[0]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(d))
    e = sample_tokens(logits, jax.random.wrap_key_data(keys), EVAL_SAMPLING)[0]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize("params", [SamplingParams(0.85, 5, 1.0), SamplingParams(1.0, 0, 0.7),
                                    EVAL_SAMPLING, SamplingParams(0.5, 3, 0.5)])
def test_top_k_top_p_stay_in_allowed_set_and_match_distribution(params):
    v, n = 40, 6000
    logits = (np.random.default_rng(4).normal(size=(v,)) * 1.5).astype(np.float32)
    keep, probs = np_allowed_probs(logits, params)
    assert 1 <= keep.sum() < v  # the filter really removes tokens
    batch = jnp.asarray(np.broadcast_to(logits, (n, v)))
    tok, lp, slp = (np.asarray(x) for x in jax.jit(sample_tokens, static_argnums=2)(
        batch, jax.random.PRNGKey(11), params))
    assert keep[tok].all(), f"emitted tokens outside the allowed set: {sorted(set(tok[~keep[tok]]))}"
    freq = np.bincount(tok, minlength=v) / n
    assert np.abs(freq - probs).max() < 0.03  # ~4 sigma at n=6000
    np.testing.assert_allclose(slp, np.log(probs[tok]), atol=1e-5)
    np.testing.assert_allclose(lp, np_log_softmax(logits / params.temperature)[tok], atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
                                           (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_argmax_last_equals_numpy_argmax_with_ties_inf_and_nan():
    from ulorl_jax.decode.sampling import argmax_last

    x = np.random.default_rng(4).integers(-3, 4, size=(64, 37)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 5:] = np.inf
    x[3, [9, 20]] = np.nan  # argmax: the first NaN
    x[4, :] = np.nan
    for rows in (x, x[:, :1], x[0]):
        got = np.asarray(jax.jit(argmax_last)(jnp.asarray(rows)))
        np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))
        assert got.dtype == np.int32


@pytest.mark.parametrize("typed", [False, True])
def test_categorical_draws_the_tokens_of_jax_random_categorical(typed):
    from ulorl_jax.decode.sampling import categorical

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(256, 40)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3] = -np.inf  # what top-k / top-p leave
    keys = jax.random.split(jax.random.PRNGKey(11), 256)
    keys = jax.random.wrap_key_data(keys) if typed else keys
    ours = np.asarray(jax.jit(categorical)(keys, jnp.asarray(logits)))
    ref = np.asarray(jax.jit(jax.vmap(jax.random.categorical))(keys, jnp.asarray(logits)))
    np.testing.assert_array_equal(ours, ref)
    assert len(np.unique(ours)) > 20  # the draws differ from row to row: not a degenerate comparison
