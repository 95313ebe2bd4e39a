"""Flash-decoding kernel vs the jnp reference (CPU interpret mode).

Tolerances (max abs error, inputs ~N(0, 1)): f32 2e-5; bf16 kernel vs the f32
reference on the same values 2e-2 (p is rounded to bf16 before p @ V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.kernels import decode_attention
from ulorl_jax.kernels import decode_attention_reference as _reference

INTERPRET = jax.default_backend() == "cpu"  # compiled on a GPU: run with JAX_PLATFORMS=cuda (conftest defaults to cpu)
# Jitted: the op-by-op eager reference compiles slower than one jit.
decode_attention_reference = jax.jit(_reference)


def _inputs(seed, b, s, hq, hkv, d, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32).astype(dtype)
    return q, k, v


# S = 96, block_k = 16, 3 splits -> each chunk is 32 keys (2 blocks).
# 1: a single key; 17: one past a block edge; 33: one past the first chunk
# edge; 64: exactly two chunks; 96: full cache.
LENGTHS = [1, 17, 33, 64, 96]


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_f32_lengths_gqa(ratio):
    q, k, v = _inputs(ratio, len(LENGTHS), 96, 2 * ratio, 2, 16)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    o = decode_attention(q, k, v, lengths, num_splits=3, block_k=16, interpret=INTERPRET)
    o_ref = decode_attention_reference(q, k, v, lengths)
    assert o.shape == q.shape and o.dtype == q.dtype
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=1e-5)


def test_ragged_cache_and_zero_length():
    # S = 90 is not a multiple of block_k (cache padded inside); D = 24 padded;
    # length 0 gives 0; more splits than blocks get capped.
    q, k, v = _inputs(7, 4, 90, 4, 2, 24)
    lengths = jnp.asarray([0, 1, 89, 90], jnp.int32)
    o = decode_attention(q, k, v, lengths, num_splits=16, block_k=16, interpret=INTERPRET)
    np.testing.assert_allclose(o, decode_attention_reference(q, k, v, lengths),
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(o[0], 0.0)


def test_bf16():
    q, k, v = _inputs(8, len(LENGTHS), 96, 8, 2, 32, jnp.bfloat16)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    o = decode_attention(q, k, v, lengths, num_splits=3, block_k=16, interpret=INTERPRET)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    o_ref = decode_attention_reference(f32(q), f32(k), f32(v), lengths)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(o), o_ref, atol=2e-2, rtol=2e-2)


def test_default_params_and_matches_last_row_of_causal_attention():
    # Decoding token t against the cache equals row t of causal attention.
    q, k, v = _inputs(9, 2, 64, 4, 2, 16)
    lengths = jnp.asarray([40, 64], jnp.int32)
    o = decode_attention(q, k, v, lengths, interpret=INTERPRET)
    np.testing.assert_allclose(o, decode_attention_reference(q, k, v, lengths),
                               atol=2e-5, rtol=1e-5)


def test_segment_ids_mask_left_padding():
    # Slot b: cache entries with kv segment != the query's segment are invisible
    # (the model's left padding is segment 0); one row sees a single entry.
    q, k, v = _inputs(10, 3, 80, 4, 2, 16)
    lengths = jnp.asarray([80, 41, 17], jnp.int32)
    kv_seg = np.ones((3, 80), np.int32)
    kv_seg[0, :37] = 0  # 37 slots of left padding
    kv_seg[1, :5] = 0
    kv_seg[1, 20:30] = 2  # another segment inside the window
    kv_seg[2, :16] = 0  # only slot 16 is visible
    kv_seg = jnp.asarray(kv_seg)
    q_seg = jnp.asarray([1, 1, 1], jnp.int32)
    o = decode_attention(q, k, v, lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                         num_splits=3, block_k=16, interpret=INTERPRET)
    o_ref = decode_attention_reference(q, k, v, lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=1e-5)
    # Independent check of the masking rule: slot 2 sees only entry 16, so it
    # returns v[2, 16] of its kv head; and padding does change the result.
    np.testing.assert_allclose(o[2], jnp.repeat(v[2, 16], 2, axis=0), atol=1e-6)
    unmasked = decode_attention_reference(q, k, v, lengths)
    assert float(jnp.max(jnp.abs(unmasked[0] - o_ref[0]))) > 1e-2
