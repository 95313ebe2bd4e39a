"""README "Your own model and data", run as written: its YAML and its commands, on a tiny local Qwen3
folder with a character tokenizer (chat template included) and jsonl problems. The only change: the
mesh is pinned to one device (`mesh.fsdp=1` appended to `ulorl train`), since the test process has 8
fake CPU devices."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from ulorl_jax.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    """The fenced block right after `<!-- walkthrough:MARKER -->` in the README."""
    text = README.read_text()
    match = re.search(rf"<!-- walkthrough:{re.escape(marker)} -->\s*```\w*\n(.*?)```", text, re.S)
    assert match, f"README has no walkthrough block {marker!r}"
    return match.group(1)


def _problems(n: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": f"sum mod 10: a{a} b{b}", "answer": str((a + b) % 10)})
    return rows


def test_readme_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from hf_utils import save_hf_model
    from ulorl_jax.data.tokenizer import build_tokenizer, synthetic_alphabet

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer(synthetic_alphabet())
    save_hf_model("qwen3", Path("my-model"), vocab_size=64, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained("my-model")
    for name, seed in (("train.jsonl", 0), ("test.jsonl", 1)):
        Path(name).write_text("".join(json.dumps(r) + "\n" for r in _problems(16 if name == "train.jsonl" else 4,
                                                                                 seed)))
    Path("my_run.yaml").write_text(_block("my_run.yaml"))
    commands = [line for line in _block("commands").splitlines() if line.strip()]
    assert len(commands) >= 5
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "ulorl", line
        argv = argv[1:] + (["mesh.fsdp=1"] if argv[1] == "train" else [])
        assert main(argv) == 0, f"`{line}` failed:\n{capsys.readouterr().err}"
    out = capsys.readouterr().out

    metrics = [json.loads(r) for r in Path("runs/mine/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # 2 steps, then --resume to 3
    assert "eval_pass_at_2" in metrics[1]  # eval_every 2
    assert "checkpoint 3" in out and Path("runs/mine/eval/step_3_test.jsonl_k2.json").is_file()
    assert (Path("my-model-rl") / "tokenizer.json").is_file()
    samples = [json.loads(r) for r in Path("samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["tokens"] for s in samples)
    assert any(Path("runs/mine/plots").glob("*.png"))
