"""Decoding: sampling and the JetStream-shaped PolicyEngine. Knows nothing of segments or learning:
segment rollout (Algorithm 1) is `ulorl_jax.rollout`.

Sampling (decode/sampling.py)
    SamplingParams, TRAIN_SAMPLING, EVAL_SAMPLING, GREEDY, sample_tokens, filter_logits
Engine, JetStream Engine API (decode/engine.py)
    PolicyEngine, DecodeState, Prefix, ResultTokens, SlotData, StepsOutput, Request, Completion, RunStats,
    register_as_jetstream_engine
`ulorl serve` (decode/serve.py), JetStream's orchestrator over the engine (decode/jetstream_backend.py).

Names resolve lazily, so `ulorl --help` (which imports decode.serve) does not import jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "sampling": ("SamplingParams", "TRAIN_SAMPLING", "EVAL_SAMPLING", "GREEDY", "sample_tokens", "filter_logits"),
    "engine": ("PolicyEngine", "DecodeState", "Prefix", "ResultTokens", "SlotData", "StepsOutput", "Request",
               "Completion", "RunStats", "register_as_jetstream_engine"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"ulorl_jax.decode.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ulorl_jax.decode' has no attribute {name!r}")
