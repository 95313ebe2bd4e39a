"""Batched prefill (issue 15): many requests per jitted call, one prefill per group of equal prompts,
a fixed set of shapes, and tokens / log-probs equal to the one-request JetStream path."""

import jax
import numpy as np
import pytest

from ulorl_jax.decode.engine import PREFILL_CALL_COST_TOKENS, PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout
from ulorl_jax.types import PromptItem

VOCAB = 96
SAMPLED = SamplingParams(0.85, 10, 0.9)


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1), seed=3)


def workload():
    """Two groups of 4 equal prompts (new samples) and 3 distinct continued samples of mixed lengths."""
    rng = np.random.default_rng(0)
    groups = [rng.integers(1, VOCAB, 6).tolist(), rng.integers(1, VOCAB, 3).tolist()]
    prompts = [g for g in groups for _ in range(4)] + [rng.integers(1, VOCAB, n).tolist() for n in (13, 9, 20)]
    return [Request(p, int(b), jax.random.PRNGKey(10 + i)) for i, (p, b) in
            enumerate(zip(prompts, rng.integers(1, 9, len(prompts))))]


def one_request_per_call(engine, params, r, sampling):
    """Today's path: JetStream's one-request `prefill` + `insert`, then decode that slot alone."""
    prefix, _ = engine.prefill(params=params, padded_tokens=np.asarray(r.prompt_ids), true_length=len(r.prompt_ids),
                               rng=r.key, max_new_tokens=r.max_new_tokens, sampling=sampling)
    state = engine.insert(prefix, engine.init_decode_state(), engine.max_concurrent_decodes - 1)
    tokens, lps = [int(prefix.token)], [float(prefix.logprob)]
    if r.max_new_tokens > 1:
        state, steps = engine.generate_steps(params, state, 8, sampling=sampling)  # stops at the budget
        valid = np.asarray(steps.valid[-1])
        tokens += np.asarray(steps.tokens[-1])[valid].tolist()
        lps += np.asarray(steps.logprobs[-1])[valid].tolist()
    return tokens, lps


@pytest.mark.slow  # 11 one-request references: > 20 s on a loaded 2-core box
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_group_prefill_equals_one_request_per_call(model, sampling):
    engine = PolicyEngine(model, max_concurrent_decodes=12, max_prefill_length=32, max_cache_len=40,
                          sampling=sampling, prefill_token_budget=128)
    params = engine.load_params()
    requests = workload()
    outs, stats = engine.run(params, requests, steps_per_call=4)
    # 11 requests, all in one refill: 2 group rows + 3 distinct rows, within the 128-token budget.
    assert stats.prefills == 11 and stats.prefill_rows == 5 and stats.prefill_tokens == 6 + 3 + 13 + 9 + 20
    assert stats.prefill_calls == 2  # rows of [20] tokens: 1 x 32; then [13, 9, 6, 3]: 4 x 16 (plan_prefill)
    for r, c in zip(requests, outs):
        tokens, lps = one_request_per_call(engine, params, r, sampling)
        assert c.tokens == tokens
        np.testing.assert_allclose(c.logprobs, lps, atol=1e-5)
        assert c.stop == "budget" and len(c.tokens) == r.max_new_tokens
    if sampling is SAMPLED:  # the 4 samples of a group share the prefill, not the first token's key
        assert len({c.tokens[0] for c in outs[:4]}) > 1 or len({tuple(c.tokens) for c in outs[:4]}) > 1


def test_prefill_many_inserts_into_the_given_slots(model):
    engine = PolicyEngine(model, max_concurrent_decodes=8, max_prefill_length=32, max_cache_len=40,
                          sampling=SAMPLED)
    params = engine.load_params()
    requests = workload()[2:9]  # half of group 0, group 1, one continued sample
    slots = [5, 0, 3, 1, 4, 7, 6]
    state, first = engine.prefill_many(params, engine.init_decode_state(), requests, slots)
    assert first.calls == 1 and first.rows == 3
    state, steps = engine.generate_steps(params, state, 3)
    for r, slot, tok in zip(requests, slots, first.tokens):
        ref, _ = one_request_per_call(engine, params, r, SAMPLED)
        got = [int(tok)] + np.asarray(steps.tokens[slot])[np.asarray(steps.valid[slot])].tolist()
        assert got == ref[:len(got)]
    assert bool(np.asarray(state.done)[2])  # slot 2 was never filled


