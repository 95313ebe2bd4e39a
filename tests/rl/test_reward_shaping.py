"""DAPO's overlong buffer against verl's DAPO reward manager restated per sample, its config keys, and how the
trainer feeds it: shaped rewards in the advantages, task rewards (0/1) for DMMPT and dynamic sampling."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ulorl_jax.config import ConfigError, load_config
from ulorl_jax.rl.advantages import grpo_advantages_host
from ulorl_jax.rl.reward_shaping import overlong_penalty, shaped_rewards
from ulorl_jax.rl.trainer import Trainer
from ulorl_jax.types import Sample


def verl_dapo_overlong(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    """verl/workers/reward_manager/dapo.py, one sample."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


@pytest.mark.parametrize("buffer_len,factor", [(16, 1.0), (96, 0.5), (1, 2.0)])
def test_penalty_equals_verl(buffer_len, factor):
    lengths = np.arange(0, 97)
    got = overlong_penalty(lengths, 96, buffer_len, factor)
    want = [verl_dapo_overlong(int(n), 96, buffer_len, factor) for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[96] == pytest.approx(-factor) and got[96 - buffer_len] == 0.0


def test_shaping_off_is_identity_and_log_adds_metrics():
    rewards, lengths = np.array([[1.0, 0.0, 1.0]]), np.array([[10, 96, 90]])
    same, metrics = shaped_rewards(rewards, lengths, 96, types.SimpleNamespace(enable=False))
    assert metrics == {} and (same == rewards).all()
    buffer = types.SimpleNamespace(enable=True, len=16, penalty_factor=1.0, log=True)
    shaped, metrics = shaped_rewards(rewards, lengths, 96, buffer)
    np.testing.assert_allclose(shaped, [[1.0, -1.0, 1.0 - 10 / 16]])
    assert metrics == pytest.approx({"overlong_reward_mean": -(1 + 10 / 16) / 3, "overlong_fraction": 2 / 3})


def test_config_keys_and_errors():
    cfg = load_config("tiny_cpu", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32",
                                   "reward.overlong_buffer.penalty_factor=1.0"])
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len) == (True, 32)
    assert load_config("tiny_cpu").reward.overlong_buffer.enable is False  # verl's default: off
    with pytest.raises(ConfigError, match="reward.overlong_buffer.len=0"):
        load_config("tiny_cpu", ["reward.overlong_buffer.enable=true"])
    with pytest.raises(ConfigError, match="reward.overlong_buffer.len=200"):
        load_config("tiny_cpu", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=200"])
    with pytest.raises(ConfigError, match="reward.overlong_buffer.penalty_factor"):
        load_config("tiny_cpu", ["reward.overlong_buffer.penalty_factor=-1"])


def test_trainer_advantages_use_shaped_rewards_and_samples_keep_task_rewards():
    """The UloRL rule stays (a truncated sample's task reward is 0); the buffer adds its penalty for the
    advantages only, and TrainSample.reward (DMMPT's positive-sample test) is the task reward."""
    cfg = load_config("tiny_cpu", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32",
                                   "reward.overlong_buffer.penalty_factor=1.0", "reward.overlong_buffer.log=true"])
    lengths = [[10, 80, 96, 40], [70, 20, 96, 96]]
    task = [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    groups = [[Sample(uid=4 * g + j, prompt_index=g, sample_index=j, prompt_ids=[1, 2], response_ids=[3] * n,
                      logprobs=[-1.0] * n, finish_reason="length" if n == 96 else "eos", metadata={"reward": r})
               for j, (n, r) in enumerate(zip(ln, rw))] for g, (ln, rw) in enumerate(zip(lengths, task))]
    fake = types.SimpleNamespace(cfg=cfg, shaping_metrics={})
    samples = Trainer.train_samples(fake, groups)
    shaped = np.asarray(task) + np.minimum(-(np.asarray(lengths) - 64) / 32, 0)
    np.testing.assert_allclose([s.advantage for s in samples], grpo_advantages_host(shaped).ravel(), rtol=1e-6)
    assert [s.reward for s in samples] == [r for g in task for r in g]
    assert fake.shaping_metrics["overlong_fraction"] == pytest.approx(5 / 8)
