"""PolicyEngine with the paged KV cache: the same tokens as the dense cache, preemption when pages run
out, admission by pages, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.page_pool import PagePool
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models import init_model, tiny_config


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3"), seed=3)


def requests(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(1, 128, size=int(rng.integers(3, 12))).tolist(), int(rng.integers(5, 40)), i)
            for i in range(n)]


def engine(model, sampling, **kw):
    return PolicyEngine(model, max_prefill_length=16, max_cache_len=64, sampling=sampling, **kw)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_tiny_pool_preempts_and_equals_the_dense_cache(model, sampling):
    """14 pages of 4 positions for 8 slots: samples are preempted and prefilled again with their tokens so
    far; every token equals the dense engine's, log-probs up to the prefill's rounding."""
    reqs = requests()
    dense = engine(model, sampling, max_concurrent_decodes=4)
    want, _ = dense.run(dense.load_params(), reqs)
    paged = engine(model, sampling, max_concurrent_decodes=8, kv_cache="paged", page_size=4, num_pages=14)
    got, stats = paged.run(paged.load_params(), reqs, steps_per_call=1)  # one call's reserve: one page each
    assert stats.preemptions > 0
    assert stats.peak_pages <= 14
    for i, (a, b) in enumerate(zip(want, got)):
        assert b.tokens == a.tokens, f"request {i}"
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, err_msg=f"request {i}")
        np.testing.assert_allclose(b.sampling_logprobs, a.sampling_logprobs, atol=1e-4)
        assert b.stop == a.stop


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_swap_preemption_equals_enough_pages(model, sampling, monkeypatch):
    """preemption="swap" on the same tiny pool: preempted samples' pages go to host memory and come back
    into other pages, with no second prefill. Tokens equal the dense engine's and a paged run with pages
    enough that nothing is preempted; log-probs equal the latter's up to float rounding (the pool's size
    changes the decode attention's sums: 5e-7 here, as much as a run that recomputes). Copies go one page
    at a time here, so a sample's pages take several calls."""
    import ulorl_jax.decode.engine as engine_module

    monkeypatch.setattr(engine_module, "SWAP_CHUNK_BYTES", 1)  # one page per copy call
    reqs = requests()
    dense = engine(model, sampling, max_concurrent_decodes=4)
    want, _ = dense.run(dense.load_params(), reqs)
    roomy = engine(model, sampling, max_concurrent_decodes=8, kv_cache="paged", page_size=4)
    exact, none = roomy.run(roomy.load_params(), reqs, steps_per_call=1)
    swap = engine(model, sampling, max_concurrent_decodes=8, kv_cache="paged", page_size=4, num_pages=14,
                  preemption="swap")
    got, stats = swap.run(swap.load_params(), reqs, steps_per_call=1)
    assert none.preemptions == 0 and stats.preemptions > 0
    assert stats.peak_pages <= 14 and stats.swap_seconds > 0
    assert stats.prefills == len(reqs)  # each request prefilled once: readmission copies, not prefills
    for i, (a, b, c) in enumerate(zip(want, exact, got)):
        assert c.tokens == a.tokens == b.tokens, f"request {i}"
        np.testing.assert_allclose(c.logprobs, b.logprobs, atol=1e-5, rtol=0, err_msg=f"request {i}")
        np.testing.assert_allclose(c.sampling_logprobs, b.sampling_logprobs, atol=1e-5, rtol=0)
        assert c.stop == a.stop


def paged(model, sampling, **kw):
    return PolicyEngine(model, max_prefill_length=16, max_cache_len=64, sampling=sampling,
                        max_concurrent_decodes=8, kv_cache="paged", page_size=4, **kw)


def record_prefill_rows(engine) -> list[list[int]]:
    """Every row the engine's batched prefill is handed, in order (an instance attribute over the method)."""
    rows = []
    prefill_many = engine._prefill_many

    def recording(params, state, prompts, *args, **kw):
        rows.extend(np.asarray(p).tolist() for p in prompts)
        return prefill_many(params, state, prompts, *args, **kw)

    engine._prefill_many = recording
    return rows


