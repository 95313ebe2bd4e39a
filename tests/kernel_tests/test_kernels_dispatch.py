"""Kernel routing per platform, checked on CPU by replacing `platform.backend()`.

With the backend reported as "tpu", impl="pallas" must build splash attention
(mask from causal / segment ids) and megablox gmm. Those TPU kernels are run
here too, in Pallas interpret mode on CPU (``platform.interpret_default()``
asks the real backend), and compared with our references; no TPU code is
compiled.
"""

from __future__ import annotations

import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.kernels import dispatch, mha_reference, platform, tpu

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="injects a fake backend on CPU")


@pytest.fixture
def backend(monkeypatch):
    def set_backend(name: str):
        monkeypatch.setattr(platform, "backend", lambda: name)
    return set_backend


def _spy(monkeypatch, module, name):
    """Wrap module.name; return the list of (args, kwargs) it was called with."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _qkv(seed, b, t, hq, hkv, d):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (b, t, hq, d)), jax.random.normal(keys[1], (b, t, hkv, d)),
            jax.random.normal(keys[2], (b, t, hkv, d)))


def test_tpu_modules_import_on_cpu():
    for name in ("jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel",
                 "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask",
                 "jax.experimental.pallas.ops.tpu.megablox"):
        importlib.import_module(name)
    assert platform.backend() == jax.default_backend() == "cpu"


@pytest.mark.parametrize("causal", [True, False])
def test_tpu_pallas_attention_routes_to_splash(monkeypatch, backend, causal):
    backend("tpu")
    built = _spy(monkeypatch, tpu, "make_splash_kernel")
    flash = _spy(monkeypatch, dispatch, "flash_attention")
    q, k, v = _qkv(0, 2, 40, 4, 2, 16)
    seg = jnp.asarray([[1] * 15 + [2] * 25, [1] * 33 + [0] * 7], jnp.int32)
    out = jax.jit(lambda q, k, v, s: dispatch.attention(q, k, v, causal=causal, segment_ids=s,
                                                        impl="pallas"))(q, k, v, seg)
    assert not flash
    assert len(built) == 1
    kw = built[0][1]
    # GQA 4/2 stays unrepeated; T = 40 is padded to one 128 splash block.
    assert kw == dict(causal=causal, num_heads=4, seq_len=128, block=128, interpret=True)
    np.testing.assert_allclose(out, mha_reference(q, k, v, causal=causal, segment_ids=seg), atol=2e-5)


def test_splash_mask_objects():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    for causal, kind in ((True, sm.CausalMask), (False, sm.FullMask)):
        kernel = tpu.make_splash_kernel(causal=causal, num_heads=2, seq_len=256, block=128, interpret=True)
        mask = np.asarray(kernel.fwd_mask_info.block_mask) if kernel.fwd_mask_info.block_mask is not None else None
        assert kind is sm.CausalMask or mask is None or (mask != 0).all()
        if causal:  # block (0, 1) lies above the diagonal: skipped
            assert mask is not None and mask.shape[-2:] == (2, 2) and mask[..., 0, 1].max() == 0


@pytest.mark.slow
def test_tpu_splash_gradients_match_reference(backend):
    backend("tpu")
    q, k, v = _qkv(1, 1, 24, 4, 1, 16)
    seg = jnp.asarray([[1] * 10 + [2] * 14], jnp.int32)
    loss = lambda fn: jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2)))  # noqa: E731
    got = loss(lambda q, k, v: dispatch.attention(q, k, v, segment_ids=seg, impl="pallas"))(q, k, v)
    ref = loss(lambda q, k, v: mha_reference(q, k, v, segment_ids=seg))(q, k, v)
    for name, a, b in zip("qkv", got, ref):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")


def test_tpu_pallas_gmm_routes_to_megablox(monkeypatch, backend):
    backend("tpu")
    mega = _spy(monkeypatch, tpu, "megablox_gmm")
    ours = _spy(monkeypatch, dispatch, "grouped_matmul")
    keys = jax.random.split(jax.random.key(2), 2)
    lhs, rhs = jax.random.normal(keys[0], (37, 40)), jax.random.normal(keys[1], (5, 40, 24))
    gs = jnp.asarray([5, 0, 20, 0, 9], jnp.int32)
    out = dispatch.gmm(lhs, rhs, gs, impl="pallas")
    assert len(mega) == 1 and not ours and mega[0][1] == dict(interpret=True)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, gs, precision="highest"), atol=3e-5)


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_gpu_and_cpu_route_to_our_kernels(monkeypatch, backend, name):
    backend(name)
    flash = _spy(monkeypatch, dispatch, "flash_attention")
    ours = _spy(monkeypatch, dispatch, "grouped_matmul")
    decode = _spy(monkeypatch, dispatch, "decode_attention")
    splash = _spy(monkeypatch, tpu, "splash_attention")
    q, k, v = _qkv(3, 1, 16, 2, 1, 16)
    # Tracing is enough to see the choice.
    jax.eval_shape(lambda q, k, v: dispatch.attention(q, k, v, impl="pallas"), q, k, v)
    jax.eval_shape(lambda x: dispatch.gmm(x, jnp.ones((2, 16, 16)), jnp.asarray([8, 8], jnp.int32)), q[0, :, 0])
    jax.eval_shape(lambda q, k, v: dispatch.decode(q, k, v, jnp.asarray([5])), q[:, 0], k, v)
    assert len(flash) == len(ours) == len(decode) == 1 and not splash


def test_tpu_decode_and_unknown_backend_fall_back_with_reason(backend, caplog):
    q, k, v = _qkv(4, 2, 16, 4, 2, 16)
    lengths = jnp.asarray([3, 16])
    want = jax.jit(lambda q, k, v: dispatch.decode(q, k, v, lengths, impl="xla"))(q[:, 0], k, v)
    backend("tpu")
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.kernels"):
        got = jax.jit(lambda q, k, v: dispatch.decode(q, k, v, lengths))(q[:, 0], k, v)
    assert "decode attention impl='pallas' falls back to 'xla'" in caplog.text and "'tpu'" in caplog.text
    np.testing.assert_allclose(got, want, atol=1e-6)
    backend("metal")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ulorl_jax.kernels"):
        out = jax.jit(lambda q, k, v: dispatch.attention(q, k, v, impl="pallas"))(q, k, v)
        jax.eval_shape(lambda x: dispatch.gmm(x, jnp.ones((2, 16, 16)), jnp.asarray([8, 8], jnp.int32)), q[0, :, 0])
    assert "attention impl='pallas' falls back to 'xla'" in caplog.text and "'metal'" in caplog.text
    assert "grouped matmul impl='pallas' falls back to 'ragged'" in caplog.text
    np.testing.assert_allclose(out, jax.jit(mha_reference)(q, k, v), atol=1e-5)
