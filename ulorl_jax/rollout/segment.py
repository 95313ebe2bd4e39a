"""Segment rollout (ULORL.md §1, paper Algorithm 1): pools and the three terminations.

Each RL step decodes at most `segment_len` new tokens per sample, for every
sample of the unfinished pool (continued: prompt + all earlier segments are
re-prefilled with the *current* params) and for `samples_per_prompt` fresh
samples of each new prompt. A sample ends the step as
  1. "eos"       EOS / stop sequence (or the length oracle)  -> experience pool,
  2. segment     budget used, total < global_max_len         -> unfinished pool,
  3. "length"    global_max_len reached (truncated, reward 0) -> experience pool.
The engine prefills a step's samples in a few batched calls (`PolicyEngine.prefill_many`, capped by its
`prefill_token_budget`); a new prompt's n samples share one prefill of the prompt.
Every response token keeps the policy version that generated it and its
log-prob (SAIS, ULORL.md §2). A prompt's n samples form a group; the group is
trainable once all n have ended (GRPO needs the whole group, §4).
Pools are plain JSON-able data (`state_dict`) so a checkpoint resumes exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ulorl_jax.buckets import pow2_ceil
from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.types import FINISH_REASONS, PromptItem, Sample  # noqa: F401  (this module's names too)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    global_max_len: int  # max response tokens of a sample (e.g. 128k)
    num_segments: int  # segment_len = global_max_len / num_segments
    samples_per_prompt: int  # n, the GRPO group size
    max_prompt_len: int
    eos_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self):
        for name in ("global_max_len", "num_segments", "samples_per_prompt", "max_prompt_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RolloutConfig.{name} must be a positive integer, got {v!r}")
        if self.global_max_len % self.num_segments:
            raise ValueError(f"RolloutConfig: num_segments={self.num_segments} does not divide "
                             f"global_max_len={self.global_max_len}")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        object.__setattr__(self, "stop_sequences", tuple(tuple(int(t) for t in s) for s in self.stop_sequences))
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("RolloutConfig.stop_sequences: empty stop sequence")

    @property
    def segment_len(self) -> int:
        return self.global_max_len // self.num_segments

    @classmethod
    def from_segment_len(cls, global_max_len: int, segment_len: int, **kw) -> "RolloutConfig":
        """Build from (global_max_len, segment_len) as the issue states the inputs."""
        if segment_len < 1 or segment_len > global_max_len:
            raise ValueError(f"segment_len={segment_len} must be in [1, global_max_len={global_max_len}]")
        if global_max_len % segment_len:
            raise ValueError(f"segment_len={segment_len} does not divide global_max_len={global_max_len}")
        return cls(global_max_len=global_max_len, num_segments=global_max_len // segment_len, **kw)


class ExperiencePool:
    """Ended samples waiting for their group to complete (a group = one prompt_index's n samples)."""

    def __init__(self, samples_per_prompt: int):
        self.samples_per_prompt = samples_per_prompt
        self.samples: list[Sample] = []

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, samples: Sequence[Sample]) -> None:
        for s in samples:
            if not s.finished:
                raise ValueError(f"ExperiencePool.add: sample uid {s.uid} is unfinished (finish_reason None)")
        self.samples.extend(samples)

    def pop_complete_groups(self) -> list[list[Sample]]:
        """Groups whose n samples have all ended, in order of completion; each sorted by sample_index."""
        groups: dict[int, list[Sample]] = {}
        for s in self.samples:
            groups.setdefault(s.prompt_index, []).append(s)
        complete = [p for p, g in groups.items() if len(g) >= self.samples_per_prompt]
        done = set(complete)
        self.samples = [s for s in self.samples if s.prompt_index not in done]
        return [sorted(groups[p], key=lambda s: s.sample_index) for p in complete]


