"""`ulorl eval`, `ulorl export` and `ulorl convert` flags, each run from the command line and checked by its effect.

The policy is a tiny Qwen3-MoE with hand-set weights: every attention and expert output projection is zero, so
the residual stream at a position is its token's embedding (one-hot), and lm_head turns the last prompt token
into the next token by a fixed table, a "program". With the word-level tokenizer below, `\\boxed{N}` is one token,
so a prompt ending in "a" is answered \\boxed{1}, one ending in "b" \\boxed{2} (program 1) or \\boxed{3}
(program 2), one ending in "c" \\boxed{4} or \\boxed{5} with equal odds; after that comes eos. Against the
answers in ROWS, some prompts are always right, some always wrong and some right about half the time, so the
accuracy and pass@k that `ulorl eval` reports are not 0 and are checked against this file's own scoring of the
samples it writes (its own \\boxed{} extraction, and pass@k = 1 - C(n-c, k) / C(n, k) written out here).
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ulorl_jax.cli import main

torch = pytest.importorskip("torch")

HIDDEN = 32  # >= the tokenizer's vocabulary: every token has its own embedding axis
BOXED = [f"\\boxed{{{n}}}" for n in range(1, 6)]
PROGRAMS = {1: {"a": ["1"], "b": ["2"], "c": ["4", "5"]},  # last prompt character -> the boxed answers it draws
            2: {"a": ["1"], "b": ["3"], "c": ["4", "5"]}}
ROWS = [{"prompt": "xa", "answer": "1"}, {"prompt": "yb", "answer": "2"}, {"prompt": "zb", "answer": "3"},
        {"prompt": "xc", "answer": "4"}, {"prompt": "yc", "answer": "4"}, {"prompt": "zc", "answer": "5"}]


def _tokenizer():
    from ulorl_jax.data.tokenizer import build_tokenizer

    return build_tokenizer("abcxyz", extra_tokens=BOXED, chat_template=None)  # no template: the prompt as written


def _program_weights(model, tokenizer, program: dict[str, list[str]]) -> None:
    """Set `model` (transformers Qwen3-MoE) to run `program` (see the module docstring)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids
    table = {ids(first): [ids(f"\\boxed{{{a}}}") for a in answers] for first, answers in program.items()}
    # RMSNorm of a one-hot embedding is sqrt(HIDDEN) on its axis: a logit of 40 for each allowed next token.
    logit = 40.0 / math.sqrt(HIDDEN)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "o_proj" in name or "down_proj" in name:
                p.zero_()  # attention and experts add nothing to the residual stream
        model.model.embed_tokens.weight.copy_(torch.eye(model.config.vocab_size, HIDDEN))
        head = model.lm_head.weight
        head.zero_()
        for token in range(len(tokenizer)):
            for nxt in table.get(token, [eos]):
                head[nxt, token] = logit


