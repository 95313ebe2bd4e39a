"""Options that must change the numbers as documented (issue 42), each against an independent reference:
entropy_coeff (NumPy entropy of the model's own logits, and jax.grad of a plain full-logits entropy),
warmup_steps / weight_decay (optax.adamw written out in NumPy), norm_adv_by_std=false and is_mode=sais
through the trainer (the TrainSamples the learner receives; SAIS ratios and loss from the recorded
rollout log-probs in NumPy)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from learner_utils import DENSE, random_samples, small_config
from trainer_utils import MOVING
from trainer_utils import tiny_config as tiny_run_config

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl.learner import Learner


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def _model():
    return init_model(tiny_config("qwen3", **DENSE), seed=0)


def _np_entropy(logits: np.ndarray) -> np.ndarray:
    """[T, V] logits -> [T] entropies in nats, float64."""
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def _response_positions(s) -> slice:
    """Positions whose logits predict the response tokens of sample `s` (prompt + response laid out)."""
    p = len(s.prompt_ids)
    return slice(p - 1, p + len(s.response_ids) - 1)


# ---------------------------------------------------------------------------
# algorithm.entropy_coeff
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_entropy_coeff_subtracts_coeff_times_mean_entropy_from_loss_and_gradient(agg):
    """verl's convention (policy_loss = pg_loss - entropy_coeff * entropy, the entropy aggregated like the
    loss): loss(c) == loss(0) - c * H, H the token mean (or mean of per-sample token means) of the full-vocab
    entropy computed in NumPy from the model's own logits; and grad(c) - grad(0) == -c * grad H, grad H by
    jax.grad of a plain full-logits entropy (not the learner's chunked log-prob / entropy scan)."""
    coeff = 0.5
    samples = random_samples(3, 5)
    model = _model()
    base = Learner(model, small_config(loss_agg_mode=agg))
    bonus = Learner(model, small_config(loss_agg_mode=agg, entropy_coeff=coeff))
    loss0, g0 = base.gradients(samples)
    loss_c, g_c = bonus.gradients(samples)

    seqs = [np.asarray([s.prompt_ids + s.response_ids], np.int32) for s in samples]
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    logits_of = jax.jit(lambda p, t: nnx.merge(graphdef, p, other)(t)[0])  # a plain full forward
    per_sample = [_np_entropy(np.asarray(logits_of(params, tokens)))[_response_positions(s)]
                  for s, tokens in zip(samples, seqs)]
    if agg == "token-mean":
        h = np.concatenate(per_sample).mean()
    else:
        h = np.mean([e.mean() for e in per_sample])
    assert h > 1.0  # a random policy: far from 0, so the term is visible
    np.testing.assert_allclose(float(loss_c), float(loss0) - coeff * h, rtol=0, atol=2e-5)

    def mean_entropy(p):
        ents = []
        for s, tokens in zip(samples, seqs):
            logp = jax.nn.log_softmax(logits_of(p, tokens).astype(jnp.float32), axis=-1)
            ents.append(-(jnp.exp(logp) * logp).sum(-1)[_response_positions(s)])
        if agg == "token-mean":
            return jnp.concatenate(ents).mean()
        return jnp.mean(jnp.stack([e.mean() for e in ents]))

    g_h = jax.jit(jax.grad(mean_entropy))(params)
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g_h))
    for (path, a), b, h_grad in zip(jax.tree_util.tree_leaves_with_path(g_c), jax.tree.leaves(g0),
                                    jax.tree.leaves(g_h)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), -coeff * np.asarray(h_grad), rtol=1e-3,
                                   atol=1e-4 * coeff * scale, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------
# optim.warmup_steps, optim.weight_decay (and betas, eps, grad_clip): optax.adamw written out
# ---------------------------------------------------------------------------


