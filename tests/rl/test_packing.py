"""Sequence packing: layout, bad input, and packed loss / gradients == the unpacked per-sample computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl import full_logprobs_and_entropy, sample_mean_entropy, token_policy_loss
from ulorl_jax.rl.learner import LearnerConfig, _micro_loss, policy_forward
from ulorl_jax.rl.packing import TrainSample, assign_rows, loss_weights, pack_samples, unpack_tokens

VOCAB = 48


def _samples(seed: int, n: int, *, max_prompt: int = 5, max_response: int = 9, logprobs: bool = True):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, o = int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_response + 1))
        out.append(TrainSample(
            prompt_ids=rng.integers(0, VOCAB, p).tolist(), response_ids=rng.integers(0, VOCAB, o).tolist(),
            advantage=float(rng.normal()), reward=float(i % 2),
            logprobs=(-rng.uniform(0.1, 4.0, o)).tolist() if logprobs else None))
    return out


def test_layout_round_trips_every_sample():
    samples = _samples(0, 7)
    packed = pack_samples(samples, row_len=16, row_multiple=2)
    rows = packed.tokens.shape[0]
    assert rows % 2 == 0 and (rows // 2) & (rows // 2 - 1) == 0  # a power of two groups of 2 rows
    assert packed.sample_lengths.shape == (8,)  # 7 samples padded to a power of two
    for i, (s, (r, start)) in enumerate(zip(samples, packed.placement)):
        n, p = s.length, len(s.prompt_ids)
        seq = s.prompt_ids + s.response_ids
        np.testing.assert_array_equal(packed.tokens[r, start:start + n], seq)
        np.testing.assert_array_equal(packed.targets[r, start:start + n - 1], seq[1:])
        np.testing.assert_array_equal(packed.positions[r, start:start + n], np.arange(n))
        seg = packed.segment_ids[r, start:start + n]
        assert (seg == seg[0]).all() and seg[0] > 0
        assert (packed.sample_index[r, start:start + n] == i).all()
        resp = packed.response_mask[r, start:start + n]
        assert resp.sum() == len(s.response_ids) and resp[p - 1] == 1 and resp[-1] == 0
        assert packed.sample_lengths[i] == len(s.response_ids)
    # segment ids unique per sample within a row; padding is segment 0 and carries nothing
    for r in range(rows):
        ids = [packed.segment_ids[r, st] for (rr, st) in packed.placement if rr == r]
        assert len(ids) == len(set(ids))
    pad = packed.segment_ids == 0
    assert packed.response_mask[pad].sum() == 0 and packed.tokens[pad].sum() == 0
    assert packed.response_mask.sum() == sum(len(s.response_ids) for s in samples)
    got = unpack_tokens(packed, packed.rollout_logprobs, samples)
    for s, g in zip(samples, got):
        np.testing.assert_allclose(g, s.logprobs, rtol=1e-6)


def test_first_fit_decreasing_fills_rows():
    assert assign_rows([6, 4, 10, 2], 10) == [(1, 0), (1, 6), (0, 0), (2, 0)]
    w = loss_weights(pack_samples(_samples(1, 5), 16), "token-mean")
    assert w.sum() == pytest.approx(1.0)
    w = loss_weights(pack_samples(_samples(1, 5), 16), "seq-mean-token-mean")
    assert w.sum() == pytest.approx(1.0)


def test_bad_samples_are_named():
    with pytest.raises(ValueError, match=r"sample 1: prompt 5 \+ response 9 = 14 tokens is longer than row_len=12"):
        pack_samples([TrainSample([1], [2], 0.0, 0.0), TrainSample([1] * 5, [2] * 9, 0.0, 0.0)], 12)
    with pytest.raises(ValueError, match="sample 0: prompt_ids is empty"):
        pack_samples([TrainSample([], [2], 0.0, 0.0)], 12)
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([], 12)


# ---------------------------------------------------------------------------
# Packed loss and gradients == per-sample (unpacked) computation through the model
# ---------------------------------------------------------------------------


def _unpacked_loss(params, graphdef, other, samples, *, temperature, tau, sigma, mask_mode, clip):
    """Reference: each sample alone in a right-padded [B, T] batch, full softmax, token_policy_loss."""
    b, t = len(samples), max(s.length for s in samples)
    tokens = np.zeros((b, t), np.int32)
    attn = np.zeros((b, t), np.int32)
    targets = np.zeros((b, t), np.int32)
    resp = np.zeros((b, t), np.float32)
    old = np.zeros((b, t), np.float32)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        tokens[i, :len(seq)] = seq
        attn[i, :len(seq)] = 1
        targets[i, :len(seq) - 1] = seq[1:]
        p, o = len(s.prompt_ids), len(s.response_ids)
        resp[i, p - 1:p - 1 + o] = 1
        old[i, p - 1:p - 1 + o] = s.logprobs
    adv = np.asarray([s.advantage for s in samples], np.float32)
    reward = np.asarray([s.reward for s in samples], np.float32)
    model = nnx.merge(graphdef, params, other)
    hidden = model.forward(jnp.asarray(tokens), attention_mask=jnp.asarray(attn), compute_logits=False).hidden
    logp, ent = full_logprobs_and_entropy(hidden, model.lm_head_weight(), jnp.asarray(targets),
                                          temperature=temperature)
    hbar = sample_mean_entropy(jax.lax.stop_gradient(ent), resp)
    loss, metrics = token_policy_loss(logp, old, adv, resp, reward, hbar, clip_low=clip, clip_high=clip,
                                      mask_mode=mask_mode, tau=tau, sigma=sigma)
    return loss, (metrics, hbar)


@pytest.mark.slow
@pytest.mark.parametrize("mask_mode", ["none", "dmmpt"])
def test_packed_loss_and_grads_equal_unpacked(mask_mode):
    cfg = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8,
                      num_hidden_layers=1)
    model = init_model(cfg, seed=3)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    samples = _samples(2, 6)
    kw = dict(temperature=0.8, tau=0.02, clip=0.2)  # τ low enough that a random policy has MPTs

    # σ between the samples' entropies, so DMMPT arms some samples and not others.
    (_, (_, hbar_ref)) = _unpacked_loss(params, graphdef, other, samples, sigma=0.0, mask_mode="none", **kw)
    sigma = float(np.median(np.asarray(hbar_ref)))
    ref_fn = jax.jit(jax.value_and_grad(
        lambda p: _unpacked_loss(p, graphdef, other, samples, sigma=sigma, mask_mode=mask_mode, **kw), has_aux=True))
    (ref_loss, (ref_metrics, _)), ref_grads = ref_fn(params)

    config = LearnerConfig(mask_mode=mask_mode, tau=kw["tau"], sigma=sigma, temperature=kw["temperature"],
                           row_len=16, micro_batch_rows=4, logprob_chunk=5, remat="full", is_mode="sais")
    packed = pack_samples(samples, config.row_len, row_multiple=config.micro_batch_rows)
    assert len({r for r, _ in packed.placement}) < len(samples)  # really packed: rows hold several samples
    mb = {k: jnp.asarray(v) for k, v in packed.arrays().items()}
    mb["loss_weight"] = jnp.asarray(loss_weights(packed, "token-mean"))
    mb["old_logprobs"] = mb["rollout_logprobs"]
    scalars = {"sample_lengths": mb.pop("sample_lengths"), "batch_entropy": jnp.zeros(()),
               "old_from_current": jnp.asarray(False), "aux_scale": jnp.ones(())}
    fn = jax.jit(jax.value_and_grad(lambda p: _micro_loss(p, graphdef, other, mb, scalars, config, "policy"),
                                    has_aux=True))
    (loss, sums), grads = fn(params)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    n = float(sums["tokens"])
    assert n == sum(len(s.response_ids) for s in samples)
    np.testing.assert_allclose(float(sums["masked_tokens"]) / n, ref_metrics["masked_fraction"], atol=1e-6)
    np.testing.assert_allclose(float(sums["mpt_tokens"]) / n, ref_metrics["mpt_fraction"], atol=1e-6)
    np.testing.assert_allclose(float(sums["ratio_sum"]) / n, ref_metrics["ratio_mean"], rtol=1e-5)
    if mask_mode == "dmmpt":
        assert 0 < float(sums["masked_tokens"]) < float(sums["mpt_tokens"])  # the mask did something, not all
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-4  # not vacuous


@pytest.mark.slow
def test_policy_forward_equals_model_forward_and_remat_keeps_grads():
    cfg = tiny_config("qwen3_moe", vocab_size=VOCAB, hidden_size=32, head_dim=8, num_hidden_layers=2)
    model = init_model(cfg, seed=1)
    packed = pack_samples(_samples(4, 4), 16)
    tok, pos, seg = (jnp.asarray(x) for x in (packed.tokens, packed.positions, packed.segment_ids))
    out = model.forward(tok, positions=pos, segment_ids=seg, compute_logits=False)
    hidden, aux = policy_forward(model, tok, pos, seg, remat="none")
    np.testing.assert_allclose(hidden, out.hidden, atol=1e-6)
    np.testing.assert_allclose(aux, out.aux_loss, rtol=1e-6)

    # Remat changes what is stored, not the math: same gradients (dense model, one compile each).
    dense = init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8,
                                   num_hidden_layers=2), seed=1)
    graphdef, params = nnx.split(dense, nnx.Param)
    w = jnp.asarray(np.random.default_rng(0).normal(size=hidden.shape), jnp.float32)

    def f(p, remat):
        h, _ = policy_forward(nnx.merge(graphdef, p), tok, pos, seg, remat=remat)
        return jnp.mean(jnp.where((seg > 0)[..., None], h * w, 0.0))

    g_none = jax.jit(jax.grad(lambda p: f(p, "none")))(params)
    g_full = jax.jit(jax.grad(lambda p: f(p, "full")))(params)
    for a, b in zip(jax.tree.leaves(g_none), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
