"""The engine's compiled shapes stay few: a run on a mesh (one device included) compiles nothing that an
earlier run compiled, prefill rows come in powers of four, and one prefill fanout serves every run."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.sharding import MESH_AXES


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3"), seed=5)


def requests(seed):
    rng = np.random.default_rng(seed)
    group = rng.integers(1, 128, 6).tolist()
    return ([Request(group, 12, (seed, i)) for i in range(4)]  # a group: one shared prefill row
            + [Request(rng.integers(1, 128, int(rng.integers(3, 15))).tolist(), int(rng.integers(4, 20)), (seed, 9 + i))
               for i in range(5)])


def mesh_of(devices: int):
    shape = (devices,) + (1,) * (len(MESH_AXES) - 1)
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(shape), MESH_AXES)


def as_the_learner_lays_out(params, mesh):
    """Weights committed to the mesh with a spec on their axes, as the learner holds them: what made a
    one-device engine's state change layout from call to call."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(*(("tensor", "fsdp")[:x.ndim])))), params)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
@pytest.mark.parametrize("devices", [1, 2])
def test_runs_on_a_mesh_compile_nothing_a_run_before_compiled(model, kv_cache, devices):
    if len(jax.devices()) < devices:
        pytest.skip("needs the fake CPU devices of tests/conftest.py")
    sampling = SamplingParams(temperature=1.0)
    eng = PolicyEngine(model, max_concurrent_decodes=8, max_prefill_length=16, max_cache_len=40, sampling=sampling,
                       mesh=mesh_of(devices), kv_cache=kv_cache, page_size=8, prefill_fanout=4)
    params = as_the_learner_lays_out(eng.load_params(), mesh_of(devices))
    shapes = set()
    prefill = eng._prefill_rows_jit

    def recording(p, state, tokens, *args, **kwargs):
        shapes.add(tokens.shape)
        return prefill(p, state, tokens, *args, **kwargs)

    recording._cache_size = prefill._cache_size
    eng._prefill_rows_jit = recording
    reqs = requests(0)
    first, _ = eng.run(params, reqs, steps_per_call=4)
    compiled = eng.compile_count()
    assert compiled == len(shapes) + 1  # one compile per prefill shape, one decode step: no layout changes
    again, _ = eng.run(params, reqs, steps_per_call=4)  # same shapes: the state's layout must match too
    assert eng.compile_count() == compiled
    assert [c.tokens for c in again] == [c.tokens for c in first]
    plain = PolicyEngine(model, max_concurrent_decodes=8, max_prefill_length=16, max_cache_len=40, sampling=sampling,
                         kv_cache=kv_cache, page_size=8, prefill_fanout=4)
    want, _ = plain.run(plain.load_params(), reqs, steps_per_call=4)
    assert [c.tokens for c in first] == [c.tokens for c in want]


def test_prefill_rows_are_powers_of_four_or_the_cap(model):
    eng = PolicyEngine(model, max_concurrent_decodes=64, max_prefill_length=128, max_cache_len=160,
                       prefill_token_budget=2048)
    assert [eng.prefill_rows(n, 16) for n in (1, 2, 4, 5, 16, 17, 64)] == [1, 4, 4, 16, 16, 64, 64]
    assert eng.prefill_rows_cap(16) == 64  # the slots, not budget / 16 = 128
    assert [eng.prefill_rows(n, 128) for n in (3, 5, 16)] == [4, 16, 16]
    assert eng.prefill_rows_cap(128) == 16 and eng.prefill_rows(1, 4096) == 1
    # every call of a plan has one of those shapes, within the budget
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 129, int(rng.integers(1, 64))).tolist()
        for length, rows in eng.plan_prefill(lengths):
            r = eng.prefill_rows(len(rows), length)
            assert r in (1, 4, 16, 64, eng.prefill_rows_cap(length)) and r * length <= 2048


def test_a_group_wider_than_the_fanout_takes_several_rows(model):
    """prefill_fanout=2: the group of 4 takes 2 rows; tokens equal an engine that shares one row."""
    reqs = requests(1)
    wide = PolicyEngine(model, max_concurrent_decodes=8, max_prefill_length=16, max_cache_len=40, sampling=GREEDY)
    narrow = PolicyEngine(model, max_concurrent_decodes=8, max_prefill_length=16, max_cache_len=40, sampling=GREEDY,
                          prefill_fanout=2)
    want, ws = wide.run(wide.load_params(), reqs)
    got, ns = narrow.run(narrow.load_params(), reqs)
    assert ws.prefill_rows == 6 and ns.prefill_rows == 7
    assert [c.tokens for c in got] == [c.tokens for c in want]
