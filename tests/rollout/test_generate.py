"""`ulorl generate` end to end on a tiny HF folder (with a tokenizer) and on our orbax folder."""

import json

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from hf_utils import save_hf_model
from ulorl_jax.cli import main
from ulorl_jax.models.hf import from_pretrained
from ulorl_jax.models.native import save_native

VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(94)}}  # 97 = the tiny HF vocab


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("hf")
    save_hf_model("qwen3", hf_dir, seed=3, eos_token_id=1)
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    fast.save_pretrained(hf_dir)
    native_dir = tmp_path_factory.mktemp("native") / "model"
    save_native(from_pretrained(hf_dir), native_dir)
    prompts = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [{"prompt": "w3 w4", "answer": "42"}, {"prompt_ids": [6, 7, 8]}, {"prompt_ids": [50, 9, 11, 12, 13]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return hf_dir, native_dir, prompts


def generate(tmp_path, model, prompts, *extra, name="out.jsonl"):
    out = tmp_path / name
    rc = main(["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
               "--max-new-tokens", "12", "--no-progress", *extra])
    assert rc == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow  # several engine compiles: > 20 s on a loaded 2-core box
def test_generate_hf_folder_greedy_segments_and_orbax(folders, tmp_path, capsys):
    hf_dir, native_dir, prompts = folders
    one = generate(tmp_path, hf_dir, prompts, "--temperature", "0", name="one.jsonl")
    assert [(r["prompt_index"], r["sample_index"]) for r in one] == [(0, 0), (1, 0), (2, 0)]
    for r in one:
        assert set(r) >= {"prompt_index", "sample_index", "tokens", "text", "logprobs", "finish_reason", "segments"}
        assert len(r["logprobs"]) == len(r["tokens"]) and 1 <= len(r["tokens"]) <= 12
        assert r["finish_reason"] == ("eos" if r["tokens"][-1] == 1 else "length")
        assert r["finish_reason"] == "eos" or len(r["tokens"]) == 12
        assert r["segments"] == 1
    # The text prompt went through the chat template: "w3 w4 " + generation prompt "w5" = ids [6, 7, 8].
    assert one[0]["tokens"] == one[1]["tokens"] and one[0]["metadata"] == {"answer": "42"}
    assert one[2]["text"] == " ".join(k for t in one[2]["tokens"] for k, v in VOCAB.items() if v == t and t > 2)
    assert "3 samples" in capsys.readouterr().out

    four = generate(tmp_path, hf_dir, prompts, "--temperature", "0", "--segments", "4", name="four.jsonl")
    assert [r["tokens"] for r in four] == [r["tokens"] for r in one]
    assert [r["segments"] for r in four] == [-(-len(r["tokens"]) // 3) for r in one]

    ids_only = native_dir.parent / "ids.jsonl"
    ids_only.write_text("\n".join(json.dumps({"prompt_ids": r}) for r in ([6, 7, 8], [50, 9, 11, 12, 13])))
    native = generate(tmp_path, native_dir, ids_only, "--temperature", "0", name="native.jsonl")
    assert [r["tokens"] for r in native] == [one[1]["tokens"], one[2]["tokens"]]
    assert "text" not in native[0]  # our folder carries no tokenizer


@pytest.mark.slow  # several engine compiles: > 20 s on a loaded 2-core box
def test_generate_sampling_many_samples(folders, tmp_path):
    hf_dir, _, prompts = folders
    rows = generate(tmp_path, hf_dir, prompts, "--samples-per-prompt", "3", "--temperature", "1.0", "--top-k", "8",
                    "--top-p", "0.9", "--seed", "4", "--segments", "2", "--max-concurrent", "4")
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(3) for s in range(3)]
    assert len({tuple(r["tokens"]) for r in rows}) > 3


def test_generate_bad_input(folders, tmp_path, capsys):
    hf_dir, native_dir, prompts = folders
    base = ["generate", "--prompts", str(prompts), "--out", str(tmp_path / "x.jsonl"), "--no-progress"]
    assert main([*base, "--model", str(native_dir)]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err
    assert main([*base, "--model", str(hf_dir), "--segments", "5"]) == 2
    assert "--segments 5 does not divide --max-new-tokens 64" in capsys.readouterr().err
    assert main([*base, "--model", str(hf_dir), "--samples-per-prompt", "0"]) == 2
    assert "--samples-per-prompt must be >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": []}\n')
    assert main(["generate", "--model", str(hf_dir), "--prompts", str(bad), "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    assert "empty prompt" in capsys.readouterr().err
    bad.write_text('{"prompt_ids": [3, 500]}\n')
    assert main(["generate", "--model", str(hf_dir), "--prompts", str(bad), "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    assert "unknown token ids [500]" in capsys.readouterr().err
