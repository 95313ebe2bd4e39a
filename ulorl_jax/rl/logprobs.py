"""Teacher-forced log-probs and entropy: moved to `ulorl_jax.models.logprobs` (the decode engine's
JetStream backend scores with them too, and decode must not depend on the learner's package). This
path stays for code that imported it."""

from ulorl_jax.models.logprobs import (  # noqa: F401
    chunked_logprobs_and_entropy,
    full_logprobs_and_entropy,
    sample_mean_entropy,
)
