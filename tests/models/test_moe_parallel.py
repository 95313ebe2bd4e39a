"""Expert-parallel MoE (models/moe_parallel.py) == the single-device experts, forward and backward.

8 fake CPU devices (tests/conftest.py). The sharded side is jitted with the
parameters in their mesh shardings and traced under `sharding.mesh_context`,
as the learner does; the reference is the plain block on one device.
Tolerance: f32, same math with a different summation order (psum_scatter over
`expert`, psum over `tensor`, chunked weight-gradient sums): atol 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulorl_jax.models import init_model, moe, moe_parallel, tiny_config
from ulorl_jax.models.moe import SparseMoeBlock, experts_dense, experts_ragged, route
from ulorl_jax.sharding import BATCH_AXES, MeshConfig, make_mesh, mesh_context, param_shardings

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
MESHES = [MeshConfig(fsdp=2, expert=4), MeshConfig(fsdp=1, expert=8), MeshConfig(data=2, fsdp=2, expert=2),
          MeshConfig(fsdp=2, expert=2, tensor=2), MeshConfig(fsdp=8)]
BLOCK = dict(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


# ---------------------------------------------------------------------------
# Pieces (one device)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [experts_ragged, experts_dense])
def test_expert_slices_sum_to_all_experts(fn):
    """expert_offset: each slice of the experts computes only its assignments; the slices sum to the whole."""
    keys = jax.random.split(jax.random.key(0), 5)
    n, d, f, e, k = 21, 8, 6, 8, 3
    x = jax.random.normal(keys[0], (n, d))
    _, weights, experts = route(x, jax.random.normal(keys[1], (d, e)), k, True)
    w_gate, w_up = (jax.random.normal(kk, (e, d, f)) for kk in keys[2:4])
    w_down = jax.random.normal(keys[4], (e, f, d))
    full = fn(x, weights, experts, w_gate, w_up, w_down)
    for per in (1, 2, 4):
        parts = sum(fn(x, weights, experts, w_gate[o:o + per], w_up[o:o + per], w_down[o:o + per],
                       expert_offset=jnp.int32(o)) for o in range(0, e, per))
        np.testing.assert_allclose(parts, full, atol=1e-5, err_msg=f"{per} experts per slice")


@pytest.mark.parametrize("n,ep,k,rows", [(4, 4, 2, 16), (16384, 8, 8, 65536), (7, 2, 2, 8), (3, 8, 8, 4)])
def test_chunking_bounds_rows_and_covers_tokens(n, ep, k, rows):
    chunks, per_chunk = moe_parallel.chunking(n, ep, k, rows)
    assert chunks * per_chunk >= n and (chunks - 1) * per_chunk < n  # every token, padding < one chunk
    assert per_chunk * ep * k <= rows or per_chunk == 1


def test_no_mesh_or_one_data_shard_keeps_the_plain_path():
    assert moe_parallel.expert_parallel_mesh() is None
    one = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert mesh_context(moe_parallel.expert_parallel_mesh, one)() is None


# ---------------------------------------------------------------------------
# MoE block on a mesh == one device
# ---------------------------------------------------------------------------


def _block_loss(graphdef, other):
    """(params, x [B, T, D]) -> scalar touching the output and the router logits (the aux-loss input)."""

    def loss(params, x):
        y, logits = nnx.merge(graphdef, params, other)(x)
        return jnp.sum(jnp.sin(y)) + 0.1 * jnp.sum(jnp.tanh(logits))

    return loss


def _count_parallel_calls(monkeypatch) -> list:
    calls = []
    real = moe.experts_parallel
    monkeypatch.setattr(moe, "experts_parallel", lambda *a, **kw: calls.append(kw["mesh"]) or real(*a, **kw))
    return calls


@needs_8
@pytest.mark.parametrize("mesh_cfg", MESHES, ids=lambda c: f"d{c.data}f{c.fsdp}e{c.expert}t{c.tensor}")
@pytest.mark.parametrize("shape,rows_per_chunk", [((8, 3), None), ((1, 13), 8)], ids=["even", "odd-chunked"])
def test_block_forward_and_grads_equal_single_device(mesh_cfg, shape, rows_per_chunk, monkeypatch):
    _check_block_on_mesh(mesh_cfg, shape, rows_per_chunk, "ragged", monkeypatch)


@needs_8
@pytest.mark.parametrize("mesh_cfg", [MESHES[0], MESHES[3]], ids=lambda c: f"d{c.data}f{c.fsdp}e{c.expert}t{c.tensor}")
def test_pallas_grouped_matmul_block_on_mesh_equals_single_device(mesh_cfg, monkeypatch):
    """moe_impl=pallas inside the expert-parallel shard_map (checked varying axes): the kernel's out_shape
    and custom VJP carry the inputs' varying axes (kernels/pallas/vma.py); equal to the one-device ragged block."""
    _check_block_on_mesh(mesh_cfg, (8, 3), None, "pallas", monkeypatch)


