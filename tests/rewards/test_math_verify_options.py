"""math-verify's own options under `reward.*` (its names, its defaults), validated with errors naming the key,
reaching the sandbox workers and the in-process path; and the documented reading of references and
predictions holding several `\\boxed{}`."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest

from ulorl_jax.config import ConfigError, RewardOptions, load_config
from ulorl_jax.rewards import MathVerifyOptions, RewardConfig, RewardScorer, reference_answer, rule_reward
from ulorl_jax.rewards.equivalence import MATH_VERIFY_OPTIONS, PARSE_OPTIONS, VERIFY_OPTIONS

logging.getLogger("math_verify").setLevel(logging.ERROR)


def _math_verify(gold: str, prediction: str, **verify_options) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(gold), parse(prediction), **verify_options))


def test_option_names_and_defaults_are_math_verify_own():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    verify_defaults = {k: p.default for k, p in inspect.signature(verify).parameters.items()}
    parse_defaults = {k: p.default for k, p in inspect.signature(parse).parameters.items()}
    latex = LatexExtractionConfig()
    mine = MathVerifyOptions()
    for name in VERIFY_OPTIONS:
        assert getattr(mine, name) == verify_defaults[name], name
    for name in ("fallback_mode", "extraction_mode"):
        assert getattr(mine, name) == parse_defaults[name], name
    assert parse_defaults["extraction_config"] == [LatexExtractionConfig(), ExprExtractionConfig()]
    assert mine.parse_kwargs()["extraction_config"] == parse_defaults["extraction_config"]
    assert mine.boxed_match_priority == latex.boxed_match_priority
    assert mine.try_extract_without_anchor == latex.try_extract_without_anchor
    assert set(MATH_VERIFY_OPTIONS) == set(VERIFY_OPTIONS) | set(PARSE_OPTIONS)
    # the same names and defaults in the run config's schema and in the scorer's config
    for name in MATH_VERIFY_OPTIONS:
        expected = getattr(mine, name)
        assert getattr(RewardConfig(), name) == expected, name
        option = getattr(RewardOptions(), name)
        assert (tuple(option) if isinstance(option, list) else option) == expected, name


def test_options_load_from_yaml_overrides_into_the_scorer():
    from ulorl_jax.rl.build import same_named

    cfg = load_config("tiny_cpu", ["reward.float_rounding=2", "reward.strict=false", "reward.extraction_config=[expr]",
                                   "reward.fallback_mode=no_fallback", "reward.boxed_match_priority=0",
                                   "reward.allow_set_relation_comp=true", "reward.numeric_precision=20",
                                   "reward.try_extract_without_anchor=false", "reward.extraction_mode=first_match"])
    options = same_named(RewardConfig, cfg.reward).math_verify
    assert options == MathVerifyOptions(float_rounding=2, strict=False, extraction_config=("expr",),
                                        fallback_mode="no_fallback", boxed_match_priority=0,
                                        allow_set_relation_comp=True, numeric_precision=20,
                                        try_extract_without_anchor=False, extraction_mode="first_match")
    assert same_named(RewardConfig, load_config("tiny_cpu").reward).math_verify == MathVerifyOptions()


@pytest.mark.parametrize("key, value", [
    ("float_rounding", "-1"), ("float_rounding", "2.5"), ("numeric_precision", "0"), ("strict", "maybe"),
    ("allow_set_relation_comp", "often"), ("extraction_config", "[latex,regex]"), ("extraction_config", "[]"),
    ("extraction_config", "[latex,latex]"), ("boxed_match_priority", "-2"), ("try_extract_without_anchor", "sometimes"),
    ("fallback_mode", "first"), ("extraction_mode", "all_matches"),
])
def test_bad_options_name_their_key(key, value):
    with pytest.raises(ConfigError, match=f"reward.{key}"):
        load_config("tiny_cpu", [f"reward.{key}={value}"])


@pytest.mark.parametrize("kwargs", [
    {"float_rounding": -1}, {"float_rounding": 2.5}, {"numeric_precision": 0}, {"strict": "no"},
    {"allow_set_relation_comp": 1}, {"extraction_config": ("latex", "regex")}, {"extraction_config": ()},
    {"boxed_match_priority": -2}, {"try_extract_without_anchor": None}, {"fallback_mode": "none"},
    {"extraction_mode": "all"},
])
def test_reward_config_rejects_bad_options_naming_the_key(kwargs):
    (key,) = kwargs
    with pytest.raises(ValueError, match=f"reward.{key}="):
        RewardScorer(RewardConfig(**kwargs))


# (boxed response, reference, options, math-verify's verdict on the boxed answer with them, and without them)
_OPTION_CASES = [
    ("so \\boxed{3.14159}", "3.14", {"float_rounding": 2}, True, False),
    ("so \\boxed{\\frac{1}{3}}", "0.333", {"float_rounding": 3}, True, False),
    ("so \\boxed{y+1}", "x+1", {"strict": False}, True, False),
    ("so \\boxed{(1, 2)}", "\\{1, 2\\}", {"strict": False}, True, True),
    ("so \\boxed{1<x<2}", "(1,2)", {"allow_set_relation_comp": True}, True, False),
    ("so \\boxed{\\frac{1}{0}}", "\\frac{1}{0}", {"fallback_mode": "no_fallback"}, False, True),
    ("so \\boxed{12}", "12", {"strict": False, "float_rounding": 0}, True, True),  # decided in-process
    ("so \\boxed{12}", "13", {"numeric_precision": 1}, False, False),  # decided in-process
]


@pytest.mark.parametrize("workers", [0, 1])
def test_options_reach_the_in_process_path_and_the_workers(workers):
    """extraction=boxed: each pair scored with its options gives math-verify's verdict with them, which differs
    from the default options' for most pairs (so ignoring an option fails here)."""
    from math_verify import parse, verify

    for text, reference, options, with_options, without in _OPTION_CASES:
        boxed = text.removeprefix("so \\boxed{")[:-1]
        parse_kw = {"fallback_mode": options["fallback_mode"]} if "fallback_mode" in options else {}
        verify_kw = {k: v for k, v in options.items() if k != "fallback_mode"}
        gold, pred = parse(f"${reference}$", **parse_kw), parse(f"${boxed}$", **parse_kw)
        assert verify(gold, pred, **verify_kw) is with_options and _math_verify(f"${reference}$", f"${boxed}$") \
            is without, (text, reference)
        with RewardScorer(RewardConfig(workers=workers, timeout_s=30, **options)) as scorer:
            assert scorer.score([(text, reference, False, {})]) == [float(with_options)], (text, options)
            assert scorer.stats.quick == (reference in ("12", "13"))  # the two integer pairs: in-process
    assert sum(w != wo for *_, w, wo in _OPTION_CASES) >= 5


