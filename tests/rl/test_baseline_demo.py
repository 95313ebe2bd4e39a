"""Each shipped baseline config runs the demo's task to completion (`ulorl demo --quick --config NAME`, in the
CI size of tests/test_demo.py) and logs verl's metric names; the full-size ones load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ulorl_jax.config import load_config
from ulorl_jax.rl.build import learner_config

BASELINES = ("grpo", "dapo", "gspo", "cispo")


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_configs_differ_from_ulorl_only_in_the_algorithm(name):
    for size in ("tiny_cpu", "qwen3_8b"):
        base, cfg = load_config(size), load_config(f"{name}_{size}")
        for section in ("model", "mesh", "data", "rollout", "optim", "trainer", "eval", "checkpoint"):
            assert getattr(cfg, section) == getattr(base, section), f"{name}_{size}: {section}"
        assert cfg.algorithm.mask_mode == "none"  # the baselines have no UloRL masking
        learner_config(cfg)  # a valid LearnerConfig
    assert load_config(f"{name}_tiny_cpu").reward.overlong_buffer.enable == (name == "dapo")


@pytest.mark.slow
@pytest.mark.parametrize("name", BASELINES)
def test_quick_demo_runs_each_baseline(name, tmp_path):
    run = tmp_path / name
    out = subprocess.run([sys.executable, "-m", "ulorl_jax.cli", "demo", "--quick", "--config", f"{name}_tiny_cpu",
                          "--run-dir", str(run), "--json", "trainer.sft_steps=40", "trainer.total_steps=4",
                          "data.synthetic.num_eval=4"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("trained_samples")]
    assert trained and all("actor/pg_clipfrac" in r and "actor/ppo_kl" in r for r in trained)
    if name == "dapo":
        assert all("overlong_fraction" in r for r in trained)
