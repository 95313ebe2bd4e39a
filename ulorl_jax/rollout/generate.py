"""`ulorl generate`: sample completions for a JSONL of prompts with our engine.

Runs the segment rollout (rollout/segment.py) with fixed weights: with
`--segments K` each sample is decoded K segments of max_new_tokens / K tokens,
re-prefilled between segments exactly as in RL training; K = 1 is plain
decoding. Greedy output does not depend on K.

Text prompts are formatted as training formats them (data/prompts.py
`encode_prompt`): a run folder's own `data.apply_chat_template`,
`data.system_prompt` and `data.chat_template_kwargs` apply, so `generate`
samples what the run was trained on; the flags below set or replace them.
A prompt must be shorter than the model's positions, and the generation
length is capped to the positions the longest prompt leaves (as `ulorl eval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ulorl_jax import model_source


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="sample completions for a JSONL of prompts (segment rollout, fixed weights)",
        description=__doc__.split("\n\n", 1)[1] + "\nPrompt lines hold `prompt` (text or chat messages, formatted "
        "as above) or `prompt_ids` (token ids). Output: one JSON line per sample with "
        "prompt_index, sample_index, tokens, text (with a tokenizer), logprobs, finish_reason (eos | length), "
        "segments.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF folder (config.json + safetensors), ulorl folder, run folder or RUN/checkpoints/STEP")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder (default: the model folder's; a run's model.tokenizer / model.path)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="a system turn before every text prompt (default: a run's data.system_prompt, else none)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="MAPPING",
                   help="extra arguments of the chat template as a YAML / JSON mapping, e.g. "
                        "'{enable_thinking: true}' (default: a run's data.chat_template_kwargs, else none)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template to text prompts (default: a run's "
                        "data.apply_chat_template, else yes when the tokenizer has one)")
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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display (none either when stderr is not a terminal)")
    p.set_defaults(func=run_cli)
    return p


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """How text prompts become token ids (the arguments of data/prompts.py `encode_prompt`)."""

    use_chat_template: bool = True  # when the tokenizer has one
    system_prompt: str | None = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)

    def describe(self, tokenizer=None) -> str:
        if not self.use_chat_template or (tokenizer is not None and not getattr(tokenizer, "chat_template", None)):
            return "text prompts encoded as they are (no chat template)"
        parts = [f"system prompt {self.system_prompt!r}" if self.system_prompt is not None else "no system prompt"]
        if self.chat_template_kwargs:
            parts.append(f"chat_template_kwargs {self.chat_template_kwargs}")
        return "text prompts formatted with the chat template, " + ", ".join(parts)


def chat_settings(args, run_config=None) -> ChatSettings:
    """The flags, else the run's data section (the formatting it trained with), else the defaults."""
    data = run_config.data if run_config is not None else None
    use = args.chat_template
    if use is None:
        use = data.apply_chat_template if data is not None else True
    system = args.system_prompt if args.system_prompt is not None else (data.system_prompt if data else None)
    if args.chat_template_kwargs is not None:
        kwargs = parse_mapping(args.chat_template_kwargs, "--chat-template-kwargs")
    else:
        kwargs = dict(data.chat_template_kwargs or {}) if data is not None else {}
    return ChatSettings(bool(use), system, kwargs)


def parse_mapping(text: str, flag: str) -> dict:
    """A YAML / JSON flow mapping ('{enable_thinking: true}'); a ValueError shows the expected form."""
    import yaml

    example = f"{flag} '{{enable_thinking: true}}'"
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{flag} {text!r} is not valid YAML ({str(err).splitlines()[0]}); e.g. {example}") from None
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{flag} {text!r}: expected a mapping of names to values, e.g. {example}")
    for key, entry in value.items():
        if ":" in key and entry is None:  # '{a:1}': YAML reads the key 'a:1' with no value
            head, _, tail = key.partition(":")
            raise ValueError(f"{flag} {text!r}: the entry {key!r} has no value (YAML needs a space after the "
                             f"colon): write {flag} '{{{head.strip()}: {tail.strip()}}}'")
    return value


