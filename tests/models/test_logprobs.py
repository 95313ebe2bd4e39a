"""Chunked log-probs / entropy against the full-softmax reference, forward and backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.rl import chunked_logprobs_and_entropy, full_logprobs_and_entropy, sample_mean_entropy


def make_inputs(seed, b, t, d, v):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    lm_head = (rng.normal(size=(d, v)) / np.sqrt(d) * 3).astype(np.float32)  # peaked and flat rows both
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    return hidden, lm_head, targets


def numpy_logprobs_and_entropy(hidden, lm_head, targets, temperature=1.0):
    logits = (hidden.astype(np.float64) @ lm_head.astype(np.float64)) / temperature
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return token, -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("t, chunk", [(37, 8), (64, 16), (5, 1024)], ids=["ragged", "divisible", "short"])
def test_chunked_matches_full_forward(t, chunk):
    hidden, lm_head, targets = make_inputs(0, 2, t, 16, 97)
    lp, ent = jax.jit(functools.partial(chunked_logprobs_and_entropy, chunk_size=chunk))(hidden, lm_head, targets)
    lp_full, ent_full = jax.jit(full_logprobs_and_entropy)(hidden, lm_head, targets)
    assert lp.shape == ent.shape == (2, t) and lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, lp_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_full, rtol=1e-5, atol=1e-5)
    lp_np, ent_np = numpy_logprobs_and_entropy(hidden, lm_head, targets)
    np.testing.assert_allclose(lp, lp_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_np, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(ent) >= -1e-6) and np.all(np.asarray(ent) <= np.log(97) + 1e-5)


def test_temperature_and_bf16_compute():
    hidden, lm_head, targets = make_inputs(1, 2, 21, 16, 64)
    kw = dict(temperature=0.85)
    lp, ent = jax.jit(functools.partial(chunked_logprobs_and_entropy, chunk_size=8, **kw))(hidden, lm_head, targets)
    lp_np, ent_np = numpy_logprobs_and_entropy(hidden, lm_head, targets, temperature=0.85)
    np.testing.assert_allclose(lp, lp_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_np, rtol=1e-5, atol=1e-5)
    kw = dict(compute_dtype=jnp.bfloat16)
    lp16, ent16 = jax.jit(functools.partial(chunked_logprobs_and_entropy, chunk_size=8, **kw))(hidden, lm_head, targets)
    lp16_full, ent16_full = jax.jit(functools.partial(full_logprobs_and_entropy, **kw))(hidden, lm_head, targets)
    assert lp16.dtype == jnp.float32
    np.testing.assert_allclose(lp16, lp16_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent16, ent16_full, rtol=1e-5, atol=1e-5)


def _objective(fn, hidden, lm_head, targets, w_lp, w_ent):
    lp, ent = fn(hidden, lm_head, targets)
    return jnp.sum(w_lp * lp) + jnp.sum(w_ent * ent)


def test_chunked_matches_full_backward():
    hidden, lm_head, targets = make_inputs(2, 2, 37, 16, 97)
    rng = np.random.default_rng(3)
    w_lp, w_ent = (rng.normal(size=(2, 37)).astype(np.float32) for _ in range(2))
    chunked = functools.partial(chunked_logprobs_and_entropy, chunk_size=8)
    grad = jax.jit(jax.grad(functools.partial(_objective, chunked), argnums=(0, 1)))
    grad_full = jax.jit(jax.grad(functools.partial(_objective, full_logprobs_and_entropy), argnums=(0, 1)))
    gh, gw = grad(hidden, lm_head, targets, w_lp, w_ent)
    gh_ref, gw_ref = grad_full(hidden, lm_head, targets, w_lp, w_ent)
    np.testing.assert_allclose(gh, gh_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-4, atol=1e-5)


def test_backward_with_temperature_and_bf16_params():
    """The closed-form cotangent (models/logprobs.py) scales by the temperature and returns each input's dtype."""
    hidden, lm_head, targets = make_inputs(5, 2, 29, 16, 97)
    rng = np.random.default_rng(6)
    w_lp, w_ent = (rng.normal(size=(2, 29)).astype(np.float32) for _ in range(2))

    def grads(fn, h, w, **kw):
        objective = functools.partial(_objective, functools.partial(fn, **kw))
        return jax.jit(jax.grad(objective, argnums=(0, 1)))(h, w, targets, w_lp, w_ent)

    chunked = functools.partial(chunked_logprobs_and_entropy, chunk_size=8)
    for got, want in zip(grads(chunked, hidden, lm_head, temperature=0.7),
                         grads(full_logprobs_and_entropy, hidden, lm_head, temperature=0.7)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(lm_head, jnp.bfloat16)
    got = grads(chunked, h16, w16, compute_dtype=jnp.bfloat16)
    want = grads(full_logprobs_and_entropy, hidden, lm_head)
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.bfloat16]
    for g, ref in zip(got, want):  # bf16 inputs and matmuls: a few per cent of the largest entry
        np.testing.assert_allclose(np.asarray(g, np.float32), ref, atol=0.05 * float(np.abs(ref).max()))


def test_argument_errors():
    hidden, lm_head, targets = make_inputs(0, 1, 4, 8, 16)
    with pytest.raises(ValueError, match="targets has shape"):
        chunked_logprobs_and_entropy(hidden, lm_head, targets[:, :3])
    with pytest.raises(ValueError, match="lm_head has shape"):
        chunked_logprobs_and_entropy(hidden, lm_head.T, targets)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs_and_entropy(hidden, lm_head, targets, chunk_size=0)


def test_sample_mean_entropy():
    rng = np.random.default_rng(4)
    entropy = rng.random((3, 6)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], np.float32)
    entropy[0, 5] = np.nan  # padding must not leak in
    out = np.asarray(jax.jit(sample_mean_entropy)(entropy, mask))
    np.testing.assert_allclose(out, [entropy[0, :3].mean(), 0.0, entropy[2].mean()], rtol=1e-6)


# ---------------------------------------------------------------------------
# Memory: the backward pass of the chunked path never holds [B, T, V]
# ---------------------------------------------------------------------------

V, D, CHUNK = 4096, 16, 256


def _grad_temp_bytes(fn, t):
    hidden = jax.ShapeDtypeStruct((1, t, D), jnp.float32)
    lm_head = jax.ShapeDtypeStruct((D, V), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(hidden, lm_head, targets):
        lp, ent = fn(hidden, lm_head, targets)
        return jnp.sum(lp) + jnp.sum(ent)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, lm_head, targets).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip(f"memory_analysis() returns None on the {jax.default_backend()} backend")
    return stats.temp_size_in_bytes


def test_chunked_backward_memory_does_not_grow_with_t_times_v():
    chunked = functools.partial(chunked_logprobs_and_entropy, chunk_size=CHUNK)
    small, large = _grad_temp_bytes(chunked, 2048), _grad_temp_bytes(chunked, 8192)
    naive_small, naive_large = (_grad_temp_bytes(full_logprobs_and_entropy, t) for t in (2048, 8192))
    logits_bytes_large = 8192 * V * 4  # one [1, T, V] float32 buffer at T = 8192 (128 MiB)
    # Naive grows with T·V (XLA CPU, jax 0.10.2: 128 MiB -> 384 MiB; buffer reuse
    # makes it ~3x rather than exactly 4x). Chunked stays ~16 MiB at both lengths.
    assert naive_large / naive_small > 2.5, (naive_small, naive_large)
    assert naive_large >= 2 * logits_bytes_large, naive_large
    assert large / small < 1.5, (small, large)
    assert large < logits_bytes_large / 4, (large, logits_bytes_large)
