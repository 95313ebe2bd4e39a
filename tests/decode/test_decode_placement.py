"""Where the rollout decodes (rollout.decode_mesh, issue 15 part 3): every layout decodes the same tokens
as the learner's mesh, holds the weights where it says, and keeps every device of its mesh decoding."""

import jax
import numpy as np
import pytest
from flax import nnx

from ulorl_jax.config import ConfigError, load_config
from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.placement import decode_placement, resolve_kind, weight_bytes
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.sharding import MeshConfig, make_mesh, shard_model

VOCAB = 96
GIB = 2**30


@pytest.fixture(scope="module")
def learner():
    """A tiny model sharded over the 8 devices as the learner holds it (fsdp=8), and its params."""
    model = init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=1), seed=5)
    mesh = make_mesh(MeshConfig(fsdp=8))
    shard_model(model, mesh)
    return model, mesh, nnx.state(model, nnx.Param)


def _requests():
    """A group of 4 equal prompts and 4 distinct ones (8 requests for 16 slots: half the slots)."""
    rng = np.random.default_rng(1)
    group = rng.integers(1, VOCAB, 5).tolist()
    prompts = [group] * 4 + [rng.integers(1, VOCAB, n).tolist() for n in (3, 9, 14, 7)]
    return [Request(p, 6, jax.random.PRNGKey(20 + i)) for i, p in enumerate(prompts)]


def _decode(model, placement, params):
    engine = PolicyEngine(model, max_concurrent_decodes=16, max_prefill_length=16, max_cache_len=24,
                          sampling=SamplingParams(0.9, 0, 1.0), mesh=placement.engine_mesh)
    return engine.run(placement.params(params), _requests(), steps_per_call=3)


@pytest.mark.slow  # four engines compiled on 8 devices: ~40 s on 2 busy cores
def test_every_layout_decodes_what_the_learner_mesh_decodes(learner):
    model, mesh, params = learner
    ref, ref_stats = _decode(model, decode_placement("learner", mesh, params), params)
    assert ref_stats.decode_devices == 8
    for kind, devices in (("replicate", 8), ("shard", 8), ("first_device", 1)):
        placement = decode_placement(kind, mesh, params)
        assert placement.kind == kind and placement.devices == devices
        got, stats = _decode(model, placement, params)
        assert stats.decode_devices == devices, kind  # distinct slots on that many devices
        assert [c.tokens for c in got] == [c.tokens for c in ref], kind
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, err_msg=kind)


def test_weights_sit_where_the_layout_says(learner):
    _, mesh, params = learner
    embed = lambda tree: tree["embed_tokens"].get_value()  # noqa: E731
    whole = np.asarray(embed(params))
    for kind in ("learner", "replicate", "shard", "first_device"):
        placement = decode_placement(kind, mesh, params)
        x = embed(placement.params(params))
        shards = x.addressable_shards
        assert {s.device for s in shards} == set(placement.mesh.devices.flat), kind
        if kind in ("replicate", "first_device"):
            assert all(s.data.shape == whole.shape for s in shards), kind  # the whole table on every device
        else:
            assert all(s.data.size == whole.size // 8 for s in shards), kind  # one eighth each (fsdp)
        np.testing.assert_array_equal(np.asarray(x), whole)


def test_requests_are_spread_over_the_devices(learner):
    """16 slots on 8 devices (2 each): the first 8 requests get one slot per device, and a refill goes to
    the devices with the fewest busy slots."""
    model, mesh, params = learner
    placement = decode_placement("replicate", mesh, params)
    engine = PolicyEngine(model, max_concurrent_decodes=16, max_prefill_length=16, max_cache_len=24,
                          mesh=placement.engine_mesh)
    assert engine._spread(list(range(16)), [None] * 16)[:8] == [0, 2, 4, 6, 8, 10, 12, 14]
    busy = [None] * 16
    for slot in (0, 1, 2, 4):  # device 0 full, devices 1 and 2 half busy
        busy[slot] = slot
    free = [s for s in range(16) if busy[s] is None]
    order = engine._spread(free, busy)
    assert sorted(order) == free and order[:5] == [6, 8, 10, 12, 14]  # the idle devices first
    assert order[5:7] == [3, 5]


def test_auto_and_bad_choices():
    weights = 10 * GIB
    assert resolve_kind("auto", 1, weights, 80 * GIB) == "learner"
    assert resolve_kind("auto", 2, weights, 80 * GIB) == "replicate"
    assert resolve_kind("auto", 2, weights, 16 * GIB) == "shard"  # more than half of a device
    assert resolve_kind("auto", 2, weights, None) == "replicate"  # CPU: no memory figure
    assert resolve_kind("shard", 1, weights, None) == "shard"
    with pytest.raises(ValueError, match=r"rollout.decode_mesh=learner needs one process, this run has 2"):
        resolve_kind("learner", 2, weights, None)
    with pytest.raises(ValueError, match=r"rollout.decode_mesh='everywhere': choose one of auto, learner"):
        resolve_kind("everywhere", 1, weights, None)
    with pytest.raises(ConfigError, match=r"rollout.decode_mesh"):
        load_config("tiny_cpu", ["rollout.decode_mesh=everywhere"])


def test_weight_bytes_counts_the_whole_weights(learner):
    _, _, params = learner
    expected = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    assert weight_bytes(params) == expected > 0
