"""Qwen3 / Qwen3-MoE policy models and Hugging Face interop."""

# Configuration
from ulorl_jax.models.config import ConfigError, ModelConfig, tiny_config

# Model
from ulorl_jax.models.qwen3 import ForwardOutput, KVCache, Qwen3ForCausalLM, init_model, init_sharded

__all__ = [
    "ConfigError",
    "ModelConfig",
    "tiny_config",
    "ForwardOutput",
    "KVCache",
    "Qwen3ForCausalLM",
    "init_model",
    "init_sharded",
]