def test_anchors_are_needed_in_responses_not_in_references():
    """try_extract_without_anchor=false: math-verify reads the response only after an anchor ("answer", "final
    answer is") or in a box; the reference `34` is an answer and is read without one (else every reward is 0)."""
    config = RewardConfig(workers=0, extraction="math_verify", try_extract_without_anchor=False, timeout_s=30)
    with RewardScorer(config) as scorer:
        batch = [("We computed 34 there.", "34", False, {}), ("The answer is 34.", "34", False, {}),
                 ("so \\boxed{34}", "34", False, {}), ("The answer is 35.", "34", False, {}),
                 ("The answer is 34.", "\\frac{68}{2}", False, {})]  # read as a value, not matched as a string
        assert scorer.score(batch) == [0.0, 1.0, 1.0, 0.0, 1.0]
    with RewardScorer(dataclasses.replace(config, try_extract_without_anchor=True)) as scorer:
        assert scorer.score(batch[:1]) == [1.0]


# --- several boxes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reference, answer", [
    ("\\boxed{3}", "3"), ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # one box: its content
    ("\\boxed{1}, \\boxed{2}", "\\boxed{1}, \\boxed{2}"),  # several: math-verify reads the whole reference
    ("The roots are \\boxed{1} and \\boxed{2}.", "The roots are \\boxed{1} and \\boxed{2}."),
    ("1/2", "1/2"),
])
def test_reference_answer(reference, answer):
    assert reference_answer(reference) == answer


# (response, reference, reward with extraction=boxed, with extraction=math_verify, math-verify on the two texts)
_SEVERAL_BOXES = [
    ("The roots are \\boxed{1}, \\boxed{2}.", "\\boxed{1}, \\boxed{2}", 0.0, 1.0, True),  # boxed keeps the last box
    ("The roots are \\boxed{\\{1, 2\\}}.", "\\boxed{1}, \\boxed{2}", 1.0, 1.0, True),  # a reference's boxes: a set
    ("The roots are \\boxed{1, 2}.", "\\boxed{1} and \\boxed{2}", 1.0, 1.0, True),
    ("The roots are \\boxed{2}.", "\\boxed{1}, \\boxed{2}", 0.0, 0.0, False),
    ("so \\boxed{5}", "\\boxed{3} then text \\boxed{5}", 1.0, 1.0, True),  # boxes not in a row: the last one
    ("so \\boxed{3}", "\\boxed{3} then text \\boxed{5}", 0.0, 0.0, False),
]


@pytest.mark.parametrize("workers", [0, 1])
def test_several_boxes_follow_math_verify_in_references_and_boxed_keeps_the_last_in_responses(workers):
    from math_verify import parse, verify

    batch = [(text, reference, False, {}) for text, reference, *_ in _SEVERAL_BOXES]
    for text, reference, _, mv_reward, mv_verdict in _SEVERAL_BOXES:
        assert verify(parse(reference), parse(text)) is mv_verdict and mv_reward == float(mv_verdict), text
    with RewardScorer(RewardConfig(workers=workers, timeout_s=30)) as scorer:
        assert scorer.score(batch) == [boxed for _, _, boxed, _, _ in _SEVERAL_BOXES]
    with RewardScorer(RewardConfig(workers=workers, timeout_s=30, extraction="math_verify")) as scorer:
        assert scorer.score(batch) == [mv for _, _, _, mv, _ in _SEVERAL_BOXES]
    for text, reference, boxed, mv, _ in _SEVERAL_BOXES:  # the unsandboxed reference rule agrees
        assert (rule_reward(text, reference), rule_reward(text, reference, extraction="math_verify")) == (boxed, mv)
