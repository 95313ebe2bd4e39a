"""Rollout: segment rollout (ULORL.md §1, paper Algorithm 1) over a decode engine.

`decode/` is a generic engine (prefill, insert, generate, KV cache, sampling) that knows nothing of
segments; this package holds what turns it into RL rollouts:

Segment rollout (rollout/segment.py)
    RolloutConfig, SegmentRollout, ExperiencePool, RolloutStepReport, sample_keys
    (the domain types Sample and PromptItem live in ulorl_jax.types)
Backends (rollout/backends.py)
    make_segment_rollout: our engine's loop or JetStream's orchestrator (`rollout.backend`)
Multi-process (rollout/distributed.py)
    DistributedRollout: each process decodes its share; ended samples are gathered
`ulorl generate` (rollout/generate.py): segment rollout with fixed weights.

Names resolve lazily, so `ulorl --help` (which imports rollout.generate) does not import jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "segment": ("RolloutConfig", "SegmentRollout", "ExperiencePool", "RolloutStepReport", "sample_keys"),
    "backends": ("make_segment_rollout",),
    "distributed": ("DistributedRollout",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"ulorl_jax.rollout.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ulorl_jax.rollout' has no attribute {name!r}")
