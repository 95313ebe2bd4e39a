"""Rewards with `reward.extraction=math_verify` agree with math-verify itself, options included.

`math_verify_corpus.jsonl` holds (gold, prediction) pairs over math-verify's documented features: integers
and thousands separators, decimals, fractions, LaTeX vs plain text, percentages, units, sets and several
boxed answers, tuples and intervals, relations, matrices, long responses with anchors, and each of
math-verify's options (`float_rounding`, `numeric_precision`, `strict`, `allow_set_relation_comp`,
`extraction_config`, `boxed_match_priority`, `try_extract_without_anchor`, `fallback_mode`,
`extraction_mode`), written for this test in the style of math-verify's README and tests. Each line:
{"feature", "gold", "prediction", "options"} (options by math-verify's names, which are `reward.*`'s).

The expected verdict is math-verify's: `verify(parse(gold), parse(prediction), ...)` called here with the
same options, translated to math-verify's objects by this file (not by the code under test). One documented
difference is written into that call: the gold is an answer, not a response, so it is read without needing
an anchor (try_extract_without_anchor=True for the gold, as math-verify's `math_metric` keeps gold and
prediction extraction targets apart); else with try_extract_without_anchor=false math-verify reads nothing
from a gold `$34$` and every verdict is False.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import pytest

from ulorl_jax.rewards import RewardConfig, RewardScorer

logging.getLogger("math_verify").setLevel(logging.ERROR)

CORPUS = Path(__file__).with_name("math_verify_corpus.jsonl")
MIN_CASES = 200
MIN_AGREEMENT = 0.99
MIN_SHARE_EACH_VERDICT = 0.35  # of the corpus, for True and for False
FEATURES = ["thousands", "decimals", "fractions", "latex", "plain", "percentages", "units", "sets",
            "several boxed", "intervals", "relations", "matrices", "precision", "strict", "set-relation",
            "extraction_config", "boxed_match_priority", "try_extract_without_anchor", "fallback_mode",
            "extraction_mode"]
VERIFY_NAMES = ("float_rounding", "numeric_precision", "strict", "allow_set_relation_comp")
# non-default option groups also scored through the sandbox workers: the options must reach them
SANDBOX_GROUPS = ({"float_rounding": 2}, {"strict": False}, {"extraction_config": ["expr"]},
                  {"allow_set_relation_comp": True})


def _cases() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def _math_verify(gold: str, prediction: str, options: dict) -> bool:
    """math-verify's verdict under `options` (its names; absent = its defaults), called directly."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig, parse, verify

    def targets(anchor: bool) -> list:
        made = {"latex": lambda: LatexExtractionConfig(try_extract_without_anchor=anchor,
                                                       boxed_match_priority=options.get("boxed_match_priority", 50)),
                "expr": lambda: ExprExtractionConfig(try_extract_without_anchor=anchor),
                "string": lambda: StringExtractionConfig(try_extract_without_anchor=anchor)}
        return [made[name]() for name in options.get("extraction_config", ["latex", "expr"])]

    modes = {"fallback_mode": options.get("fallback_mode", "first_match"),
             "extraction_mode": options.get("extraction_mode", "any_match")}
    gold_parsed = parse(gold, targets(True), parsing_timeout=20, **modes)  # the gold needs no anchor
    pred_parsed = parse(prediction, targets(options.get("try_extract_without_anchor", True)), parsing_timeout=20,
                        **modes)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=20,
                       **{name: options[name] for name in VERIFY_NAMES if name in options}))


def _scores(cases: list[dict], workers: int) -> list[float]:
    """Our rewards through the public scorer, one scorer per option set (the options are a scorer's config)."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, case in enumerate(cases):
        groups[json.dumps(case["options"], sort_keys=True)].append(i)
    rewards: list[float] = [float("nan")] * len(cases)
    for key, indices in groups.items():
        config = RewardConfig(extraction="math_verify", workers=workers, timeout_s=30, **json.loads(key))
        with RewardScorer(config) as scorer:
            batch = [(cases[i]["prediction"], cases[i]["gold"], False, {}) for i in indices]
            for i, reward in zip(indices, scorer.score(batch)):
                rewards[i] = reward
            assert scorer.stats.timeouts == scorer.stats.crashes == 0, (key, scorer.stats)
    return rewards


def _disagreements(cases: list[dict], expected: list[bool], rewards: list[float]) -> list[str]:
    return [f"[{c['feature']}] gold={c['gold']!r} prediction={c['prediction'][:120]!r} options={c['options']}: "
            f"math-verify {e}, ours {r}" for c, e, r in zip(cases, expected, rewards) if float(e) != r]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[dict], list[bool]]:
    cases = _cases()
    return cases, [_math_verify(c["gold"], c["prediction"], c["options"]) for c in cases]


def test_corpus_covers_math_verify_features_and_both_verdicts(corpus):
    cases, expected = corpus
    assert len(cases) >= MIN_CASES, len(cases)
    features = " ".join(c["feature"] for c in cases)
    assert [f for f in FEATURES if f not in features] == []
    assert len({(c["gold"], c["prediction"], json.dumps(c["options"], sort_keys=True)) for c in cases}) == len(cases)
    for verdict in (True, False):
        share = sum(e is verdict for e in expected) / len(expected)
        assert share >= MIN_SHARE_EACH_VERDICT, (verdict, share)
    for options in SANDBOX_GROUPS:  # each option group holds a pair whose verdict the option changes
        group = [(c, e) for c, e in zip(cases, expected) if c["options"] == options]
        assert any(_math_verify(c["gold"], c["prediction"], {}) is not e for c, e in group), options


def test_scorer_agrees_with_math_verify_in_process(corpus):
    cases, expected = corpus
    rewards = _scores(cases, workers=0)
    disagreements = _disagreements(cases, expected, rewards)
    agreement = 1 - len(disagreements) / len(cases)
    print(f"agreement with math-verify: {agreement:.4f} over {len(cases)} pairs")
    assert agreement >= MIN_AGREEMENT, "\n".join(disagreements)


def test_scorer_agrees_with_math_verify_in_sandbox_workers(corpus):
    """A sample through the sandbox workers: the default options, and option groups whose verdicts differ from
    the defaults' (so a worker that ignored its options would disagree)."""
    cases, expected = corpus
    chosen = [i for i, c in enumerate(cases) if c["options"] in SANDBOX_GROUPS or (not c["options"] and i % 6 == 0)]
    sample = [cases[i] for i in chosen]
    rewards = _scores(sample, workers=1)
    disagreements = _disagreements(sample, [expected[i] for i in chosen], rewards)
    assert 1 - len(disagreements) / len(sample) >= MIN_AGREEMENT, "\n".join(disagreements)
