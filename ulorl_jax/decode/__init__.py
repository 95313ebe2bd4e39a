"""Decoding: sampling, the JetStream-shaped PolicyEngine, and segment rollout (ULORL.md §1).

Sampling (decode/sampling.py)
    SamplingParams, TRAIN_SAMPLING, EVAL_SAMPLING, GREEDY, sample_tokens, filter_logits
Engine, JetStream Engine API (decode/engine.py)
    PolicyEngine, DecodeState, Prefix, ResultTokens, SlotData, StepsOutput, Request, Completion, RunStats,
    register_as_jetstream_engine
Segment rollout (decode/segment.py)
    Sample, PromptItem, RolloutConfig, SegmentRollout, ExperiencePool, RolloutStepReport

Names resolve lazily, so `ulorl --help` (which imports decode.generate) does not import jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "sampling": ("SamplingParams", "TRAIN_SAMPLING", "EVAL_SAMPLING", "GREEDY", "sample_tokens", "filter_logits"),
    "engine": ("PolicyEngine", "DecodeState", "Prefix", "ResultTokens", "SlotData", "StepsOutput", "Request",
               "Completion", "RunStats", "register_as_jetstream_engine"),
    "segment": ("Sample", "PromptItem", "RolloutConfig", "SegmentRollout", "ExperiencePool", "RolloutStepReport"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"ulorl_jax.decode.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ulorl_jax.decode' has no attribute {name!r}")
