"""Rewards you can trust (issue 17): the fast path never contradicts math-verify, math-verify's own
extraction, bounded time on degenerate responses, the worker count, and the verifier's prompt."""

from __future__ import annotations

import logging
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ulorl_jax.config import ConfigError, load_config
from ulorl_jax.rewards import (
    VERIFIER_TEMPLATE,
    RewardConfig,
    RewardScorer,
    answers_equivalent,
    last_boxed,
    normalize_answer,
    parse_number,
    parse_verdict,
    quick_equivalence,
    rule_reward,
    verifier_prompt,
)
from ulorl_jax.rewards.extract import _last_boxed_reference

logging.getLogger("math_verify").setLevel(logging.ERROR)


def _math_verify(prediction: str, reference: str) -> bool:
    """math-verify's own verdict, called directly on the two answers, each read as `$...$` (the documented
    reading of a bare answer); both must be read (else our string fallback, not math-verify, would decide)."""
    from math_verify import parse, verify

    def as_latex(s: str) -> str:
        s = s.strip()
        return s if s.startswith("$") else f"${s}$"

    gold = parse(as_latex(reference), parsing_timeout=20)
    pred = parse(as_latex(prediction), parsing_timeout=20)
    assert gold and pred, (reference, gold, prediction, pred)
    return bool(verify(gold, pred, timeout_seconds=20))


# --- 1. the fast path's verdict is math-verify's (the property test: test_fast_path.py) -------------------------
@pytest.mark.parametrize("prediction, reference, expected", [
    ("2 3", "23", False),  # spaces between digits are not removed before comparing
    ("0,111", "111", False),  # a comma after a lone 0 is not a thousands separator
    ("32, 349", "32349", False),  # nor one followed by a space (a list of two numbers)
    ("32, 349", "32,349", False),  # a list of two numbers is not a number with a thousands separator
    ("x \\rightarrow 0", "x \\leftarrow 0", False),  # \left / \right are not stripped out of arrows
    ("\\frac{1}{3}", "0.333333", True),  # math-verify rounds floats to 6 places
    ("12", "13", False), ("-7", "-7", True), ("$40$", "40", True), ("007", "7", True),
])
def test_known_defects_now_follow_math_verify(prediction, reference, expected):
    assert quick_equivalence(prediction, reference) in (expected, None)
    assert answers_equivalent(prediction, reference) is expected
    assert _math_verify(prediction, reference) is expected


def test_normalize_answer_keeps_meaning():
    assert normalize_answer("2 3") == "2 3" and normalize_answer(" 2  3 ") == "2 3"
    assert normalize_answer("x \\rightarrow 0") == "x\\rightarrow0" != normalize_answer("x \\leftarrow 0")
    assert normalize_answer("\\left( x \\right)") == "(x)"
    assert normalize_answer("1,000") == "1000" and normalize_answer("12,345.5") == "12345.5"
    assert normalize_answer("0,111") == "0,111" and normalize_answer("32, 349") == "32,349"


def test_parse_number_is_bounded():
    assert parse_number("1e100000000") is None  # refused, not built (it would take minutes)
    assert parse_number("9^{9^{9^{9}}}") is None
    assert parse_number("1" * 101) is None
    assert parse_number("1e999") == 10**999 and parse_number("-\\frac{3}{4}") == parse_number("-0.75")
    start = time.perf_counter()
    for text in ["1e100000000", "9" * 10**6, "1/" + "2" * 10**6, "\\frac{" + "1" * 10**6 + "}{3}"]:
        assert parse_number(text) is None
    assert time.perf_counter() - start < 1.0


# --- 3. linear-time extraction --------------------------------------------------------
_box_text = st.lists(st.sampled_from(["\\boxed", "\\fbox", "{", "}", "\\{", "\\}", " ", "\n", "1", "x", "\\", "$"]),
                     max_size=40).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)  # a failure reproduces
@given(_box_text)
def test_property_last_boxed_matches_plain_scan(text):
    assert last_boxed(text) == _last_boxed_reference(text)


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{" * 100_000, None),
    ("\\boxed{" * 100_000 + "\\boxed{5}", "5"),
    ("\\boxed{4}" + "\\boxed{" * 100_000, "4"),  # truncated boxes after a complete one
    ("\\boxed{" + "{" * 1_000_000, None),
    ("x" * 1_000_000 + "\\boxed{3}", "3"),
    ("\\boxed\n{" * 100_000, None),
])
def test_last_boxed_is_fast_on_degenerate_text(text, expected):
    start = time.perf_counter()
    assert last_boxed(text) == expected
    assert time.perf_counter() - start < 1.0


# --- 3. the scorer on degenerate responses ----------------------------------------------
_DEGENERATE = [
    ("\\boxed{" * 100_000, "1", 0.0),
    ("so \\boxed{1e100000000}", "1", 0.0),
    ("so \\boxed{9^{9^{9^{9}}}}", "1", 0.0),
    ("Let me think. " * 75_000 + "\\boxed{42}", "42", 1.0),  # about 1 MB
    ("\\frac{" * 150_000 + "}" * 100_000, "1", 0.0),  # 1 MB of braces
    ("\x00\x01\x07\x1b[31m\r\x7f\u202e\ud800 \\boxed{7}\x00", "7", 1.0),  # control characters
]