def load_prompts(path, tokenizer, chat: ChatSettings | None = None, max_positions: int | None = None) -> list:
    """PromptItems of a JSONL file: `prompt` (text or chat messages, formatted by `chat`) or `prompt_ids`.
    max_positions: the model's positions; a prompt of that many tokens or more is refused, naming its line."""
    from ulorl_jax.data.prompts import encode_prompt
    from ulorl_jax.types import PromptItem

    chat = chat or ChatSettings()
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
            try:  # exactly as training formats its prompts
                ids = encode_prompt(tokenizer, row["prompt"], use_chat_template=chat.use_chat_template,
                                    system_prompt=chat.system_prompt, chat_template_kwargs=chat.chat_template_kwargs)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}:{lineno}: {err}") from None
            ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{path}:{lineno}: empty prompt (0 tokens)")
        if max_positions is not None and len(ids) >= max_positions:
            raise ValueError(f"{path}:{lineno}: the prompt has {len(ids)} tokens; the model has {max_positions} "
                             f"positions, which must hold the prompt and at least one new token")
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
    chat = chat_settings(args)  # a bad flag fails before the model loads
    start = time.perf_counter()
    tokenizer = None if args.tokenizer is None else load_tokenizer_flag(args.tokenizer)
    loaded = model_source.load(source, dtype=args.dtype)
    tokenizer = loaded.tokenizer if tokenizer is None else tokenizer
    model = loaded.model
    if loaded.run_config is not None:
        chat = chat_settings(args, loaded.run_config)
        if tokenizer is not None:
            print(f"ulorl generate: {chat.describe(tokenizer)} (as run {source.path} trained; the --system-prompt / "
                  "--chat-template-kwargs / --[no-]chat-template flags change it)", file=sys.stderr)
    positions = model.config.max_position_embeddings
    prompts = load_prompts(args.prompts, tokenizer, chat, max_positions=positions)
    eos = model_source.eos_token_ids(model.config, tokenizer)
    max_prompt = max(len(p.prompt_ids) for p in prompts)
    max_new_tokens = cap_new_tokens(args.max_new_tokens, args.segments, max_prompt, positions)
    cfg = RolloutConfig(global_max_len=max_new_tokens, num_segments=args.segments,
                        samples_per_prompt=args.samples_per_prompt, max_prompt_len=max_prompt,
                        eos_token_ids=eos, sampling=sampling)
    total = len(prompts) * args.samples_per_prompt
    engine = PolicyEngine(model, max_concurrent_decodes=min(args.max_concurrent, total),
                          max_prefill_length=max_prompt + max_new_tokens - cfg.segment_len,
                          max_cache_len=max_prompt + max_new_tokens, sampling=sampling, eos_token_ids=eos,
                          tokenizer=tokenizer)
    params = engine.load_params()
    key = jax.random.PRNGKey(args.seed)
    ended = []
    with _progress(args.no_progress or not sys.stderr.isatty(), total * max_new_tokens) as advance:
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


def load_tokenizer_flag(folder: str):
    """The tokenizer of `--tokenizer DIR`; a clear error for a folder without tokenizer files."""
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"--tokenizer {folder}: no such folder")
    tokenizer = model_source.load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"--tokenizer {folder}: no tokenizer files there ({', '.join(model_source.TOKENIZER_FILES)})")
    return tokenizer


def cap_new_tokens(asked: int, segments: int, longest: int, positions: int) -> int:
    """`asked` new tokens, capped (with a warning) so that the longest prompt plus them fit the model's
    positions, rounded down to a multiple of `segments`."""
    room = positions - longest
    if asked <= room:
        return asked
    capped = room // segments * segments
    if capped < 1:
        raise ValueError(f"the longest prompt ({longest} tokens) leaves {room} of the model's {positions} positions, "
                         f"fewer than --segments {segments}: lower --segments or shorten the prompt")
    print(f"ulorl generate: warning: --max-new-tokens {asked} + the longest prompt ({longest} tokens) exceed the "
          f"model's {positions} positions; generating {capped} at most", file=sys.stderr)
    return capped


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
