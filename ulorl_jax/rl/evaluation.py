"""Held-out evaluation: avg@k, pass@k, length and truncation of k samples per problem.

`evaluate` is what the trainer runs every `trainer.eval_every` steps. `run_eval`
is `ulorl eval`: it builds only what evaluation needs (tokenizer, model, engine,
reward scorer; no optimizer, no run folder writes) around any model source
(`model_source.py`: an HF or ulorl folder, a run folder or one checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import numpy as np

from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.memory import format_bytes, kv_cache_bytes, memory_budget
from ulorl_jax.rewards.scorer import RewardScorer
from ulorl_jax.rl.packing import TrainSample
from ulorl_jax.rl.pass_at_k import grouped_pass_at_k
from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout
from ulorl_jax.types import PromptItem, Sample

log = logging.getLogger(__name__)

# Default decode slots for `ulorl eval` when rollout.max_concurrent_decodes is null.
DEFAULT_EVAL_SLOTS = 64


def response_text(sample: Sample, tokenizer) -> str:
    return tokenizer.decode(sample.response_ids, skip_special_tokens=True)


def score_samples(samples: list[Sample], scorer: RewardScorer, tokenizer) -> list[float]:
    """Rewards in {0, 1}; stored in each sample's metadata["reward"] so the pools carry them."""
    batch = [(response_text(s, tokenizer), str(s.metadata.get("answer", "")), s.finish_reason == "length",
              s.metadata) for s in samples]
    rewards = scorer.score(batch) if batch else []
    for s, r in zip(samples, rewards):
        s.metadata["reward"] = float(r)
    return rewards


def evaluate(engine: PolicyEngine, params, prompts, scorer: RewardScorer, *, k: int, max_new_tokens: int,
             max_prompt_len: int, sampling: SamplingParams, tokenizer, seed: int,
             entropy_fn: Callable[[list[TrainSample]], float] | None = None) -> dict[str, float]:
    """avg@k accuracy on `prompts` (PromptItems with metadata["answer"]), the unbiased pass@k for k in
    1, 2, 4, 8 up to k ("eval_pass_at_K", `rl/pass_at_k.py`), mean length, truncation rate;
    with `entropy_fn` (e.g. `Learner.mean_entropy`) also the policy's mean token entropy on its own
    held-out samples ("eval_entropy": fixed prompts, so it tracks the policy rather than the batch mix)."""
    ended = sample_and_score(engine, params, prompts, scorer, k=k, max_new_tokens=max_new_tokens,
                             max_prompt_len=max_prompt_len, sampling=sampling, tokenizer=tokenizer, seed=seed)
    return eval_metrics(ended, entropy_fn)


def sample_and_score(engine: PolicyEngine, params, prompts, scorer: RewardScorer, *, k: int, max_new_tokens: int,
                     max_prompt_len: int, sampling: SamplingParams, tokenizer, seed: int) -> list[Sample]:
    """k samples of every prompt, ended (eos or max_new_tokens) and scored: metadata["reward"] holds each reward."""
    rollout = SegmentRollout(engine, RolloutConfig(global_max_len=max_new_tokens, num_segments=1,
                                                   samples_per_prompt=k, max_prompt_len=max_prompt_len,
                                                   eos_token_ids=engine.eos_token_ids, sampling=sampling))
    report = rollout.step(params, prompts, policy_version=-1, rng=jax.random.PRNGKey(seed))
    score_samples(report.ended, scorer, tokenizer)
    return report.ended


def eval_metrics(ended: list[Sample], entropy_fn: Callable[[list[TrainSample]], float] | None = None
                 ) -> dict[str, float]:
    """`evaluate`'s metrics of scored samples (metadata["reward"], see `sample_and_score`)."""
    rewards = [s.metadata["reward"] for s in ended]
    lengths = [len(s.response_ids) for s in ended]
    by_problem: dict[int, list[float]] = {}
    for s, r in zip(ended, rewards):
        by_problem.setdefault(s.prompt_index, []).append(r)
    extra = {f"eval_pass_at_{name.removeprefix('pass@')}": value
             for name, value in grouped_pass_at_k(by_problem.values()).items()}
    if entropy_fn is not None and ended:
        extra["eval_entropy"] = entropy_fn([TrainSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                                                        advantage=0.0, reward=0.0) for s in ended])
    return extra | {"eval_accuracy": float(np.mean(rewards)) if rewards else 0.0,
                    "eval_length_mean": float(np.mean(lengths)) if lengths else 0.0,
                    "eval_truncated_fraction": float(np.mean([s.finish_reason == "length" for s in ended]))
                    if ended else 0.0,
                    "eval_samples": len(ended)}