def test_plan_respects_the_token_budget(model):
    engine = PolicyEngine(model, max_concurrent_decodes=16, max_prefill_length=64, max_cache_len=64,
                          prefill_token_budget=64)
    assert engine.prefill_buckets == (16, 32, 64)
    lengths = [3, 40, 7, 12, 30, 5, 17, 2, 64]
    calls = engine.plan_prefill(lengths)
    assert sorted(i for _, rows in calls for i in rows) == list(range(len(lengths)))
    for length, rows in calls:
        assert all(lengths[i] <= length for i in rows)
        assert engine.prefill_rows(len(rows), length) * length <= 64 or len(rows) == 1
    # longest first, consecutive calls within rows x L <= 64
    assert [(length, [lengths[i] for i in rows]) for length, rows in calls] == [
        (64, [64]), (64, [40]), (32, [30, 17]), (16, [12, 7, 5, 3]), (16, [2])]
    big = PolicyEngine(model, max_concurrent_decodes=16, max_prefill_length=64, max_cache_len=64,
                       prefill_token_budget=1024)
    # One call would pad all 9 rows to 64 (16 x 64 = 1024 tokens); two calls pad 4 x 64 + 16 x 16 = 512
    # (rows come in powers of four), which saves more than a call costs (PREFILL_CALL_COST_TOKENS).
    assert PREFILL_CALL_COST_TOKENS < 1024 - 512
    assert [(length, [lengths[i] for i in rows]) for length, rows in big.plan_prefill(lengths)] == [
        (64, [64, 40, 30, 17]), (16, [12, 7, 5, 3, 2])]
    # Rows of similar lengths share one call: a split would save less padding than a call costs.
    assert [length for length, _ in big.plan_prefill([60, 50, 40, 33])] == [64]


@pytest.mark.slow  # 18 rollout steps, several compiles: > 20 s on a loaded 2-core box
def test_segment_steps_do_not_recompile(model):
    """A fixed set of compiled shapes: once every shape a workload needs has compiled, more steps with
    new weights and new keys compile nothing."""
    engine = PolicyEngine(model, max_concurrent_decodes=16, max_prefill_length=40, max_cache_len=40,
                          sampling=SAMPLED, prefill_token_budget=256)
    cfg = RolloutConfig(global_max_len=24, num_segments=3, samples_per_prompt=4, max_prompt_len=8, sampling=SAMPLED)
    rng = np.random.default_rng(1)

    def roll(params, seed):
        rollout = SegmentRollout(engine, cfg, steps_per_call=4)
        calls = []
        for step in range(6):
            prompts = [PromptItem(10 * step + j, rng.integers(1, VOCAB, 8).tolist()) for j in range(2)] if step < 3 \
                else []
            rep = rollout.step(params, prompts, policy_version=step, rng=jax.random.PRNGKey(seed + step))
            calls.append((rep.prefill_calls, rep.prefill_rows))
        assert not rollout.unfinished_pool  # no EOS: 3 segments of 8 each, then "length"
        return calls

    params = engine.load_params()
    calls = roll(params, 0)
    assert calls[0] == (1, 2)  # step 0: 2 new prompts x 4 samples -> one call, one row per prompt
    assert calls[1] == (1, 10)  # step 1: 8 continued (16 tokens) + 2 new prompts, one call (16 rows x 16 <= 256)
    compiled = engine.compile_count()
    for scaled in (jax.tree.map(lambda x: x * 0.5, params), jax.tree.map(lambda x: x * 2.0, params)):
        assert roll(scaled, 100) == calls
        assert engine.compile_count() == compiled


def test_bad_input_names_the_request(model):
    engine = PolicyEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_cache_len=24)
    params = engine.load_params()
    state = engine.init_decode_state()
    with pytest.raises(ValueError, match="request 1 prompt has 17 tokens, more than max_prefill_length=16"):
        engine.prefill_many(params, state, [Request([1, 2], 3, 0), Request(list(range(1, 18)), 3, 1)], [0, 1])
    with pytest.raises(ValueError, match="request 1 prompt has 17 tokens, more than max_prefill_length=16"):
        engine.run(params, [Request([1, 2], 3, 0), Request(list(range(1, 18)), 3, 1)])
    with pytest.raises(ValueError, match="distinct slot"):
        engine.prefill_many(params, state, [Request([1], 3, 0), Request([2], 3, 1)], [0, 0])
    with pytest.raises(ValueError, match="slot=4"):
        engine.prefill_many(params, state, [Request([1], 3, 0)], [4])
    with pytest.raises(ValueError, match="max_new_tokens=30"):
        engine.prefill_many(params, state, [Request([1], 30, 0)], [0])
    with pytest.raises(ValueError, match="prefill_token_budget"):
        PolicyEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_cache_len=24, prefill_token_budget=0)


def test_host_keys_equal_jax_keys_bit_for_bit():
    """Batched prefill ships each request's key as raw uint32 [2]; an int seed's host shortcut must be the
    key `jax.random.PRNGKey` makes, and every other kind of key must come through unchanged."""
    from ulorl_jax.decode.engine import _host_key

    for seed in (0, 1, 7, 12345, 2**16 + 3, 2**31 - 1, np.int32(99), np.int64(2**30)):
        got = _host_key(seed)
        assert got.dtype == np.uint32 and got.shape == (2,)
        np.testing.assert_array_equal(got, np.asarray(jax.random.PRNGKey(int(seed))), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(_host_key(-1), np.asarray(jax.random.PRNGKey(-1)))  # outside it: jax's own
    raw = jax.random.fold_in(jax.random.PRNGKey(3), 4)
    np.testing.assert_array_equal(_host_key(raw), np.asarray(raw))
    typed = jax.random.key(5)
    np.testing.assert_array_equal(_host_key(typed), np.asarray(jax.random.key_data(typed)))
    host = np.array([1, 2], np.uint32)
    assert _host_key(host) is host