def test_recompute_preemption_prefills_again_and_equals_a_roomy_pool(model):
    """Sampled (greedy: test_paged_engine.py): a preempted sample must take its RNG key along to its second
    prefill for its tokens to equal the roomy pool's."""
    sampling = SamplingParams(temperature=1.0)
    reqs = requests()
    roomy = paged(model, sampling)  # the dense cache's memory: 8 slots x 64 positions / 4
    roomy_rows = record_prefill_rows(roomy)
    want, none = roomy.run(roomy.load_params(), reqs, steps_per_call=1)
    tiny = paged(model, sampling, num_pages=14, preemption="recompute")
    tiny_rows = record_prefill_rows(tiny)
    got, stats = tiny.run(tiny.load_params(), reqs, steps_per_call=1)

    assert none.preemptions == 0 and none.prefills == len(reqs) and len(roomy_rows) == len(reqs)
    assert stats.preemptions > 0 and stats.peak_pages <= 14
    # every preempted sample is prefilled once more: RunStats counts it ...
    assert stats.prefills - len(reqs) == stats.preemptions
    assert stats.prefill_tokens > none.prefill_tokens
    # ... and so do the rows handed to the prefill: each re-prefill row is a prompt followed by that
    # request's first tokens (all it had generated but the last)
    prompts = [r.prompt_ids for r in reqs]
    again = [row for row in tiny_rows if row not in prompts]
    assert len(tiny_rows) == len(reqs) + stats.preemptions and len(again) == stats.preemptions
    for row in again:
        owners = [i for i, p in enumerate(prompts) if row[:len(p)] == p and len(row) > len(p)
                  and row[len(p):] == want[i].tokens[:len(row) - len(p)]]
        assert owners, f"re-prefill row {row} is no request's prompt + tokens so far"
    for i, (a, b) in enumerate(zip(want, got)):
        assert b.tokens == a.tokens, f"request {i}"
        assert b.stop == a.stop
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, err_msg=f"request {i}")
        np.testing.assert_allclose(b.sampling_logprobs, a.sampling_logprobs, atol=1e-4, err_msg=f"request {i}")


def test_swap_out_and_in_moves_a_slot_to_other_pages(model):
    """swap_out then swap_in into different pages of the pool: the decode state's row and the K/V at the
    slot's cached positions are restored exactly, and the next decode call gives the same tokens."""
    eng = engine(model, GREEDY, max_concurrent_decodes=2, kv_cache="paged", page_size=4, num_pages=16)
    params = eng.load_params()
    reqs = requests(2, seed=4)
    _, stats = eng.run(params, reqs)  # reference run: tokens of both requests
    assert stats.preemptions == 0
    pool = PagePool(16, 4, 2, eng.max_pages_per_slot)
    for slot, r in enumerate(reqs):
        assert pool.grow(slot, len(r.prompt_ids) + 4)
    state = eng._with_page_table(eng.init_decode_state(), pool.table())
    state, _ = eng._prefill_many(params, state, [np.asarray(r.prompt_ids, np.int32) for r in reqs],
                                 [r.max_new_tokens for r in reqs], [np.array([0, r.key], np.uint32) for r in reqs],
                                 [0, 1], GREEDY, 1, [None, None])
    state, _ = eng.generate_steps(params, state, 3)
    before = np.asarray(state.cache.k[0]).copy()
    _, want = eng.generate_steps(params, jax.tree.map(jnp.copy, state), 3)  # the next call, undisturbed
    out = eng.swap_out(state, 1, pool.owned(1))
    state = eng.free_slot(state, 1)
    pool.release(1)
    assert pool.grow(0, len(reqs[0].prompt_ids) + 12)  # slot 0 takes pages slot 1 gave back
    assert pool.grow(1, int(out.row.index) + 4)  # slot 1 comes back into other pages
    state = eng._with_page_table(state, pool.table())
    state = eng.swap_in(state, 1, pool.owned(1), out)
    again = eng.swap_out(state, 1, pool.owned(1))
    for a, b in zip(out.k + out.v + tuple(out.row), again.k + again.v + tuple(again.row)):
        np.testing.assert_array_equal(a, b)
    assert not bool(np.asarray(state.done)[1])
    assert not np.array_equal(before, np.asarray(state.cache.k[0]))  # the pool changed: pages moved
    _, got = eng.generate_steps(params, state, 3)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
    assert np.asarray(want.valid)[1].all()


