"""Pallas flash attention vs the jnp reference, forward and backward (CPU interpret).

Tolerances (max abs error; inputs ~N(0, 1), D = 16 or 32):
  f32:  output 2e-5, dq / dk / dv 1e-4 (kernel vs reference, both f32 math).
  bf16: the kernel runs on bf16 inputs, the reference on the same values
        upcast to f32; output 3e-2, grads 5e-2 (relative 2e-2): the kernel
        rounds p and ds to bf16 before its matmuls, as FlashAttention does.
        Measured: f32 errors ~1e-6 to 5e-6; bf16 up to ~1.8e-2 (dv), within
        ~2x of what the reference itself loses when run in bf16.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.kernels import IMPLS, attention, flash_attention, mha_reference

INTERPRET = jax.default_backend() == "cpu"  # compiled on a GPU: run with JAX_PLATFORMS=cuda (conftest defaults to cpu)

TOL = {
    jnp.float32: dict(out=2e-5, grad=1e-4, rtol=1e-5),
    jnp.bfloat16: dict(out=3e-2, grad=5e-2, rtol=2e-2),
}


def _inputs(seed, b, tq, tk, hq, hkv, d, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, tq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, tq, hq, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _packed_segments(b: int, t: int, seed: int = 0) -> jnp.ndarray:
    """[B, T] ids 1, 1, 2, 2, 2, 3, ... then a trailing padding segment of 0s."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        row, sid = [], 1
        body = t - rng.integers(1, t // 4 + 1)  # padding tail of >= 1 token
        while len(row) < body:
            row += [sid] * int(rng.integers(1, t // 3 + 1))
            sid += 1
        row = row[:body] + [0] * (t - body)
        rows.append(row)
    return jnp.asarray(rows, jnp.int32)


def _jit_vjp(fn):
    """jit(q, k, v, do -> (fn(q, k, v), (dq, dk, dv)))."""
    def run(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)
    return jax.jit(run)


def _check(q, k, v, do, *, causal, segment_ids=None, **kernel_kwargs):
    """Kernel vs reference: output and (dq, dk, dv) from one VJP each."""
    dtype = q.dtype
    tol = TOL[jnp.float32 if dtype == jnp.float32 else jnp.bfloat16]

    def kernel(q, k, v):
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                               interpret=INTERPRET, **kernel_kwargs)

    def reference(q, k, v):
        return mha_reference(q, k, v, causal=causal, segment_ids=segment_ids)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    # One jit per side: compiling the op-by-op eager reference costs more here
    # than the interpreted kernel itself.
    o, grads = _jit_vjp(kernel)(q, k, v, do)
    o_ref, grads_ref = _jit_vjp(reference)(f32(q), f32(k), f32(v), f32(do))

    assert o.dtype == dtype and o.shape == q.shape
    np.testing.assert_allclose(f32(o), o_ref, atol=tol["out"], rtol=tol["rtol"])
    for name, g, g_ref, x in zip("qkv", grads, grads_ref, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        np.testing.assert_allclose(
            f32(g), g_ref, atol=tol["grad"], rtol=tol["rtol"], err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
def test_f32_gqa_ratios(causal, ratio):
    # T = 40 is not a multiple of the 16-wide blocks: exercises the padding.
    q, k, v, do = _inputs(ratio, 1, 40, 40, 2 * ratio, 2, 16)
    _check(q, k, v, do, causal=causal, block_q=16, block_k=16,
           block_q_bwd=16, block_k_bwd=16)


@pytest.mark.parametrize("causal", [True, False])
def test_f32_packed_segments(causal):
    b, t = 2, 72
    q, k, v, do = _inputs(10, b, t, t, 4, 2, 16)
    seg = _packed_segments(b, t)
    assert (seg[:, -1] == 0).all() and (jnp.max(seg, axis=1) >= 3).all()
    _check(q, k, v, do, causal=causal, segment_ids=seg, block_q=16, block_k=32,
           block_q_bwd=32, block_k_bwd=16)


def test_f32_uneven_blocks_head_dim_padding():
    # D = 24 is padded to 32 inside; forward and backward use different tiles,
    # and q is padded to 64 rows while k / v are padded to 48.
    b, t = 2, 37
    q, k, v, do = _inputs(11, b, t, t, 4, 1, 24)
    _check(q, k, v, do, causal=True, segment_ids=_packed_segments(b, t, 4),
           block_q=64, block_k=16, block_q_bwd=32, block_k_bwd=16)


def test_f32_cross_attention_unequal_lengths():
    q, k, v, do = _inputs(12, 1, 24, 53, 4, 2, 16)
    _check(q, k, v, do, causal=False, block_q=16, block_k=16,
           block_q_bwd=16, block_k_bwd=16)


@pytest.mark.parametrize("causal", [True, False])
def test_bf16(causal):
    b, t = 1, 48
    q, k, v, do = _inputs(13, b, t, t, 4, 2, 32, jnp.bfloat16)
    _check(q, k, v, do, causal=causal, segment_ids=_packed_segments(b, t, 1),
           block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def test_default_blocks_long_row():
    # Default (backend) block sizes on a ~200-token row, several blocks each way.
    q, k, v, do = _inputs(14, 1, 200, 200, 2, 1, 16)
    _check(q, k, v, do, causal=True, segment_ids=_packed_segments(1, 200, 2))


def test_jit_and_grad_compose():
    q, k, v, _ = _inputs(15, 1, 32, 32, 2, 1, 16)

    @jax.jit
    def loss(q, k, v):
        o = flash_attention(q, k, v, causal=True, block_q=16, block_k=16,
                            interpret=INTERPRET)
        return jnp.sum(o ** 2)

    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(mha_reference(*a) ** 2),
                             argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


def test_bad_block_size_raises():
    q, k, v, _ = _inputs(0, 1, 32, 32, 2, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, block_q=24, interpret=INTERPRET)


# -- reference semantics ------------------------------------------------------
def test_reference_empty_rows_output_zero_with_finite_grads():
    q, k, v, _ = _inputs(1, 1, 4, 4, 2, 1, 16)
    seg = jnp.array([[1, 1, 2, 3]], jnp.int32)
    kv_seg = jnp.array([[1, 1, 2, 2]], jnp.int32)  # query 3 (segment 3) sees no key

    def f(q, k, v):
        return mha_reference(q, k, v, causal=False, segment_ids=seg, kv_segment_ids=kv_seg)

    o = jax.jit(f)(q, k, v)
    np.testing.assert_array_equal(o[0, 3], 0.0)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    np.testing.assert_array_equal(grads[0][0, 3], 0.0)


def test_reference_gqa_matches_repeated_heads():
    q, k, v, _ = _inputs(2, 1, 8, 8, 4, 2, 16)
    ref = jax.jit(mha_reference)
    o = ref(q, k, v)
    o_mha = ref(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(o, o_mha, atol=1e-6)


# -- dispatch -----------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="impl")
def _jit_attention(q, k, v, segment_ids=None, *, impl):
    # Dispatch checks (and their log lines) run while this is traced.
    return attention(q, k, v, segment_ids=segment_ids, impl=impl)


def test_dispatch_pallas_matches_xla():
    q, k, v, _ = _inputs(3, 2, 40, 40, 4, 2, 16)
    seg = _packed_segments(2, 40, 3)
    o_xla = _jit_attention(q, k, v, seg, impl="xla")
    o_pallas = _jit_attention(q, k, v, seg, impl="pallas")
    np.testing.assert_allclose(o_pallas, o_xla, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="tests the non-GPU fallback")
def test_dispatch_cudnn_falls_back_on_cpu(caplog):
    q, k, v, _ = _inputs(4, 1, 16, 16, 2, 1, 16)
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.kernels"):
        o = _jit_attention(q, k, v, impl="cudnn")
    assert any("falls back to 'xla'" in r.getMessage() and "GPU" in r.getMessage()
               for r in caplog.records)
    np.testing.assert_allclose(o, jax.jit(mha_reference)(q, k, v), atol=1e-6)


def test_dispatch_pallas_unsupported_case_falls_back(caplog):
    q, k, v, _ = _inputs(5, 1, 16, 16, 2, 1, 16)
    k = k.astype(jnp.bfloat16)  # mixed dtypes: the kernel does not take them
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.kernels"):
        o = _jit_attention(q, k, v, impl="pallas")
    assert any("dtype" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(o, jax.jit(mha_reference)(q, k, v), atol=1e-6)


def test_dispatch_unknown_impl_raises():
    q, k, v, _ = _inputs(6, 1, 16, 16, 2, 1, 16)
    with pytest.raises(ValueError, match="flash2") as err:
        attention(q, k, v, impl="flash2")
    for name in IMPLS:
        assert name in str(err.value)
