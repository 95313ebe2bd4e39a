"""UloRL learner: losses, advantages, log-probs, packing, the train step."""

# Policy loss (Eq. 10) and its DMMPT mask
# Token log-probs and entropy
from ulorl_jax.models.logprobs import (
    chunked_logprobs_and_entropy,
    full_logprobs_and_entropy,
    sample_mean_entropy,
)

# Advantages and dynamic sampling
from ulorl_jax.rl.advantages import (
    DynamicSamplingReport,
    dynamic_sampling_keep,
    dynamic_sampling_report,
    grpo_advantages,
    grpo_advantages_host,
)
from ulorl_jax.rl.kl import KL_TYPES, kl_penalty

# The train step and the learner
from ulorl_jax.rl.learner import Learner, LearnerConfig, make_optimizer, policy_forward

# Importance sampling under segments
from ulorl_jax.rl.losses import (
    ENTROPY_MODES,
    IS_MODES,
    LOSS_AGG_MODES,
    MASK_MODES,
    logprob_mismatch,
    logprob_mismatch_sums,
    loss_mask,
    low_entropy_samples,
    mpt_mask,
    old_logprobs_for,
    token_policy_loss,
    validate_loss_inputs,
    weighted_policy_loss,
)

# Sequence packing
from ulorl_jax.rl.packing import (
    PackedBatch,
    TrainSample,
    loss_weights,
    pack_samples,
    unpack_tokens,
)

# Baselines: verl's policy-loss family and agg_loss modes, rollout correction, DAPO's overlong buffer
from ulorl_jax.rl.policy_losses import (
    POLICY_LOSSES,
    PolicyLossParams,
    aggregation_weights,
    policy_token_losses,
)
from ulorl_jax.rl.reward_shaping import overlong_penalty, shaped_rewards
from ulorl_jax.rl.rollout_correction import rollout_is_weights, rollout_rejection_keep

__all__ = [
    "ENTROPY_MODES",
    "IS_MODES",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "MASK_MODES",
    "POLICY_LOSSES",
    "DynamicSamplingReport",
    "Learner",
    "LearnerConfig",
    "PackedBatch",
    "PolicyLossParams",
    "TrainSample",
    "aggregation_weights",
    "chunked_logprobs_and_entropy",
    "dynamic_sampling_keep",
    "dynamic_sampling_report",
    "full_logprobs_and_entropy",
    "grpo_advantages",
    "grpo_advantages_host",
    "kl_penalty",
    "logprob_mismatch",
    "logprob_mismatch_sums",
    "loss_mask",
    "loss_weights",
    "low_entropy_samples",
    "make_optimizer",
    "mpt_mask",
    "old_logprobs_for",
    "overlong_penalty",
    "pack_samples",
    "policy_forward",
    "policy_token_losses",
    "rollout_is_weights",
    "rollout_rejection_keep",
    "sample_mean_entropy",
    "shaped_rewards",
    "token_policy_loss",
    "unpack_tokens",
    "validate_loss_inputs",
    "weighted_policy_loss",
]
