"""Sharded forward on 8 fake CPU devices equals the unsharded one; params carry the rules' shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hf_utils import save_hf_model
from ulorl_jax.models import init_model, init_sharded, tiny_config
from ulorl_jax.models.hf import from_pretrained
from ulorl_jax.sharding import (DEFAULT_PARAM_RULES, MeshConfig, MeshError, logical_to_spec, spec_on,
                                make_mesh, shard_batch, shard_model)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")

MESHES = {
    "fsdp8": MeshConfig(fsdp=8),
    "data2-fsdp2-tensor2": MeshConfig(data=2, fsdp=2, tensor=2),
    "fsdp2-expert4": MeshConfig(fsdp=2, expert=4),
    "data2-expert2-tensor2": MeshConfig(data=2, fsdp=1, expert=2, tensor=2),
}


def _walk_params(model):
    state = nnx.state(model, nnx.Param)
    return jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_config("qwen3_moe", num_experts=8, num_hidden_layers=2)
    model = init_model(cfg, seed=7)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 12)), jnp.int32)
    return cfg, model, tokens, np.asarray(model(tokens))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_forward_equals_unsharded(reference, mesh_name):
    cfg, model, tokens, expected = reference
    mesh = make_mesh(MESHES[mesh_name])
    sharded = init_sharded(cfg, mesh, seed=7)  # same seed: same weights, created in place on the mesh
    for path, var in _walk_params(sharded):
        want = spec_on(logical_to_spec(var.logical_axes, DEFAULT_PARAM_RULES), mesh)
        assert var[...].sharding.spec == want, jax.tree_util.keystr(path)
        assert var[...].sharding.mesh == mesh
    assert sharded.layers[0].mlp.gate[...].sharding.spec == P("expert", "fsdp", "tensor")  # context 1: as before
    logits = nnx.jit(lambda m, t: m(t))(sharded, shard_batch(tokens, mesh))
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5)
    # shard_model moves an existing model onto the mesh the same way
    moved = shard_model(init_model(cfg, seed=7), mesh)
    assert moved.embed_tokens[...].sharding.spec == P("tensor", "fsdp")


def test_from_pretrained_places_shards(tmp_path):
    save_hf_model("qwen3_moe", tmp_path, vocab_size=96)  # divisible by tensor=2
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    sharded = from_pretrained(tmp_path, mesh=mesh)
    plain = from_pretrained(tmp_path)
    q = sharded.layers[0].self_attn.q_proj[...]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (16, 2, 8)
    tokens = jnp.ones((8, 5), jnp.int32)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, t: m(t))(sharded, shard_batch(tokens, mesh))),
                               np.asarray(plain(tokens)), atol=1e-5)


def test_bad_mesh_shapes():
    with pytest.raises(MeshError, match=r"data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 = 3 devices, but 8 are available"):
        make_mesh(MeshConfig(data=3, fsdp=1))
    with pytest.raises(MeshError, match="8 is not a multiple of 3"):
        make_mesh(MeshConfig(data=3))
    with pytest.raises(MeshError, match="only one mesh axis may be -1"):
        make_mesh(MeshConfig(data=-1, fsdp=-1))
    with pytest.raises(MeshError, match="mesh.tensor=0"):
        make_mesh(MeshConfig(tensor=0))


def test_indivisible_parameter_and_batch_name_the_tensor():
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=8))
    with pytest.raises(MeshError, match=r"parameter .*k_proj with shape \(64, 2, 16\).*does not divide"):
        init_sharded(tiny_config("qwen3"), mesh)
    with pytest.raises(MeshError, match=r"batch of shape \(3, 4\)"):
        shard_batch(jnp.ones((3, 4)), make_mesh(MeshConfig(fsdp=8)))


def test_single_device_mesh_works():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    model = init_sharded(tiny_config("qwen3"), mesh, seed=1)
    tokens = jnp.ones((2, 3), jnp.int32)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(init_model(tiny_config("qwen3"), 1)(tokens)),
                               atol=1e-6)


def test_context_axis_shards_parameters_like_fsdp():
    """With mesh.context > 1 the embed dim splits over fsdp x context (ZeRO-3 over both); at context 1 the
    spelling is the one without a context axis."""
    assert DEFAULT_PARAM_RULES["embed"] == ("fsdp", "context")
    both = make_mesh(MeshConfig(fsdp=2, context=4))
    assert spec_on(P("expert", ("fsdp", "context"), "tensor"), both) == P("expert", ("fsdp", "context"), "tensor")
    assert spec_on(P(("fsdp", "context")), make_mesh(MeshConfig(fsdp=8))) == P("fsdp")
    assert spec_on(P(("fsdp", "context")), make_mesh(MeshConfig(fsdp=1, context=8))) == P("context")
