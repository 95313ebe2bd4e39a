"""Segment rollout (ULORL.md §1): segmented greedy == unsegmented, the three terminations, pools, resume."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from hf_utils import save_hf_model

from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models.hf import from_pretrained
from ulorl_jax.rollout.segment import ExperiencePool, RolloutConfig, SegmentRollout
from ulorl_jax.types import PromptItem, Sample

GLOBAL = 16
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7, 21], [88, 1, 30, 30, 4, 19, 52, 6], [33, 8, 15, 91, 27],
           [12, 64, 3, 3, 80], [70, 71, 72, 9]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    save_hf_model("qwen3", folder, seed=2)
    return from_pretrained(folder)


@pytest.fixture(scope="module")
def reference(model):
    """Unsegmented greedy continuations without EOS, and an EOS id chosen so that one prompt
    ends exactly at token 8: a segment boundary for K = 2, 4 and 8."""
    engine = PolicyEngine(model, max_concurrent_decodes=3, max_prefill_length=32, max_cache_len=40, sampling=GREEDY)
    free, _ = engine.run(engine.load_params(), [Request(p, GLOBAL, 0) for p in PROMPTS])
    free = [c.tokens for c in free]
    for toks in free:
        eos = toks[7]
        if eos not in toks[:7] and any(eos not in other for other in free):
            return free, eos
    raise AssertionError("no prompt gives a boundary EOS; change the prompts")


@pytest.fixture(scope="module")
def engine(model, reference):
    return PolicyEngine(model, max_concurrent_decodes=3, max_prefill_length=32, max_cache_len=40, sampling=GREEDY,
                        eos_token_ids=(reference[1],))


def config(k, n=1, eos=(), **kw):
    return RolloutConfig(global_max_len=GLOBAL, num_segments=k, samples_per_prompt=n, max_prompt_len=16,
                         eos_token_ids=eos, **{"sampling": GREEDY, **kw})


def roll_to_end(rollout, prompts, rng=0, version0=0):
    ended, step, reports = [], 0, []
    while prompts or rollout.unfinished_pool:
        report = rollout.step(rollout.engine.load_params(), prompts, policy_version=version0 + step,
                              rng=jax.random.PRNGKey(rng + step))
        reports.append(report)
        ended += report.ended
        prompts, step = [], step + 1
    return sorted(ended, key=lambda s: (s.prompt_index, s.sample_index)), reports


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_segmented_greedy_equals_unsegmented_with_all_terminations(engine, reference, k):
    free, eos = reference
    rollout = SegmentRollout(engine, config(k, eos=(eos,)), steps_per_call=3)
    ended, reports = roll_to_end(rollout, [PromptItem(i, p, {"answer": str(i)}) for i, p in enumerate(PROMPTS)])
    seg = GLOBAL // k
    reasons = []
    for s, toks in zip(ended, free):
        expect = toks[:toks.index(eos) + 1] if eos in toks else toks  # unsegmented decoding with EOS
        assert s.response_ids == expect
        reason = "eos" if eos in toks else "length"
        assert s.finish_reason == reason
        reasons.append((reason, len(expect)))
        assert s.segments == -(-len(expect) // seg)
        assert s.policy_versions == [t // seg for t in range(len(expect))]  # version of the step that made it
        assert len(s.logprobs) == len(expect) and s.metadata == {"answer": str(s.prompt_index)}
    assert ("eos", 8) in reasons and ("length", GLOBAL) in reasons  # boundary EOS and global max both hit
    assert len(reports) == k  # a truncated sample needs all K segments
    assert sum(r.truncated for r in reports) == sum(r == "length" for r, _ in reasons)
    assert sum(r.finished for r in reports) == sum(r == "eos" for r, _ in reasons)
    assert sum(r.tokens_decoded for r in reports) == sum(n for _, n in reasons)
    if k > 1:
        assert reports[0].carried == reports[0].unfinished_pool_size > 0
    assert reports[-1].unfinished_pool_size == 0


def test_segmented_logprobs_match_unsegmented(engine, reference):
    eos = reference[1]
    one, _ = roll_to_end(SegmentRollout(engine, config(1, eos=(eos,))), [PromptItem(0, PROMPTS[1])])
    four, _ = roll_to_end(SegmentRollout(engine, config(4, eos=(eos,))), [PromptItem(0, PROMPTS[1])])
    np.testing.assert_allclose(four[0].logprobs, one[0].logprobs, atol=1e-4)


_PAD = 32  # every prompt + GLOBAL tokens fits: one compiled shape for the reference forwards


def _logits_under(model, params, seq: list[int]) -> jax.Array:
    """[len(seq), V] logits of one full forward (no KV cache) with `params`, right-padded to _PAD."""
    graphdef, _, other = nnx.split(model, nnx.Param, ...)
    fwd = _FORWARDS.setdefault(id(model), jax.jit(
        lambda p, t, m: nnx.merge(graphdef, p, other)(t, attention_mask=m)))
    tokens, mask = np.zeros((1, _PAD), np.int32), np.zeros((1, _PAD), np.int32)
    tokens[0, :len(seq)], mask[0, :len(seq)] = seq, 1
    return fwd(params, tokens, mask)[0, :len(seq)]


_FORWARDS: dict = {}


def _greedy_under(model, params, prefix: list[int], n: int) -> list[int]:
    """Independent reference: `n` greedy tokens after `prefix` by full forwards (no KV cache) with `params`."""
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(jax.numpy.argmax(_logits_under(model, params, seq)[-1])))
    return seq[len(prefix):]


def test_carried_samples_continue_under_the_new_weights(model):
    """Each step's segment of a carried sample is decoded with that step's weights: tokens equal greedy
    decoding of (prompt + earlier segments) under the new weights, log-probs their teacher-forced values
    under them, and the weights change enough that the old ones would pick other tokens."""
    engine = PolicyEngine(model, max_concurrent_decodes=3, max_prefill_length=32, max_cache_len=40, sampling=GREEDY)
    base = engine.load_params()
    leaves, treedef = jax.tree.flatten(base)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    versions = [base] + [jax.tree.unflatten(treedef, [x + 0.3 * x.std() * jax.random.normal(k, x.shape, x.dtype)
                                                      for x, k in zip(leaves, jax.random.split(keys[v], len(leaves)))])
                         for v in range(1, 4)]
    k, seg = 4, GLOBAL // 4
    rollout = SegmentRollout(engine, config(k))
    items = [PromptItem(i, p) for i, p in enumerate(PROMPTS[:3])]
    ended = []
    for v, params in enumerate(versions):
        ended += rollout.step(params, items if v == 0 else [], policy_version=v, rng=jax.random.PRNGKey(v)).ended
    assert not rollout.unfinished_pool and len(ended) == len(items)
    changed = 0
    for s in sorted(ended, key=lambda s: s.prompt_index):
        prompt = PROMPTS[s.prompt_index]
        assert s.policy_versions == [t // seg for t in range(GLOBAL)]
        for v, params in enumerate(versions):
            before = prompt + s.response_ids[:v * seg]
            assert s.response_ids[v * seg:(v + 1) * seg] == _greedy_under(model, params, before, seg), (s.prompt_index, v)
            if v and _greedy_under(model, versions[v - 1], before, seg) != s.response_ids[v * seg:(v + 1) * seg]:
                changed += 1  # the previous weights would have continued differently
        seq = prompt + s.response_ids
        logp = jax.nn.log_softmax(_logits_under(model, versions[-1], seq)[len(prompt) - 1:-1])
        last = [float(logp[t, tok]) for t, tok in enumerate(s.response_ids)][-seg:]
        np.testing.assert_allclose(s.logprobs[-seg:], last, atol=1e-4)
    assert changed > 0, "the weight versions decode alike: the test would not see stale weights"


@pytest.mark.slow  # several engine compiles: > 20 s on a loaded 2-core box
def test_groups_pools_and_exact_resume(engine, reference):
    eos = reference[1]
    cfg = config(4, n=3, eos=(eos,), sampling=SamplingParams(1.0))
    prompts = [PromptItem(i, p) for i, p in enumerate(PROMPTS[:4])]
    a = SegmentRollout(engine, cfg, steps_per_call=2)
    r0 = a.step(engine.load_params(), prompts, policy_version=0, rng=jax.random.PRNGKey(5))
    assert r0.carried + r0.finished + r0.truncated == 12 and r0.truncated == 0
    snapshot = json.loads(json.dumps(a.state_dict()))  # plain JSON-able data
    b = SegmentRollout(engine, cfg, steps_per_call=4)
    b.load_state_dict(snapshot)
    groups = []
    for step in range(1, 4):
        ra = a.step(engine.load_params(), [], policy_version=step, rng=jax.random.PRNGKey(5 + step))
        rb = b.step(engine.load_params(), [], policy_version=step, rng=jax.random.PRNGKey(5 + step))
        # Same samples; log-probs up to the last ulp: b refills its slots at other times (4 steps per call),
        # so its batched prefill calls have other shapes, and XLA rounds a row's math by its batch shape.
        da, db = ([s.to_dict() | {"logprobs": None} for s in r.ended] for r in (ra, rb))
        assert da == db
        for sa, sb in zip(ra.ended, rb.ended):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=1e-6, atol=1e-6)
        groups += a.experience_pool.pop_complete_groups()
    assert not a.unfinished_pool and len(a.experience_pool) == 0
    assert sorted(g[0].prompt_index for g in groups) == [0, 1, 2, 3]
    for g in groups:
        assert [s.sample_index for s in g] == [0, 1, 2] and all(s.finished for s in g)
    assert len({tuple(s.response_ids) for g in groups for s in g}) > 4  # sampled, so samples differ
    assert b.state_dict()["next_uid"] == 12


def test_group_is_trainable_only_when_all_samples_ended():
    pool = ExperiencePool(2)
    done = Sample(0, 7, 0, [1], [2], [-0.1], [0], 1, "eos")
    pool.add([done])
    assert pool.pop_complete_groups() == [] and len(pool) == 1
    pool.add([Sample(1, 7, 1, [1], [3, 4], [-0.2, -0.3], [0, 1], 2, "length")])
    (group,) = pool.pop_complete_groups()
    assert [s.uid for s in group] == [0, 1] and len(pool) == 0
    with pytest.raises(ValueError, match="unfinished"):
        pool.add([Sample(2, 8, 0, [1])])
    assert Sample.from_dict(group[1].to_dict()) == group[1]


def test_length_oracle_ends_samples_as_eos(engine):
    targets = {0: 3, 1: 8, 2: 13}
    rollout = SegmentRollout(engine, config(4, eos=engine.eos_token_ids),
                             length_oracle=lambda s: targets[s.prompt_index])
    ended, _ = roll_to_end(rollout, [PromptItem(i, PROMPTS[3 + i]) for i in range(3)])
    for s in ended:
        toks = len(s.response_ids)
        assert s.finish_reason == "eos"
        assert toks == targets[s.prompt_index] or s.response_ids[-1] in engine.eos_token_ids
        assert s.segments == -(-toks // 4)


def test_bad_input_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="segment_len=32"):
        RolloutConfig.from_segment_len(16, 32, samples_per_prompt=1, max_prompt_len=4)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        config(2, n=0)
    with pytest.raises(ValueError, match="num_segments"):
        config(0)
    with pytest.raises(ValueError, match="does not divide"):
        config(3)
    assert RolloutConfig.from_segment_len(16, 4, samples_per_prompt=1, max_prompt_len=4).num_segments == 4
    rollout = SegmentRollout(engine, config(2, eos=engine.eos_token_ids))
    params = engine.load_params()
    with pytest.raises(ValueError, match="empty"):
        rollout.step(params, [PromptItem(0, [])], 0, 0)
    with pytest.raises(ValueError, match="max_prompt_len=16"):
        rollout.step(params, [PromptItem(0, list(range(20)))], 0, 0)
    with pytest.raises(ValueError, match=r"unknown token ids \[200\]"):
        rollout.step(params, [PromptItem(0, [1, 200])], 0, 0)
    with pytest.raises(ValueError, match="prompt_index 3 is already in flight"):
        rollout.step(params, [PromptItem(3, [1]), PromptItem(3, [2])], 0, 0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SegmentRollout(engine, config(2, eos=()))
    small = PolicyEngine(engine._model, max_concurrent_decodes=1, max_prefill_length=16, max_cache_len=40)
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        SegmentRollout(small, config(2))


def test_sample_keys_equal_fold_in_in_one_shape_up_to_the_floor():
    """Per-sample keys are fold_in(fold_in(key, uid), progress), and batches of any size up to
    SAMPLE_KEYS_MIN_PAD share one compiled shape (a batch growing past a power of two compiled anew,
    0.24 s in the middle of a run)."""
    from ulorl_jax.rollout import segment

    key = jax.random.PRNGKey(7)
    before = segment._fold_keys._cache_size()
    for n in (3, 40, segment.SAMPLE_KEYS_MIN_PAD):
        uids, progress = list(range(100, 100 + n)), [(5 * u) % 17 for u in range(n)]
        keys = segment.sample_keys(key, uids, progress)
        want = [np.asarray(jax.random.fold_in(jax.random.fold_in(key, u), p), np.uint32)
                for u, p in zip(uids, progress)]
        np.testing.assert_array_equal(np.stack(keys), np.stack(want))
    assert segment._fold_keys._cache_size() - before <= 1
