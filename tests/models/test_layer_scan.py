"""`learner.scan_layers` (models/layer_scan.py): the layers as one lax.scan give the loss and gradients
of the unrolled layers (the learner's whole step on an 8-device expert mesh: test_moe_parallel.py);
layers of different kinds fall back to the unrolled loop with a warning; the scanned program's
backward keeps one layer of activations.

Reference: `policy_forward` with the layers unrolled (itself tested equal to the model's forward in
test_packing.py). Tolerance: f32, same math, a loop instead of straight-line code."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from learner_utils import VOCAB, assert_trees_close, small_config

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.models.layer_scan import unscannable
from ulorl_jax.rl.learner import policy_forward
from ulorl_jax.sharding import MeshConfig, make_mesh

MOE = dict(vocab_size=VOCAB, hidden_size=32, head_dim=8, num_experts=4, num_hidden_layers=3,
           moe_intermediate_size=16)


def _loss_and_grads(model, scan: bool):
    """Loss (hidden states and the MoE aux loss) and its gradients through `policy_forward` with remat."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, VOCAB, (2, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3], jnp.int32)  # packed + padding
    positions = jnp.asarray([list(range(7)) + list(range(5)), list(range(9)) + [0] * 3], jnp.int32)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def loss(params):
        hidden, aux = policy_forward(nnx.merge(graphdef, params, other), tokens, positions, segments,
                                     remat="full", scan=scan)
        return jnp.sum(jnp.sin(hidden)) + aux

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
def test_scanned_gradients_equal_unrolled():
    dense = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8, num_hidden_layers=3)
    for model_type, arch in (("qwen3", dense), ("qwen3_moe", MOE)):
        model = init_model(tiny_config(model_type, **arch), seed=2)
        loss_ref, grads_ref = _loss_and_grads(model, scan=False)
        loss, grads = _loss_and_grads(model, scan=True)
        # the loss sums 768 sin terms of O(1) to about -1.5: float32 summation order (jax 0.12's scan vs the
        # unrolled layers) moves it by up to ~1e-5 absolute, far below any real mismatch
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-6, atol=2e-5)
        # grads are O(100) here (sum of sin over all hidden units): atol 1e-4 is 1e-6 of their scale
        assert_trees_close(grads, grads_ref, 1e-5, 1e-4, f"{model_type} scanned grads")


def test_mixed_layers_run_unrolled_with_a_warning(caplog):
    cfg = tiny_config("qwen3_moe", **MOE, mlp_only_layers=(1,), intermediate_size=64)
    model = init_model(cfg, seed=0)
    reason = unscannable(model.layers)
    assert reason is not None and "mix MoE (2 of 3) and dense" in reason
    assert "nothing to scan" in unscannable(model.layers[:1])
    loss_ref, _ = _loss_and_grads(model, scan=False)
    with caplog.at_level(logging.WARNING):
        loss, _ = _loss_and_grads(model, scan=True)
    assert "running the layers unrolled" in caplog.text
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)


@pytest.mark.slow
def test_scanned_backward_memory_grows_by_one_saved_input_per_layer():
    """XLA's memory analysis of the train step (one CPU device), 2 vs 6 layers of a dense model with
    long rows: scanned, the extra memory per layer is the layer's weights, their AdamW state and its
    saved input — far below one layer's activations, which the unrolled program keeps several of."""
    from ulorl_jax.plan import compile_train_step

    rows, row_len, hidden = 2, 2048, 64
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    peaks = {}
    for layers in (2, 6):
        mc = tiny_config("qwen3", vocab_size=256, hidden_size=hidden, intermediate_size=256, head_dim=16,
                         num_hidden_layers=layers, max_position_embeddings=row_len)
        lc = small_config(row_len=row_len, micro_batch_rows=rows, logprob_chunk=512, scan_layers=True)
        peaks[layers] = compile_train_step(mc, lc, mesh, rows, row_len)["peak_bytes"]
    per_layer = (peaks[6] - peaks[2]) / 4
    saved_input = rows * row_len * hidden * 4  # f32 [rows, row_len, D]
    weights = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(init_model(mc).layers[0])))  # f32 bytes
    one_layer_activations = rows * row_len * (4 * hidden + 3 * 256) * 4  # q/k/v/attn out + the MLP's 3
    print(f"per layer {per_layer / 2**20:.2f} MiB; saved input {saved_input / 2**20:.2f} MiB, "
          f"one layer's activations {one_layer_activations / 2**20:.2f} MiB")
    assert per_layer <= saved_input + 6 * weights + 2**16
    assert per_layer < one_layer_activations / 2
