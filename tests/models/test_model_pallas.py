"""The model with attention_impl=pallas / moe_impl=pallas (interpret mode on CPU)
equals attention_impl=xla / moe_impl=ragged: training forward (logits, loss and
gradients) and KV-cache decoding (logits), including left-padded prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulorl_jax import kernels
from ulorl_jax.kernels import dispatch
from ulorl_jax.models import init_model, tiny_config


def _loss_and_grads(model, tokens, segment_ids):
    def loss_fn(m):
        logits = m(tokens, segment_ids=segment_ids)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return nnx.jit(lambda m: nnx.value_and_grad(loss_fn)(m))(model)


@pytest.mark.slow  # ~35-45 s on 2 busy cores: interpret-mode kernels under value_and_grad
@pytest.mark.parametrize("impls", [dict(attention_impl="pallas"), dict(moe_impl="pallas", num_hidden_layers=1)],
                         ids=["attention", "moe"])
def test_pallas_matches_xla_logits_and_grads(impls):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 21)), jnp.int32)
    segments = jnp.asarray([[1] * 9 + [2] * 10 + [0] * 2, [1] * 21], jnp.int32)  # packed row + plain row
    reference = {"attention_impl": "xla", "moe_impl": "ragged", "num_hidden_layers": impls.get("num_hidden_layers", 2)}
    xla = init_model(tiny_config("qwen3_moe", **reference), seed=4)
    pallas = init_model(tiny_config("qwen3_moe", **{**reference, **impls}), seed=4)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(pallas(tokens, segment_ids=segments))[real],
                               np.asarray(xla(tokens, segment_ids=segments))[real], atol=1e-4)
    (l_x, g_x), (l_p, g_p) = _loss_and_grads(xla, tokens, segments), _loss_and_grads(pallas, tokens, segments)
    assert abs(float(l_x) - float(l_p)) < 1e-5
    for a, b in zip(jax.tree.leaves(g_x), jax.tree.leaves(g_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def _greedy_decode(model, prompts, mask, steps):
    """Left-padded prefill, then `steps` single-token decode steps; all logits."""
    step = nnx.jit(lambda m, t, c, a: m.decode_step(t, c, attention_mask=a))
    cache = model.init_cache(prompts.shape[0], 32)
    logits, cache = step(model, prompts, cache, mask)
    out = [np.asarray(logits[:, -1])]
    for _ in range(steps):
        nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
        logits, cache = step(model, nxt, cache, jnp.ones_like(nxt))
        out.append(np.asarray(logits[:, 0]))
    return np.stack(out, 1)  # [B, 1 + steps, V]


def test_decode_pallas_matches_xla_with_left_padding(monkeypatch, caplog):
    from ulorl_jax.models import fallback

    fallback._warned.clear()
    calls = []
    original = dispatch.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatch, "decode_attention", spy)
    rng = np.random.default_rng(1)
    lengths = [9, 4, 1]  # slots 1 and 2 start with 5 and 8 padding tokens
    prompts = jnp.asarray(rng.integers(0, 128, (3, 9)), jnp.int32)
    mask = jnp.asarray([[0] * (9 - n) + [1] * n for n in lengths], jnp.int32)
    xla = init_model(tiny_config("qwen3", attention_impl="xla"), seed=6)
    pallas = init_model(tiny_config("qwen3", attention_impl="pallas"), seed=6)
    with caplog.at_level("WARNING"):
        got = _greedy_decode(pallas, prompts, mask, steps=5)
    want = _greedy_decode(xla, prompts, mask, steps=5)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert calls and all(kw.get("kv_segment_ids") is not None for kw in calls)  # the kernel ran, with the cache's ids
    assert "multi-token prefill" in caplog.text  # prefill: logged xla fallback
    assert "decode attention impl='pallas' falls back" not in caplog.text


def test_cudnn_falls_back_with_a_logged_reason(caplog):
    from ulorl_jax.models import fallback

    fallback._warned.clear()
    tokens = jnp.ones((1, 5), jnp.int32)
    reference = init_model(tiny_config("qwen3_moe"), seed=2)(tokens)
    with caplog.at_level("WARNING"):
        other = init_model(tiny_config("qwen3_moe", attention_impl="cudnn"), seed=2)(tokens)
    np.testing.assert_allclose(np.asarray(other), np.asarray(reference), atol=1e-6)
    if jax.default_backend() != "gpu":
        assert "attention_impl=cudnn needs a GPU" in caplog.text


def test_moe_pallas_uses_the_grouped_matmul_kernel(monkeypatch):
    seen = []
    original = dispatch.grouped_matmul
    monkeypatch.setattr(dispatch, "grouped_matmul", lambda *a, **kw: seen.append(a[0].shape) or original(*a, **kw))
    model = init_model(tiny_config("qwen3_moe", moe_impl="pallas"), seed=2)
    jax.eval_shape(lambda t: model(t), jnp.ones((1, 5), jnp.int32))
    assert kernels.grouped_matmul_experts is not None
    assert len(seen) == 3 * model.config.num_hidden_layers  # gate, up, down per MoE layer
