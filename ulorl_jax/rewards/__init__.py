"""Rewards for UloRL (ULORL.md §4): 1 iff the final answer matches the reference, never a dead run."""

# Batch scoring (what the trainer calls)
from ulorl_jax.rewards.scorer import EXTRACTIONS, REWARD_KINDS, RewardConfig, RewardScorer, RewardStats, as_reward

# Answer extraction and equivalence
from ulorl_jax.rewards.equivalence import (
    MathVerifyOptions,
    answers_equivalent,
    math_verify_equivalence,
    math_verify_response_equivalence,
    normalize_answer,
    parse_number,
    quick_equivalence,
)
from ulorl_jax.rewards.extract import extract_answer, last_boxed
from ulorl_jax.rewards.rule import reference_answer, rule_reward

# Generative verifier (a judge model on the decode engine)
from ulorl_jax.rewards.verifier import (
    VERIFIER_TEMPLATE,
    GenerativeVerifier,
    VerifierConfig,
    parse_verdict,
    verifier_prompt,
)

# Sandboxed calls (timeouts, crash containment, custom functions by import path)
from ulorl_jax.rewards.sandbox import Outcome, SandboxPool, resolve_function

__all__ = [
    "EXTRACTIONS",
    "REWARD_KINDS",
    "RewardConfig",
    "RewardScorer",
    "RewardStats",
    "as_reward",
    "MathVerifyOptions",
    "answers_equivalent",
    "math_verify_equivalence",
    "math_verify_response_equivalence",
    "normalize_answer",
    "parse_number",
    "quick_equivalence",
    "extract_answer",
    "last_boxed",
    "reference_answer",
    "rule_reward",
    "VERIFIER_TEMPLATE",
    "GenerativeVerifier",
    "VerifierConfig",
    "parse_verdict",
    "verifier_prompt",
    "Outcome",
    "SandboxPool",
    "resolve_function",
]
