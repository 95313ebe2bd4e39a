"""The materialised XLA attention (the reference every other path is tested against): forward and gradients
equal a NumPy float64 formula, so its hand-written softmax backward cannot drift unnoticed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ulorl_jax.models.attention import AttentionMask, xla_attention


def _numpy_attention(q, k, v, allowed):
    """float64 [B, T, Hq, D] attention with GQA; allowed [B, T, S]."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head h reads KV head h // g
    scores = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d)
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, vv)


def test_forward_and_gradients_equal_numpy():
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d = 2, 24, 4, 2, 8
    q, k, v = (rng.normal(size=(b, t, h, d)) for h in (hq, hkv, hkv))
    seg = np.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], np.int32)  # packed row; a row with padding
    mask = AttentionMask(jnp.asarray(seg), jnp.asarray(seg), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    allowed = np.asarray(mask.dense())
    w = rng.normal(size=(b, t, hq, d))
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))

    np.testing.assert_allclose(xla_attention(q32, k32, v32, mask), _numpy_attention(q, k, v, allowed), atol=1e-5)

    grads = jax.grad(lambda *a: jnp.sum(xla_attention(*a, mask) * w), argnums=(0, 1, 2))(q32, k32, v32)
    eps = 1e-6  # central differences of the float64 formula, one coordinate per tensor and position
    for name, x, grad in zip("qkv", (q, k, v), grads):
        for idx in [(0, 3, 0, 1), (0, 15, 1, 5), (1, 7, 1, 2), (1, 22, 0, 0)]:
            if name == "q" or idx[2] < hkv:
                up, down = x.copy(), x.copy()
                up[idx] += eps
                down[idx] -= eps
                args = lambda y: [y if n == name else z for n, z in zip("qkv", (q, k, v))]  # noqa: E731
                numeric = (np.sum(_numpy_attention(*args(up), allowed) * w)
                           - np.sum(_numpy_attention(*args(down), allowed) * w)) / (2 * eps)
                np.testing.assert_allclose(float(grad[idx]), numeric, rtol=1e-3, atol=1e-4, err_msg=f"d{name}{idx}")
