"""UloRL learner: losses, advantages, log-probs, packing, the train step."""

# Policy loss (Eq. 10) and its DMMPT mask
from ulorl_jax.rl.losses import (
    ENTROPY_MODES,
    IS_MODES,
    LOSS_AGG_MODES,
    MASK_MODES,
    loss_mask,
    low_entropy_samples,
    mpt_mask,
    token_policy_loss,
    validate_loss_inputs,
    weighted_policy_loss,
)

# Importance sampling under segments
from ulorl_jax.rl.losses import logprob_mismatch, logprob_mismatch_sums, old_logprobs_for

# Advantages and dynamic sampling
from ulorl_jax.rl.advantages import (
    DynamicSamplingReport,
    dynamic_sampling_keep,
    dynamic_sampling_report,
    grpo_advantages,
    grpo_advantages_host,
)

# Token log-probs and entropy
from ulorl_jax.models.logprobs import (
    chunked_logprobs_and_entropy,
    full_logprobs_and_entropy,
    sample_mean_entropy,
)

# Sequence packing
from ulorl_jax.rl.packing import PackedBatch, TrainSample, loss_weights, pack_samples, unpack_tokens

# The train step and the learner
from ulorl_jax.rl.learner import Learner, LearnerConfig, make_optimizer, policy_forward

__all__ = [
    "ENTROPY_MODES",
    "IS_MODES",
    "LOSS_AGG_MODES",
    "MASK_MODES",
    "loss_mask",
    "low_entropy_samples",
    "mpt_mask",
    "token_policy_loss",
    "validate_loss_inputs",
    "weighted_policy_loss",
    "logprob_mismatch",
    "logprob_mismatch_sums",
    "old_logprobs_for",
    "DynamicSamplingReport",
    "dynamic_sampling_keep",
    "dynamic_sampling_report",
    "grpo_advantages",
    "grpo_advantages_host",
    "chunked_logprobs_and_entropy",
    "full_logprobs_and_entropy",
    "sample_mean_entropy",
    "PackedBatch",
    "TrainSample",
    "loss_weights",
    "pack_samples",
    "unpack_tokens",
    "Learner",
    "LearnerConfig",
    "make_optimizer",
    "policy_forward",
]
