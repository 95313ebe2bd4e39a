"""Pallas kernels (attention, decode attention, MoE grouped matmul), imported
as ``ulorl_jax.kernels``.

Never import this folder as a top-level ``kernels`` package: that name belongs
to a PyPI package which transformers imports when present.
"""

# Entry points models call.
from .dispatch import GMM_IMPLS, IMPLS, attention, decode, gmm, paged_decode
from .moe import grouped_matmul_experts

# Pallas kernels.
from .decode_attention import decode_attention, default_decode_params
from .flash_attention import default_block_sizes, flash_attention
from .grouped_matmul import default_gmm_block_sizes, grouped_matmul
from .paged_decode_attention import default_paged_decode_params, paged_decode_attention

# TPU routes (JAX's splash attention / megablox, imported lazily) and the
# platform query the dispatchers use (tests replace it).
from . import platform, tpu

# Plain-jnp references the kernels are tested against.
from .reference import (
    decode_attention_reference,
    mha_reference,
    paged_decode_attention_reference,
)

__all__ = [
    "IMPLS",
    "GMM_IMPLS",
    "attention",
    "decode",
    "paged_decode",
    "gmm",
    "grouped_matmul_experts",
    "grouped_matmul",
    "default_gmm_block_sizes",
    "platform",
    "tpu",
    "decode_attention",
    "default_decode_params",
    "paged_decode_attention",
    "default_paged_decode_params",
    "flash_attention",
    "default_block_sizes",
    "decode_attention_reference",
    "paged_decode_attention_reference",
    "mha_reference",
]