@dataclasses.dataclass
class RolloutStepReport:
    ended: list[Sample]  # samples that ended this step ("eos" or "length")
    tokens_decoded: int
    finished: int  # ended with "eos"
    carried: int  # went to the unfinished pool
    truncated: int  # ended with "length" (global max)
    unfinished_pool_size: int
    experience_pool_size: int
    decode_seconds: float
    prefill_seconds: float
    slot_occupancy: float
    prefill_calls: int = 0  # batched prefill calls (engine.prefill_many)
    prefill_rows: int = 0  # distinct prompts prefilled (a new group's n samples share one)
    decode_devices: int = 0  # devices that decoded distinct slots (summed over processes)
    preemptions: int = 0  # samples preempted for want of KV pages (paged cache; summed over processes)
    peak_pages: int = 0  # most KV pages in use at once (paged cache; the largest process's)

    def metrics(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "ended"}


@jax.jit
def _fold_keys(key, uids, progress):  # [N] each -> [N] keys: fold_in(fold_in(key, uid), progress)
    return jax.vmap(lambda u, n: jax.random.fold_in(jax.random.fold_in(key, u), n))(uids, progress)


SAMPLE_KEYS_MIN_PAD = 256  # sample_keys' smallest padded size: one compiled shape up to this many samples


def sample_keys(key, uids: Sequence[int], progress: Sequence[int]) -> list[np.ndarray]:
    """Per sample `fold_in(fold_in(key, uid), tokens generated so far)` as raw uint32 [2] host arrays,
    in one jitted call, not 2 dispatches per sample. Padded to a power of two of at least
    SAMPLE_KEYS_MIN_PAD: one shape for every step of up to that many samples (a batch that grew past 32
    used to compile a new one, 0.24 s, in the middle of a run), a few beyond."""
    n = len(uids)
    if n == 0:
        return []
    size = pow2_ceil(n, SAMPLE_KEYS_MIN_PAD)
    pad = lambda x: np.pad(np.asarray(x, np.uint32), (0, size - n))  # noqa: E731
    keys = _fold_keys(key, pad(uids), pad(progress))
    if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return list(np.asarray(keys, np.uint32)[:n])


