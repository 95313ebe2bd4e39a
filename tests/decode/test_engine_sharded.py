"""PolicyEngine on an 8-device mesh == the same engine on one device.

8 fake CPU devices (tests/conftest.py). The sharded engine gets params sharded as the learner holds
them (`sharding.shard_model`) and `mesh=`: its functions trace under the mesh, so the MoE runs
expert-parallel (models/moe_parallel.py) and Pallas decode attention one kernel call per (slot, head)
block (kernels/pallas/sharded.py). Reference: the one-device engine (itself tested equal to transformers'
generate in test_engine.py). Greedy tokens must be identical; log-probs f32 within 1e-4 (different
summation order in the collectives).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from ulorl_jax.decode.engine import PolicyEngine, Request, decode_state_specs
from ulorl_jax.decode.sampling import GREEDY
from ulorl_jax.models import init_model, moe, tiny_config
from ulorl_jax.sharding import MeshConfig, make_mesh, shard_model

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7, 21], [88, 1, 30, 30, 4, 19, 52, 6], [33, 8, 15, 91, 27],
           [7, 7, 7], [100, 3, 64, 2, 2, 9]]
NEW = 10


def _run(engine, params):
    outs, _ = engine.run(params, [Request(p, NEW, i) for i, p in enumerate(PROMPTS)], steps_per_call=4)
    return outs


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_sharded_engine_generates_what_one_device_does(attention_impl, monkeypatch):
    config = tiny_config("qwen3_moe", attention_impl=attention_impl, num_experts=8, num_experts_per_tok=2)
    model = init_model(config, seed=3)
    kw = dict(max_concurrent_decodes=4, max_prefill_length=8, max_cache_len=24, sampling=GREEDY)
    want = _run(PolicyEngine(model, **kw), nnx.state(model, nnx.Param))

    calls = []
    real = moe.experts_parallel
    monkeypatch.setattr(moe, "experts_parallel", lambda *a, **k: calls.append(1) or real(*a, **k))
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    sharded_model = shard_model(init_model(config, seed=3), mesh)
    engine = PolicyEngine(sharded_model, mesh=mesh, **kw)
    params = engine.load_params()
    got = _run(engine, params)
    assert calls  # the MoE ran expert-parallel inside the engine
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.tokens == w.tokens, f"prompt {i}"
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4, err_msg=f"prompt {i}")

    # The decode state keeps its layout: slots over (fsdp, expert), KV heads over tensor; a second run
    # compiles nothing new.
    state = engine.init_decode_state()
    specs = decode_state_specs(state, mesh)
    assert specs.cache.k[0] == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None, "tensor", None)
    assert state.cache.k[0].sharding.spec == specs.cache.k[0]
    compiled = engine.compile_count()
    assert [c.tokens for c in _run(engine, params)] == [c.tokens for c in got]
    assert engine.compile_count() == compiled
