"""JetStream 0.2.2's own orchestrator (Driver + LLMOrchestrator request path) driving PolicyEngine.

Runs wherever google-jetstream is installed (CI installs the `jetstream` extra);
skipped, with the reason, only where it is not importable.
"""

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.choices import ROLLOUT_BACKENDS
from ulorl_jax.decode import jetstream_backend as jb
from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rollout.backends import make_segment_rollout
from ulorl_jax.rollout.segment import RolloutConfig
from ulorl_jax.types import PromptItem

needs_jetstream = pytest.mark.skipif(not jb.jetstream_available(), reason="google-jetstream is not installed "
                                     "(pip install -e '.[jetstream]'); CI installs it for these tests")
slow = pytest.mark.slow  # the TensorFlow import (via seqio) and compiles: ~50 s of CPU for the file

VOCAB, PROMPT_LENS, NEW = 97, (3, 7, 12, 5, 9), 10


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2), seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(6, VOCAB, n).tolist() for n in PROMPT_LENS]


_FWD = {}


def full_logits(model, seq, length=32):
    """[len(seq), V] logits of one full forward (no KV cache), right-padded to a fixed length."""
    fwd = _FWD.setdefault(id(model), jax.jit(lambda t, m: model(t, attention_mask=m)))
    tokens = np.zeros((1, length), np.int32)
    mask = np.zeros((1, length), np.int32)
    tokens[0, :len(seq)], mask[0, :len(seq)] = seq, 1
    return fwd(jnp.asarray(tokens), jnp.asarray(mask))[0, :len(seq)]


def reference_greedy(model, prompt, n, eos=()):
    """Independent reference: full forward (no KV cache) + argmax, one token at a time."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(full_logits(model, seq)[-1])))
        if seq[-1] in eos:
            break
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def eos_id(model, prompts):
    """An EOS id that greedy decoding hits mid-way for prompt 0 (so the EOS path runs)."""
    return reference_greedy(model, prompts[0], NEW)[4]


@pytest.fixture(scope="module")
def engine(model, eos_id):
    return PolicyEngine(model, max_concurrent_decodes=2, max_prefill_length=32, max_cache_len=48,
                        sampling=GREEDY, eos_token_ids=(eos_id,))


@needs_jetstream
@slow
def test_import_hazards_contained():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    js = jb.import_jetstream()
    assert root.level == level, "jetstream's import changed the root logger level"
    assert root.handlers == handlers, "jetstream's import left a handler on the root logger"
    assert jax.tree_map is jax.tree_util.tree_map
    assert issubclass(PolicyEngine, js.engine_api.Engine)  # registered as a JetStream Engine
    assert "jetstream_pt" not in sys.modules


@needs_jetstream
@slow
def test_driver_greedy_matches_engine_and_reference(model, engine, prompts, eos_id):
    """JetStream's Driver + LLMOrchestrator.Decode (offline request path) vs our own loop vs full forward.
    5 prompts on 2 slots: slots are refilled; prompt 0 ends at EOS, the rest at max_tokens."""
    params = engine.load_params()
    ours, _ = engine.run(params, [Request(p, NEW, i) for i, p in enumerate(prompts)])
    theirs = jb.decode_with_jetstream(engine, params, prompts, NEW, sampling=GREEDY)
    ref = [reference_greedy(model, p, NEW, eos=(eos_id,)) for p in prompts]
    assert [c.tokens for c in ours] == ref
    assert theirs == ref
    assert theirs[0][-1] == eos_id and len(theirs[0]) < NEW
    assert any(len(t) == NEW and eos_id not in t for t in theirs)


@needs_jetstream
@slow
def test_runner_completions_and_recomputed_logprobs(engine, prompts):
    """JetStreamRunner.run keeps PolicyEngine.run's contract; its recomputed log-probs equal the
    engine's decode-time ones (sampled, so the temperature convention matters too)."""
    params = engine.load_params()
    reqs = [Request(p, 6, i) for i, p in enumerate(prompts)]
    sampling = SamplingParams(0.9, 0, 1.0)
    ours, _ = jb.JetStreamRunner(engine).run(params, reqs, sampling=GREEDY)
    ref, _ = engine.run(params, reqs, sampling=GREEDY)
    assert [c.tokens for c in ours] == [c.tokens for c in ref]
    assert [c.stop for c in ours] == [c.stop for c in ref]
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    # Stop sequences: decoded to the budget, then cut where our loop stops.
    stop = [ref[1].tokens[1:3]]
    cut, _ = jb.JetStreamRunner(engine).run(params, reqs, sampling=GREEDY, stop_sequences=stop)
    ref_cut, _ = engine.run(params, reqs, sampling=GREEDY, stop_sequences=stop)
    assert [(c.tokens, c.stop) for c in cut] == [(c.tokens, c.stop) for c in ref_cut]
    assert cut[1].stop == "stop" and len(cut[1].tokens) == 3
    # Sampled (T = 0.9): keys reach requests in prefill order, so the draws equal our loop's; the recomputed
    # log-probs match a direct full-forward log-softmax at T = 0.9.
    sampled, stats = jb.JetStreamRunner(engine).run(params, reqs, sampling=sampling)
    assert stats.tokens_decoded == sum(len(c.tokens) for c in sampled) > 0
    ref_sampled, _ = engine.run(params, reqs, sampling=sampling)
    assert [c.tokens for c in sampled] == [c.tokens for c in ref_sampled]
    assert [c.tokens for c in sampled] != [c.tokens for c in ref]  # really sampled
    for p, c in zip(prompts, sampled):
        logp = jax.nn.log_softmax(full_logits(engine._model, p + c.tokens) / 0.9, axis=-1)  # noqa: SLF001
        expect = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c.tokens)]
        np.testing.assert_allclose(c.logprobs, expect, atol=2e-5)
        assert c.sampling_logprobs == c.logprobs  # no top-k / top-p: the two coincide


