"""Rewards: extraction, equivalence, sandboxed timeouts/crashes, custom functions, batch scoring."""

from __future__ import annotations

import math
import os
import time

import pytest

from ulorl_jax.rewards import (
    RewardConfig,
    RewardScorer,
    SandboxPool,
    answers_equivalent,
    extract_answer,
    last_boxed,
    parse_number,
    quick_equivalence,
    reference_answer,
    resolve_function,
    rule_reward,
)

HERE = __name__  # the module name the sandbox workers import these functions by


# --- custom reward functions, called by import path from sandbox workers ---------
def exact_reward(text: str, reference: str, metadata: dict) -> float:
    return float(text.strip() == reference.strip()) * metadata.get("weight", 1.0)


def sleepy_reward(text: str, reference: str, metadata: dict) -> float:
    if text == "hang":
        time.sleep(60)
    return 1.0


def raising_reward(text: str, reference: str, metadata: dict) -> float:
    if text == "boom":
        raise RuntimeError("reward exploded")
    return 1.0


def odd_value_reward(text: str, reference: str, metadata: dict):
    return {"nan": float("nan"), "inf": float("inf"), "str": "1.0", "none": None, "list": [1.0],
            "true": True, "half": 0.5}[text]


def dying_reward(text: str, reference: str, metadata: dict) -> float:
    if text == "die":
        os._exit(3)
    return 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- extraction --------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}} done", "\\sqrt{\\frac{a}{b^{2}}}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are content
    ("\\fbox{7}", "7"),
    ("\\boxed 5$", "5"),
    ("\\boxed{3} and then \\boxed{4", "3"),  # an unclosed box (truncated) is skipped
    ("no box here", None),
    ("\\boxed{", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_extract_answer_with_pattern():
    assert extract_answer("Answer: 12\nAnswer: 13", r"Answer:\s*(\S+)") == "13"
    assert extract_answer("#### 7", r"####\s*\d+") == "#### 7"  # no group: whole match
    assert extract_answer("nothing", r"Answer:\s*(\S+)") is None
    with pytest.raises(ValueError, match="answer_pattern"):
        extract_answer("x", "(unclosed")


# --- equivalence -------------------------------------------------------------------
@pytest.mark.parametrize("pred, ref", [
    ("0.5", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "1/2"), ("1,000", "1000"),
    ("$8$", "8"), ("8.", "8"), ("\\text{8}", "8"), ("-\\frac{3}{4}", "-0.75"),
])
def test_quick_equivalence_numbers(pred, ref):
    # equal numbers in different notations: math-verify says so; the fast path never says otherwise
    assert quick_equivalence(pred, ref) in (True, None)
    assert answers_equivalent(pred, ref) is True


def test_quick_equivalence_declines_symbolic():
    assert quick_equivalence("3", "4") is False
    assert quick_equivalence("$8$", "8") is True  # the same math-verify input
    assert quick_equivalence("0.5", "1/2") is None  # math-verify decides (it rounds floats)
    assert quick_equivalence("(x+1)^2", "x^2+2x+1") is None  # needs math-verify
    assert parse_number("\\frac{1}{0}") is None
    assert parse_number("x") is None


@pytest.mark.parametrize("pred, ref, expected", [
    ("(x+1)^2", "x^2+2x+1", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi", False),
    ("x^2", "x^3", False),
    ("hello world", "hello world", True),  # string fallback: math-verify parses nothing useful
    ("hello", "world", False),
])
def test_answers_equivalent(pred, ref, expected):
    assert answers_equivalent(pred, ref) is expected


def test_rule_reward_rules():
    assert rule_reward("... \\boxed{\\frac12}", "0.5") == 1.0
    assert rule_reward("... \\boxed{0.5}", "0.5", truncated=True) == 0.0  # truncated -> 0 (§1)
    assert rule_reward("the answer is 0.5", "0.5") == 0.0  # no final answer
    assert rule_reward("Answer: 0.5", "1/2", answer_pattern=r"Answer:\s*(\S+)") == 1.0
    assert reference_answer("so \\boxed{3}") == "3"


# --- sandbox -----------------------------------------------------------------------
def test_sandbox_timeout_kills_and_replaces_worker():
    with SandboxPool(1) as pool:
        first = pool.map(f"{HERE}:sleepy_reward", [("ok", "", {})], timeout_s=20)
        assert first[0].status == "ok"
        (pid,) = pool.pids()
        start = time.monotonic()
        out = pool.map(f"{HERE}:sleepy_reward", [("hang", "", {}), ("ok", "", {})], timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert [o.status for o in out] == ["timeout", "ok"]
        assert elapsed < 15, elapsed  # 1 s deadline + one worker restart, not the 60 s sleep
        assert pool.restarts == 1
        assert pid not in pool.pids() and not _alive(pid)  # the hung worker is gone, not leaked
        workers = pool.pids()
    assert not any(_alive(p) for p in workers)  # close() stops the rest


def test_sandbox_crash_and_error():
    with SandboxPool(2) as pool:
        out = pool.map(f"{HERE}:dying_reward", [("die", "", {}), ("x", "", {}), ("y", "", {})], timeout_s=20)
        assert [o.status for o in out] == ["crash", "ok", "ok"]
        out = pool.map(f"{HERE}:raising_reward", [("boom", "", {}), ("fine", "", {})], timeout_s=20)
        assert out[0].status == "error" and "reward exploded" in out[0].detail
        assert out[1].status == "ok" and out[1].value == 1.0


def test_resolve_function_errors():
    assert resolve_function(f"{HERE}:exact_reward") is exact_reward
    for bad, msg in [("nocolon", "package.module:function"), ("no_such_mod_xyz:f", "cannot import"),
                     (f"{HERE}:missing", "no attribute")]:
        with pytest.raises(ValueError, match=msg):
            resolve_function(bad)


# --- the scorer --------------------------------------------------------------------
def test_scorer_rule_batch_against_unsandboxed_rule():
    batch = [
        ("... so \\boxed{0.5}", "\\frac{1}{2}", False, {}),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", False, {}),  # goes to math-verify in a worker
        ("\\boxed{(x+1)^2}", "x^2+2x+1", False, {}),  # duplicate: one call
        ("\\boxed{x^3}", "x^2", False, {}),
        ("\\boxed{8}", "8", True, {}),  # truncated
        ("no answer", "1", False, {}),
        ("\\boxed{9}", "\\boxed{9}", False, {}),  # boxed reference
    ]
    with RewardScorer(RewardConfig(workers=1, timeout_s=20)) as scorer:
        rewards = scorer.score(batch)
        expected = [rule_reward(t, r, truncated=tr) for t, r, tr, _ in batch]
        assert rewards == expected == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        s = scorer.stats
        # sandboxed: 0.5 vs \frac{1}{2} (only math-verify may equate notations), (x+1)^2, x^3
        assert (s.scored, s.truncated, s.no_answer, s.sandboxed) == (7, 1, 1, 3)
        assert s.timeouts == s.crashes == s.bad_values == 0
        scorer.score(batch[1:2])  # cached verdict: no new call
        assert scorer.stats.sandboxed == 3


def test_scorer_inline_matches_sandboxed():
    batch = [("\\boxed{(x+1)^2}", "x^2+2x+1", False, {}), ("\\boxed{2\\pi}", "\\pi", False, {})]
    with RewardScorer(RewardConfig(workers=0)) as scorer:
        assert scorer.score(batch) == [1.0, 0.0]
        assert scorer._pool is None


def test_scorer_custom_hang_raise_bad_values():
    config = RewardConfig(kind="custom", custom_fn=f"{HERE}:sleepy_reward", timeout_s=1.0, workers=2)
    with RewardScorer(config) as scorer:
        start = time.monotonic()
        assert scorer.score([("hang", "r", False, {}), ("fine", "r", False, {})]) == [0.0, 1.0]
        assert time.monotonic() - start < 15
        assert scorer.stats.timeouts == 1 and scorer.stats.crashes == 0

    with RewardScorer(RewardConfig(kind="custom", custom_fn=f"{HERE}:raising_reward", workers=1)) as scorer:
        assert scorer.score([("boom", "r", False, {}), ("ok", "r", False, {})]) == [0.0, 1.0]
        assert scorer.stats.crashes == 1

    with RewardScorer(RewardConfig(kind="custom", custom_fn=f"{HERE}:odd_value_reward", workers=1)) as scorer:
        keys = ["nan", "inf", "str", "none", "list", "true", "half"]
        rewards = scorer.score([(k, "", False, {}) for k in keys])
        assert rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5]
        assert scorer.stats.bad_values == 5
        assert all(math.isfinite(r) for r in rewards)


def test_scorer_custom_metadata_and_truncation():
    config = RewardConfig(kind="custom", custom_fn=f"{HERE}:exact_reward", workers=1)
    with RewardScorer(config) as scorer:
        batch = [("a", "a", False, {"weight": 0.5}), ("a", "b", False, {}), ("a", "a", True, {})]
        assert scorer.score(batch) == [0.5, 0.0, 0.0]


def test_scorer_custom_inline_timeout_and_raise():
    config = RewardConfig(kind="custom", custom_fn=f"{HERE}:sleepy_reward", timeout_s=0.5, workers=0)
    with RewardScorer(config) as scorer:
        start = time.monotonic()
        assert scorer.score([("hang", "", False, {}), ("ok", "", False, {})]) == [0.0, 1.0]
        assert time.monotonic() - start < 5
        assert scorer.stats.timeouts == 1


def test_reward_config_errors():
    for kwargs, msg in [({"kind": "magic"}, "reward kind"), ({"timeout_s": 0}, "timeout_s"),
                        ({"kind": "custom"}, "custom_fn"), ({"answer_pattern": "("}, "answer_pattern"),
                        ({"kind": "custom", "custom_fn": "nope"}, "package.module:function")]:
        with pytest.raises(ValueError, match=msg):
            RewardScorer(RewardConfig(**kwargs))
    with pytest.raises(ValueError, match="verifier"):
        RewardScorer(RewardConfig(kind="verifier"))


# --- generative verifier -----------------------------------------------------------
class _StubJudge:
    def __init__(self, outputs):
        self.outputs = outputs
        self.seen = []

    def judge(self, items):
        self.seen.extend(items)
        if self.outputs == "raise":
            raise RuntimeError("judge is down")
        from ulorl_jax.rewards import parse_verdict

        return [parse_verdict(o) for o in self.outputs[: len(items)]]


def test_parse_verdict():
    from ulorl_jax.rewards import parse_verdict

    assert parse_verdict("Yes.") is True
    assert parse_verdict(" no, they differ") is False
    assert parse_verdict("maybe") is None
    assert parse_verdict("yesterday") is None  # whole words only
    assert parse_verdict("no... actually yes") is False  # the first verdict counts


def test_scorer_verifier_plumbing_with_stub_judge():
    judge = _StubJudge(["yes", "No", "hmm"])
    with RewardScorer(RewardConfig(kind="verifier"), verifier=judge) as scorer:
        batch = [("... \\boxed{27 cm}", "0.27 m", False, {"prompt": "q1"}),
                 ("\\boxed{x}", "y", False, {}),
                 ("\\boxed{one half}", "1/2", False, {}),
                 ("\\boxed{1/2}", "$1/2$", False, {}),  # equal by the cheap rules: no judge call
                 ("no box", "1", False, {}),
                 ("\\boxed{3}", "3", True, {})]
        assert scorer.score(batch) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
        assert [item[:2] for item in judge.seen] == [("27 cm", "0.27 m"), ("x", "y"), ("one half", "1/2")]
        assert judge.seen[0][2] == {"prompt": "q1"}
        assert (scorer.stats.unparsable, scorer.stats.quick, scorer.stats.no_answer) == (1, 1, 1)
    with RewardScorer(RewardConfig(kind="verifier"), verifier=_StubJudge("raise")) as scorer:
        assert scorer.score([("\\boxed{a}", "b", False, {}), ("\\boxed{c}", "d", False, {})]) == [0.0, 0.0]
        assert scorer.stats.crashes == 2


@pytest.mark.slow  # model init + engine compile: ~15 s idle, more on a loaded 2-core box
def test_generative_verifier_with_tiny_random_model():
    from ulorl_jax.data.tokenizer import build_tokenizer
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rewards import GenerativeVerifier, VerifierConfig, parse_verdict

    tok = build_tokenizer()
    model = init_model(tiny_config("qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1), seed=0)
    verifier = GenerativeVerifier(VerifierConfig(max_new_tokens=4, slots=2), model=model, tokenizer=tok)
    ids = verifier.prompt_ids("27 cm", "0.27 m", {"prompt": "How long?"})
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nDecide whether") and text.endswith("<|im_start|>assistant\n")
    assert "Question: How long?\nReference answer: 0.27 m\nCandidate answer: 27 cm\n" in text
    # decode with a short template: keeps the tiny model's compile to one small prefill bucket
    verifier = GenerativeVerifier(VerifierConfig(template="R:{reference} C:{prediction} yes/no?",
                                                 max_new_tokens=4, slots=2), model=model, tokenizer=tok)
    assert tok.decode(verifier.prompt_ids("a", "b")) == "<|im_start|>user\nR:b C:a yes/no?<|im_end|>\n" \
        "<|im_start|>assistant\n"
    items = [("27 cm", "0.27 m", {}), ("1/2", "one half", {}), ("x", "y", {})]
    verdicts = verifier.judge(items)
    outputs = list(verifier.last_outputs)
    assert len(verdicts) == 3 and verdicts == [parse_verdict(o) for o in outputs]
    assert all(0 < len(tok.encode(o, add_special_tokens=False)) <= 4 for o in outputs if o)
    assert verifier.judge(items) == verdicts and verifier.last_outputs == outputs  # greedy: deterministic
    with RewardScorer(RewardConfig(kind="verifier"), verifier=verifier) as scorer:
        rewards = scorer.score([(f"\\boxed{{{p}}}", r, False, m) for p, r, m in items])
        assert rewards == [float(v) if v is not None else 0.0 for v in verdicts]
        assert scorer.stats.unparsable == sum(v is None for v in verdicts)
    with pytest.raises(ValueError, match="template"):
        GenerativeVerifier(VerifierConfig(template="no fields"), model=model, tokenizer=tok)


# --- property: extraction of nested boxes ------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_atom = st.text(alphabet="0123456789abcxyz+-*/^_=,. \\", max_size=6).filter(lambda s: not s.endswith("\\"))
_balanced = st.recursive(_atom, lambda inner: st.builds(lambda a, b, c: f"{a}{{{b}}}{c}", _atom, inner, _atom),
                         max_leaves=8)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)  # a failure reproduces
@given(st.text(alphabet="abc {}$\\boxed", max_size=30), _balanced, st.text(alphabet="abc .$", max_size=10))
def test_last_boxed_recovers_any_balanced_content(prefix, content, suffix):
    text = f"{prefix}\\boxed{{{content}}}{suffix}"
    assert last_boxed(text) == content.strip()
