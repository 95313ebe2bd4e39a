"""The allowed values of every option, defined once and keyed by its YAML name (`algorithm.sigma`).

The run config (`config.validate`) and the parts that take an option directly (`LearnerConfig`, which the
benchmarks and tests build without a YAML) check a value with `check_option`, so a bound is written once
and both say the same thing about a bad value: `algorithm.sigma=0.0: expected a target entropy > 0`.
Cross-field rules (a divisor of, at least the sum of) stay in `config.validate`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

from ulorl_jax import choices
from ulorl_jax.models.config import ATTENTION_IMPLS, MOE_IMPLS, ConfigError

__all__ = ["CHOICES", "RANGES", "check_option"]

# Enum-like string options (each list defined once: choices.py, models/config.py).
CHOICES: dict[str, tuple[str, ...]] = {
    "model.attention_impl": ATTENTION_IMPLS,
    "model.moe_impl": MOE_IMPLS,
    "model.dtype": choices.DTYPES,
    "model.param_dtype": choices.DTYPES,
    "data.on_bad_row": choices.ON_BAD_ROW,
    "rollout.backend": choices.ROLLOUT_BACKENDS,
    "rollout.decode_mesh": choices.DECODE_MESHES,
    "rollout.kv_cache": choices.KV_CACHES,
    "rollout.preemption": choices.PREEMPTIONS,
    "algorithm.is_mode": choices.IS_MODES,
    "algorithm.mask_mode": choices.MASK_MODES,
    "algorithm.entropy_mode": choices.ENTROPY_MODES,
    "algorithm.loss_agg_mode": choices.LOSS_AGG_MODES,
    "algorithm.loss_mode": choices.POLICY_LOSS_MODES,  # verl: actor.policy_loss.loss_mode
    "trainer.remat": choices.REMAT,  # the YAML also takes true / false (config.remat_policy)
    "reward.kind": choices.REWARD_KINDS,
    "reward.extraction": choices.EXTRACTIONS,
    "reward.fallback_mode": choices.MV_FALLBACK_MODES,  # math-verify's parse() options, by its names
    "reward.extraction_mode": choices.MV_EXTRACTION_MODES,
    "checkpoint.on_save_error": choices.ON_SAVE_ERROR,
}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _at_least(lo, what: str = "") -> tuple[Callable[[Any], bool], str]:
    return (lambda v: _finite(v) and v >= lo), f">= {lo}{what}"


def _optional(check: tuple[Callable[[Any], bool], str], none: str = "null") -> tuple[Callable[[Any], bool], str]:
    ok, want = check
    return (lambda v: v is None or ok(v)), f"{want} or {none}"


_POSITIVE = (lambda v: _finite(v) and v > 0), "> 0"
_COUNT = _at_least(1)
_BOOL = (lambda v: isinstance(v, bool)), "true or false"


def _integer_at_least(lo: int, what: str = "") -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo), f"an integer >= {lo}{what}"


# Numeric options: key -> (predicate, what is expected).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "algorithm.tau": ((lambda v: _finite(v) and 0 < v <= 1), "a probability in (0, 1]"),
    "algorithm.sigma": ((lambda v: _finite(v) and v > 0), "a target entropy > 0"),
    "algorithm.clip_ratio_low": ((lambda v: _finite(v) and 0 <= v < 1), "a value in [0, 1)"),
    "algorithm.clip_ratio_high": _at_least(0),
    "algorithm.entropy_coeff": (_finite, "a finite number"),
    "algorithm.aux_loss_coef": _at_least(0),
    # verl's names (actor.clip_ratio_c, actor.loss_scale_factor, actor.tau_pos / tau_neg)
    "algorithm.clip_ratio_c": _optional(((lambda v: _finite(v) and v > 1), "> 1 (dual-clip)"), "null (off)"),
    "algorithm.loss_scale_factor": _optional(_POSITIVE, "null (rollout.global_max_len)"),
    "algorithm.tau_pos": _POSITIVE,
    "algorithm.tau_neg": _POSITIVE,
    "optim.lr": _POSITIVE,
    "optim.warmup_steps": _at_least(0),
    "optim.weight_decay": _at_least(0),
    "optim.grad_clip": _optional(_POSITIVE, "null (off)"),
    "optim.betas": ((lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                     and all(_finite(b) and 0 <= b < 1 for b in v)), "two values in [0, 1)"),
    "optim.eps": _POSITIVE,
    "trainer.ppo_mini_batch_size": _optional(_COUNT, "null (all samples)"),
    "trainer.ppo_epochs": _COUNT,
    "trainer.micro_batch_rows": _COUNT,
    "trainer.row_len": _optional(_at_least(2), "null (max_prompt_len + global_max_len)"),
    "trainer.logprob_chunk": _COUNT,
    "rollout.temperature": _at_least(0, " (0 = greedy)"),
    "rollout.page_size": _COUNT,
    "rollout.kv_pages": _optional(_COUNT, "null (the dense cache's memory)"),
    # math-verify's own verify() / parse() options (rewards/equivalence.py MathVerifyOptions)
    "reward.float_rounding": _integer_at_least(0, " (decimal places)"),
    "reward.numeric_precision": _integer_at_least(1, " (significant digits)"),
    "reward.strict": _BOOL,
    "reward.allow_set_relation_comp": _BOOL,
    "reward.extraction_config": ((lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                                  and all(isinstance(t, str) and t in choices.MV_EXTRACTION_TARGETS for t in v)
                                  and len(set(v)) == len(v)),
                                 f"a non-empty list of distinct targets from {list(choices.MV_EXTRACTION_TARGETS)}"),
    "reward.boxed_match_priority": _integer_at_least(-1, " (-1 = off)"),
    "reward.try_extract_without_anchor": _BOOL,
    # DAPO's overlong buffer, verl's reward_model.overlong_buffer (rl/reward_shaping.py)
    "reward.overlong_buffer.enable": _BOOL,
    "reward.overlong_buffer.len": _integer_at_least(0, " (tokens)"),
    "reward.overlong_buffer.penalty_factor": _at_least(0),
    "reward.overlong_buffer.log": _BOOL,
}


def check_option(key: str, value: Any) -> None:
    """Raise ConfigError naming `key`, `value` and what is expected, if `value` is not allowed for `key`."""
    if key in CHOICES:
        allowed = CHOICES[key]
        if value not in allowed:
            match = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise ConfigError(f"{key}={value!r}: expected one of {list(allowed)}{hint}")
    elif key in RANGES:
        ok, want = RANGES[key]
        if not ok(value):
            raise ConfigError(f"{key}={value!r}: expected {want}")
    else:
        raise KeyError(f"no bounds are defined for option {key!r}")