@pytest.mark.parametrize("extraction", ["boxed", "math_verify"])
def test_scorer_bounded_time_on_degenerate_responses(extraction):
    """Each degenerate response is scored within 2 s (math-verify under a 0.5 s timeout; the rest is room for
    killing the worker on a loaded 2-core machine: 1.16 s seen beside a benchmark), and the scorer scores a
    normal pair correctly afterwards. Without the timeout, 9^{9^{9^{9}}} never finishes."""
    config = RewardConfig(workers=2, timeout_s=60, extraction=extraction)
    with RewardScorer(config) as scorer:
        # starts the pool; a fresh worker's first math-verify call (regexes, sympy) takes 0.3-0.5 s on a loaded box
        assert scorer.score([("\\boxed{\\frac{1}{2}}", "0.5", False, {})]) == [1.0]
        scorer.config.timeout_s = 0.5
        for text, reference, expected in _DEGENERATE:
            scorer.wait_ready()  # a worker killed by the previous timeout restarts off the clock
            start = time.perf_counter()
            rewards = scorer.score([(text, reference, False, {})])
            elapsed = time.perf_counter() - start
            assert elapsed < 2.0, (text[:40], elapsed)
            if extraction == "boxed" or (expected == 1.0 and len(text) < 1000):  # math-verify reads 1 MB in
                assert rewards == [expected], text[:40]  # about 0.2-1 s here: over the timeout is a 0
            assert rewards[0] in (0.0, 1.0)
        scorer.wait_ready()
        scorer.config.timeout_s = 60  # a fresh worker's first simplify can take seconds on a loaded machine
        batch = [("\\boxed{\\frac{1}{2}}", "0.5", False, {}), ("\\boxed{(x+1)^2}", "x^2+2x+1", False, {}),
                 ("\\boxed{3}", "4", False, {})]
        assert scorer.score(batch) == [1.0, 1.0, 0.0]


