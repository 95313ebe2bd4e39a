"""Which decoder a segment rollout drives: our engine's own loop, or JetStream's orchestrator over it.

Both have `PolicyEngine.run`'s contract, so `SegmentRollout` (Algorithm 1) is the same code over either;
this is the one place that picks (config key `rollout.backend`)."""

from __future__ import annotations

from ulorl_jax.choices import ROLLOUT_BACKENDS
from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout


def make_segment_rollout(engine: PolicyEngine, config: RolloutConfig, *, rollout_backend: str = "engine",
                         seed: int = 0, **kwargs) -> SegmentRollout:
    """SegmentRollout over our in-process loop ("engine") or JetStream's orchestrator ("jetstream");
    `kwargs` go to SegmentRollout (length_oracle, steps_per_call, on_tokens)."""
    if rollout_backend == "engine":
        return SegmentRollout(engine, config, **kwargs)
    if rollout_backend == "jetstream":
        from ulorl_jax.decode.jetstream_backend import JetStreamRunner, import_jetstream

        import_jetstream()  # fail now, with the install hint, rather than mid-step
        return SegmentRollout(JetStreamRunner(engine, seed=seed), config, **kwargs)
    raise ValueError(f"rollout_backend={rollout_backend!r}; choose one of {ROLLOUT_BACKENDS}")
