"""A model's shape for analytic cost figures: parameter counts (total and active per token), KV-cache
bytes per token and attention FLOPs. `ulorl plan` and the segment-rollout cost model
(bench/segment_cost.py) both use it."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int  # 0 = dense
    top_k: int
    expert_mlp: int
    dense_mlp: int
    tied: bool = False

    @classmethod
    def from_model_config(cls, name: str, c) -> "ModelShape":
        return cls(name, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                   c.head_dim, c.vocab_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   c.intermediate_size, c.tie_word_embeddings)

    def _attn(self) -> int:
        d, h, k, dh = self.hidden, self.heads, self.kv_heads, self.head_dim
        return d * h * dh * 2 + d * k * dh * 2

    def params(self) -> tuple[float, float]:
        """(total, active per token) parameter counts."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        if self.experts:
            mlp_total = self.experts * 3 * self.hidden * self.expert_mlp + self.hidden * self.experts
            mlp_active = self.top_k * 3 * self.hidden * self.expert_mlp + self.hidden * self.experts
        else:
            mlp_total = mlp_active = 3 * self.hidden * self.dense_mlp
        return (emb + self.layers * (self._attn() + mlp_total), emb + self.layers * (self._attn() + mlp_active))

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * bytes_per_value

    def attention_flops(self, context: np.ndarray) -> np.ndarray:
        """Forward attention FLOPs of one new token against `context` keys (QK^T and PV)."""
        return 4.0 * self.layers * self.heads * self.head_dim * context
