"""Prompt sources for the trainer: the built-in synthetic task, or prompt files.

Both are deterministic streams of `PromptItem`s with a JSON-able position
(`state_dict` / `load_state_dict`), so a resumed run draws exactly the
prompts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

from ulorl_jax.data.synthetic import SyntheticConfig, SyntheticProblem, make_splits, noisy_trace
from ulorl_jax.types import PromptItem

log = logging.getLogger(__name__)

# Keys of `data.synthetic` that are not SyntheticConfig fields.
# eval_min_operands: held-out problems with at least this many operands (a harder split than training, which
# keeps min_operands..max_operands); null = both splits from the same distribution.
_SYNTHETIC_RUN_KEYS = {"num_train": 512, "num_eval": 64, "seed": 0, "noise_p": 0.1, "task": "arithmetic",
                       "eval_min_operands": None}


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """The demo's task: train / held-out problems and the noisy warm-start traces."""

    config: SyntheticConfig
    train: tuple[SyntheticProblem, ...]
    eval: tuple[SyntheticProblem, ...]
    noise_p: float
    seed: int

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "SyntheticTask":
        opts = {**_SYNTHETIC_RUN_KEYS, **(options or {})}
        if opts.pop("task") != "arithmetic":
            raise ValueError(f"data.synthetic.task={options.get('task')!r}: only 'arithmetic' is built in")
        known = {f.name for f in dataclasses.fields(SyntheticConfig)} | set(_SYNTHETIC_RUN_KEYS)
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"unknown data.synthetic key(s) {unknown}; known: {sorted(known - {'task'})}")
        num_train, num_eval, seed, noise_p, eval_min = (
            opts.pop(k) for k in ("num_train", "num_eval", "seed", "noise_p", "eval_min_operands"))
        if not 0.0 <= noise_p < 1.0:
            raise ValueError(f"data.synthetic.noise_p={noise_p} must be in [0, 1)")
        config = SyntheticConfig(**opts)
        if eval_min is not None and not (type(eval_min) is int
                                         and config.min_operands <= eval_min <= config.max_operands):
            raise ValueError(f"data.synthetic.eval_min_operands={eval_min!r} must be an integer in "
                             f"[min_operands, max_operands] = [{config.min_operands}, {config.max_operands}]")
        splits = make_splits(config, num_train, num_eval, seed)
        held_out = splits["eval"]
        if eval_min is not None:  # training stays this draw; the split is a hash of the prompt, so held-out
            # problems drawn from the harder distribution are still never training problems
            held_out = make_splits(dataclasses.replace(config, min_operands=eval_min), 0, num_eval, seed)["eval"]
        return cls(config, tuple(splits["train"]), tuple(held_out), float(noise_p), int(seed))

    def warm_start_traces(self, step: int, batch: int) -> list[tuple[SyntheticProblem, str]]:
        """`batch` (problem, noisy trace) pairs for supervised step `step`, deterministic in (seed, step)."""
        rng = np.random.default_rng([self.seed, 1, step])
        picks = rng.integers(0, len(self.train), size=batch)
        return [(self.train[i], noisy_trace(self.train[i], self.noise_p, rng)[0]) for i in picks]


def encode_prompt(tokenizer, text: str, apply_chat_template: bool) -> list[int]:
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer.encode(text, add_special_tokens=False))


class ProblemStream:
    """Cycles through a fixed list of problems in a seeded order, reshuffled every epoch.

    Position = number of prompts drawn; prompt_index (the group id) = that
    running count, so group ids never repeat within a run."""

    def __init__(self, problems: Sequence[SyntheticProblem], tokenizer, *, seed: int,
                 apply_chat_template: bool):
        if not problems:
            raise ValueError("the synthetic task has no training problems (data.synthetic.num_train)")
        self.problems = list(problems)
        self.tokenizer = tokenizer
        self.seed = seed
        self.apply_chat_template = apply_chat_template
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 2, epoch]).permutation(len(self.problems))

    def take(self, count: int) -> list[PromptItem]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.problems))
            problem = self.problems[int(self._order(epoch)[offset])]
            ids = encode_prompt(self.tokenizer, problem.prompt, self.apply_chat_template)
            out.append(PromptItem(self.position, ids, {"answer": problem.answer, "prompt": problem.prompt}))
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"prompt stream seed {state['seed']} in the checkpoint != configured {self.seed}")
        self.position = int(state["position"])