def _check_block_on_mesh(mesh_cfg, shape, rows_per_chunk, moe_impl, monkeypatch):
    if rows_per_chunk:  # several chunks per device
        monkeypatch.setattr(moe_parallel, "ROWS_PER_CHUNK", rows_per_chunk)
    calls = _count_parallel_calls(monkeypatch)
    block = SparseMoeBlock(tiny_config("qwen3_moe", **BLOCK), rngs=nnx.Rngs(params=3))
    sharded_block = SparseMoeBlock(tiny_config("qwen3_moe", moe_impl=moe_impl, **BLOCK), rngs=nnx.Rngs(params=3))
    sharded_graphdef = nnx.graphdef(sharded_block)
    graphdef, params, other = nnx.split(block, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (*shape, BLOCK["hidden_size"]))
    loss = _block_loss(graphdef, other)
    forward = lambda p, x: nnx.merge(graphdef, p, other)(x)[0]  # noqa: E731

    y_ref = forward(params, x)
    l_ref, (gp_ref, gx_ref) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    assert calls == []

    mesh = make_mesh(mesh_cfg)
    param_sh = param_shardings(params, mesh)
    x_sh = NamedSharding(mesh, P(BATCH_AXES) if shape[0] % 8 == 0 else P())
    loss = _block_loss(sharded_graphdef, other)
    forward = lambda p, x: nnx.merge(sharded_graphdef, p, other)(x)[0]  # noqa: E731
    y = jax.jit(mesh_context(forward, mesh), in_shardings=(param_sh, x_sh))(params, x)
    l, (gp, gx) = jax.jit(mesh_context(jax.value_and_grad(loss, argnums=(0, 1)), mesh),
                          in_shardings=(param_sh, x_sh))(params, x)
    assert len(calls) == 2 and calls[0].shape == mesh.shape  # the expert-parallel path ran
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    np.testing.assert_allclose(l, l_ref, rtol=1e-6)
    np.testing.assert_allclose(gx, gx_ref, atol=1e-5)
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp_ref)):
        np.testing.assert_allclose(g, g_ref, atol=1e-5, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------
# Whole model through the learner's sharded step
# ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_8
def test_scanned_learner_gradients_on_data_fsdp_expert_mesh_equal_unrolled_single_device(monkeypatch):
    from learner_utils import VOCAB, assert_trees_close, random_samples, small_config

    from ulorl_jax.rl.learner import Learner

    model = init_model(tiny_config("qwen3_moe", vocab_size=VOCAB, hidden_size=32, head_dim=8, num_experts=8,
                                   num_hidden_layers=2, moe_intermediate_size=16), seed=5)
    samples = random_samples(8, 12)
    conf = small_config(micro_batch_rows=8, aux_loss_coef=0.01, mask_mode="mpt", tau=0.02)
    loss_ref, grads_ref = Learner(model, conf).gradients(samples)
    calls = _count_parallel_calls(monkeypatch)
    # The sharded side also scans its layers (models/layer_scan.py): stacked weights keep their shardings.
    scanned = dataclasses.replace(conf, scan_layers=True)
    loss, grads = Learner(model, scanned, make_mesh(MeshConfig(data=2, fsdp=2, expert=2))).gradients(samples)
    assert calls  # the model's MoE layers ran expert-parallel
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    assert_trees_close(grads, grads_ref, 1e-4, 1e-6, "grads data=2 fsdp=2 expert=2")


@needs_8
def test_router_top_k_stays_row_sharded():
    """top_k's custom call is replicated by GSPMD (an all-gather of [all tokens, E] per MoE layer and again
    in the aux loss); `top_k_rows` runs it per row shard: same values and indices, no [N, E] gather."""
    n, e, k = 64, 16, 4
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (n, e)), axis=-1)
    want = jax.lax.top_k(probs, k)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    placed = jax.device_put(probs, NamedSharding(mesh, P(BATCH_AXES, None)))
    fn = jax.jit(mesh_context(lambda p: moe.top_k_rows(p, k), mesh))
    got = fn(placed)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=0)
    hlo = fn.lower(placed).compile().as_text()
    assert f"f32[{n},{e}]" not in hlo and f"f32[{n // 8},{e}]" in hlo
