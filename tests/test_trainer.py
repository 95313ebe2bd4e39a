"""The UloRL trainer end to end: exact resume, SIGKILL resume, segments from several policy versions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ulorl_jax.config import load_config
from ulorl_jax.metrics import read_metrics
from ulorl_jax.rl.trainer import Trainer, TrainingError

# A tiny random policy on the synthetic task: short outputs, 3 segments, groups of 4.
TINY = [
    "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_attention_heads=2",
    "model.arch.num_key_value_heads=1", "model.arch.moe_intermediate_size=16", "model.arch.vocab_size=64",
    "data.synthetic.max_operands=3", "data.synthetic.num_train=64", "data.synthetic.num_eval=4",
    "data.max_prompt_len=32", "mesh.fsdp=1",
    "rollout.global_max_len=12", "rollout.num_segments=3", "rollout.n=4",
    "trainer.train_batch_size=2", "trainer.ppo_mini_batch_size=8", "trainer.micro_batch_rows=4",
    "trainer.logprob_chunk=16", "trainer.eval_every=0", "trainer.sft_steps=0",
    "algorithm.dynamic_sampling=false",  # a random policy earns no reward: train on the all-0 groups too
    "optim.lr=1e-2", "eval.k=2", "eval.max_new_tokens=12", "checkpoint.async_save=true", "logging.tensorboard=false",
]


def tiny_config(*extra: str):
    return load_config("tiny_cpu", TINY + list(extra))


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    for x, y in zip(_leaves(a.learner.params), _leaves(b.learner.params), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(_leaves(a.learner.opt_state), _leaves(b.learner.opt_state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.rollout.state_dict() == b.rollout.state_dict()
    assert a.prompts.state_dict() == b.prompts.state_dict()
    assert (a.step, a.policy_version, a.learner.step) == (b.step, b.policy_version, b.learner.step)
    assert [[s.to_dict() for s in g] for g in a.ready_groups] == [[s.to_dict() for s in g] for g in b.ready_groups]


@pytest.mark.slow
def test_exact_resume_equals_straight_run(tmp_path):
    cfg = tiny_config("trainer.total_steps=4", "checkpoint.save_every=2")
    straight = Trainer(cfg, tmp_path / "straight")
    straight.fit()
    first = Trainer(tiny_config("trainer.total_steps=2", "checkpoint.save_every=2"), tmp_path / "split")
    first.fit()
    first.close()
    resumed = Trainer(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 2
    resumed.fit()
    try:
        assert straight.policy_version >= 1, "no update happened: the test would compare nothing"
        assert straight.rollout.unfinished_pool, "nothing carried over: the pools would compare nothing"
        _assert_same_state(straight, resumed)
        # metrics.jsonl of the resumed run holds each step once, equal to the straight run's
        keep = ("reward_mean", "ended_samples", "pool_unfinished", "trained_samples", "policy_version")
        a = [{k: r.get(k) for k in keep} for r in read_metrics(tmp_path / "straight")]
        b = [{k: r.get(k) for k in keep} for r in read_metrics(tmp_path / "split")]
        assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3, 4]
        assert a == b
    finally:
        straight.close()
        resumed.close()


def test_carried_sample_has_tokens_from_three_policy_versions(tmp_path):
    """Even prompts end after 1 token (their groups train at once, bumping the policy version);
    odd prompts run the full 3 segments, each under the then-current weights."""
    cfg = tiny_config("trainer.total_steps=3", "checkpoint.save_every=0")
    oracle = lambda s: 1 if s.prompt_index % 2 == 0 else 12  # noqa: E731
    trainer = Trainer(cfg, tmp_path / "run", length_oracle=oracle)
    try:
        for _ in range(3):
            trainer.train_step()
        # The first odd prompt (index 1) started at step 1, ended at step 3 and was trained on then.
        ended = [s for g in trainer.last_trained_groups for s in g if s.prompt_index == 1]
        assert len(ended) == cfg.rollout.n
        for s in ended:
            assert s.segments == 3
            assert len(s.response_ids) == 12
            assert sorted(set(s.policy_versions)) == [0, 1, 2]
            seg = cfg.rollout.global_max_len // cfg.rollout.num_segments
            assert s.policy_versions == [0] * seg + [1] * seg + [2] * seg
    finally:
        trainer.close()


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    cfg = tiny_config("trainer.total_steps=1", "checkpoint.save_every=1")
    t = Trainer(cfg, tmp_path / "run")
    t.fit()
    t.close()
    with pytest.raises(ValueError, match="--resume"):
        Trainer(cfg, tmp_path / "run")


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        Trainer(tiny_config(), tmp_path / "empty", resume=True)


def test_too_many_steps_without_trainable_groups_stops_clearly(tmp_path):
    # dynamic sampling on, random policy: every group is all-0 and dropped
    cfg = tiny_config("algorithm.dynamic_sampling=true", "trainer.max_consecutive_skips=1",
                      "rollout.num_segments=1", "checkpoint.save_every=0")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        with pytest.raises(TrainingError, match="consecutive steps without a trainable group"):
            for _ in range(4):
                trainer.train_step()
    finally:
        trainer.close()


@pytest.mark.slow
def test_sigkill_mid_run_resumes_from_last_committed_checkpoint(tmp_path):
    """`ulorl train` is killed after its second checkpoint; `--resume` continues from it and ends in the
    same state as an uninterrupted run."""
    overrides = TINY + ["trainer.total_steps=4", "checkpoint.save_every=1", "checkpoint.keep_last=2"]
    run = tmp_path / "killed"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    cmd = [sys.executable, "-m", "ulorl_jax.cli", "train", "--config", "tiny_cpu", "--run-dir", str(run)]
    proc = subprocess.Popen(cmd + overrides, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    ckpt = run / "checkpoints"
    try:
        while time.time() < deadline and proc.poll() is None:
            if (ckpt / "2").is_dir():
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    done = subprocess.run(cmd + ["--resume"] + overrides, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 4, steps  # each step once, run completed
    cfg = load_config("tiny_cpu", overrides)
    straight = Trainer(cfg, tmp_path / "straight")
    straight.fit()
    resumed = Trainer(cfg, run, resume=True)  # the final checkpoint of the killed-and-resumed run
    try:
        assert resumed.step == 4
        _assert_same_state(straight, resumed)
    finally:
        straight.close()
        resumed.close()


def test_resume_with_a_changed_experiment_config_is_refused(tmp_path):
    t = Trainer(tiny_config("trainer.total_steps=1", "checkpoint.save_every=1"), tmp_path / "run")
    t.fit()
    t.close()
    with pytest.raises(ValueError, match="algorithm.mask_mode: 'dmmpt' -> 'none'"):
        Trainer(tiny_config("algorithm.mask_mode=none"), tmp_path / "run", resume=True)
    # how long to train and how often to save may change
    Trainer(tiny_config("trainer.total_steps=3", "checkpoint.save_every=0"), tmp_path / "run", resume=True).close()
