"""Logits parity with transformers' PyTorch Qwen3 / Qwen3-MoE (float32, max abs diff <= 1e-4)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_utils import hf_logits, random_tokens, save_hf_model
from ulorl_jax.models import qwen3
from ulorl_jax.models.hf import from_pretrained

ATOL = 1e-4

CASES = {
    "dense": ("qwen3", {}),
    "moe": ("qwen3_moe", {}),
    "moe-no-renorm": ("qwen3_moe", {"norm_topk_prob": False}),
    "moe-mlp-only-sparse-step-2": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [0],
                                                   "decoder_sparse_step": 2}),
    "gqa-1": ("qwen3", {"num_key_value_heads": 4}),
    "gqa-2": ("qwen3", {"num_key_value_heads": 2}),
    "gqa-4": ("qwen3", {"num_key_value_heads": 1}),
    "tied-embeddings": ("qwen3", {"tie_word_embeddings": True}),
    "yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32}}),
    "moe-yarn": ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 1.5, "rope_theta": 1e6,
                                                    "original_max_position_embeddings": 16}}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(model_type, folder, **overrides)
    model = from_pretrained(folder)
    forward = nnx.jit(lambda m, tokens, **kw: m(tokens, **kw))  # one compile per shape, not per op
    return request.param, hf, lambda tokens, **kw: forward(model, tokens, **kw)


def test_logits_match_transformers(pair):
    name, hf, ours = pair
    tokens = random_tokens(3, 70 if "yarn" in name else 13)  # yarn: run past the original window
    expected = hf_logits(hf, tokens)
    got = np.asarray(ours(jnp.asarray(tokens)))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_logits_in_pieces_match_transformers(pair, monkeypatch):
    """On CPU, more than CPU_LOGITS_PIECE positions take the logits in pieces of the token axis (here 6,
    6 and 5 of 17): the concatenation must equal transformers' one matmul."""
    name, hf, ours = pair
    monkeypatch.setattr(qwen3, "CPU_LOGITS_PIECE", 24)  # read at trace time; 4 x 17 is a new shape
    tokens = random_tokens(4, 17)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_transformers_and_unpadded(pair, side):
    _, hf, ours = pair
    lengths = [9, 5, 1]
    t = max(lengths)
    tokens = random_tokens(len(lengths), t, seed=1)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, t - n:] = 1
        else:
            mask[i, :n] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    expected = hf_logits(hf, tokens, attention_mask=mask, position_ids=positions)
    got = np.asarray(ours(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], atol=ATOL, rtol=0)
    for i in range(len(lengths)):  # each padded row equals the sample run alone
        alone = np.asarray(ours(jnp.asarray(tokens[i:i + 1, real[i]])))[0]
        np.testing.assert_allclose(got[i, real[i]], alone, atol=ATOL, rtol=0)


def test_packed_rows_equal_separate_runs(pair):
    _, _, ours = pair
    lengths = [4, 7, 3]
    samples = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    pad = 2
    row = np.concatenate(samples + [np.zeros(pad, np.int32)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])[None]
    packed = np.asarray(ours(jnp.asarray(row), segment_ids=jnp.asarray(segments, jnp.int32)))[0]
    start = 0
    for s in samples:
        alone = np.asarray(ours(jnp.asarray(s[None])))[0]
        np.testing.assert_allclose(packed[start:start + len(s)], alone, atol=ATOL, rtol=0)
        start += len(s)
