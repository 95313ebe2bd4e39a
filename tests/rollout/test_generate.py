"""`ulorl generate` end to end on a tiny HF folder (with a tokenizer), on our orbax folder and on a run folder."""

import argparse
import json

import numpy as np
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
    # --tokenizer DIR: text prompts (chat template included) and text output for a folder without one
    borrowed = generate(tmp_path, native_dir, prompts, "--temperature", "0", "--tokenizer", str(hf_dir),
                        name="borrowed.jsonl")
    assert [r["tokens"] for r in borrowed] == [r["tokens"] for r in one]
    assert borrowed[2]["text"] == one[2]["text"]


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


def test_generate_refuses_a_prompt_as_long_as_the_models_positions(folders, tmp_path, capsys):
    hf_dir, _, _ = folders
    positions = json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_ids": [3, 4]}) + "\n" + json.dumps({"prompt_ids": [3] * positions}) + "\n")
    assert main(["generate", "--model", str(hf_dir), "--prompts", str(long), "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    assert (f"{long}:2: the prompt has {positions} tokens; the model has {positions} positions, which must hold the "
            "prompt and at least one new token") in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_generate_tokenizer_and_chat_flags_are_checked_first(folders, tmp_path, capsys):
    hf_dir, native_dir, prompts = folders
    base = ["generate", "--model", str(native_dir), "--prompts", str(prompts), "--out", str(tmp_path / "x.jsonl"),
            "--no-progress"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*base, "--tokenizer", str(empty)]) == 2
    assert f"--tokenizer {empty}: no tokenizer files there (tokenizer.json" in capsys.readouterr().err
    assert main([*base, "--tokenizer", str(hf_dir), "--chat-template-kwargs", "{enable_thinking:true}"]) == 2
    assert ("--chat-template-kwargs '{enable_thinking:true}': the entry 'enable_thinking:true' has no value (YAML "
            "needs a space after the colon): write --chat-template-kwargs '{enable_thinking: true}'"
            in capsys.readouterr().err)
    assert main([*base, "--chat-template-kwargs", "[1, 2]"]) == 2
    assert "expected a mapping of names to values" in capsys.readouterr().err


def test_chat_settings_are_the_flags_else_the_runs_else_the_defaults():
    from ulorl_jax.config import load_config
    from ulorl_jax.rollout.generate import ChatSettings, add_parser, chat_settings

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    flags = ["generate", "--model", "m", "--prompts", "p", "--out", "o"]
    run = load_config("tiny_cpu", ["data.apply_chat_template=true", "data.system_prompt=be brief",
                                   "data.chat_template_kwargs.enable_thinking=true"])
    assert chat_settings(parser.parse_args(flags)) == ChatSettings(True, None, {})
    assert chat_settings(parser.parse_args(flags), run) == ChatSettings(True, "be brief", {"enable_thinking": True})
    given = parser.parse_args([*flags, "--system-prompt", "terse", "--chat-template-kwargs", "{enable_thinking: false}",
                               "--no-chat-template"])
    assert chat_settings(given, run) == ChatSettings(False, "terse", {"enable_thinking": False})
    assert chat_settings(given) == ChatSettings(False, "terse", {"enable_thinking": False})


# --- a run folder: the run's own chat settings ----------------------------------------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder as `ulorl train` leaves it (config.yaml + checkpoints/0) whose data section formats text prompts
    with a system prompt and a chat-template argument; fresh tiny weights (what was trained is not the point)."""
    import jax
    from flax import nnx

    from ulorl_jax.checkpoint import TrainCheckpointer
    from ulorl_jax.config import config_to_yaml, load_config
    from ulorl_jax.data.tokenizer import CHAT_TEMPLATE, build_tokenizer
    from ulorl_jax.models import init_model

    root = tmp_path_factory.mktemp("run_source")
    tokenizer = build_tokenizer(chat_template=CHAT_TEMPLATE + "{% if enable_thinking %}T{% endif %}")
    tokenizer.save_pretrained(root / "tok")
    (root / "train.jsonl").write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    cfg = load_config("tiny_cpu", [
        "model.arch.vocab_size=128", "model.arch.max_position_embeddings=48", f"model.tokenizer={root / 'tok'}",
        "data.synthetic=null", f"data.train_files=[{root / 'train.jsonl'}]", "data.apply_chat_template=true",
        "data.system_prompt=be brief", "data.chat_template_kwargs={enable_thinking: true}"])
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    model = init_model(cfg.model.model_config(), seed=0)
    ckpt = TrainCheckpointer(run / "checkpoints", async_save=False)
    try:
        ckpt.save(0, params=nnx.state(model, nnx.Param), opt_state={"count": np.zeros((), np.int32)},
                  rng=jax.random.PRNGKey(0), meta={})
    finally:
        ckpt.close()
    return run, tokenizer


@pytest.mark.slow  # an engine compile for a 48-position model
def test_generate_on_a_run_formats_text_prompts_as_the_run_trained(run_folder, tmp_path, capsys):
    from ulorl_jax.data.prompts import encode_prompt

    run, tokenizer = run_folder
    as_trained = encode_prompt(tokenizer, "hi", system_prompt="be brief",
                               chat_template_kwargs={"enable_thinking": True})
    plain = encode_prompt(tokenizer, "hi")
    assert tokenizer.decode(as_trained).startswith("<|im_start|>system\nbe brief") and tokenizer.decode(
        as_trained).endswith("assistant\nT")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in (
        {"prompt": "hi"}, {"prompt_ids": as_trained}, {"prompt_ids": plain})))
    out = tmp_path / "out.jsonl"
    # 40 new tokens do not fit beside the 24-token prompt in 48 positions: capped, as `ulorl eval` does.
    # No --no-progress: stderr is not a terminal here, so no progress display and no stray blank line either.
    assert main(["generate", "--model", str(run), "--prompts", str(prompts), "--out", str(out), "--temperature", "0",
                 "--max-new-tokens", "40", "--segments", "2"]) == 0
    err = capsys.readouterr().err
    assert "" not in err.splitlines() and not err.startswith("\n"), repr(err)
    assert "system prompt 'be brief', chat_template_kwargs {'enable_thinking': True}" in err
    longest = len(as_trained)
    assert (f"--max-new-tokens 40 + the longest prompt ({longest} tokens) exceed the model's 48 positions; generating "
            f"{(48 - longest) // 2 * 2} at most") in err
    text, ids, bare = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(text["tokens"]) <= 48 - longest
    # the text prompt was formatted with the run's system prompt and template argument: the same greedy tokens
    # and log-probs as the ids built that way, unlike the prompt without them
    assert text["tokens"] == ids["tokens"]
    np.testing.assert_allclose(text["logprobs"], ids["logprobs"], atol=1e-5)
    assert not np.allclose(text["logprobs"][:1], bare["logprobs"][:1], atol=1e-3)
