"""PolicyEngine: parity with transformers generate, continuous batching, log-probs, no recompiles, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_utils import save_hf_model
from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models.hf import from_pretrained

PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7, 21], [88, 1, 30, 30, 4, 19, 52, 6, 13, 70, 2, 44], [33, 8, 15, 91, 27]]
NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    hf = save_hf_model("qwen3", folder, seed=1)
    return hf, from_pretrained(folder)


def hf_greedy(hf, prompt, eos):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                          eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits, 1)[0].float()  # [N, V]
    lp = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
    return tokens, lp


def make_engine(model, slots=4, **kw):
    kw = {"max_prefill_length": 16, "max_cache_len": 32, "sampling": GREEDY, **kw}
    return PolicyEngine(model, max_concurrent_decodes=slots, **kw)


@pytest.fixture(scope="module")
def engine(models):
    """One greedy 2-slot engine shared by several tests (each engine compiles its own functions)."""
    return make_engine(models[1], slots=2)


@pytest.mark.slow  # several engine compiles: > 20 s on a loaded 2-core box
def test_greedy_equals_transformers_generate(models):
    hf, ours = models
    free = [hf_greedy(hf, p, None)[0] for p in PROMPTS]
    eos = free[1][5]  # an id that really occurs: prompt 1 (at least) stops on it
    assert eos not in free[1][:5]
    engine = make_engine(ours, eos_token_ids=(eos,))
    outs, stats = engine.run(engine.load_params(), [Request(p, NEW, i) for i, p in enumerate(PROMPTS)])
    for p, c in zip(PROMPTS, outs):
        ref_tokens, ref_lp = hf_greedy(hf, p, eos)
        assert c.tokens == ref_tokens
        np.testing.assert_allclose(c.logprobs, ref_lp, atol=1e-4)
        assert c.stop == ("eos" if ref_tokens[-1] == eos else "budget")
    assert outs[1].stop == "eos" and len(outs[1].tokens) == 6
    assert stats.tokens_decoded == sum(len(c.tokens) for c in outs)


def test_jetstream_api_step_by_step_equals_run(engine):
    params = engine.load_params()
    state = engine.init_decode_state()
    tokens = {0: [], 1: []}
    for slot, p in enumerate(PROMPTS[:2]):
        padded = np.zeros(16, np.int32)
        padded[:len(p)] = p
        prefix, first = engine.prefill(params=params, padded_tokens=padded, true_length=len(p), rng=slot,
                                       max_new_tokens=6)
        tokens[slot].append(int(first.convert_to_numpy().get_result_at_slot(0).tokens[0, 0]))
        state = engine.insert(prefix, state, slot)
    for _ in range(7):
        state, result = engine.generate(params, state)
        result = result.convert_to_numpy()
        for slot in (0, 1):
            r = result.get_result_at_slot(slot)
            if r.valid[0, 0]:
                tokens[slot].append(int(r.tokens[0, 0]))
    outs, _ = engine.run(params, [Request(p, 6, i) for i, p in enumerate(PROMPTS[:2])])
    assert [tokens[0], tokens[1]] == [c.tokens for c in outs]
    assert all(len(t) == 6 for t in tokens.values())
    assert engine.samples_per_slot == 1 and engine.max_concurrent_decodes == 2 and engine.max_prefill_length == 16


def test_prefill_on_existing_prefix_equals_one_prefill(engine):
    params = engine.load_params()
    prompt = PROMPTS[2]
    whole, _ = engine.prefill(params=params, padded_tokens=np.asarray(prompt), true_length=len(prompt), rng=3)
    head, _ = engine.prefill(params=params, padded_tokens=np.asarray(prompt[:5]), true_length=5, rng=3)
    tail, _ = engine.prefill(params=params, existing_prefix=head, padded_tokens=np.asarray(prompt[5:] + [0, 0]),
                             true_length=len(prompt) - 5, rng=3)
    assert int(tail.cache.index[0]) == int(whole.cache.index[0]) == len(prompt)
    assert int(tail.token) == int(whole.token)
    np.testing.assert_allclose(float(tail.logprob), float(whole.logprob), atol=1e-5)
    outs = []
    for prefix in (whole, tail):
        state = engine.insert(prefix, engine.init_decode_state(), 1)
        state, steps = engine.generate_steps(params, state, 5)
        outs.append(np.asarray(steps.tokens[1]))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.slow  # several engine compiles: > 20 s on a loaded 2-core box
def test_continuous_batching_equals_one_at_a_time_and_logprobs_match_forward(models):
    _, ours = models
    sampling = SamplingParams(0.85, 10, 0.9)
    engine = make_engine(ours, slots=2, sampling=sampling)
    params = engine.load_params()
    rng = np.random.default_rng(0)
    requests = [Request(rng.integers(0, 97, size=int(rng.integers(1, 14))).tolist(), int(rng.integers(1, 15)), i)
                for i in range(6)]  # 6 requests, 2 slots, mixed lengths and budgets
    batched, stats = engine.run(params, requests, steps_per_call=4)
    assert stats.prefills == 6 and 0 < stats.slot_occupancy <= 1
    forward = nnx.jit(lambda m, t: m(t))
    for r, c in zip(requests, batched):
        alone, _ = engine.run(params, [r], steps_per_call=4)
        assert alone[0].tokens == c.tokens
        np.testing.assert_allclose(alone[0].logprobs, c.logprobs, atol=1e-5)
        assert len(c.tokens) == r.max_new_tokens  # no EOS configured: every request uses its budget
        # Log-probs against the full forward on prompt + response (independent recomputation).
        seq = np.zeros((1, 32), np.int32)  # right padding: causal, so it changes nothing before it
        seq[0, :len(r.prompt_ids) + len(c.tokens)] = r.prompt_ids + c.tokens
        logits = np.asarray(forward(ours, jnp.asarray(seq)))[0, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1
                                                            + len(c.tokens)] / sampling.temperature  # [N, V]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        np.testing.assert_allclose(c.logprobs, logp[np.arange(len(c.tokens)), c.tokens], atol=1e-4)
        assert all(s >= l - 1e-5 for s, l in zip(c.sampling_logprobs, c.logprobs))  # renormalised: never lower


def test_new_weights_do_not_recompile(engine):
    params = engine.load_params()
    requests = [Request(p, 5, i) for i, p in enumerate(PROMPTS[:3])]
    first, _ = engine.run(params, requests, steps_per_call=4)
    compiled = engine.compile_count()
    assert compiled > 0
    for scale in (1.5, -1.0):
        new_params = jax.tree.map(lambda x: x * scale, params)  # a new pytree: "weights after a train step"
        outs, _ = engine.run(new_params, requests, steps_per_call=4)
        assert engine.compile_count() == compiled
    assert [c.tokens for c in outs] != [c.tokens for c in first]  # the new weights were really used


def test_stop_sequence_ends_a_request(engine):
    params = engine.load_params()
    free, _ = engine.run(params, [Request(PROMPTS[2], 10, 0)])
    stop = free[0].tokens[3:5]
    first_end = next(i + 2 for i in range(9) if free[0].tokens[i:i + 2] == stop)
    outs, _ = engine.run(params, [Request(PROMPTS[2], 10, 0)], stop_sequences=[stop], steps_per_call=8)
    assert outs[0].tokens == free[0].tokens[:first_end] and outs[0].stop == "stop"


def test_bad_input_is_a_clear_error(engine, models):
    ours = models[1]
    params = engine.load_params()
    with pytest.raises(ValueError, match="empty"):
        engine.run(params, [Request([], 4, 0)])
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        engine.run(params, [Request(list(range(17)), 4, 0)])
    with pytest.raises(ValueError, match=r"unknown token ids \[97\]"):
        engine.run(params, [Request([1, 97], 4, 0)])
    with pytest.raises(ValueError, match=r"unknown token ids \[-1\]"):
        engine.prefill(params=params, padded_tokens=np.array([-1, 2]), true_length=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.prefill(params=params, padded_tokens=np.arange(10), true_length=10, max_new_tokens=24)
    with pytest.raises(ValueError, match="true_length"):
        engine.prefill(params=params, padded_tokens=np.arange(3), true_length=5)
    prefix, _ = engine.prefill(params=params, padded_tokens=np.arange(3), true_length=3)
    with pytest.raises(ValueError, match="slot=2"):
        engine.insert(prefix, engine.init_decode_state(), 2)
    with pytest.raises(ValueError, match="max_prefill_length=40 > max_cache_len=32"):
        make_engine(ours, max_prefill_length=40)
    with pytest.raises(ValueError, match="max_concurrent_decodes"):
        make_engine(ours, slots=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        make_engine(ours, eos_token_ids=(500,))
