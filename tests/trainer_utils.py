"""Shared helpers for trainer tests: the tiny run config, state comparison, `ulorl train` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from ulorl_jax.config import load_config

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
    "trainer.dynamic_sampling_max_rounds=1",  # one rollout round per step (tiny_cpu has 2)
    "optim.lr=1e-2", "eval.k=2", "eval.max_new_tokens=12", "checkpoint.async_save=true", "logging.tensorboard=false",
]
TESTS = Path(__file__).resolve().parent


def parity_reward(text: str, reference: str, metadata: dict) -> float:
    """1 for an even-length response: a random policy earns mixed rewards, so advantages (and the
    weights) move from the first update on, unlike with the task's own reward, which it never earns."""
    return float(len(text) % 2 == 0)


# With TINY: rewards that make every update change the weights.
MOVING = ["reward.kind=custom", "reward.custom_fn=trainer_utils:parity_reward"]


def tiny_config(*extra: str):
    return load_config("tiny_cpu", TINY + list(extra))


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_trees(a, b) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_same_state(a, b) -> None:
    """Two Trainers hold the same params, optimizer, pools, data position, counters and rng."""
    assert_same_trees(a.learner.params, b.learner.params)
    assert_same_trees(a.learner.opt_state, b.learner.opt_state)
    np.testing.assert_array_equal(np.asarray(a.base_key), np.asarray(b.base_key))
    assert a.rollout.state_dict() == b.rollout.state_dict()
    assert a.prompts.state_dict() == b.prompts.state_dict()
    assert (a.step, a.policy_version, a.learner.step) == (b.step, b.policy_version, b.learner.step)
    assert [[s.to_dict() for s in g] for g in a.ready_groups] == [[s.to_dict() for s in g] for g in b.ready_groups]


def subprocess_env(compile_cache: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a `ulorl` child: one CPU device, optionally a shared persistent compilation cache
    (each child otherwise compiles the same tiny programs again, ~20-40 s on 2 busy cores)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    if compile_cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(compile_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def train_command(run_dir, overrides: list[str], *, resume: bool = False, fault: str | None = None) -> list[str]:
    """`ulorl train --config tiny_cpu ...`, or the same through tests/fault_inject.py with FAULT ("kind:N")."""
    args = ["train", "--config", "tiny_cpu", "--run-dir", str(run_dir)] + (["--resume"] if resume else [])
    head = [sys.executable, str(TESTS / "fault_inject.py"), fault, "--"] if fault else \
        [sys.executable, "-m", "ulorl_jax.cli"]
    return head + args + list(overrides)


def run_train(run_dir, overrides: list[str], *, env: dict, resume: bool = False, fault: str | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(run_dir, overrides, resume=resume, fault=fault), env=env,
                          capture_output=True, text=True, timeout=timeout)
