"""The UloRL trainer end to end: exact resume, segments from several policy versions, clear stops.

SIGKILL at random points (rollout, learner step, checkpoint write) and storage faults: tests/rl/test_reliability.py."""

from __future__ import annotations

import pytest

from trainer_utils import assert_same_state as _assert_same_state
from trainer_utils import MOVING, leaves, tiny_config
from ulorl_jax.metrics import read_metrics
from ulorl_jax.rl.trainer import Trainer, TrainingError


@pytest.mark.slow
def test_exact_resume_equals_straight_run(tmp_path):
    # MOVING: rewards that make every update change the weights, so a bad restore of the weights or of the
    # optimizer state (moments, step count) shows in the final weights; 2 rollout rounds per step, so the
    # first update happens before the split (at step 2), and more after it
    moving = (*MOVING, "trainer.dynamic_sampling_max_rounds=2", "checkpoint.save_every=2")
    cfg = tiny_config(*moving, "trainer.total_steps=4")
    straight = Trainer(cfg, tmp_path / "straight")
    initial = leaves(straight.learner.params)
    straight.fit()
    first = Trainer(tiny_config(*moving, "trainer.total_steps=2"), tmp_path / "split")
    first.fit()
    after_two = leaves(first.learner.params)
    first.close()
    resumed = Trainer(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 2
    resumed.fit()
    try:
        assert straight.policy_version >= 1, "no update happened: the test would compare nothing"
        assert straight.rollout.unfinished_pool, "nothing carried over: the pools would compare nothing"
        final = leaves(straight.learner.params)
        assert any((x != y).any() for x, y in zip(initial, after_two)), "weights did not move before the split"
        assert any((x != y).any() for x, y in zip(after_two, final)), "weights did not move after the split"
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


def test_resume_before_the_first_checkpoint_starts_the_run(tmp_path, caplog):
    """A run killed before its first checkpoint (even before config.yaml) has nothing to lose: --resume
    starts it from step 1, with a warning, exactly as a fresh run."""
    cfg = tiny_config("trainer.total_steps=1", "checkpoint.save_every=0")
    (tmp_path / "killed" / "checkpoints").mkdir(parents=True)  # as a kill during the first save leaves it
    with caplog.at_level("WARNING"):
        resumed = Trainer(cfg, tmp_path / "killed", resume=True)
    assert "no committed checkpoint" in caplog.text and not resumed.resumed and resumed.step == 0
    fresh = Trainer(cfg, tmp_path / "fresh")
    try:
        resumed.fit()
        fresh.fit()
        assert resumed.step == 1 and (tmp_path / "killed" / "config.yaml").exists()
        _assert_same_state(resumed, fresh)
    finally:
        resumed.close()
        fresh.close()


def test_resume_with_a_missing_run_config_names_the_cause(tmp_path, capsys):
    from ulorl_jax.cli import main

    run = tmp_path / "run"
    assert main(["train", "--config", str(run / "config.yaml"), "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config.yaml: not found" in err and "start it again with the config you first gave it" in err


def test_too_many_steps_without_trainable_groups_stops_clearly(tmp_path):
    # dynamic sampling on, random policy: every group is all-0 and dropped
    cfg = tiny_config("algorithm.dynamic_sampling=true", "trainer.max_consecutive_skips=1",
                      "rollout.num_segments=1", "checkpoint.save_every=0")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        with pytest.raises(TrainingError, match="2 consecutive steps trained nothing") as err:
            for _ in range(4):
                trainer.train_step()
        # the message gives the reward distribution of the dropped groups and what to try
        message = str(err.value)
        assert "16 samples ended with mean reward 0.000" in message  # 2 steps x 2 prompts x 4 samples
        assert "4 complete groups as all wrong" in message and "warm start" in message
    finally:
        trainer.close()


def test_resume_with_a_changed_experiment_config_is_refused(tmp_path):
    t = Trainer(tiny_config("trainer.total_steps=1", "checkpoint.save_every=1"), tmp_path / "run")
    t.fit()
    t.close()
    with pytest.raises(ValueError, match="algorithm.mask_mode: 'dmmpt' -> 'none'"):
        Trainer(tiny_config("algorithm.mask_mode=none"), tmp_path / "run", resume=True)
    # how long to train and how often to save may change
    Trainer(tiny_config("trainer.total_steps=3", "checkpoint.save_every=0"), tmp_path / "run", resume=True).close()


def test_ulorl_eval_on_a_jsonl_benchmark(tmp_path, capsys):
    """`ulorl eval --data FILE.jsonl`: avg@k over the file's prompts with the eval sampling settings."""
    import json

    from ulorl_jax.cli import main
    from ulorl_jax.data.synthetic import SyntheticConfig, generate_problems, problem_rows, write_jsonl
    from ulorl_jax.data.tokenizer import build_tokenizer, synthetic_alphabet

    tok_dir = tmp_path / "tok"
    build_tokenizer(synthetic_alphabet()).save_pretrained(tok_dir)
    rows = problem_rows(generate_problems(SyntheticConfig(max_operands=3), 3, seed=0))
    data = write_jsonl(rows, tmp_path / "bench.jsonl")
    from trainer_utils import TINY

    argv = ["eval", "--config", "tiny_cpu", "--data", str(data), "--k", "2", "--json",
            *TINY, f"model.tokenizer={tok_dir}"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_samples"] == 3 * 2
    assert 0.0 <= result["eval_accuracy"] <= 1.0 and result["eval_length_mean"] > 0
    # pass@k for k = 1, 2 (up to --k): pass@1 is avg@k when every problem has k samples; pass@2 >= pass@1.
    assert set(k for k in result if k.startswith("eval_pass_at_")) == {"eval_pass_at_1", "eval_pass_at_2"}
    assert result["eval_pass_at_1"] == pytest.approx(result["eval_accuracy"])
    assert result["eval_pass_at_1"] <= result["eval_pass_at_2"] <= 1.0


def test_model_folder_without_tokenizer_is_refused_before_the_run_folder_exists(tmp_path):
    from hf_utils import save_hf_model

    save_hf_model("qwen3", tmp_path / "model")  # weights and config.json, no tokenizer files
    cfg = tiny_config("model.arch=null", f"model.path={tmp_path / 'model'}")
    with pytest.raises(ValueError, match=r"model\.path\) has no tokenizer files \(tokenizer.json"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_hooks_run_every_n_steps_in_their_stage(tmp_path):
    """The end of a step is hooks (rl/hooks.py): eval and reward stats add to the metrics before they are
    written; a user's "metrics" hook does too, every 2 steps; an "after" hook sees the written line; the
    checkpoint hook saves every checkpoint.save_every steps."""
    cfg = tiny_config("trainer.total_steps=4", "trainer.eval_every=2", "checkpoint.save_every=3")
    trainer = Trainer(cfg, tmp_path / "run")
    calls = []
    trainer.add_hook(lambda tr, m: m.update(custom_metric=float(tr.step)), every=2, stage="metrics")
    trainer.add_hook(lambda tr, m: calls.append((tr.step, read_metrics(tr.run_dir / "metrics.jsonl")[-1]["step"])),
                     name="after_write")
    try:
        trainer.fit()
        assert [h.name for h in trainer.hooks][:4] == ["eval", "reward_stats", "nonfinite_guard", "checkpoint"]
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("custom_metric") for r in rows] == [None, 2.0, None, 4.0]
    assert ["eval_accuracy" in r for r in rows] == [False, True, False, True]
    assert all("reward_stats" in r for r in rows)
    assert calls == [(1, 1), (2, 2), (3, 3), (4, 4)]  # after the line of its step was written
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [3, 4]  # every 3 steps, and the final one fit() writes


def test_a_bad_hook_is_refused_by_name():
    from ulorl_jax.rl.hooks import StepHook

    with pytest.raises(ValueError, match="hook 'x': stage='before'"):
        StepHook("x", 1, lambda tr, m: None, stage="before")
    with pytest.raises(ValueError, match="hook 'x': every=-1"):
        StepHook("x", -1, lambda tr, m: None)


@pytest.mark.slow
def test_a_small_kv_pool_preempts_and_trains_the_same_samples(tmp_path, monkeypatch):
    """rollout.kv_pages far below the batch's need (and no pages kept back at admission, so that samples
    outgrow the pool mid-segment): the rollout preempts (kv_preemptions in metrics.jsonl, pages within the
    pool) and, recomputing or swapping, trains on the same tokens as the default pool."""
    import ulorl_jax.decode.engine as engine_module

    monkeypatch.setattr(engine_module, "ADMIT_LOOKAHEAD_CALLS", 0)
    longer = ("trainer.total_steps=2", "checkpoint.save_every=0", "rollout.global_max_len=48",
              "rollout.num_segments=2", "rollout.page_size=4")

    def run(name, *extra):
        trainer = Trainer(tiny_config(*longer, *extra), tmp_path / name)
        try:
            trainer.fit()
            return ([[s.response_ids for s in g] for g in trainer.last_trained_groups],
                    read_metrics(tmp_path / name))
        finally:
            trainer.close()

    want, roomy = run("roomy")
    assert sum(r["kv_preemptions"] for r in roomy) == 0
    assert want and any(len(r) > 24 for g in want for r in g), "no sample outgrew a segment"
    for preemption in ("recompute", "swap"):
        got, metrics = run(preemption, "rollout.kv_pages=24", f"rollout.preemption={preemption}")
        assert sum(r["kv_preemptions"] for r in metrics) > 0, preemption
        assert 0 < max(r["kv_peak_pages"] for r in metrics) <= 24
        assert got == want, preemption


def test_an_unimportable_custom_reward_names_the_module_and_pythonpath_and_leaves_no_folder(tmp_path, capsys):
    from ulorl_jax.cli import main
    from trainer_utils import TINY

    run = tmp_path / "runs" / "mine"
    cfg = tiny_config("reward.kind=custom", "reward.custom_fn=my_rewards_xyz.score:reward")
    with pytest.raises(ValueError, match=r"reward\.custom_fn='my_rewards_xyz\.score:reward': module "
                                         r"'my_rewards_xyz\.score' is not importable .* to PYTHONPATH"):
        Trainer(cfg, run)
    assert not (tmp_path / "runs").exists()
    assert main(["train", "--config", "tiny_cpu", "--run-dir", str(run), *TINY, "reward.kind=custom",
                 "reward.custom_fn=my_rewards_xyz.score:reward"]) == 2
    err = capsys.readouterr().err
    assert "install the package that provides it, or add the folder" in err and "PYTHONPATH" in err
    assert not (tmp_path / "runs").exists()


def test_a_custom_reward_whose_dependency_is_missing_says_so(tmp_path, monkeypatch):
    from ulorl_jax.rewards.scorer import import_custom_fn

    (tmp_path / "needs_dep_xyz.py").write_text("import missing_dep_xyz\n\ndef reward(t, r, m):\n    return 1.0\n")
    (tmp_path / "no_fn_xyz.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"reward\.custom_fn='needs_dep_xyz:reward': module 'needs_dep_xyz' imports "
                                         r"'missing_dep_xyz', which is not installed"):
        import_custom_fn("needs_dep_xyz:reward")
    with pytest.raises(ValueError, match=r"reward\.custom_fn='no_fn_xyz:reward': module 'no_fn_xyz' has no attribute"):
        import_custom_fn("no_fn_xyz:reward")


def test_a_setup_failure_after_the_folder_is_made_removes_only_a_folder_it_created(tmp_path, monkeypatch):
    """The folder comes after every check; what can still fail (restore, config.yaml, the metrics writer)
    removes a folder this run created, never one that was there before."""
    import ulorl_jax.rl.trainer as trainer_module

    def broken_writer(*args, **kwargs):
        raise OSError("metrics writer failed")

    monkeypatch.setattr(trainer_module, "MetricsWriter", broken_writer)
    cfg = tiny_config("trainer.total_steps=1")
    with pytest.raises(OSError, match="metrics writer failed"):
        Trainer(cfg, tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="metrics writer failed"):
        Trainer(cfg, kept)
    assert (kept / "notes.txt").read_text() == "mine"


def test_warm_start_without_synthetic_data_is_refused_before_the_folder_exists(tmp_path):
    """It used to fail in `ulorl train`'s warm start, after the run folder and its config.yaml were written."""
    from ulorl_jax.data.tokenizer import build_tokenizer, synthetic_alphabet

    build_tokenizer(synthetic_alphabet()).save_pretrained(tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text('{"prompt": "a1 b2", "answer": "3"}\n')
    cfg = tiny_config("data.synthetic=null", f"data.train_files=[{tmp_path / 'train.jsonl'}]", "trainer.sft_steps=2",
                      f"model.tokenizer={tmp_path / 'tok'}")
    with pytest.raises(ValueError, match=r"trainer\.sft_steps=2 needs data\.synthetic"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
