"""Tiny random Hugging Face Qwen3 / Qwen3-MoE models, built offline for tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def hf_config(model_type: str = "qwen3", **overrides):
    kwargs = {**TINY, **(TINY_MOE if model_type == "qwen3_moe" else {}), **overrides}
    cls = transformers.Qwen3Config if model_type == "qwen3" else transformers.Qwen3MoeConfig
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def make_hf_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    """A float32 HF model with random (non-trivial) weights, norms included."""
    torch.manual_seed(seed)
    cls = transformers.Qwen3ForCausalLM if model_type == "qwen3" else transformers.Qwen3MoeForCausalLM
    model = cls(hf_config(model_type, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def save_hf_model(model_type: str, folder, **kwargs):
    model = make_hf_model(model_type, **kwargs)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: np.ndarray, attention_mask=None, position_ids=None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long),
            attention_mask=None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask)),
            position_ids=None if position_ids is None else torch.as_tensor(np.asarray(position_ids)),
        )
    return out.logits.float().numpy()


def random_tokens(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int32)
