"""Step hooks: what runs after each RL step, every N steps (levanter-style).

The trainer's loop is rollout -> learner update -> hooks. A hook is `fn(trainer, metrics)` with a stage:
- "metrics": before the step's metrics are written; it may add to them (held-out eval, reward stats);
- "after": once they are written; it acts on the run (checkpoint, the non-finite guard, user code).
Hooks of a stage run in the order they were added; `every` = 0 disables one. The trainer's defaults
(`default_hooks`) are hooks like any other, so a user adds theirs with `Trainer.add_hook` without
forking the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

STAGES = ("metrics", "after")


@dataclasses.dataclass(frozen=True)
class StepHook:
    name: str
    every: int  # run after steps every, 2 * every, ...; 0 = never
    fn: Callable[[Any, dict], None]  # (trainer, metrics of the step)
    stage: str = "after"

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"hook {self.name!r}: stage={self.stage!r} is not one of {list(STAGES)}")
        if self.every < 0:
            raise ValueError(f"hook {self.name!r}: every={self.every} must be >= 0 (0 = never)")

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def run_hooks(hooks: list[StepHook], stage: str, trainer, step: int, metrics: dict) -> None:
    for hook in hooks:
        if hook.stage == stage and hook.due(step):
            hook.fn(trainer, metrics)


def default_hooks(cfg) -> list[StepHook]:
    """Held-out eval (trainer.eval_every), reward-scorer stats, the non-finite guard and checkpoints
    (checkpoint.save_every), in that order."""
    return [
        StepHook("eval", cfg.trainer.eval_every, lambda tr, m: m.update(tr.evaluate()), stage="metrics"),
        StepHook("reward_stats", 1, lambda tr, m: m.update(reward_stats=tr.scorer.stats.to_dict()),
                 stage="metrics"),
        StepHook("nonfinite_guard", 1, lambda tr, m: tr.stop_if_nonfinite(), stage="after"),
        StepHook("checkpoint", cfg.checkpoint.save_every, lambda tr, m: tr.save(), stage="after"),
    ]
