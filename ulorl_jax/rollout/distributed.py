"""Multi-process segment rollout: each process decodes its share of a step's prompts, ended samples are
gathered so every process feeds the learner the same global batch (`ulorl_jax/distributed.py` joins the
processes; this module is the rollout's part)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from ulorl_jax.distributed import allgather_json, shard_prompts
from ulorl_jax.rollout.segment import ExperiencePool, RolloutStepReport
from ulorl_jax.types import Sample


def merge_reports(parts: Sequence[dict], ended: list, experience_pool_size: int):
    """One RolloutStepReport for the whole step from every process's `report.metrics()`: counts summed,
    seconds the slowest process's, slot occupancy averaged."""
    total = lambda key: sum(p[key] for p in parts)  # noqa: E731
    return RolloutStepReport(
        ended=ended, tokens_decoded=total("tokens_decoded"), finished=total("finished"), carried=total("carried"),
        truncated=total("truncated"), unfinished_pool_size=total("unfinished_pool_size"),
        experience_pool_size=experience_pool_size, decode_seconds=max(p["decode_seconds"] for p in parts),
        prefill_seconds=max(p["prefill_seconds"] for p in parts),
        slot_occupancy=sum(p["slot_occupancy"] for p in parts) / len(parts),
        prefill_calls=total("prefill_calls"), prefill_rows=total("prefill_rows"),
        decode_devices=total("decode_devices"), preemptions=total("preemptions"),
        peak_pages=max(p["peak_pages"] for p in parts))


class DistributedRollout:
    """A `SegmentRollout` per process over a contiguous share of each step's prompts.

    `step(params, prompts, policy_version, rng, score=None)` takes the *global* prompt list (the
    same on every process), decodes this process's share, and returns a `RolloutStepReport` for
    the whole step: `ended` holds the samples that ended on any process (the same list everywhere,
    ordered by uid), the counts are summed over processes. uids follow the global prompt order,
    exactly as one process would number them, so tokens are independent of the process count.

    Pools: the unfinished pool is per process (a continued sample stays where its prompt was
    decoded); `experience_pool` is global (every process adds every ended sample), so the groups
    the trainer pops are the same everywhere. `step` and `state_dict` are collectives.
    """

    def __init__(self, rollout, process_index: int | None = None, process_count: int | None = None):
        self.rollout = rollout
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.next_uid = rollout.next_uid  # the global counter
        self.experience_pool = ExperiencePool(rollout.config.samples_per_prompt)

    @property
    def config(self):
        return self.rollout.config

    def step(self, params: Any, prompts: Sequence[Any], policy_version: int, rng: Any,
             score: Callable[[list], Any] | None = None):
        """One segment step over this process's share of `prompts`; `score(samples)` (e.g. the
        trainer's reward) runs on this process's ended samples before the gather, so each sample is
        scored once and every process sees the same `metadata` (rewards)."""
        n = self.rollout.config.samples_per_prompt
        start, mine = shard_prompts(prompts, self.process_index, self.process_count)
        self.rollout.next_uid = self.next_uid + start * n
        local = self.rollout.step(params, mine, policy_version, rng)
        self.next_uid += len(prompts) * n
        self.rollout.experience_pool.samples = []  # the global pool below holds them
        if score is not None:
            score(local.ended)
        parts = allgather_json({"ended": [s.to_dict() for s in local.ended], "report": local.metrics()})
        ended = sorted((Sample.from_dict(d) for p in parts for d in p["ended"]), key=lambda s: s.uid)
        self.experience_pool.add(ended)
        return merge_reports([p["report"] for p in parts], ended, len(self.experience_pool))

    # -- checkpointable state (SegmentRollout's keys, the unfinished pool per process) ---------

    def state_dict(self) -> dict:
        """A collective: `unfinished_pools[i]` is process i's unfinished pool."""
        return {"unfinished_pools": allgather_json([s.to_dict() for s in self.rollout.unfinished_pool]),
                "experience_pool": [s.to_dict() for s in self.experience_pool.samples],
                "next_uid": self.next_uid, "steps_done": self.rollout.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """Process i takes `unfinished_pools[i]`; a state saved by another number of processes is refused."""
        pools = state.get("unfinished_pools")
        saved = 1 if pools is None else len(pools)  # a one-process SegmentRollout state has "unfinished_pool"
        if saved != self.process_count:
            raise ValueError(f"the rollout state was saved by {saved} process(es) but this run has "
                             f"{self.process_count}: each process's unfinished pool resumes on the same process "
                             f"index, so resume with --num-processes {saved}")
        self.rollout.load_state_dict({"unfinished_pool": pools[self.process_index], "experience_pool": [],
                                      "next_uid": state["next_uid"], "steps_done": state["steps_done"]})
        self.experience_pool.samples = [Sample.from_dict(d) for d in state["experience_pool"]]
        self.next_uid = int(state["next_uid"])
