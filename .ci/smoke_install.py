"""Smoke test of the install front door: README command 1 (`pip install -e .`, no extras) runs our commands.

.ci/run calls this in a venv holding exactly that install, so a package we import but do not declare (jinja2,
which transformers leaves to an extra and which the test extras' torch pulls in) fails here, not on a
user's machine. Built locally, without torch (not installed in that venv): a tiny Qwen3 Hugging Face folder
written by our own code (`ulorl_jax.models.hf.save_pretrained`), a character tokenizer (`tokenizers` wrapped by
transformers' PreTrainedTokenizerFast) with a Qwen3-style chat template that needs jinja (a namespace, loop
variables, filters, `enable_thinking`), a few jsonl problems and a one-step config. Then the real `ulorl`
console script of this interpreter's environment runs:

    ulorl generate --model FOLDER --prompts p.jsonl --out o.jsonl --max-new-tokens 8
    ulorl train --config run.yaml --run-dir RUN          (trainer.total_steps=1)

Each must exit 0 and write its outputs; the first failure prints the command's stderr tail and exits 1.

    python .ci/smoke_install.py [--work DIR]      (default: a temporary folder, removed afterwards)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Qwen3's chat template, reduced to what a one-character-per-token vocabulary can show, but with the jinja it
# uses: a namespace, loop.index0 / loop.last, string tests and filters, and the `enable_thinking` switch that
# configs pass through data.chat_template_kwargs.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content | trim %}{%- endif %}"
    "{%- if ns.system %}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content | string) + '<|im_end|>' }}"
    "{%- if not loop.last or add_generation_prompt %}{{- '\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '{}\\n' }}{%- endif %}"
    "{%- endif %}"
)

CONFIG = """\
model:
  path: {model}
data:
  train_files: [train.jsonl]
  eval_files: [test.jsonl]
  prompt_key: prompt
  answer_key: answer
  max_prompt_len: 64
  apply_chat_template: true
  system_prompt: "Answer with one digit."
  chat_template_kwargs: {{enable_thinking: false}}
rollout: {{global_max_len: 16, num_segments: 2, n: 2}}
trainer: {{train_batch_size: 2, ppo_mini_batch_size: 4, micro_batch_rows: 4, total_steps: 1, eval_every: 1}}
eval: {{k: 1, max_new_tokens: 8}}
checkpoint: {{save_every: 1}}
"""


def build_model_folder(folder: Path) -> dict:
    """A tiny random Qwen3 HF folder + its tokenizer, all from this package (no torch)."""
    from ulorl_jax.data.tokenizer import build_tokenizer, synthetic_alphabet
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.models.hf import save_pretrained

    tokenizer = build_tokenizer(synthetic_alphabet() + ".,?", chat_template=CHAT_TEMPLATE)
    config = tiny_config("qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id)
    assert len(tokenizer) <= config.vocab_size, (len(tokenizer), config.vocab_size)
    save_pretrained(init_model(config, seed=0), folder)
    tokenizer.save_pretrained(folder)
    return {"vocab": len(tokenizer)}


def write_problems(path: Path, n: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": f"sum mod 10: a{a} b{b}?", "answer": str((a + b) % 10)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(label: str, argv: list[str], cwd: Path, timings: dict) -> None:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    timings[label] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        sys.exit(f"smoke_install: `{' '.join(argv)}` exited {proc.returncode} in {cwd}:\n{tail}")
    print(f"  {label}: ok in {timings[label]}s")


def smoke(work: Path) -> dict:
    ulorl = Path(sys.executable).parent / "ulorl"  # the console script `pip install -e .` wrote beside python
    if not ulorl.is_file():
        sys.exit(f"smoke_install: no `ulorl` script beside {sys.executable}: run `pip install -e .` in this venv")
    timings: dict = {}
    start = time.perf_counter()
    info = build_model_folder(work / "my-model")
    write_problems(work / "train.jsonl", 8, seed=0)
    write_problems(work / "test.jsonl", 2, seed=1)
    (work / "run.yaml").write_text(CONFIG.format(model="my-model"))
    timings["build"] = round(time.perf_counter() - start, 1)
    print(f"  built my-model (vocab {info['vocab']}) and the data in {timings['build']}s")

    run("ulorl --help", [str(ulorl), "--help"], work, timings)
    run("ulorl generate", [str(ulorl), "generate", "--model", "my-model", "--prompts", "test.jsonl",
                           "--out", "o.jsonl", "--max-new-tokens", "8", "--no-progress"], work, timings)
    samples = [json.loads(line) for line in (work / "o.jsonl").read_text().splitlines()]
    if len(samples) != 2 or not all(s["tokens"] for s in samples):
        sys.exit(f"smoke_install: ulorl generate wrote {len(samples)} samples to o.jsonl, want 2 with tokens")

    run("ulorl train", [str(ulorl), "train", "--config", "run.yaml", "--run-dir", "runs/smoke"], work, timings)
    run_dir = work / "runs" / "smoke"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [m.get("step") for m in metrics] != [1]:
        sys.exit(f"smoke_install: ulorl train wrote steps {[m.get('step') for m in metrics]} to "
                 f"{run_dir / 'metrics.jsonl'}, want [1]")
    if not any((run_dir / "checkpoints").iterdir()):
        sys.exit(f"smoke_install: ulorl train wrote no checkpoint under {run_dir / 'checkpoints'}")
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="folder to build in (kept; default: a temp one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": expected here
    versions = {p: (importlib.metadata.version(p) if importlib.util.find_spec(m) else "absent")
                for p, m in (("jax", "jax"), ("transformers", "transformers"), ("jinja2", "jinja2"),
                             ("torch", "torch"))}
    print("smoke_install:", ", ".join(f"{p} {v}" for p, v in versions.items()))
    start = time.perf_counter()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        timings = smoke(args.work)
    else:
        work = Path(tempfile.mkdtemp(prefix="ulorl-smoke-"))
        try:
            timings = smoke(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"smoke_install: ok in {time.perf_counter() - start:.0f}s {json.dumps(timings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
