"""Blockwise attention (models/blockwise_attention.py) == the materialised reference (`xla_attention`),
forward and gradients, on packed ragged rows, padding, GQA, lengths not divisible by the blocks and a
prefill into a cache; and its memory grows linearly with the row length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.models.attention import AttentionMask, get_attention_impl, xla_attention
from ulorl_jax.models.blockwise_attention import blockwise_attention


def _inputs(b, tq, tk, hq, hkv, d, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype)
    return q, k, v


def _packed_mask(b, t, seed=0):
    """Rows packed with ragged segments (ids 1, 2, ...) and trailing padding (id 0)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, sid = 0, 1
        while pos < t - 10:
            n = int(rng.integers(5, t // 2))
            seg[row, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    seg = jnp.asarray(seg)
    return AttentionMask(seg, seg, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))


def _check(q, k, v, mask, block_q, block_k, atol):
    ref = xla_attention(q, k, v, mask)
    got = blockwise_attention(q, k, v, mask, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=atol)
    w = jnp.asarray(np.random.default_rng(9).normal(size=ref.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    want = jax.grad(loss(lambda *a: xla_attention(*a, mask)), argnums=(0, 1, 2))(q, k, v)
    have = jax.grad(loss(lambda *a: blockwise_attention(*a, mask, block_q=block_q, block_k=block_k)),
                    argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", want, have):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), atol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("t,block_q,block_k", [(200, 64, 48), (256, 32, 64), (130, 64, 64)])
def test_packed_ragged_rows_forward_and_grads(t, block_q, block_k):
    q, k, v = _inputs(2, t, t, 4, 2, 16, seed=t)  # GQA 2
    _check(q, k, v, _packed_mask(2, t, seed=t), block_q, block_k, atol=2e-5)


def test_bf16_inputs():
    q, k, v = _inputs(1, 160, 160, 8, 2, 32, seed=3, dtype=jnp.bfloat16)  # GQA 4
    _check(q, k, v, _packed_mask(1, 160, seed=3), 32, 32, atol=3e-2)


def test_prefill_into_a_cache():
    """Queries at cache slots 40..139 of a 180-slot cache (not self-attention): causal in cache order."""
    b, tq, tk = 2, 100, 180
    q, k, v = _inputs(b, tq, tk, 4, 1, 16, seed=5)
    kv_seg = np.ones((b, tk), np.int32)
    kv_seg[:, 140:] = 0  # empty cache slots
    kv_seg[1, :10] = 0  # left padding of the second slot
    mask = AttentionMask(jnp.ones((b, tq), jnp.int32), jnp.asarray(kv_seg),
                         jnp.broadcast_to(jnp.arange(40, 40 + tq, dtype=jnp.int32), (b, tq)), is_self_attention=False)
    _check(q, k, v, mask, 32, 48, atol=2e-5)


def test_short_calls_take_the_reference_path():
    q, k, v = _inputs(2, 1, 50, 4, 2, 16)
    mask = AttentionMask(jnp.ones((2, 1), jnp.int32), jnp.ones((2, 50), jnp.int32),
                         jnp.full((2, 1), 49, jnp.int32), is_self_attention=False)
    np.testing.assert_array_equal(np.asarray(blockwise_attention(q, k, v, mask)), np.asarray(xla_attention(q, k, v, mask)))
    assert get_attention_impl("blockwise") is not get_attention_impl("xla")


def _temp_bytes(fn, t):
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, t, 4, 32), (1, t, 2, 32), (1, t, 2, 32)))
    mask = AttentionMask(jnp.ones((1, t), jnp.int32), jnp.ones((1, t), jnp.int32),
                         jnp.arange(t, dtype=jnp.int32)[None])
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask) ** 2), argnums=(0, 1, 2)))
    return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_the_row():
    """Forward + backward temp memory at 1k and 4k tokens: x4 for blockwise (O(T x block)), x16 for the
    materialised reference (O(T^2))."""
    small, large = _temp_bytes(blockwise_attention, 1024), _temp_bytes(blockwise_attention, 4096)
    ref_small, ref_large = _temp_bytes(xla_attention, 1024), _temp_bytes(xla_attention, 4096)
    assert large / small < 6, (small, large)
    assert ref_large / ref_small > 12, (ref_small, ref_large)  # the check can tell the two apart
    assert large < ref_large / 10


def _scanned_layers_temp_bytes(t: int) -> int:
    """Temp bytes of the gradient of 2 scanned 'layers' (x -> x + attention(x W)) over one packed row whose
    segment ids and positions are the same in every layer, as in the learner's scanned decoder layers."""
    h, d = 4, 16

    def loss(x, w, seg):
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)

        def layer(x, w):
            q = (x @ w).reshape(1, t, h, d)
            mask = AttentionMask(seg, seg, idx)
            return x + blockwise_attention(q, q[:, :, :1], q[:, :, 1:2], mask).reshape(1, t, h * d), None

        return jnp.sum(jax.lax.scan(layer, x, w)[0])

    sds = jax.ShapeDtypeStruct
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    lowered = grad.lower(sds((1, t, h * d), jnp.float32), sds((2, h * d, h * d), jnp.float32), sds((1, t), jnp.int32))
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_memory_under_scanned_layers_grows_linearly_with_the_row():
    """Regression: transposing a layer scan hoisted the tile masks, which depend only on the loop-invariant
    segment ids and positions, out of the loop for every tile at once: O(T^2) (x16 from 2k to 8k tokens)."""
    small, large = _scanned_layers_temp_bytes(2048), _scanned_layers_temp_bytes(8192)
    assert large / small < 6, (small, large)