# ---------------------------------------------------------------------------
# `ulorl eval`
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class EvalPlan:
    """What `ulorl eval` will run, decided (and checked) before anything large is allocated."""

    k: int
    max_new_tokens: int
    max_prompt_len: int  # the longest prompt of the eval set
    slots: int
    kv_cache_bytes: int
    notes: list[str]


def plan_eval(cfg, model_config, prompts: list[PromptItem], *, k: int | None, max_new_tokens: int | None,
              max_memory_gb: float | None) -> EvalPlan:
    """Generation length: --max-new-tokens, else eval.max_new_tokens, else rollout.global_max_len, capped to
    the model's positions minus the longest prompt (with a note). Refuses a KV cache over the budget."""
    notes = []
    k = k or cfg.eval.k
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    longest = max(len(p.prompt_ids) for p in prompts)
    positions = model_config.max_position_embeddings
    if longest >= positions:
        raise ValueError(f"the longest eval prompt has {longest} tokens; the model has {positions} positions")
    asked = max_new_tokens or cfg.eval.max_new_tokens or cfg.rollout.global_max_len
    room = positions - longest
    if asked > room:
        if max_new_tokens or cfg.eval.max_new_tokens:
            notes.append(f"warning: {asked} new tokens + the longest prompt ({longest}) exceed the model's "
                         f"{positions} positions; generating {room} at most")
        else:
            notes.append(f"generation length {room} (the model's {positions} positions minus the longest prompt, "
                         f"{longest}; set --max-new-tokens or eval.max_new_tokens to choose)")
        asked = room
    slots = min(len(prompts) * k, cfg.rollout.max_concurrent_decodes or DEFAULT_EVAL_SLOTS)
    need = kv_cache_bytes(model_config, slots, longest + asked)
    budget, where = memory_budget(max_memory_gb)
    if need > budget:
        raise ValueError(
            f"the decode KV cache needs {format_bytes(need)} ({slots} slots x {longest + asked} positions) but "
            f"{where} allows {format_bytes(budget)}: lower --max-new-tokens (now {asked}) or "
            f"rollout.max_concurrent_decodes (now {slots} slots), or raise --max-memory")
    return EvalPlan(k, asked, longest, slots, need, notes)


def sample_records(samples: list[Sample], tokenizer) -> list[dict[str, Any]]:
    """One JSON-able record per scored sample, ordered by (prompt_index, sample_index): what `ulorl eval` writes
    beside its results. prompt_index is the prompt's position in the eval set (a file's row order); source and
    line (a file's prompts) say where the prompt came from."""
    records = []
    for s in sorted(samples, key=lambda s: (s.prompt_index, s.sample_index)):
        records.append({"prompt_index": s.prompt_index, "sample_index": s.sample_index,
                        "source": s.metadata.get("source"), "line": s.metadata.get("line"),
                        "prompt": s.metadata.get("prompt"), "answer": s.metadata.get("answer"),
                        "text": response_text(s, tokenizer), "tokens": [int(t) for t in s.response_ids],
                        "finish_reason": s.finish_reason, "reward": s.metadata["reward"]})
    return records


def run_eval(cfg, loaded, prompts: list[PromptItem], plan: EvalPlan, *, seed: int | None = None
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate `loaded` (model_source.LoadedModel) on `prompts` as `plan` says: (the eval metrics, one record per
    sample (`sample_records`))."""
    from ulorl_jax.rl.build import build_engine, build_scorer, eval_sampling_params

    sampling = eval_sampling_params(cfg)
    engine = build_engine(cfg, loaded.model, loaded.tokenizer, slots=plan.slots,
                          max_len=plan.max_prompt_len + plan.max_new_tokens, sampling=sampling)
    scorer = build_scorer(cfg)
    try:
        ended = sample_and_score(engine, engine.load_params(), prompts, scorer, k=plan.k,
                                 max_new_tokens=plan.max_new_tokens, max_prompt_len=plan.max_prompt_len,
                                 sampling=sampling, tokenizer=loaded.tokenizer, seed=eval_seed(cfg, seed))
    finally:
        scorer.close()
    return eval_metrics(ended), sample_records(ended, loaded.tokenizer)


def eval_seed(cfg, seed: int | None = None) -> int:
    """The sampling seed of `ulorl eval`: `seed`, else trainer.seed + 1 (the trainer's held-out eval uses the same)."""
    return cfg.trainer.seed + 1 if seed is None else seed