@needs_jetstream
@slow
def test_segment_rollout_jetstream_equals_engine(engine, prompts, eos_id):
    """Algorithm 1 with rollout_backend=jetstream == rollout_backend=engine (greedy): every sample's
    tokens, per-token policy versions, segments and finish reasons; log-probs to float rounding.
    Weights change at step 2 (continued samples are re-prefilled with them)."""
    cfg = RolloutConfig(global_max_len=12, num_segments=3, samples_per_prompt=2, max_prompt_len=12,
                        eos_token_ids=(eos_id,), sampling=GREEDY)
    params = engine.load_params()
    params_v2 = jax.tree.map(lambda x: x * 1.01, params)
    items = [PromptItem(i, p, {"answer": str(i)}) for i, p in enumerate(prompts)]
    results = {}
    for backend in ROLLOUT_BACKENDS:
        rollout = make_segment_rollout(engine, cfg, rollout_backend=backend)
        ended, reports = [], []
        for step, (todo, p) in enumerate([(items[:3], params), (items[3:], params), ([], params_v2),
                                          ([], params_v2)]):
            rep = rollout.step(p, todo, policy_version=step, rng=step)
            ended += rep.ended
            reports.append((rep.finished, rep.carried, rep.truncated, rep.tokens_decoded))
        assert not rollout.unfinished_pool
        results[backend] = (sorted(ended, key=lambda s: s.uid), reports)
    (eng, eng_rep), (jet, jet_rep) = results["engine"], results["jetstream"]
    assert eng_rep == jet_rep
    assert {s.finish_reason for s in eng} == {"eos", "length"}  # both termination paths ran
    assert any(len(set(s.policy_versions)) > 1 for s in eng)  # samples spanning weight versions
    for a, b in zip(eng, jet):
        da, db = a.to_dict(), b.to_dict()
        la, lb = da.pop("logprobs"), db.pop("logprobs")
        assert da == db
        np.testing.assert_allclose(la, lb, atol=2e-5)


@needs_jetstream
@slow
def test_bad_requests_rejected_before_the_driver(engine):
    js = jb.import_jetstream()
    pb = js.jetstream_pb2
    tok = pb.DecodeRequest.TokenContent
    cases = {
        "max_prefill_length": pb.DecodeRequest(token_content=tok(token_ids=[7] * 33), max_tokens=4),
        "max_tokens=0": pb.DecodeRequest(token_content=tok(token_ids=[7, 8]), max_tokens=0),
        "unknown token ids": pb.DecodeRequest(token_content=tok(token_ids=[7, VOCAB + 3]), max_tokens=4),
        "empty": pb.DecodeRequest(token_content=tok(token_ids=[]), max_tokens=4),
        "tokenizer": pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text="hi"), max_tokens=4),
    }
    for needle, req in cases.items():
        with pytest.raises(ValueError, match=needle):
            jb.request_prompt_ids(engine, req, None)
    with pytest.raises(ValueError, match="max_prefill_length"):
        jb.decode_with_jetstream(engine, engine.load_params(), [[7] * 40], 4)
    with pytest.raises(ValueError, match="rollout_backend"):
        make_segment_rollout(engine, RolloutConfig(8, 2, 1, 4, eos_token_ids=engine.eos_token_ids),
                                rollout_backend="vllm")


@needs_jetstream
@slow
def test_thread_failure_is_contained(engine, prompts):
    """A raising driver thread would SIGKILL the process under JetStream's JetThread; ours turns it into
    JetStreamThreadError in the caller (this test process surviving is part of the check)."""
    with pytest.raises(jb.JetStreamThreadError, match="request keys"):
        jb.decode_with_jetstream(engine, engine.load_params(), prompts[:2], 3, keys=[])  # prefill raises
    # The module-level JetThread is JetStream's again, and a fresh driver works.
    assert jb.import_jetstream().orchestrator.JetThread.__name__ == "JetThread"
    assert jb.decode_with_jetstream(engine, engine.load_params(), prompts[:1], 2, sampling=GREEDY)


def test_missing_jetstream_is_a_clear_error(monkeypatch, capsys, tmp_path):
    """Runs with or without the extra: the error says what to install (and what never to)."""
    from ulorl_jax.cli import main

    monkeypatch.setattr(jb, "jetstream_available", lambda: False)
    with pytest.raises(jb.JetStreamUnavailable, match="google-jetstream==0.2.2"):
        jb.import_jetstream.__wrapped__()
    monkeypatch.setattr(jb, "import_jetstream", jb.import_jetstream.__wrapped__)
    with pytest.raises(jb.JetStreamUnavailable, match="jetstream-pt"):
        make_segment_rollout(None, None, rollout_backend="jetstream")
    (tmp_path / "config.json").write_text("{}")  # a model folder as far as `serve`'s option check goes
    assert main(["serve", "--api", "jetstream", "--model", str(tmp_path)]) == 2
    assert "pip install" in capsys.readouterr().err