def _program_model(folder: Path, program: int):
    from hf_utils import make_hf_model

    tokenizer = _tokenizer()
    model = make_hf_model("qwen3_moe", vocab_size=HIDDEN, hidden_size=HIDDEN, num_hidden_layers=1,
                          tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    _program_weights(model, tokenizer, PROGRAMS[program])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def program_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "program1"
    _program_model(folder, 1)
    return folder


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    (folder / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return folder / "bench.jsonl"


@pytest.fixture(scope="module")
def program_run(tmp_path_factory, program_model) -> tuple[Path, dict[int, dict[str, np.ndarray]]]:
    """A run folder as `ulorl train` leaves it (config.yaml, checkpoints/1 and 2 by TrainCheckpointer) whose
    step 1 holds program 1 and step 2 program 2; returns it and each step's weights by HF tensor name."""
    from flax import nnx

    from ulorl_jax.checkpoint import TrainCheckpointer
    from ulorl_jax.config import config_to_yaml, load_config
    from ulorl_jax.models.hf import from_pretrained, hf_state_dict

    root = tmp_path_factory.mktemp("runs")
    program2 = root / "program2"
    _program_model(program2, 2)
    run_dir = root / "run"
    run_dir.mkdir()
    cfg = load_config(None, [f"model.path={program_model}", "data.train_files=[train.jsonl]", "eval.k=2",
                             "eval.max_new_tokens=4", "reward.workers=0", "mesh.fsdp=1"])
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    weights = {}
    with TrainCheckpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        for step, folder in ((1, program_model), (2, program2)):
            model = from_pretrained(folder)
            weights[step] = hf_state_dict(model)
            ckpt.save(step, params=nnx.state(model, nnx.Param), opt_state={"count": np.zeros((), np.int32)},
                      rng=np.zeros(2, np.uint32), meta={"step": step})
    return run_dir, weights


# ---------------------------------------------------------------------------------------------------------------
# the test's own scoring
# ---------------------------------------------------------------------------------------------------------------


def _boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return found[-1].strip() if found else None


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------
# ulorl eval
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_numbers_equal_an_independent_scoring_of_its_samples(program_model, bench, tmp_path, capsys):
    """`ulorl eval --model M` with no config: accuracy, avg@k and pass@k equal this test's scoring of the
    samples it writes, on a policy that gets some prompts right and some wrong."""
    tokenizer = _tokenizer()
    out = tmp_path / "res.json"
    out.write_text("{}")  # --out overwrites, the samples file beside it too
    (tmp_path / "res.samples.jsonl").write_text("old\n")
    assert main(["eval", "--model", str(program_model), "--data", str(bench), "--k", "4", "--out", str(out),
                 "--json"]) == 0
    printed = _last_json(capsys.readouterr().out)
    result = json.loads(out.read_text())
    assert printed == result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json", "res.samples.jsonl"]
    samples = _read_samples(tmp_path / "res.samples.jsonl")
    assert result["samples_file"] == str(tmp_path / "res.samples.jsonl")
    assert len(samples) == len(ROWS) * 4 == result["eval_samples"]
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(p, i) for p in range(len(ROWS))
                                                                       for i in range(4)]
    correct: dict[int, int] = {}
    for s in samples:
        row = ROWS[s["prompt_index"]]
        assert (s["prompt"], s["answer"]) == (row["prompt"], row["answer"])
        assert tokenizer.decode(s["tokens"], skip_special_tokens=True) == s["text"]
        # the program: the prompt's last character picks the answer drawn, then eos
        assert s["finish_reason"] == "eos" and len(s["tokens"]) == 2 and s["tokens"][-1] == tokenizer.eos_token_id
        assert _boxed(s["text"]) in PROGRAMS[1][row["prompt"][-1]]
        reward = float(_boxed(s["text"]) == row["answer"])
        assert s["reward"] == reward
        correct[s["prompt_index"]] = correct.get(s["prompt_index"], 0) + int(reward)
    assert correct[0] == 4 and correct[1] == 4 and correct[2] == 0  # "a" and "b" -> 2 always right, "b" -> 3 never
    accuracy = sum(correct.values()) / len(samples)
    assert 0 < accuracy < 1
    assert result["eval_accuracy"] == pytest.approx(accuracy)
    for k in (1, 2, 4):
        want = sum(_pass_at_k(4, c, k) for c in correct.values()) / len(ROWS)
        assert result[f"eval_pass_at_{k}"] == pytest.approx(want), k
    assert "eval_pass_at_8" not in result
    assert result["eval_pass_at_1"] < result["eval_pass_at_2"] < result["eval_pass_at_4"] < 1  # "c" prompts mix
    assert result["eval_length_mean"] == 2 and result["eval_truncated_fraction"] == 0

    # what the result was computed from
    assert result["checkpoint"] == {"kind": "hf", "path": str(program_model), "resolved": str(program_model.resolve()),
                                    "step": None}
    assert result["data"] == {"files": [str(bench)], "resolved": [str(bench.resolve())], "from": "--data"}
    assert result["k"] == 4 and result["max_new_tokens"] == 256 - 2  # capped: 256 positions minus the prompt
    assert result["sampling"] == {"temperature": 0.85, "top_k": 20, "top_p": 0.95}
    assert result["reward"]["kind"] == "rule" and result["reward"]["extraction"] == "boxed"
    assert set(result["reward"]) >= {"answer_pattern", "timeout_s", "workers", "custom_fn", "verifier_model"}
    assert result["overrides"] == [] and result["config"] is None


def test_eval_max_memory_refuses_before_allocating(program_model, bench, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert main(["eval", "--model", str(program_model), "--data", str(bench), "--out", str(out),
                 "--max-memory", "1e-6"]) == 2
    err = capsys.readouterr().err
    # 1e-6 GB shown as 1.05 KiB, not "0.00 GiB"
    assert "ulorl eval: error: the decode KV cache needs" in err and "--max-memory allows 1.05 KiB" in err
    assert not out.exists()


def test_eval_out_folder_is_refused_by_name(program_model, bench, tmp_path, capsys):
    assert main(["eval", "--model", str(program_model), "--data", str(bench), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err


def test_eval_default_names_keep_every_result(tmp_path):
    """RUN/eval/step_S_DATA_kK.json: DATA is the --data name with its suffix (a parquet and a jsonl of the same
    stem differ), "eval" for the config's held-out set; a taken name gets -2, -3, ...; --out is used as given."""
    from argparse import Namespace

    from ulorl_jax.commands import _eval_output_path, _write_eval_files
    from ulorl_jax.model_source import ModelSource

    run = ModelSource("run", tmp_path / "run", 7)
    paths = [_eval_output_path(Namespace(out=None, data=data), run, 4)
             for data in ("d/heldout.jsonl", "d/heldout.parquet", "d/heldout", None)]
    assert [p.relative_to(tmp_path / "run") for p in paths] == [
        Path("eval/step_7_heldout.jsonl_k4.json"), Path("eval/step_7_heldout.parquet_k4.json"),
        Path("eval/step_7_heldout_k4.json"), Path("eval/step_7_eval_k4.json")]
    written = [_write_eval_files(paths[0], {"n": n}, [{"sample": n}], overwrite=False) for n in range(3)]
    assert [p.name for p in written] == ["step_7_heldout.jsonl_k4.json", "step_7_heldout.jsonl_k4-2.json",
                                         "step_7_heldout.jsonl_k4-3.json"]
    for n, path in enumerate(written):
        result = json.loads(path.read_text())
        assert result["n"] == n and result["results_file"] == str(path)
        assert _read_samples(Path(result["samples_file"])) == [{"sample": n}]
    assert _eval_output_path(Namespace(out=str(tmp_path / "x.json"), data=None), run, 4) == tmp_path / "x.json"
    assert _eval_output_path(Namespace(out=None, data=None), ModelSource("hf", tmp_path), 4) is None


@pytest.mark.slow
def test_eval_results_of_a_run_never_overwrite_each_other(program_run, bench, capsys):
    """Default names in RUN/eval/: the same command again (here with another reward setting) keeps the earlier
    result; --step picks the checkpoint (step 1: program 1, step 2 (latest): program 2); --k sets the samples
    per prompt and the pass@k reported; --max-new-tokens cuts every sample (a cut sample scores 0)."""
    run_dir, _ = program_run
    before = sorted(p.name for p in run_dir.iterdir())
    results = {}
    for name, argv in [("latest", []),
                       ("pattern", [r"reward.answer_pattern=\\boxed\{(\d)\}"]),
                       ("step1", ["--step", "1", "--k", "3", "--max-new-tokens", "1"])]:
        assert main(["eval", "--run-dir", str(run_dir), "--data", str(bench), "--json", *argv]) == 0, \
            capsys.readouterr().err
        results[name] = _last_json(capsys.readouterr().out)
    eval_dir = run_dir / "eval"
    files = {"latest": "step_2_bench.jsonl_k2.json", "pattern": "step_2_bench.jsonl_k2-2.json",
             "step1": "step_1_bench.jsonl_k3.json"}
    assert sorted(p.name for p in eval_dir.iterdir()) == sorted(
        list(files.values()) + [f.removesuffix(".json") + ".samples.jsonl" for f in files.values()])
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(before + ["eval"])  # the run's own files alone
    samples = {}
    for name, file in files.items():
        assert json.loads((eval_dir / file).read_text()) == results[name], name
        assert results[name]["results_file"] == str(eval_dir / file)
        samples[name] = _read_samples(Path(results[name]["samples_file"]))
    latest, pattern, step1 = results["latest"], results["pattern"], results["step1"]
    assert latest["checkpoint"] == {"kind": "run", "path": str(run_dir), "resolved": str(run_dir.resolve()),
                                    "step": 2}
    assert latest["k"] == 2 and latest["max_new_tokens"] == 4  # the run's eval.k and eval.max_new_tokens
    assert latest["reward"]["answer_pattern"] is None and latest["reward"]["workers"] == 0
    assert latest["overrides"] == [] and pattern["overrides"] == [r"reward.answer_pattern=\\boxed\{(\d)\}"]
    assert pattern["reward"]["answer_pattern"] == r"\\boxed\{(\d)\}"
    # --step: "yb" (answer 2) is answered by each step's own program
    for name, answer in (("latest", "3"), ("step1", "2")):
        assert {s["text"] for s in samples[name] if s["prompt"] == "yb"} == {f"\\boxed{{{answer}}}"}, name
    assert latest["eval_accuracy"] == pytest.approx(np.mean([s["reward"] for s in samples["latest"]]))
    assert 0 < latest["eval_accuracy"] < 1
    # --k 3, --max-new-tokens 1
    assert step1["checkpoint"]["step"] == 1 and step1["k"] == 3 and step1["max_new_tokens"] == 1
    assert len(samples["step1"]) == len(ROWS) * 3 == step1["eval_samples"]
    assert {k for k in step1 if k.startswith("eval_pass_at_")} == {"eval_pass_at_1", "eval_pass_at_2"}
    assert all(len(s["tokens"]) == 1 and s["finish_reason"] == "length" and s["reward"] == 0
               for s in samples["step1"])
    assert step1["eval_truncated_fraction"] == 1 and step1["eval_accuracy"] == 0


# ---------------------------------------------------------------------------------------------------------------
# ulorl export / convert
# ---------------------------------------------------------------------------------------------------------------


def _safetensors(folder: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype as stored, values as float32) of every tensor of an HF folder."""
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        raw = file.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                out[name] = (header[name]["dtype"], f.get_tensor(name).float().numpy())
    return out


PER_EXPERT = "model.layers.0.mlp.experts.0.gate_proj.weight"
FUSED = "model.layers.0.mlp.experts.gate_up_proj"


def test_export_step_dtype_and_expert_layout(program_run, tmp_path, capsys):
    run_dir, weights = program_run
    assert main(["export", str(run_dir), str(tmp_path / "latest")]) == 0
    assert f"run {run_dir} checkpoint 2" in capsys.readouterr().out
    latest = _safetensors(tmp_path / "latest")
    assert {dtype for dtype, _ in latest.values()} == {"F32"} and PER_EXPERT in latest and FUSED not in latest
    np.testing.assert_array_equal(latest["lm_head.weight"][1], weights[2]["lm_head.weight"])

    argv = ["export", str(run_dir), str(tmp_path / "step1"), "--step", "1", "--dtype", "bfloat16",
            "--expert-layout", "fused"]
    assert main(argv) == 0
    assert f"run {run_dir} checkpoint 1" in capsys.readouterr().out
    step1 = _safetensors(tmp_path / "step1")
    assert {dtype for dtype, _ in step1.values()} == {"BF16"}
    assert FUSED in step1 and "model.layers.0.mlp.experts.down_proj" in step1
    assert not any(".experts.0." in name for name in step1)
    # step 1's weights (program 1), not the latest's: the two programs differ in lm_head
    head1, head2 = weights[1]["lm_head.weight"], weights[2]["lm_head.weight"]
    assert not np.array_equal(head1, head2)
    np.testing.assert_allclose(step1["lm_head.weight"][1], head1, rtol=1e-2)
    assert json.loads((tmp_path / "step1" / "config.json").read_text())["dtype"] == "bfloat16"


def test_convert_dtype_and_expert_layout(program_model, tmp_path, capsys):
    from ulorl_jax.models.native import load_native

    source = _safetensors(program_model)
    ours = tmp_path / "ours"
    assert main(["convert", "hf-to-ulorl", str(program_model), str(ours), "--dtype", "bfloat16"]) == 0
    assert json.loads((ours / "model_config.json").read_text())["param_dtype"] == "bfloat16"
    import jax
    from flax import nnx

    params = jax.tree.leaves(nnx.state(load_native(ours), nnx.Param))
    assert params and {str(p.dtype) for p in params} == {"bfloat16"}

    fused = tmp_path / "fused"
    assert main(["convert", "ulorl-to-hf", str(ours), str(fused), "--dtype", "float16",
                 "--expert-layout", "fused"]) == 0
    tensors = _safetensors(fused)
    assert {dtype for dtype, _ in tensors.values()} == {"F16"}
    assert FUSED in tensors and not any(".experts.0." in name for name in tensors)
    np.testing.assert_allclose(tensors["lm_head.weight"][1], source["lm_head.weight"][1], rtol=1e-2)
    assert (fused / "tokenizer.json").is_file()

    # export's documented default layout is per_expert, whatever layout its source folder has
    assert main(["export", str(fused), str(tmp_path / "exported")]) == 0
    exported = _safetensors(tmp_path / "exported")
    assert PER_EXPERT in exported and FUSED not in exported

    # --expert-layout is a layout to write: hf-to-ulorl writes none, so it is refused rather than ignored
    assert main(["convert", "hf-to-ulorl", str(program_model), str(tmp_path / "x"), "--expert-layout", "fused"]) == 2
    assert "--expert-layout applies to ulorl-to-hf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