class SegmentRollout:
    """Algorithm 1 over a PolicyEngine. `length_oracle(sample)` (tests / benchmarks) may return a
    total response length at which the sample ends as if it had emitted EOS."""

    def __init__(self, engine: PolicyEngine, config: RolloutConfig, *,
                 length_oracle: Callable[[Sample], int | None] | None = None, steps_per_call: int = 8,
                 on_tokens: Callable[[int], None] | None = None):
        need_prefill = config.max_prompt_len + config.global_max_len - config.segment_len
        if engine.max_prefill_length < need_prefill:
            raise ValueError(f"engine.max_prefill_length={engine.max_prefill_length} < max_prompt_len + "
                             f"global_max_len - segment_len = {need_prefill} (continued samples are re-prefilled)")
        if engine.max_cache_len < config.max_prompt_len + config.global_max_len - 1:
            raise ValueError(f"engine.max_cache_len={engine.max_cache_len} < max_prompt_len + global_max_len - 1 = "
                             f"{config.max_prompt_len + config.global_max_len - 1}")
        if set(config.eos_token_ids) != set(engine.eos_token_ids):
            raise ValueError(f"RolloutConfig.eos_token_ids {config.eos_token_ids} differ from the engine's "
                             f"{engine.eos_token_ids}")
        self.engine, self.config = engine, config
        self.length_oracle = length_oracle
        self.steps_per_call = steps_per_call
        self.on_tokens = on_tokens
        self.unfinished_pool: list[Sample] = []
        self.experience_pool = ExperiencePool(config.samples_per_prompt)
        self.next_uid = 0
        self.steps_done = 0

    # -- checkpointable state -------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"unfinished_pool": [s.to_dict() for s in self.unfinished_pool],
                "experience_pool": [s.to_dict() for s in self.experience_pool.samples],
                "next_uid": self.next_uid, "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        missing = {"unfinished_pool", "experience_pool", "next_uid", "steps_done"} - set(state)
        if missing:
            raise ValueError(f"SegmentRollout.load_state_dict: missing keys {sorted(missing)}")
        self.unfinished_pool = [Sample.from_dict(d) for d in state["unfinished_pool"]]
        self.experience_pool.samples = [Sample.from_dict(d) for d in state["experience_pool"]]
        self.next_uid, self.steps_done = int(state["next_uid"]), int(state["steps_done"])

    # -- one RL step ----------------------------------------------------------------------

    def _in_flight(self) -> set[int]:
        return {s.prompt_index for s in self.unfinished_pool} | {s.prompt_index for s in self.experience_pool.samples}

    def new_samples(self, prompts: Sequence[PromptItem]) -> list[Sample]:
        cfg, seen = self.config, self._in_flight()
        out = []
        for p in prompts:
            if p.prompt_index in seen:
                raise ValueError(f"prompt_index {p.prompt_index} is already in flight (group ids must be unique)")
            seen.add(p.prompt_index)
            ids = list(self.engine.check_prompt(p.prompt_ids, what=f"prompt_index {p.prompt_index}"))
            if len(ids) > cfg.max_prompt_len:
                raise ValueError(f"prompt_index {p.prompt_index} has {len(ids)} tokens > max_prompt_len="
                                 f"{cfg.max_prompt_len}")
            for j in range(cfg.samples_per_prompt):
                out.append(Sample(self.next_uid, p.prompt_index, j, [int(t) for t in ids],
                                  metadata=dict(p.metadata)))
                self.next_uid += 1
        return out

    def _budget(self, s: Sample) -> tuple[int, int | None]:
        """(tokens this step, oracle target length or None)."""
        cfg = self.config
        budget = min(cfg.segment_len, cfg.global_max_len - len(s.response_ids))
        target = self.length_oracle(s) if self.length_oracle else None
        if target is not None:
            if target < 1:
                raise ValueError(f"length_oracle returned {target} for uid {s.uid}; need >= 1")
            budget = min(budget, max(1, target - len(s.response_ids)))
        return budget, target

    def step(self, params: Any, new_prompts: Sequence[PromptItem], policy_version: int, rng: Any,
             score: Callable[[list[Sample]], Any] | None = None) -> RolloutStepReport:
        """One segment step (module doc). `score(ended)` (the trainer's reward) runs on the samples that
        ended before they join the experience pool, as `DistributedRollout.step` does on each process."""
        cfg = self.config
        batch = self.unfinished_pool + self.new_samples(new_prompts)
        self.unfinished_pool = []
        key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
        # The key depends on the sample and its progress only, never on slot or batch order.
        keys = sample_keys(key, [s.uid for s in batch], [len(s.response_ids) for s in batch])
        requests, targets = [], []
        for s, k in zip(batch, keys):
            budget, target = self._budget(s)
            targets.append(target)
            requests.append(Request(s.prompt_ids + s.response_ids, budget, k))
        completions, stats = self.engine.run(params, requests, sampling=cfg.sampling,
                                             stop_sequences=cfg.stop_sequences, steps_per_call=self.steps_per_call,
                                             on_tokens=self.on_tokens)
        ended, finished, truncated = [], 0, 0
        for s, c, target in zip(batch, completions, targets):
            s.response_ids += c.tokens
            s.logprobs += c.logprobs
            s.policy_versions += [int(policy_version)] * len(c.tokens)
            s.segments += 1
            oracle_end = target is not None and len(s.response_ids) >= target
            if c.stop in ("eos", "stop") or oracle_end:
                s.finish_reason = "eos"
                finished += 1
            elif len(s.response_ids) >= cfg.global_max_len:
                s.finish_reason = "length"  # truncated: the trainer gives it reward 0
                truncated += 1
            else:
                self.unfinished_pool.append(s)
                continue
            ended.append(s)
        if score is not None:
            score(ended)
        self.experience_pool.add(ended)
        self.steps_done += 1
        return RolloutStepReport(
            ended=ended, tokens_decoded=stats.tokens_decoded, finished=finished,
            carried=len(self.unfinished_pool), truncated=truncated,
            unfinished_pool_size=len(self.unfinished_pool), experience_pool_size=len(self.experience_pool),
            decode_seconds=stats.decode_seconds, prefill_seconds=stats.prefill_seconds,
            slot_occupancy=stats.slot_occupancy, prefill_calls=stats.prefill_calls,
            prefill_rows=stats.prefill_rows, decode_devices=stats.decode_devices, preemptions=stats.preemptions,
            peak_pages=stats.peak_pages)