def _adamw_reference(steps, *, lr, warmup, wd, b1, b2, eps, clip):
    """optax.chain(clip_by_global_norm, adamw(warmup_constant_schedule(0, lr, warmup))) in NumPy, one step at a
    time from the learner's actual params and gradients: [(params_before, grads)] -> expected params after."""
    m = v = None
    out = []
    for k, (p, g) in enumerate(steps, start=1):
        norm = np.sqrt(sum(float((x ** 2).sum()) for x in g))
        if clip is not None:
            g = [x * (clip / max(norm, clip)) for x in g]
        m = [(1 - b1) * x for x in g] if m is None else [b1 * a + (1 - b1) * x for a, x in zip(m, g)]
        v = [(1 - b2) * x * x for x in g] if v is None else [b2 * a + (1 - b2) * x * x for a, x in zip(v, g)]
        rate = lr * min(k - 1, warmup) / warmup if warmup else lr  # the schedule at count k - 1
        out.append([x - rate * ((a / (1 - b1 ** k)) / (np.sqrt(c / (1 - b2 ** k)) + eps) + wd * x)
                    for x, a, c in zip(p, m, v)])
    return out


def test_warmup_and_weight_decay_follow_adamw_written_out():
    """W + 2 updates of a learner with warmup_steps=W, weight_decay, non-default betas / eps and clipping:
    after each, the params equal optax.adamw's formula in NumPy from the params and gradients before it,
    with the rate lr * min(k - 1, W) / W at update k (optax.warmup_constant_schedule(0, lr, W) at count k - 1,
    as transformers' get_constant_schedule_with_warmup: the first update has rate 0). The same reference with warmup 0
    or weight decay 0 is far outside the tolerance, so ignoring either option fails."""
    warmup, lr, wd, b1, b2, eps, clip = 3, 1e-2, 0.1, 0.8, 0.95, 1e-6, 1.0
    learner = Learner(_model(), small_config(lr=lr, warmup_steps=warmup, weight_decay=wd, betas=(b1, b2), eps=eps,
                                             grad_clip=clip, mask_mode="none"))
    samples = random_samples(4, 6)
    steps, after = [], []
    for _ in range(warmup + 2):
        p = [x for x in jax.tree.leaves(_host(learner.params))]
        _, grads = learner.gradients(samples)  # the step's gradient: one update, pi_old = current (POIS)
        steps.append((p, [x for x in jax.tree.leaves(_host(grads))]))
        m = learner.update(samples)
        assert m["skipped"] == 0 and m["updates"] == 1
        np.testing.assert_allclose(m["grad_norm"], np.sqrt(sum((x ** 2).sum() for x in steps[-1][1])), rtol=1e-5)
        after.append([x for x in jax.tree.leaves(_host(learner.params))])
    assert all(np.array_equal(a, b) for a, b in zip(after[0], steps[0][0])), "update 1 of a warmup has rate 0"
    want = _adamw_reference(steps, lr=lr, warmup=warmup, wd=wd, b1=b1, b2=b2, eps=eps, clip=clip)
    tol = dict(rtol=1e-5, atol=5e-4 * lr)  # Adam's g / (|g| + eps) of float32 gradients: a small part of lr
    for k, (got, exp) in enumerate(zip(after, want), start=1):
        for i, (a, b) in enumerate(zip(got, exp)):
            np.testing.assert_allclose(a, b, **tol, err_msg=f"update {k}, leaf {i}")

    def off(got, exp):
        return max(float(np.abs(a - b).max()) for a, b in zip(got, exp))

    no_warmup = _adamw_reference(steps, lr=lr, warmup=0, wd=wd, b1=b1, b2=b2, eps=eps, clip=clip)
    no_decay = _adamw_reference(steps, lr=lr, warmup=warmup, wd=0.0, b1=b1, b2=b2, eps=eps, clip=clip)
    for k in range(warmup + 2):
        if k < warmup:  # a rate below lr
            assert off(after[k], no_warmup[k]) > 0.1 * lr, f"update {k + 1}: warmup made no difference"
        if k > 0:  # decay needs a rate > 0
            assert off(after[k], no_decay[k]) > 20 * tol["atol"], f"update {k + 1}: weight decay made no difference"


