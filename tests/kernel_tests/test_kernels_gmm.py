"""Pallas grouped matmul vs jax.lax.ragged_dot and a per-group NumPy loop (CPU interpret).

Forward and both backward products (d_lhs, d_rhs) from one VJP each.
Tolerances (max abs error; inputs ~N(0, 1), K = 40):
  f32:  3e-5 absolute (measured ~4e-6: both sides are f32 dots, different
        summation order).
  bf16: the kernel takes bf16 inputs and accumulates in f32, then rounds the
        result to bf16; the reference runs the same values in f32. 0.1 absolute
        / 2e-2 relative covers the final bf16 rounding of O(6)-sized sums
        (bf16 ulp at 4..8 is 0.03) and the bf16 cotangent products.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.kernels import dispatch, gmm, grouped_matmul, grouped_matmul_experts
from ulorl_jax.kernels.grouped_matmul import group_metadata
from ulorl_jax.models.moe import experts_ragged, route

INTERPRET = jax.default_backend() == "cpu"  # compiled on a GPU: run with JAX_PLATFORMS=cuda (conftest defaults to cpu)
TOL = {jnp.float32: dict(atol=3e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-1, rtol=2e-2)}
BLOCKS = dict(block_m=16, block_n=16, block_k=16)


def _inputs(sizes, m, k, n, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout


def _numpy_reference(lhs, rhs, sizes, dout):
    """(out, d_lhs, d_rhs) by an explicit loop over groups, float64."""
    lhs, rhs, dout = (np.asarray(x, np.float64) for x in (lhs, rhs, dout))
    out, d_lhs, d_rhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[g]
        d_lhs[rows] = dout[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ dout[rows]
        start += size
    return out, d_lhs, d_rhs


def _vjp(fn, lhs, rhs, dout):
    def run(lhs, rhs, dout):
        out, vjp = jax.vjp(fn, lhs, rhs)
        return (out, *vjp(dout))
    return jax.jit(run)(lhs, rhs, dout)


# M = 37 rows: not a multiple of the 16-row tile; K = 40 and N = 24 are padded.
CASES = {
    "zeros_between": [5, 0, 17, 3, 0, 12],
    "one_group_all": [0, 0, 37, 0, 0, 0],
    "rows_left_over": [10, 10, 10, 0, 0, 2],  # sum 32 < 37: rows past the sum give 0
    "all_zero": [0, 0, 0, 0, 0, 0],
    "tile_aligned": [16, 0, 16, 5, 0, 0],
}


@pytest.mark.parametrize("case", list(CASES))
def test_f32_forward_and_grads(case):
    sizes = CASES[case]
    lhs, rhs, gs, dout = _inputs(sizes, 37, 40, 24, seed=len(case))
    got = _vjp(lambda a, b: grouped_matmul(a, b, gs, interpret=INTERPRET, **BLOCKS), lhs, rhs, dout)
    ragged = _vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=jax.lax.Precision.HIGHEST),
                  lhs, rhs, dout)
    loop = _numpy_reference(lhs, rhs, gs, dout)
    for name, g, r, ref in zip(("out", "d_lhs", "d_rhs"), got, ragged, loop):
        assert g.dtype == jnp.float32 and g.shape == r.shape, name
        np.testing.assert_allclose(g, r, **TOL[jnp.float32], err_msg=f"{name} vs ragged_dot")
        np.testing.assert_allclose(g, ref, **TOL[jnp.float32], err_msg=f"{name} vs numpy loop")
    if sum(sizes) < 37:
        np.testing.assert_array_equal(got[0][sum(sizes):], 0.0)
        np.testing.assert_array_equal(got[1][sum(sizes):], 0.0)


def test_bf16_forward_and_grads():
    lhs, rhs, gs, dout = _inputs(CASES["zeros_between"], 37, 40, 24, jnp.bfloat16, seed=3)
    got = _vjp(lambda a, b: grouped_matmul(a, b, gs, interpret=INTERPRET, **BLOCKS), lhs, rhs, dout)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = _vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=jax.lax.Precision.HIGHEST),
               f32(lhs), f32(rhs), f32(dout))
    for name, g, r in zip(("out", "d_lhs", "d_rhs"), got, ref):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(f32(g), r, **TOL[jnp.bfloat16], err_msg=name)


def test_default_blocks_and_larger_groups():
    # Backend default tiles; groups spanning several row tiles each.
    sizes = [40, 0, 3, 61, 20]
    lhs, rhs, gs, dout = _inputs(sizes, 130, 64, 48, seed=9)
    got = _vjp(lambda a, b: grouped_matmul(a, b, gs, interpret=INTERPRET), lhs, rhs, dout)
    for name, g, r in zip(("out", "d_lhs", "d_rhs"), got, _numpy_reference(lhs, rhs, gs, dout)):
        np.testing.assert_allclose(g, r, **TOL[jnp.float32], err_msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_group_metadata_covers_every_row_once(seed):
    """Every (row, group) pair is visited exactly once, within the static bound."""
    rng = np.random.default_rng(seed)
    g, bm = int(rng.integers(1, 9)), 16
    sizes = rng.integers(0, 30, g) * (rng.random(g) < 0.7)
    rows = int(sizes.sum() + rng.integers(0, 20))
    rows_p = -(-max(rows, 1) // bm) * bm
    meta = jax.tree.map(np.asarray, group_metadata(jnp.asarray(sizes, jnp.int32), rows, rows_p, bm))
    owner = np.full(rows_p, -1)
    hits = np.zeros(rows_p, int)
    for grp, tile in zip(meta.visit_group, meta.visit_tile):
        for r in range(tile * bm, (tile + 1) * bm):
            if meta.starts[grp] <= r < meta.ends[grp]:
                hits[r] += 1
                owner[r] = grp
    np.testing.assert_array_equal(hits, 1)
    expected = np.concatenate([np.repeat(np.arange(g), sizes), np.full(rows_p - sizes.sum(), g)])
    np.testing.assert_array_equal(owner, expected)  # real groups in order, then the zero group


def test_bad_inputs_name_the_problem():
    lhs, rhs, gs, _ = _inputs([3, 4], 7, 16, 16)
    with pytest.raises(ValueError, match="shape mismatch"):
        grouped_matmul(lhs, rhs[:, :8], gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="dtypes"):
        grouped_matmul(lhs, rhs.astype(jnp.bfloat16), gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_m"):
        grouped_matmul(lhs, rhs, gs, block_m=24, interpret=INTERPRET)


# -- MoE experts on the kernel ----------------------------------------------------
def test_experts_equal_ragged_forward_and_grads():
    n, d, f, e, k = 21, 16, 24, 5, 2
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (n, d))
    _, weights, experts = route(x, jax.random.normal(keys[1], (d, e)), k, True)
    experts = experts.at[:, 0].set(jnp.where(jnp.arange(n) < 15, 3, experts[:, 0]))  # skew: expert 3 busy
    w_gate, w_up = (jax.random.normal(kk, (e, d, f)) * 0.3 for kk in keys[2:4])
    w_down = jax.random.normal(keys[4], (e, f, d)) * 0.3

    def loss(fn, *args):
        x, weights, w_gate, w_up, w_down = args
        return jnp.sum(jnp.sin(fn(x, weights, experts, w_gate, w_up, w_down)))

    args = (x, weights, w_gate, w_up, w_down)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=range(5)))(*args)  # noqa: E731
    l_k, g_k = grad(grouped_matmul_experts)
    with jax.default_matmul_precision("highest"):  # the reference in full f32 (a GPU's default f32 dot is TF32)
        l_r, g_r = grad(experts_ragged)
    assert abs(float(l_k) - float(l_r)) < 1e-4
    for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), g_k, g_r):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5, err_msg=name)


def test_gmm_dispatch_mixed_dtypes_fall_back_to_ragged(caplog):
    lhs, rhs, gs, _ = _inputs([3, 4], 7, 16, 16)
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.kernels"):
        out = gmm(lhs, rhs.astype(jnp.bfloat16), gs)
    assert "grouped matmul impl='pallas' falls back to 'ragged'" in caplog.text and "dtype" in caplog.text
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs.astype(jnp.bfloat16), gs), atol=1e-6)
    with pytest.raises(ValueError, match="megablocks"):
        dispatch.gmm(lhs, rhs, gs, impl="megablocks")
