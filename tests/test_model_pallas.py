"""The model with attention_impl=pallas (interpret mode on CPU) equals attention_impl=xla."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulorl_jax.models import init_model, tiny_config


def _loss_and_grads(model, tokens, segment_ids):
    def loss_fn(m):
        logits = m(tokens, segment_ids=segment_ids)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return nnx.jit(lambda m: nnx.value_and_grad(loss_fn)(m))(model)


def test_pallas_attention_matches_xla_logits_and_grads():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 21)), jnp.int32)
    segments = jnp.asarray([[1] * 9 + [2] * 10 + [0] * 2, [1] * 21], jnp.int32)  # packed row + plain row
    xla = init_model(tiny_config("qwen3_moe", attention_impl="xla"), seed=4)
    pallas = init_model(tiny_config("qwen3_moe", attention_impl="pallas"), seed=4)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(pallas(tokens, segment_ids=segments))[real],
                               np.asarray(xla(tokens, segment_ids=segments))[real], atol=1e-4)
    (l_x, g_x), (l_p, g_p) = _loss_and_grads(xla, tokens, segments), _loss_and_grads(pallas, tokens, segments)
    assert abs(float(l_x) - float(l_p)) < 1e-5
    for a, b in zip(jax.tree.leaves(g_x), jax.tree.leaves(g_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_unavailable_impls_fall_back_with_a_logged_reason(caplog):
    from ulorl_jax.models import fallback

    fallback._warned.clear()
    tokens = jnp.ones((1, 5), jnp.int32)
    reference = init_model(tiny_config("qwen3_moe"), seed=2)(tokens)
    with caplog.at_level("WARNING"):
        other = init_model(tiny_config("qwen3_moe", attention_impl="cudnn", moe_impl="pallas"), seed=2)(tokens)
    np.testing.assert_allclose(np.asarray(other), np.asarray(reference), atol=1e-6)
    if jax.default_backend() != "gpu":
        assert "attention_impl=cudnn needs a GPU" in caplog.text
    assert "moe_impl=pallas: no Pallas grouped matmul" in caplog.text
