"""Pallas attention kernels, imported as ``ulorl_jax.kernels``.

Never import this folder as a top-level ``kernels`` package: that name belongs
to a PyPI package which transformers imports when present.
"""

# Entry point models call.
from .dispatch import IMPLS, attention

# Pallas kernels.
from .decode_attention import decode_attention, default_decode_params
from .flash_attention import default_block_sizes, flash_attention

# Plain-jnp references the kernels are tested against.
from .reference import decode_attention_reference, mha_reference

__all__ = [
    "IMPLS",
    "attention",
    "decode_attention",
    "default_decode_params",
    "flash_attention",
    "default_block_sizes",
    "decode_attention_reference",
    "mha_reference",
]
