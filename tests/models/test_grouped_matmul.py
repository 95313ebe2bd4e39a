"""The CPU's plain-JAX grouped matmul (models/grouped_matmul.py) == `lax.ragged_dot`, forward and both
gradients, on ragged, empty and partial groups; the MoE experts built on it == the dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.models.grouped_matmul import grouped_matmul
from ulorl_jax.models.moe import default_grouped_matmul, experts_dense, experts_ragged


@pytest.mark.parametrize("sizes,block", [
    ([60, 0, 100, 40, 90], 64),  # ragged with an empty group; 10 trailing rows belong to no group (give 0)
    ([300, 0, 0, 0, 0], 64),  # one group
    ([0, 0, 0, 0, 0], 32),  # no rows in any group
    ([7, 13, 1, 200, 79], 128),  # groups smaller than a tile, a tile larger than the rows' remainder
    ([75, 75, 75, 75, 0], 8),  # many tiles
])
def test_equals_ragged_dot_forward_and_grads(sizes, block):
    rng = np.random.default_rng(len(sizes) + block)
    m, k, n = 300, 16, 24
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot(lhs, rhs, gs)
    np.testing.assert_allclose(grouped_matmul(lhs, rhs, gs, block=block), want, atol=1e-5)
    w = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
    ref = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) * w), argnums=(0, 1))(lhs, rhs)
    got = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, gs, block=block) * w), argnums=(0, 1))(lhs, rhs)
    for name, a, b in zip(("d_lhs", "d_rhs"), ref, got):
        np.testing.assert_allclose(b, a, atol=1e-4, err_msg=name)


def test_experts_on_it_equal_the_dense_reference():
    rng = np.random.default_rng(0)
    n, d, f, e, k = 70, 16, 12, 6, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(x, weights, experts, *a) ** 2)

    grouped = lambda *a: experts_ragged(*a, grouped_matmul=grouped_matmul)  # noqa: E731
    np.testing.assert_allclose(grouped(x, weights, experts, w_gate, w_up, w_down),
                               experts_dense(x, weights, experts, w_gate, w_up, w_down), rtol=1e-5, atol=1e-4)
    ref = jax.grad(loss(experts_dense), argnums=(0, 1, 2))(w_gate, w_up, w_down)
    got = jax.grad(loss(grouped), argnums=(0, 1, 2))(w_gate, w_up, w_down)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3)
    assert default_grouped_matmul() is grouped_matmul  # the CPU picks it (ragged_dot elsewhere)