# --- 2. extraction: math_verify ---------------------------------------------------------
_MATH_VERIFY_CASES = [
    # (response, reference, reward with extraction=boxed, reward with extraction=math_verify)
    ("Adding the two parts, the answer is $34$.", "34", 0.0, 1.0),
    ("So the probability is $\\frac13$", "1/3", 0.0, 1.0),
    ("The roots are \\boxed{1}, \\boxed{2}", "\\{1,2\\}", 0.0, 1.0),  # several boxes read as one set
    ("Final answer: 12", "12", 0.0, 1.0),  # a plain expression
    ("First I tried 3, then found \\boxed{7}. Checking: 7 - 2 = 5.", "7", 1.0, 1.0),
    ("we get \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0, 1.0),
    ("the answer is \\boxed{8}", "9", 0.0, 0.0),
    ("I do not know.", "5", 0.0, 0.0),
]


def test_extraction_math_verify_reads_more_than_boxes():
    batch = [(text, ref, False, {}) for text, ref, _, _ in _MATH_VERIFY_CASES]
    with RewardScorer(RewardConfig(workers=2, timeout_s=20)) as scorer:
        assert scorer.score(batch) == [boxed for _, _, boxed, _ in _MATH_VERIFY_CASES]
    with RewardScorer(RewardConfig(workers=2, timeout_s=20, extraction="math_verify")) as scorer:
        rewards = scorer.score(batch + batch[:2])  # repeated responses: one call each
        assert rewards == [mv for _, _, _, mv in _MATH_VERIFY_CASES] + [1.0, 1.0]
        assert scorer.stats.sandboxed == len(batch)  # duplicates in a batch share one call
        assert scorer.score(batch[:1]) == [1.0] and scorer.stats.sandboxed == len(batch)  # cached verdict
        assert scorer.score([(batch[0][0], "34", True, {})]) == [0.0]  # truncated: 0 (§1)
    for text, ref, _, mv in _MATH_VERIFY_CASES[:3]:  # the unsandboxed reference rule agrees
        assert rule_reward(text, ref, extraction="math_verify") == mv


def test_extraction_math_verify_with_answer_pattern_and_inline():
    config = RewardConfig(workers=0, extraction="math_verify", answer_pattern=r"ANSWER:(.*)")
    with RewardScorer(config) as scorer:
        batch = [("scratch: 5 and 6\nANSWER: the value is $\\frac{6}{4}$", "1.5", False, {}),
                 ("no marker, \\boxed{1.5}", "1.5", False, {})]
        assert scorer.score(batch) == [1.0, 0.0]
        assert scorer.stats.no_answer == 1 and scorer._pool is None


def test_reward_options_extraction_and_workers():
    cfg = load_config("tiny_cpu")
    assert cfg.reward.extraction == "boxed" and cfg.reward.workers is None
    cfg = load_config("tiny_cpu", ["reward.extraction=math_verify", "reward.workers=3"])
    assert (cfg.reward.extraction, cfg.reward.workers) == ("math_verify", 3)
    for override, key in [("reward.extraction=regex", "reward.extraction"), ("reward.workers=-1", "reward.workers")]:
        with pytest.raises(ConfigError, match=key):
            load_config("tiny_cpu", [override])
    cores = len(os.sched_getaffinity(0))
    assert RewardConfig().num_workers == max(2, cores)
    assert RewardConfig(workers=0).num_workers == 0 and RewardConfig(workers=5).num_workers == 5
    with pytest.raises(ValueError, match="extraction"):
        RewardScorer(RewardConfig(extraction="regex"))


# --- 5. what rule cannot judge, and the verifier's prompt and parsing ----------------------
_HARD_CASES = [("27cm", "0.27m"), ("one half", "1/2"), ("half", "0.5"), ("\\text{2 hours}", "120 minutes")]


@pytest.mark.parametrize("prediction, reference", _HARD_CASES)
def test_rule_cannot_judge_units_and_words(prediction, reference):
    assert rule_reward(f"\\boxed{{{prediction}}}", reference) == 0.0  # equal in meaning, 0 by the rule


class _ScriptedJudge:
    """Reads the real verifier prompt and answers from a script keyed by (reference, candidate), as a
    judge model would; records every prompt."""

    def __init__(self, script: dict[tuple[str, str], str]):
        self.script = script
        self.prompts: list[str] = []

    def judge(self, items):
        verdicts = []
        for prediction, reference, metadata in items:
            prompt = verifier_prompt(VERIFIER_TEMPLATE, prediction, reference, str(metadata.get("prompt", "")))
            self.prompts.append(prompt)
            lines = dict(line.split(": ", 1) for line in prompt.splitlines() if ": " in line)
            output = self.script.get((lines["Reference answer"], lines["Candidate answer"]), "I am unsure.")
            verdicts.append(parse_verdict(output))
        return verdicts


def test_verifier_judges_the_hard_cases_with_a_scripted_judge():
    judge = _ScriptedJudge({("0.27m", "27cm"): "Yes, 27 cm is 0.27 m.", ("1/2", "one half"): "yes",
                            ("0.5", "half"): "YES", ("120 minutes", "\\text{2 hours}"): "Yes",
                            ("1/2", "one third"): "No. One third is not one half."})
    batch = [(f"... so \\boxed{{{p}}}", r, False, {"prompt": "How long is the rod?"}) for p, r in _HARD_CASES]
    batch += [("\\boxed{one third}", "1/2", False, {}), ("\\boxed{seven}", "7", False, {}),
              ("\\boxed{12}", "12", False, {})]  # the same answer: no judge call
    with RewardScorer(RewardConfig(kind="verifier"), verifier=judge) as scorer:
        assert scorer.score(batch) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
        assert (scorer.stats.quick, scorer.stats.sandboxed, scorer.stats.unparsable) == (1, 6, 1)
    first = judge.prompts[0]
    assert first.startswith("Decide whether the candidate's final answer is equivalent to the reference answer")
    assert "Question: How long is the rod?\nReference answer: 0.27m\nCandidate answer: 27cm\n" in first
    assert first.endswith("Reply with one word: yes or no.")
    assert "Question: \nReference answer: 7\nCandidate answer: seven\n" in judge.prompts[-1]


def test_verifier_prompt_clips_long_fields_and_parses_verdicts():
    long_answer = "x" * 1000 + "END"
    prompt = verifier_prompt(VERIFIER_TEMPLATE, long_answer, "5", "Q" * 1000, max_field_chars=50)
    assert "Candidate answer: ..." + long_answer[-50:] + "\n" in prompt and "Q" * 51 not in prompt
    assert verifier_prompt("{reference}|{prediction}", "a", "b") == "b|a"
    for output, verdict in [("Yes", True), ("no.", False), ("**Yes**, equivalent", True), ("NO", False),
                            ("The answer is: no", False), ("Nope", None), ("yesno", None), ("", None),
                            ("I cannot say; yes", True)]:
        assert parse_verdict(output) is verdict, output


def test_long_responses_are_scored_whole_in_the_sandbox():
    """A response over IN_PROCESS_CHARS is not parsed in the trainer process: the whole boxed rule runs in a
    sandboxed worker (under the timeout) and gives rule_reward's verdict; its duplicate shares the call."""
    from ulorl_jax.rewards.rule import rule_reward
    from ulorl_jax.rewards.scorer import IN_PROCESS_CHARS

    think = "step " * (IN_PROCESS_CHARS // 5 + 1)
    batch = [(think + "so \\boxed{\\frac{1}{2}}", "0.5", False, {}), (think + "so \\boxed{3}", "4", False, {}),
             (think + "so \\boxed{\\frac{1}{2}}", "0.5", False, {}), ("\\boxed{7}", "7", False, {})]
    for workers in (2, 0):
        with RewardScorer(RewardConfig(workers=workers, timeout_s=20)) as scorer:
            assert scorer.score(batch) == [rule_reward(t, r) for t, r, _, _ in batch] == [1.0, 0.0, 1.0, 1.0]
            assert scorer.stats.sandboxed == 2 and scorer.stats.quick == 1  # two long calls; \boxed{7} in-process