def test_enough_pages_keeps_more_samples_in_flight(model):
    """The dense cache's memory (4 slots x 64 positions = 64 pages of 4) as a pool for 16 slots: short
    samples no longer wait for a slot (the long ones are preempted now and then); tokens equal; stop
    sequences still end samples."""
    reqs = requests(16, seed=1)
    stop = [reqs[0].prompt_ids[:0] + [7]]
    dense = engine(model, GREEDY, max_concurrent_decodes=4)
    want, d = dense.run(dense.load_params(), reqs, stop_sequences=stop)
    paged = engine(model, GREEDY, max_concurrent_decodes=16, kv_cache="paged", page_size=4, num_pages=64)
    got, p = paged.run(paged.load_params(), reqs, stop_sequences=stop, steps_per_call=2)
    assert p.peak_pages <= 64
    assert p.in_flight > 2 * d.in_flight
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.stop for c in got] == [c.stop for c in want]


def test_default_pool_is_the_dense_cache_memory_and_never_preempts(model):
    paged = engine(model, GREEDY, max_concurrent_decodes=4, kv_cache="paged", page_size=8)
    assert paged.num_pages == 4 * 8  # 4 slots x 64 positions
    _, stats = paged.run(paged.load_params(), requests(8, seed=2))
    assert stats.preemptions == 0 and 0 < stats.peak_pages <= 32


def test_request_that_can_never_fit_is_refused_up_front(model):
    paged = engine(model, GREEDY, max_concurrent_decodes=2, kv_cache="paged", page_size=4, num_pages=5)
    with pytest.raises(ValueError, match=r"request 1: a prompt of 5 tokens \+ max_new_tokens=30 needs 9 KV pages "
                                         r"of 4 positions, more than the pool's num_pages=5"):
        paged.run(paged.load_params(), [Request([1, 2, 3], 4, 0), Request([1, 2, 3, 4, 5], 30, 1)])


def test_paged_engine_refuses_the_calls_that_bypass_its_pages(model):
    paged = engine(model, GREEDY, max_concurrent_decodes=2, kv_cache="paged", page_size=4)
    state = paged.init_decode_state()
    with pytest.raises(ValueError, match="prefill_many needs kv_cache='dense'"):
        paged.prefill_many(paged.load_params(), state, [Request([1, 2], 3, 0)], [0])
    with pytest.raises(ValueError, match="kv_cache="):
        engine(model, GREEDY, max_concurrent_decodes=2, kv_cache="pages")
    with pytest.raises(ValueError, match=r"preemption='swapped': expected one of \('recompute', 'swap'\)"):
        engine(model, GREEDY, max_concurrent_decodes=2, kv_cache="paged", preemption="swapped")


def test_page_pool_hands_out_and_takes_back_pages():
    pool = PagePool(num_pages=6, page_size=4, slots=3, max_pages_per_slot=4)
    assert pool.grow(0, 5) and pool.owned(0) == [0, 1]
    assert pool.grow(1, 4) and pool.owned(1) == [2]
    assert pool.grow(0, 9) and pool.owned(0) == [0, 1, 3]  # grows by the missing page only
    assert not pool.grow(2, 13)  # 4 pages wanted, 2 free: nothing taken
    assert pool.owned(2) == [] and pool.free_pages == 2
    assert pool.table().shape == (3, 4)  # always max_pages_per_slot wide: one compiled shape
    np.testing.assert_array_equal(pool.table(), [[0, 1, 3, 6], [2, 6, 6, 6], [6, 6, 6, 6]])
    pool.release(0)
    assert pool.free_pages == 5 and pool.peak_used == 4
    assert pool.grow(2, 100) and len(pool.owned(2)) == 4  # capped at max_pages_per_slot


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
def test_swap_preemption_on_a_mesh_equals_one_device():
    """The swap copies under an 8-device mesh (slots over fsdp x expert, KV heads over tensor): the same
    greedy tokens as the one-device dense engine, through preemptions."""
    from ulorl_jax.sharding import MeshConfig, make_mesh, shard_model

    config = tiny_config("qwen3")
    reqs = requests()
    dense = engine(init_model(config, seed=3), GREEDY, max_concurrent_decodes=4)
    want, _ = dense.run(dense.load_params(), reqs)
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    sharded = engine(shard_model(init_model(config, seed=3), mesh), GREEDY, mesh=mesh, max_concurrent_decodes=8,
                     kv_cache="paged", page_size=4, num_pages=14, preemption="swap")
    got, stats = sharded.run(sharded.load_params(), reqs, steps_per_call=1)
    assert stats.preemptions > 0 and stats.prefills == len(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in want]