def test_weight_decay_is_decoupled_from_the_gradient():
    """All advantages 0 (mask off, no entropy / aux term): the policy gradient is exactly 0 and Adam's step is
    0, so one AdamW update is the decoupled decay alone, params -= lr * wd * params (optax.adamw). An L2 term
    added to the gradient instead would go through Adam's normalisation: about lr * sign(params)."""
    lr, wd = 1e-2, 0.1
    learner = Learner(_model(), small_config(lr=lr, weight_decay=wd, mask_mode="none"))
    samples = [dataclasses.replace(s, advantage=0.0) for s in random_samples(5, 4)]
    before = jax.tree.leaves(_host(learner.params))
    m = learner.update(samples)
    assert m["grad_norm"] == 0.0 and m["skipped"] == 0
    for i, (a, b) in enumerate(zip(jax.tree.leaves(_host(learner.params)), before)):
        np.testing.assert_allclose(a - b, -lr * wd * b, rtol=1e-4, atol=1e-9, err_msg=f"leaf {i}")
        assert np.abs(a - b).max() > 0 or np.abs(b).max() == 0


# ---------------------------------------------------------------------------
# Through the trainer: norm_adv_by_std, is_mode=sais
# ---------------------------------------------------------------------------


def _capture_updates(trainer) -> list[dict]:
    """Wrap trainer.learner.update: record, per call, the TrainSamples, the trained groups (with their
    per-token policy versions), the params before the update (host copies) and the returned metrics."""
    calls = []
    update = trainer.learner.update

    def recording(samples):
        call = {"samples": list(samples), "groups": [list(g) for g in trainer.last_trained_groups],
                "params": _host(trainer.learner.params), "version": trainer.policy_version}
        call["metrics"] = update(samples)
        calls.append(call)
        return call["metrics"]

    trainer.learner.update = recording
    return calls


def _group_rewards(call) -> list[np.ndarray]:
    return [np.asarray([s.metadata["reward"] for s in g], np.float64) for g in call["groups"]]


@pytest.mark.slow  # a Trainer (engine + learner compiles): > 20 s on 2 cores
def test_norm_adv_by_std_false_feeds_the_learner_centred_rewards(tmp_path):
    """algorithm.norm_adv_by_std=false: the advantages the learner receives are reward - group mean (Dr. GRPO),
    not divided by the group std; the default (the same groups through Trainer.train_samples) divides by
    std + 1e-6 (ddof=0). At least one group has mixed rewards with std != 1, so the two differ."""
    from ulorl_jax.rl.trainer import Trainer

    cfg = tiny_run_config(*MOVING, "algorithm.norm_adv_by_std=false", "rollout.num_segments=1",
                          "checkpoint.save_every=0")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        calls = _capture_updates(trainer)
        for _ in range(4):
            trainer.train_step()
            if any(r.std() > 0 for c in calls for r in _group_rewards(c)):
                break
        mixed = 0
        for call in calls:
            got = np.asarray([s.advantage for s in call["samples"]], np.float64)
            rewards = _group_rewards(call)
            assert [s.reward for s in call["samples"]] == [float(x) for r in rewards for x in r]
            centred = np.concatenate([r - r.mean() for r in rewards])
            np.testing.assert_allclose(got, centred, rtol=0, atol=1e-6)
            mixed += sum(r.std() > 0 for r in rewards)
            # the default, on the same groups: divided by the group std
            default = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, norm_adv_by_std=True))
            trainer.cfg = default
            try:
                divided = np.asarray([s.advantage for s in trainer.train_samples(call["groups"])], np.float64)
            finally:
                trainer.cfg = cfg
            np.testing.assert_allclose(divided, np.concatenate([(r - r.mean()) / (r.std() + 1e-6) for r in rewards]),
                                       rtol=1e-5, atol=1e-6)
            if any(abs(r.std() - 1.0) > 0.1 and r.std() > 0 for r in rewards):
                assert np.abs(divided - got).max() > 0.1
        assert mixed > 0, "no group with mixed rewards: the test compares nothing"
    finally:
        trainer.close()


