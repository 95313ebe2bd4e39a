"""verl's policy losses through the Learner: packed rows, micro-batches and the 8-device sharded step give
verl's loss of the whole mini-batch (the reference of tests/rl/test_policy_losses.py on the learner's own
log-probs), and the options arrive from the run config."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from learner_utils import DENSE, assert_trees_close, random_samples, small_config
from test_policy_losses import (
    CLIP_C,
    CLIP_HIGH,
    CLIP_LOW,
    TAU_NEG,
    TAU_POS,
    verl_reference,
)

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl.learner import Learner, LearnerConfig
from ulorl_jax.rl.packing import unpack_tokens
from ulorl_jax.sharding import MeshConfig, make_mesh

SCALE_FACTOR = 16.0  # test_policy_losses' verl reference divides seq-mean-token-sum-norm by it


def _config(mode, agg, **kw):
    return small_config(is_mode="sais", mask_mode="none", loss_mode=mode, loss_agg_mode=agg,
                        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, tau_pos=TAU_POS,
                        tau_neg=TAU_NEG, loss_scale_factor=SCALE_FACTOR, **kw)


def _learner_logprobs(learner, samples):
    packed, batch = learner.pack(samples)
    logp, _ = learner._score_batch(batch)
    return unpack_tokens(packed, logp.reshape(packed.tokens.shape), samples)


def _as_matrix(rows):
    t = max(len(r) for r in rows)
    out = np.zeros((len(rows), t))
    mask = np.zeros((len(rows), t))
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        mask[i, :len(r)] = 1.0
    return out, mask


@pytest.mark.slow
@pytest.mark.parametrize("mode,agg", [("vanilla", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean"),
                                      ("geo_mean", "seq-mean-token-mean"), ("cispo", "token-sum"),
                                      ("sapo", "seq-mean-token-sum")])
def test_learner_loss_is_verls_loss_of_the_mini_batch(mode, agg):
    """Several samples per packed row, one row per micro-batch (gradient accumulation over 4+): the learner's
    loss equals verl's formula on the unpacked batch with the learner's log-probs (SAIS: π_old = rollout)."""
    samples = random_samples(11, 9)
    learner = Learner(init_model(tiny_config("qwen3", **DENSE), seed=0), _config(mode, agg))
    assert learner.pack(samples)[1]["tokens"].shape[0] >= 4
    lp, mask = _as_matrix(_learner_logprobs(learner, samples))
    old, _ = _as_matrix([s.logprobs for s in samples])
    adv = np.broadcast_to(np.asarray([s.advantage for s in samples])[:, None], lp.shape)
    want = verl_reference(mode, lp, old, adv, mask, agg)
    loss, _ = learner.gradients(samples)
    np.testing.assert_allclose(float(loss), want[0], rtol=2e-5, atol=1e-6)
    m = learner.update(samples)
    np.testing.assert_allclose(m["actor/pg_clipfrac"], want[2], atol=1e-6)
    np.testing.assert_allclose(m["actor/ppo_kl"], want[3], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["actor/pg_clipfrac_lower"], want[4], atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
def test_sharded_step_equals_single_device_for_the_sequence_level_losses():
    samples = random_samples(8, 20)
    model = init_model(tiny_config("qwen3", **DENSE), seed=5)
    for mode, agg in (("gspo", "seq-mean-token-sum-norm"), ("geo_mean", "token-mean")):
        conf = _config(mode, agg, micro_batch_rows=8)
        ref = Learner(model, conf)
        loss_ref, g_ref = ref.gradients(samples)
        sharded = Learner(model, conf, make_mesh(MeshConfig(fsdp=8)))
        loss, grads = sharded.gradients(samples)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, err_msg=mode)
        g_scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g_ref))
        assert_trees_close(grads, g_ref, 1e-4, 1e-5 * g_scale, f"gradients {mode}")


@pytest.mark.parametrize("field,value,match", [
    ("loss_mode", "ppo", r"algorithm.loss_mode='ppo': expected one of \['vanilla', 'gspo', 'cispo', 'geo_mean', "
                         r"'sapo'\]"),
    ("clip_ratio_c", 1.0, r"algorithm.clip_ratio_c=1.0: expected > 1 \(dual-clip\) or null \(off\)"),
    ("tau_pos", 0.0, "algorithm.tau_pos"),
    ("tau_neg", -1.0, "algorithm.tau_neg"),
    ("loss_scale_factor", 0.0, "algorithm.loss_scale_factor"),
    ("loss_agg_mode", "seq-mean-token-sum-norm", "needs algorithm.loss_scale_factor"),
])
def test_bad_values_name_the_key(field, value, match):
    with pytest.raises(ValueError, match=match):
        LearnerConfig(**{field: value})


def test_run_config_defaults_and_overrides():
    """verl's defaults (clip_ratio_c 3, tau_pos 1, tau_neg 1.05, vanilla), and seq-mean-token-sum-norm's divisor
    defaults to the max response length (verl: the padded response length)."""
    from ulorl_jax.config import ConfigError, load_config
    from ulorl_jax.rl.build import learner_config

    lc = learner_config(load_config("tiny_cpu", ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"]))
    assert (lc.loss_mode, lc.clip_ratio_c, lc.tau_pos, lc.tau_neg) == ("vanilla", 3.0, 1.0, 1.05)
    assert lc.loss_scale_factor == 96.0  # tiny_cpu's rollout.global_max_len
    lc = learner_config(load_config("tiny_cpu", ["algorithm.loss_mode=cispo", "algorithm.clip_ratio_c=null",
                                                 "algorithm.loss_scale_factor=4096"]))
    assert (lc.loss_mode, lc.clip_ratio_c, lc.loss_scale_factor) == ("cispo", None, 4096)
    with pytest.raises(ConfigError, match="algorithm.loss_mode"):
        load_config("tiny_cpu", ["algorithm.loss_mode=grpo"])
