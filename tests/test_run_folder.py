"""A run folder works from any working directory (run_paths.py): `ulorl train` stores every path-valued
option of config.yaml absolute, so eval, generate, export and --resume run from elsewhere; a missing model
folder is named as missing; `ulorl train` says which checkpoint it resumed from and counts steps in words."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer_utils import subprocess_env, tiny_config
from ulorl_jax import model_source, run_paths
from ulorl_jax.config import SCHEMA, config_to_yaml, load_config


def test_every_path_valued_option_of_the_schema_is_resolved():
    """A new path option must join run_paths.PATH_OPTIONS, or a run folder using it breaks elsewhere."""
    path_like = {k for k in SCHEMA if re.search(r"(path|files?|dir|tokenizer|_model)$", k)}
    assert path_like == set(run_paths.PATH_OPTIONS)
    assert set(run_paths.FOLDER_OPTIONS) <= set(run_paths.PATH_OPTIONS)


def test_resolve_paths_makes_relative_paths_absolute_against_the_base(tmp_path):
    cfg = load_config(None, ["model.path=models/m", "model.tokenizer=~/tok", "data.train_files=[a.jsonl,/d/b.jsonl]",
                             "data.eval_files=[../c.jsonl]", "reward.verifier_model=null"])
    out = run_paths.resolve_paths(cfg, base=tmp_path / "x")
    assert out.model.path == str(tmp_path / "x" / "models" / "m")
    assert out.model.tokenizer == os.path.join(os.path.expanduser("~"), "tok")
    assert out.data.train_files == [str(tmp_path / "x" / "a.jsonl"), "/d/b.jsonl"]
    assert out.data.eval_files == [str(tmp_path / "c.jsonl")]
    assert out.reward.verifier_model is None
    assert cfg.model.path == "models/m", "the given config is left as it was"
    assert run_paths.resolve_paths(out, base="/elsewhere") == out  # absolute paths stay


def test_a_missing_model_folder_is_named_as_missing(tmp_path, monkeypatch):
    """Relative model.path from a directory where it does not exist: 'no such folder' (it used to read
    'has no tokenizer files'), for the trainer and for a run folder used as a model; no folder is left."""
    from ulorl_jax.rl.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    cfg = tiny_config("model.arch=null", "model.path=my-model")
    with pytest.raises(FileNotFoundError, match=rf"model\.path={re.escape(str(tmp_path / 'my-model'))}: no such "
                                                r"folder") as err:
        Trainer(cfg, "runs/mine")
    assert "tokenizer files" not in str(err.value)
    assert not Path("runs").exists()

    run = tmp_path / "run"  # a run folder whose model folder is gone
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(config_to_yaml(run_paths.resolve_paths(cfg)))
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*my-model \(in .*run/config\.yaml\): no such folder"):
        model_source.load(model_source.resolve(run))
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*my-model: no such folder"):
        model_source.build_tokenizer(model_source.run_config(run))


def test_an_older_run_with_relative_paths_resolves_them_against_the_working_directory(tmp_path, monkeypatch, caplog):
    cfg = tiny_config("model.tokenizer=tok")  # as a run folder written before paths were stored absolute
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING"):
        loaded = model_source.run_config(run)
    assert loaded.model.tokenizer == str(tmp_path / "tok")
    assert "holds relative paths (model.tokenizer=tok)" in caplog.text
    from ulorl_jax.rl.trainer import check_resume_config

    check_resume_config(run / "config.yaml", loaded)  # the same run: relative == absolute here


def _ulorl(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ulorl_jax.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"`ulorl {' '.join(args)}` in {cwd} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_a_run_started_with_relative_paths_works_from_another_directory(tmp_path):
    """Train 1 step in project/ with relative model, tokenizer and data paths; then, from elsewhere/, eval the
    run, generate from it, export it and resume it to step 2."""
    pytest.importorskip("torch")
    from hf_utils import save_hf_model
    from test_walkthrough import _problems
    from ulorl_jax.data.tokenizer import build_tokenizer, synthetic_alphabet

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    tokenizer = build_tokenizer(synthetic_alphabet())
    save_hf_model("qwen3", project / "my-model", vocab_size=64, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(project / "tok")  # model.tokenizer: a second relative path
    for name, n, seed in (("train.jsonl", 8, 0), ("test.jsonl", 2, 1)):
        (project / name).write_text("".join(json.dumps(r) + "\n" for r in _problems(n, seed)))
    (project / "my_run.yaml").write_text(
        "model: {path: my-model, tokenizer: tok}\n"
        "data: {train_files: [train.jsonl], eval_files: [test.jsonl], max_prompt_len: 64}\n"
        "rollout: {global_max_len: 8, num_segments: 1, n: 2}\n"
        "trainer: {train_batch_size: 2, ppo_mini_batch_size: 4, micro_batch_rows: 1, total_steps: 1}\n"
        "eval: {k: 1, max_new_tokens: 4}\n"
        "checkpoint: {save_every: 1, async_save: false}\n"
        "logging: {tensorboard: false}\n")
    env = subprocess_env(tmp_path / "jax-cache")
    train = _ulorl(["train", "--config", "my_run.yaml", "--run-dir", "runs/mine"], project, env)
    assert "ulorl train: 1 step done;" in train.stdout

    stored = yaml.safe_load((project / "runs/mine/config.yaml").read_text())
    assert stored["model"]["path"] == str(project / "my-model") and stored["model"]["tokenizer"] == str(project / "tok")
    assert stored["data"]["train_files"] == [str(project / "train.jsonl")]
    assert stored["data"]["eval_files"] == [str(project / "test.jsonl")]

    run = "../project/runs/mine"  # the run folder itself given relative to the new directory
    result = json.loads(_ulorl(["eval", "--run-dir", run, "--json"], elsewhere, env).stdout.splitlines()[-1])
    assert result["eval_samples"] == 2 and result["step"] == 1  # data.eval_files of the run, k=1
    _ulorl(["generate", "--model", run, "--prompts", "../project/test.jsonl", "--out", "samples.jsonl",
            "--max-new-tokens", "4"], elsewhere, env)
    assert len((elsewhere / "samples.jsonl").read_text().splitlines()) == 2
    _ulorl(["export", run, "exported"], elsewhere, env)
    assert (elsewhere / "exported" / "config.json").is_file() and (elsewhere / "exported" / "tokenizer.json").is_file()
    resumed = _ulorl(["train", "--config", f"{run}/config.yaml", "--run-dir", run, "--resume",
                      "trainer.total_steps=2"], elsewhere, env)
    assert f"ulorl train: resumed from checkpoint 1 in {project / 'runs/mine/checkpoints'}" in resumed.stdout
    assert "ulorl train: 2 steps done;" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (project / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
