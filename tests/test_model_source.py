"""A trained run as a model: `--model` sources, `ulorl export` to a Hugging Face folder, `ulorl eval` on a run.

Reference for the export: transformers' own PyTorch model and tokenizer loaded from the exported folder
through the Auto classes, against our model restored from the run's checkpoint.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_utils import MOVING, tiny_config

from ulorl_jax import model_source
from ulorl_jax.cli import main
from ulorl_jax.rl import evaluation
from ulorl_jax.rl.trainer import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run whose weights moved: 1 segment (every group completes in its step), mixed rewards."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = tiny_config(*MOVING, "rollout.num_segments=1", "trainer.total_steps=2", "checkpoint.save_every=1",
                      "checkpoint.async_save=false")
    trainer = Trainer(cfg, run_dir)
    initial = [np.asarray(x) for x in jax.tree.leaves(trainer.learner.params)]
    trainer.fit()
    trainer.close()
    assert trainer.policy_version >= 1, "no update happened: the tests would compare initial weights"
    return run_dir, initial


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resolve_names_every_kind_and_refuses_the_rest(run, tmp_path):
    run_dir, _ = run
    assert model_source.resolve(run_dir) == model_source.ModelSource("run", run_dir, None)
    assert model_source.resolve(run_dir / "checkpoints" / "1") == model_source.ModelSource("run", run_dir, 1)
    assert model_source.resolve(run_dir, step=2).step == 2
    with pytest.raises(FileNotFoundError, match="missing: no such folder"):
        model_source.resolve(tmp_path / "missing")
    with pytest.raises(ValueError, match="is not a model: expected a Hugging Face folder"):
        model_source.resolve(tmp_path)
    with pytest.raises(Exception, match=r"checkpoint step 7 not in .* \(available: \[1, 2\]\)"):
        model_source.load(model_source.resolve(run_dir, step=7))


@pytest.mark.slow
def test_export_loads_in_transformers_with_equal_logits_and_tokenizer(run, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    import transformers

    run_dir, initial = run
    out = tmp_path / "hf"
    assert main(["export", str(run_dir / "checkpoints" / "2"), str(out)]) == 0
    assert "checkpoint 2" in capsys.readouterr().out
    ours = model_source.load(model_source.resolve(run_dir, step=2))
    trained = [np.asarray(x) for x in jax.tree.leaves(nnx.state(ours.model, nnx.Param))]
    assert any(not np.array_equal(a, b) for a, b in zip(initial, trained)), "checkpoint holds the initial weights"

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "sum mod 10: a3 b5 c9"
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert ids and ids == ours.tokenizer.encode(text, add_special_tokens=False)
    assert hf_tok.eos_token_id == ours.tokenizer.eos_token_id
    tokens = np.asarray([ids], np.int32)
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(ours.model(jnp.asarray(tokens))), want, atol=1e-4)
    # an export never writes into a folder that holds something
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_on_a_run_folder_leaves_the_run_alone(run, tmp_path, capsys):
    """`ulorl eval --run-dir R --data F --step S`: R's config, checkpoint S named in the output, results in
    R/eval/, and config.yaml, metrics.jsonl and the folder's other contents unchanged."""
    from ulorl_jax.data.synthetic import (
        SyntheticConfig,
        generate_problems,
        problem_rows,
        write_jsonl,
    )

    run_dir, _ = run
    data = write_jsonl(problem_rows(generate_problems(SyntheticConfig(max_operands=3), 3, seed=1)),
                       tmp_path / "bench.jsonl")
    before = {p.name: _digest(p) for p in run_dir.iterdir() if p.is_file()}
    entries = sorted(p.name for p in run_dir.iterdir())
    assert main(["eval", "--run-dir", str(run_dir), "--step", "1", "--data", str(data), "--k", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert f"run {run_dir} checkpoint 1" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["step"] == 1 and result["eval_samples"] == 3 * 2 and "eval_pass_at_2" in result
    written = run_dir / "eval" / "step_1_bench.jsonl_k2.json"
    assert json.loads(written.read_text())["eval_accuracy"] == result["eval_accuracy"]
    assert {p.name: _digest(p) for p in run_dir.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(entries + ["eval"])


def test_eval_plan_caps_generation_and_refuses_what_does_not_fit():
    from ulorl_jax.config import load_config
    from ulorl_jax.models.config import tiny_config as tiny_model
    from ulorl_jax.types import PromptItem

    cfg = load_config(None, ["data.train_files=[x.jsonl]", "model.path=m"])  # schema defaults: 131,072-token outputs
    model = tiny_model("qwen3", max_position_embeddings=256)
    prompts = [PromptItem(i, list(range(1, 1 + n)), {}) for i, n in enumerate((10, 40))]
    plan = evaluation.plan_eval(cfg, model, prompts, k=2, max_new_tokens=None, max_memory_gb=None)
    assert plan.max_new_tokens == 256 - 40 and plan.slots == 4 and "256 positions" in plan.notes[0]
    assert plan.kv_cache_bytes == evaluation.kv_cache_bytes(model, 4, 256)
    asked = evaluation.plan_eval(cfg, model, prompts, k=2, max_new_tokens=100, max_memory_gb=None)
    assert asked.max_new_tokens == 100 and not asked.notes
    with pytest.raises(ValueError, match=r"KV cache needs [\d.]+ KiB .* --max-memory allows 1\.05 KiB: lower "
                                         r"--max-new-tokens \(now 100\) or rollout.max_concurrent_decodes"):
        evaluation.plan_eval(cfg, model, prompts, k=2, max_new_tokens=100, max_memory_gb=1e-6)
    with pytest.raises(ValueError, match="the longest eval prompt has 300 tokens; the model has 256 positions"):
        evaluation.plan_eval(cfg, model, [PromptItem(0, [1] * 300, {})], k=1, max_new_tokens=None,
                             max_memory_gb=None)