def eval_prompts(problems: Sequence[SyntheticProblem], tokenizer, apply_chat_template: bool) -> list[PromptItem]:
    return [PromptItem(i, encode_prompt(tokenizer, p.prompt, apply_chat_template),
                       {"answer": p.answer, "prompt": p.prompt}) for i, p in enumerate(problems)]


def prompt_file_stream(files: Sequence[str], options: Any, tokenizer, max_prompt_len: int | None, *,
                       shuffle: bool, held_out: bool = False):
    """A PromptStream over the rows of `files` (jsonl / parquet / datasets folders). `options`: the run
    config's `data` section. Each file's kept and dropped rows are reported, by reason; a file with more
    than `data.max_dropped_fraction` of its rows dropped is refused. `held_out`: eval files, read with
    `data.eval_prompt_key` / `eval_answer_key` when set. Rows' other keys (`data.extra_keys`, null = all)
    reach the rewards' metadata, in training and held-out eval alike."""
    from ulorl_jax.data.prompts import PromptDataConfig, PromptStream, load_prompts

    prompt_key, answer_key = options.prompt_key, options.answer_key
    if held_out:
        prompt_key = options.eval_prompt_key or prompt_key
        answer_key = options.eval_answer_key or answer_key
    prefix = "data.eval_" if held_out else "data."  # the options named when a file lacks a key
    extra_keys = options.extra_keys
    records, bad = [], []
    for path in files:
        config = PromptDataConfig(path=path, prompt_key=prompt_key, answer_key=answer_key,
                                  max_prompt_len=max_prompt_len, on_bad_row=options.on_bad_row,
                                  use_chat_template=options.apply_chat_template, system_prompt=options.system_prompt,
                                  chat_template_kwargs=dict(options.chat_template_kwargs or {}), shuffle=shuffle,
                                  seed=options.shuffle_seed,
                                  extra_keys=None if extra_keys is None else tuple(extra_keys),
                                  prompt_key_option=f"{prefix}prompt_key", answer_key_option=f"{prefix}answer_key",
                                  extra_keys_option="data.extra_keys")
        config.validate()
        got, rejected = load_prompts(config, tokenizer)
        _report_file(path, len(got), rejected, options.max_dropped_fraction, held_out)
        records += got
        bad += rejected
    if not records:
        raise ValueError(f"no usable prompts in {list(files)}")
    return PromptStream(records, seed=options.shuffle_seed, shuffle=shuffle, bad_rows=bad)


def _report_file(path: str, kept: int, rejected: list, max_fraction: float, held_out: bool) -> None:
    """Log how many rows of `path` were kept and why the others were dropped; refuse too many drops."""
    import re
    from collections import Counter

    total = kept + len(rejected)
    role = "eval" if held_out else "train"
    if not rejected:
        log.info("data (%s): %s: kept all %d rows", role, path, total)
        return
    reasons = Counter(re.sub(r"\d+", "N", row.reason.split(":")[0] if row.reason.startswith("bad JSON")
                             else row.reason) for row in rejected)
    summary = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(5))
    message = f"data ({role}): {path}: kept {kept} of {total} rows, dropped {len(rejected)} ({summary})"
    if len(rejected) > max_fraction * total:
        raise ValueError(f"{message}: more than data.max_dropped_fraction={max_fraction:g} of the file. Fix the "
                         f"rows (first: {rejected[0]}), raise data.max_prompt_len if prompts are too long, or set "
                         f"data.max_dropped_fraction")
    log.warning("%s", message)
