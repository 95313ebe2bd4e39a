"""Sampled (temperature) segment rollout with a fixed policy, K = 1 / 2 / 4 segments, against an independent
sampler: full forwards (no KV cache) and jax.random.categorical with the documented per-sample keys.

Sampled segmented != unsegmented token for token, by design: the rollout gives each sample at each step the
key fold_in(fold_in(step key, uid), tokens so far) (segment.py `sample_keys`; README "Segment rollout keeps
every sample's RNG key a function of (step seed, uid, tokens so far)"), and the engine splits that key once
per token. A continued sample thus draws its next segment from a fresh key, not from where the engine's key
chain of the previous segment stopped, so after the first segment boundary the draws (not their
distribution) differ from an unsegmented run. What holds, and is checked here: every segment is exactly the
unsegmented decoding of (prompt + earlier segments) from that key, the first segment equals K = 1's first
tokens, and the recorded log-probs are the policy's log softmax(logits / T) of the drawn tokens.
Greedy segmented == unsegmented token for token: tests/rollout/test_segment.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout
from ulorl_jax.types import PromptItem

GLOBAL, N, T = 16, 2, 0.7
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7, 21], [88, 1, 30, 30, 4]]
SAMPLING = SamplingParams(temperature=T)
_PAD = 32  # prompt + GLOBAL tokens fit: one compiled shape for the reference forwards


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3"), seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return PolicyEngine(model, max_concurrent_decodes=4, max_prefill_length=32, max_cache_len=40, sampling=SAMPLING)


def step_key(step: int):
    return jax.random.PRNGKey(100 + step)  # a new key every step, as the trainer's fold_in(seed, step)


def roll(engine, k: int):
    """All prompts to the end with K = k segments and the same params every step; samples by uid."""
    rollout = SegmentRollout(engine, RolloutConfig(global_max_len=GLOBAL, num_segments=k, samples_per_prompt=N,
                                                   max_prompt_len=16, sampling=SAMPLING), steps_per_call=3)
    params = engine.load_params()
    prompts, ended, step = [PromptItem(i, p) for i, p in enumerate(PROMPTS)], [], 0
    while prompts or rollout.unfinished_pool:
        ended += rollout.step(params, prompts, policy_version=step, rng=step_key(step)).ended
        prompts, step = [], step + 1
    assert step == k
    return sorted(ended, key=lambda s: s.uid)


@pytest.fixture(scope="module")
def reference_sampler(model):
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    forward = jax.jit(lambda t, m: nnx.merge(graphdef, params, other)(t, attention_mask=m))

    def sample(prefix: list[int], key, n: int) -> tuple[list[int], list[float]]:
        """n tokens after `prefix` from `key` as the engine documents it: per token (key, sub) = split(key),
        token = categorical(sub, logits / T); log-prob = log softmax(logits / T)[token]."""
        seq, lps = list(prefix), []
        for _ in range(n):
            tokens, mask = np.zeros((1, _PAD), np.int32), np.zeros((1, _PAD), np.int32)
            tokens[0, :len(seq)], mask[0, :len(seq)] = seq, 1
            scaled = forward(tokens, mask)[0, len(seq) - 1].astype(jnp.float32) / T
            key, sub = jax.random.split(key)
            tok = int(jax.random.categorical(sub, scaled))
            lps.append(float(jax.nn.log_softmax(scaled)[tok]))
            seq.append(tok)
        return seq[len(prefix):], lps

    return sample


@pytest.fixture(scope="module")
def unsegmented(engine):
    return roll(engine, 1)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sampled_segments_equal_unsegmented_decoding_from_their_keys(engine, reference_sampler, unsegmented, k):
    samples = unsegmented if k == 1 else roll(engine, k)
    seg = GLOBAL // k
    assert len(samples) == N * len(PROMPTS)
    for s in samples:
        assert len(s.response_ids) == GLOBAL and s.segments == k and s.finish_reason == "length"
        assert s.policy_versions == [t // seg for t in range(GLOBAL)]
        for j in range(k):
            key = jax.random.fold_in(jax.random.fold_in(step_key(j), s.uid), j * seg)
            want, lps = reference_sampler(PROMPTS[s.prompt_index] + s.response_ids[:j * seg], key, seg)
            assert s.response_ids[j * seg:(j + 1) * seg] == want, (k, s.uid, j)
            np.testing.assert_allclose(s.logprobs[j * seg:(j + 1) * seg], lps, atol=1e-4, err_msg=f"{k} {s.uid} {j}")
    # each sample its own draws (the uid is in the key): a group's samples differ
    for i in range(len(PROMPTS)):
        group = [tuple(s.response_ids) for s in samples if s.prompt_index == i]
        assert len(set(group)) == N, f"prompt {i}: identical samples"
    if k > 1:
        # the first segment draws from the same key as K = 1; the later ones from their own keys
        assert all(a.response_ids[:seg] == b.response_ids[:seg] for a, b in zip(samples, unsegmented))
        assert any(a.response_ids[seg:] != b.response_ids[seg:] for a, b in zip(samples, unsegmented))
