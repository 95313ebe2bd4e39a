"""Model configuration: one dataclass for Qwen3 dense and Qwen3-MoE.

Field names follow Hugging Face's `config.json` so a reader can map them one to
one; runtime choices (dtypes, attention and MoE implementations) sit beside them.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
ATTENTION_IMPLS = ("xla", "blockwise", "cudnn", "pallas")
MOE_IMPLS = ("ragged", "dense", "pallas")
EXPERT_LAYOUTS = ("per_expert", "fused")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def resolve_dtype(name: str | Any, *, option: str = "dtype") -> Any:
    """'float32' / 'bfloat16' / 'float16' (or a jnp dtype) -> jnp dtype."""
    if not isinstance(name, str):
        return jnp.dtype(name).type
    if name not in _DTYPES:
        raise ConfigError(f"{option}={name!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _closest(name: str, choices) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # None, or HF's rope parameters without rope_theta, e.g.
    # {"rope_type": "yarn", "factor": 1.5, "original_max_position_embeddings": 32768}.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    # Qwen3-MoE only.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # Token ids copied through to exported config.json.
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Runtime choices (not part of the checkpoint).
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of activations
    attention_impl: str = "blockwise"  # xla (materialised reference) | blockwise | cudnn | pallas
    moe_impl: str = "ragged"
    # Expert tensor layout used when writing an HF checkpoint (kept from the source).
    expert_layout: str = "per_expert"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        for name, allowed in (
            ("attention_impl", ATTENTION_IMPLS),
            ("moe_impl", MOE_IMPLS),
            ("expert_layout", EXPERT_LAYOUTS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")
        resolve_dtype(self.param_dtype, option="param_dtype")
        resolve_dtype(self.dtype, option="dtype")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be positive")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe" and self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen3MoeDecoderLayer."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes) -> "ModelConfig":
        unknown = [k for k in changes if k not in {f.name for f in dataclasses.fields(self)}]
        if unknown:
            raise ConfigError(f"unknown model option {unknown[0]!r}{_closest(unknown[0], self.field_names())}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    # --- Hugging Face config.json <-> ModelConfig -------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict, **runtime) -> "ModelConfig":
        """Parse an HF `config.json` dict (transformers 4.x or 5.x key styles)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json model_type={model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
        if hf.get("attention_bias", False):
            raise ConfigError("config.json attention_bias=true is not supported (Qwen3 has no attention bias)")
        if hf.get("use_sliding_window", False):
            raise ConfigError("config.json use_sliding_window=true is not supported")
        # transformers 5 keeps rope_theta inside rope_parameters; 4.x has it top level
        # with an optional rope_scaling dict.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {**legacy, **rope}
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "default":
            scaling = None
        elif rope_type != "yarn":
            raise ConfigError(f"config.json rope_type={rope_type!r}: only 'default' and 'yarn' are supported")
        num_heads = hf["num_attention_heads"]
        kwargs = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        if model_type == "qwen3_moe":
            kwargs.update(
                num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
                num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                norm_topk_prob=hf.get("norm_topk_prob", False),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
            )
        return cls(**kwargs, **runtime)

    def to_hf_config(self):
        """A transformers config object (Qwen3Config or Qwen3MoeConfig) for this model."""
        import transformers

        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.model_type == "qwen3":
            cfg = transformers.Qwen3Config(**common)
        else:
            cfg = transformers.Qwen3MoeConfig(
                **common,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        cfg.dtype = self.param_dtype
        # AutoModelForCausalLM picks the class by model_type; other tools (vLLM, SGLang, the hub) read this.
        cfg.architectures = ["Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen3MoeForCausalLM"]
        return cfg


def tiny_config(model_type: str = "qwen3_moe", **overrides) -> ModelConfig:
    """A few-thousand-parameter config for tests and the CPU demo."""
    base = dict(
        model_type=model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    )
    if model_type == "qwen3_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    base.update(overrides)
    return ModelConfig(**base)
