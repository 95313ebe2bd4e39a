"""`ulorl generate`: sample completions for a JSONL of prompts with our engine.

Runs the segment rollout (rollout/segment.py) with fixed weights: with
`--segments K` each sample is decoded K segments of max_new_tokens / K tokens,
re-prefilled between segments exactly as in RL training; K = 1 is plain
decoding. Greedy output does not depend on K.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ulorl_jax import model_source


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="sample completions for a JSONL of prompts (segment rollout, fixed weights)",
        description=__doc__.split("\n\n", 1)[1] + "\nPrompt lines hold `prompt` (text; the chat template is "
        "applied when the tokenizer has one) or `prompt_ids` (token ids). Output: one JSON line per sample with "
        "prompt_index, sample_index, tokens, text (with a tokenizer), logprobs, finish_reason (eos | length), "
        "segments.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (config.json + safetensors) or ulorl folder")
    p.add_argument("--prompts", required=True, help="input JSONL, one prompt per line")
    p.add_argument("--out", required=True, help="output JSONL (overwritten)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="response tokens per sample (default 64)")
    p.add_argument("--segments", type=int, default=1,
                   help="decode in K segments of max-new-tokens/K, re-prefilling between them (default 1)")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="samples per prompt, n (default 1)")
    p.add_argument("--temperature", type=float, default=0.85, help="0 = greedy (default 0.85)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-concurrent", type=int, default=16, help="decode slots (default 16)")
    p.add_argument("--steps-per-call", type=int, default=8, help="decode steps per jitted call (default 8)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameter / compute dtype (default: float32 for HF folders, as stored for ulorl)")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.set_defaults(func=run_cli)
    return p


def load_prompts(path, tokenizer) -> list:
    from ulorl_jax.types import PromptItem

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    items = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("prompt_ids" in row):
            raise ValueError(f"{path}:{lineno}: need exactly one of `prompt` (text) or `prompt_ids`")
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{path}:{lineno}: prompt_ids must be a list of integers")
        else:
            if tokenizer is None:
                raise ValueError(f"{path}:{lineno}: text `prompt` needs a tokenizer, and the model folder has "
                                 f"none ({', '.join(model_source.TOKENIZER_FILES)}); give `prompt_ids` instead")
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(row["prompt"])["input_ids"]
            ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{path}:{lineno}: empty prompt (0 tokens)")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "prompt_ids")}
        items.append(PromptItem(len(items), ids, meta))
    if not items:
        raise ValueError(f"--prompts {path}: no prompts")
    return items


def run_cli(args) -> int:
    import jax

    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import SamplingParams
    from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout

    for name in ("max_new_tokens", "segments", "samples_per_prompt", "max_concurrent", "steps_per_call"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens % args.segments:
        raise ValueError(f"--segments {args.segments} does not divide --max-new-tokens {args.max_new_tokens}")
    source = model_source.resolve(args.model)  # HF / ulorl folder, run folder or checkpoint
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    start = time.perf_counter()
    loaded = model_source.load(source, dtype=args.dtype)
    tokenizer, model = loaded.tokenizer, loaded.model
    prompts = load_prompts(args.prompts, tokenizer)
    eos = model_source.eos_token_ids(model.config, tokenizer)
    max_prompt = max(len(p.prompt_ids) for p in prompts)
    cfg = RolloutConfig(global_max_len=args.max_new_tokens, num_segments=args.segments,
                        samples_per_prompt=args.samples_per_prompt, max_prompt_len=max_prompt,
                        eos_token_ids=eos, sampling=sampling)
    total = len(prompts) * args.samples_per_prompt
    engine = PolicyEngine(model, max_concurrent_decodes=min(args.max_concurrent, total),
                          max_prefill_length=max_prompt + args.max_new_tokens - cfg.segment_len,
                          max_cache_len=max_prompt + args.max_new_tokens, sampling=sampling, eos_token_ids=eos,
                          tokenizer=tokenizer)
    params = engine.load_params()
    key = jax.random.PRNGKey(args.seed)
    ended = []
    with _progress(args.no_progress, total * args.max_new_tokens) as advance:
        rollout = SegmentRollout(engine, cfg, steps_per_call=args.steps_per_call, on_tokens=advance)
        todo, step = prompts, 0
        while todo or rollout.unfinished_pool:
            report = rollout.step(params, todo, policy_version=0, rng=jax.random.fold_in(key, step))
            ended += report.ended
            todo, step = [], step + 1
    ended.sort(key=lambda s: (s.prompt_index, s.sample_index))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for s in ended:
            row = {"prompt_index": s.prompt_index, "sample_index": s.sample_index, "tokens": s.response_ids}
            if tokenizer is not None:
                row["text"] = tokenizer.decode(s.response_ids, skip_special_tokens=True)
            row.update(logprobs=s.logprobs, finish_reason=s.finish_reason, segments=s.segments)
            if s.metadata:
                row["metadata"] = s.metadata
            f.write(json.dumps(row) + "\n")
    n_tokens = sum(len(s.response_ids) for s in ended)
    print(f"ulorl generate: {len(ended)} samples ({len(prompts)} prompts x {args.samples_per_prompt}), "
          f"{n_tokens} tokens, {args.segments} segment(s) of {cfg.segment_len}, in {time.perf_counter() - start:.1f}s "
          f"-> {out}")
    return 0


class _progress:
    """A rich progress bar over decoded tokens (upper bound: every sample runs to the max)."""

    def __init__(self, disabled: bool, total: int):
        self.disabled, self.total, self.bar = disabled, total, None

    def __enter__(self):
        if self.disabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens (max)"),
                            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
        self.bar.start()
        task = self.bar.add_task("decode", total=self.total)
        return lambda n: self.bar.update(task, advance=n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
