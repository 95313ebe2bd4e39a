"""`trainer.remat: attention` (rl/learner.py REMAT_POLICIES): per-layer remat that keeps each layer's
attention output and log-sum-exp. Its gradients equal those of `none` and `full` (same math), and its
backward does not rerun the blockwise attention forward: XLA's count of transcendental operations (the
softmax exponentials) in the compiled gradient program is near that of `none`, which keeps everything,
while `full` adds the attention forward's again.

Rows of 300 tokens, so that attention takes the blockwise path (more than one 256-query block)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from learner_utils import VOCAB, assert_trees_close

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl.learner import policy_forward

T = 300


def _grad_fn(model, remat: str, scan: bool):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, VOCAB, (1, T)), jnp.int32)
    segments = jnp.asarray([[1] * 170 + [2] * 120 + [0] * 10], jnp.int32)  # packed + padding
    positions = jnp.asarray([list(range(170)) + list(range(120)) + [0] * 10], jnp.int32)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def loss(params):
        hidden, aux = policy_forward(nnx.merge(graphdef, params, other), tokens, positions, segments,
                                     remat=remat, scan=scan)
        return jnp.sum(jnp.sin(hidden)) + aux

    return jax.value_and_grad(loss), params


def _transcendentals(fn, params) -> float:
    """XLA's count of transcendental operations (exp, log, ...) in the compiled gradient program."""
    return float(jax.jit(fn).lower(params).compile().cost_analysis()["transcendentals"])


@pytest.mark.parametrize("scan", [False, True])
def test_attention_policy_keeps_the_attention_forward_and_the_gradients(scan):
    model = init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8,
                                   num_hidden_layers=2), seed=3)
    assert model.config.attention_impl == "blockwise"
    results, exps = {}, {}  # exps: transcendental ops per policy
    for remat in ("none", "full", "attention"):
        fn, params = _grad_fn(model, remat, scan)
        results[remat] = jax.jit(fn)(params)
        exps[remat] = _transcendentals(fn, params)
    # `full` reruns every layer's forward, the attention's exponentials included; `attention` reruns only
    # the layers' O(T) parts (norms, activations): a small fraction of what `full` adds over `none`
    recomputed_full, recomputed_attention = exps["full"] - exps["none"], exps["attention"] - exps["none"]
    assert 0 <= recomputed_attention < 0.25 * recomputed_full, exps
    for remat in ("full", "attention"):
        np.testing.assert_allclose(results[remat][0], results["none"][0], rtol=1e-5)  # f32, other fusion
        assert_trees_close(results[remat][1], results["none"][1], 1e-5, 1e-4, f"remat={remat} grads")
