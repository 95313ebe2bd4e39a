"""Dropless MoE: grouped matmul (ragged_dot) == dense reference; aux loss == transformers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hf_utils import hf_logits, random_tokens, save_hf_model
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.models.hf import from_pretrained
from ulorl_jax.models.moe import experts_dense, experts_ragged, route


def _expert_inputs(n=37, d=16, f=24, e=6, k=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (n, d))
    router = jax.random.normal(keys[1], (d, e))
    w_gate, w_up = (jax.random.normal(kk, (e, d, f)) * 0.3 for kk in keys[2:4])
    w_down = jax.random.normal(keys[4], (e, f, d)) * 0.3
    return x, router, w_gate, w_up, w_down, k


@pytest.mark.parametrize("skew", [False, True])
def test_ragged_equals_dense_forward_and_grads(skew):
    x, router, w_gate, w_up, w_down, k = _expert_inputs()
    _, weights, experts = route(x, router, k, True)
    if skew:  # expert 5 takes every token, expert 0 a few, the rest nothing
        experts = jnp.stack([jnp.full((x.shape[0],), 5), jnp.where(jnp.arange(x.shape[0]) < 3, 0, 4)], 1)
    args = (x, weights, experts, w_gate, w_up, w_down)
    np.testing.assert_allclose(experts_ragged(*args), experts_dense(*args), atol=1e-5)

    def loss(fn, x, weights, w_gate, w_up, w_down):
        return jnp.sum(jnp.sin(fn(x, weights, experts, w_gate, w_up, w_down)))

    argnums = (1, 2, 3, 4, 5)
    g_ragged = jax.grad(loss, argnums)(experts_ragged, x, weights, w_gate, w_up, w_down)
    g_dense = jax.grad(loss, argnums)(experts_dense, x, weights, w_gate, w_up, w_down)
    for a, b in zip(g_ragged, g_dense):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_model_moe_impls_agree():
    tokens = jnp.asarray(random_tokens(2, 9, vocab=128))
    ragged = init_model(tiny_config("qwen3_moe", moe_impl="ragged"), seed=1)
    dense = init_model(tiny_config("qwen3_moe", moe_impl="dense"), seed=1)
    np.testing.assert_allclose(ragged(tokens), dense(tokens), atol=1e-5)


def test_aux_loss_equals_transformers(tmp_path):
    hf = save_hf_model("qwen3_moe", tmp_path, num_hidden_layers=3, num_experts=6, num_experts_per_tok=2)
    ours = from_pretrained(tmp_path)
    tokens = random_tokens(3, 10)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0  # left padding in one row
    mask[2, 7:] = 0  # right padding in another
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                 position_ids=torch.as_tensor(positions), output_router_logits=True)
    got = ours.forward(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    print(float(out.aux_loss), float(got.aux_loss))
    assert abs(float(got.aux_loss) - float(out.aux_loss)) < 1e-5
    # Unpadded: every token counts, as in transformers with attention_mask=None.
    with torch.no_grad():
        plain = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long), output_router_logits=True)
    assert abs(float(ours.forward(jnp.asarray(tokens)).aux_loss) - float(plain.aux_loss)) < 1e-5
    assert abs(float(load_balancing_loss_func(plain.router_logits, 6, 2, None)) - float(plain.aux_loss)) < 1e-7
    np.testing.assert_allclose(np.asarray(got.logits)[mask.astype(bool)],
                               hf_logits(hf, tokens, mask, positions)[mask.astype(bool)], atol=1e-4)


def test_dense_model_has_zero_aux_loss():
    out = init_model(tiny_config("qwen3")).forward(jnp.ones((1, 4), jnp.int32))
    assert float(out.aux_loss) == 0.0 and out.router_logits == ()