def _reference_logprobs(learner, params, samples, temperature: float) -> list[np.ndarray]:
    """Per sample, log softmax(logits / T)[token] of its response tokens by one plain full forward (float64
    softmax in NumPy) at `params`."""
    model = nnx.merge(learner.graphdef, jax.tree.map(jnp.asarray, params), learner._other)
    out = []
    for s in samples:
        tokens = np.asarray([s.prompt_ids + s.response_ids], np.int32)
        z = np.asarray(model(jnp.asarray(tokens)), np.float64)[0][_response_positions(s)] / temperature
        z -= z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        out.append(logp[np.arange(len(s.response_ids)), s.response_ids])
    return out


@pytest.mark.slow  # a Trainer (engine + learner compiles) and 2 steps: > 20 s on 2 cores
def test_sais_uses_the_rollout_logprobs_of_each_segment_through_the_trainer(tmp_path):
    """is_mode=sais, 2 segments, weights moving every step: a group whose samples hold tokens from policy
    versions 0 and 1 trains at step 2. The learner's ratio metrics, clip fractions and policy loss equal
    NumPy's from pi_old = the recorded rollout log-probs (ratio 1 on the current version's tokens, away from
    1 on the older segment's tokens) and pi = a full forward at the params before the update; POIS would
    give ratio_max == 1 exactly."""
    from ulorl_jax.rl.trainer import Trainer

    cfg = tiny_run_config(*MOVING, "algorithm.is_mode=sais", "algorithm.mask_mode=none",
                          "rollout.num_segments=2", "checkpoint.save_every=0")
    # Even prompts end after 1 or 2 tokens (mixed parity rewards: the weights move each step);
    # odd prompts run both segments, each under the then-current weights.
    oracle = lambda s: (1 + s.sample_index % 2) if s.prompt_index % 2 == 0 else 12  # noqa: E731
    trainer = Trainer(cfg, tmp_path / "run", length_oracle=oracle)
    temperature = cfg.rollout.temperature
    clip_low, clip_high = cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high
    try:
        calls = _capture_updates(trainer)
        for _ in range(2):
            trainer.train_step()
        call = next(c for c in calls if any(len(set(s.policy_versions)) == 2 for g in c["groups"] for s in g))
        samples, m = call["samples"], call["metrics"]
        assert m["updates"] == 1  # 2 groups of 4 = one mini-batch of 8: pi = the params before the update
        versions = [np.asarray(s.policy_versions) for g in call["groups"] for s in g]
        ref = _reference_logprobs(trainer.learner, call["params"], samples, temperature)
        recorded = [np.asarray(s.logprobs, np.float64) for s in samples]
        diff = np.concatenate([a - b for a, b in zip(ref, recorded)])
        current = np.concatenate([v == call["version"] for v in versions])
        assert np.abs(diff[current]).max() < 1e-4  # the rollout's own policy: the learner scores it alike
        assert np.abs(diff[~current]).max() > 1e-2  # the older segments: the weights moved since
        ratio = np.exp(diff)
        adv = np.concatenate([np.full(len(s.response_ids), s.advantage) for s in samples])
        np.testing.assert_allclose(m["ratio_mean"], ratio.mean(), rtol=1e-5)
        np.testing.assert_allclose(m["ratio_max"], ratio.max(), rtol=1e-5)
        assert m["ratio_max"] != 1.0  # POIS: exactly 1 at the first update
        surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
        surrogate = np.where(adv < 0, np.maximum(surrogate, cfg.algorithm.clip_ratio_c * adv), surrogate)  # dual-clip
        np.testing.assert_allclose(m["pg_loss"], -surrogate.mean(), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(m["clip_fraction_high"], ((adv > 0) & (ratio > 1 + clip_high)).mean(), atol=1e-7)
        np.testing.assert_allclose(m["clip_fraction_low"], ((adv < 0) & (ratio < 1 - clip_low)).mean(), atol=1e-7)
    finally:
        trainer.close()
