"""The in-process fast path (rewards/equivalence.py `quick_equivalence`) gives only math-verify's own verdicts.

The reference verdict is math-verify itself: `verify(parse(gold), parse(prediction), **verify_options)` called
here, with math-verify's names, on each answer read as `$...$` (the documented reading of a bare answer; an
answer already starting with `$` is passed as written). The strategy is built so that most draws are
decidable, half of them True and half False, and the test asserts those shares over its draws: a fast path
that abstained everywhere, or decided only identical strings, would fail it. The draws are derandomised
(a fixed seed, no example database), so a failure reproduces on any machine.
"""

from __future__ import annotations

import collections
import logging

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from ulorl_jax.rewards import MathVerifyOptions, RewardConfig, RewardScorer, quick_equivalence

logging.getLogger("math_verify").setLevel(logging.ERROR)

MIN_DECIDED_SHARE = 0.25  # of all draws, for each of True and False (the strategy aims at ~1/3 each)


def _dollar(answer: str) -> str:
    answer = answer.strip()
    return answer if answer.startswith("$") else f"${answer}$"


def _math_verify(prediction: str, reference: str, verify_options: dict) -> bool:
    """math-verify's verdict, called directly with its default parse() and the drawn verify() options."""
    from math_verify import parse, verify

    gold, target = parse(_dollar(reference), parsing_timeout=20), parse(_dollar(prediction), parsing_timeout=20)
    # an answer math-verify reads nothing from would be decided by our string fallback, not by math-verify:
    # the strategy draws only answers it reads
    assert gold and target, (reference, gold, prediction, target)
    return bool(verify(gold, target, timeout_seconds=20, **verify_options))


# --- answers: every kind math-verify reads, including values sympy cannot compare (zoo, nan) --------------------
_integer = st.one_of(st.integers(-1000, 1000), st.integers(-10**100 + 1, 10**100 - 1)).map(str)  # canonical
_decimal = st.builds(lambda a, b: f"{a}.{b}", st.integers(-99, 999), st.text("0123456789", min_size=1, max_size=7))
_fraction = st.builds(lambda a, b, form: form.format(a, b), st.integers(-20, 20), st.integers(1, 12),
                      st.sampled_from(["{}/{}", "\\frac{{{}}}{{{}}}", "\\dfrac{{{}}}{{{}}}"]))
_set = st.lists(st.integers(-5, 5), min_size=1, max_size=4).flatmap(lambda xs: st.sampled_from([
    "\\{" + ",".join(map(str, xs)) + "\\}", "(" + ",".join(map(str, xs)) + ")", ",".join(map(str, xs))]))
_latex = st.sampled_from([
    "x \\rightarrow 0", "\\left(1\\right)", "\\text{8}", "8.", "\\pi", "2\\pi", "\\sqrt{2}", "\\frac{\\sqrt{2}}{2}",
    "\\infty", "-\\infty", "x^2", "x^{2}+2x+1", "\\mathrm{e}", "1e3", "10^{3}", "50\\%", "0.333333", "[1,2)",
    "\\left[1,2\\right)", "(-\\infty, 3]", "a \\leq b", "x = 5", "y=2x+1", "1 < x < 2", "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
    "\\begin{pmatrix}1 & 2\\\\3 & 4\\end{pmatrix}", "5\\text{ cm}", "3\\,\\mathrm{m}", "90^\\circ", "\\sin x",
    "\\frac{1}{0}", "0/0", "\\infty-\\infty", "0\\cdot\\infty", "\\text{Evelyn}", "x+y", "\\{1,3\\}\\cup\\{2,4\\}",
    "1,000", "007", "+5", "-0", "2 3", "32, 349", "0,111", "1\\,000",
])
_answer = st.one_of(_integer, _decimal, _fraction, _set, _latex)


def _dressed(answer: str) -> st.SearchStrategy[str]:
    """The same math-verify input written again: bare, in `$...$`, or padded."""
    return st.sampled_from([answer, f"${answer}$", f"  {answer} ", f"${answer}$ "])


def _other_integer(n: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 3).filter(bool).map(lambda d: n + d), st.just(-n).filter(bool),
                     st.integers(-10**100 + 1, 10**100 - 1)).filter(lambda m: m != n)


# non-canonical writings of an integer: the fast path must abstain on them (or be right)
_INTEGER_FORMS = ["0{}", "00{}", "+{}", "{}.0", "{:,}", "{:,}|, ", "{:,}|{,}", "{:,}|\\,", "-{}"]


def _written(form: str, n: int) -> str:
    """n written in one of `_INTEGER_FORMS` ("{:,}|, ": thousands separated by ", ")."""
    form, _, separator = form.partition("|")
    text = form.format(n)
    return text.replace(",", separator) if separator else text


@st.composite
def _pair(draw) -> tuple[str, str, str]:
    """(kind, prediction, reference): "same" (the fast path's True), "integers" (its False), "integer_forms"
    (one integer written two ways, or two integers: abstain or be right) or "other" (near misses)."""
    kind = draw(st.sampled_from(["same"] * 3 + ["integers"] * 3 + ["integer_forms"] * 2 + ["other"]))
    if kind == "same":
        answer = draw(_answer)
        return kind, draw(_dressed(answer)), draw(_dressed(answer))
    if kind == "integers":
        n = draw(st.one_of(st.integers(-1000, 1000), st.integers(-10**100 + 1, 10**100 - 1)))
        m = draw(_other_integer(n))
        return kind, draw(_dressed(str(m))), draw(_dressed(str(n)))
    if kind == "integer_forms":
        n = draw(st.one_of(st.integers(0, 30), st.integers(1000, 10**7)))
        m = draw(st.sampled_from([n, n, n, n + 1]))
        reference_form = draw(st.sampled_from(["{}"] * len(_INTEGER_FORMS) + _INTEGER_FORMS))
        return kind, _written(draw(st.sampled_from(_INTEGER_FORMS)), m), _written(reference_form, n)
    answer = draw(_answer)
    other = draw(st.one_of(_answer, st.sampled_from([answer + "0", "-" + answer, "+" + answer, "0" + answer,
                                                    answer.replace(" ", ""), answer[:-1] + "1"])))
    return kind, answer, other


_VERIFY_OPTIONS = st.fixed_dictionaries({  # math-verify's verify() options, its names
    "float_rounding": st.integers(0, 10), "numeric_precision": st.integers(1, 30), "strict": st.booleans(),
    "allow_set_relation_comp": st.booleans()})
_PARSE_OPTIONS = st.one_of(  # mostly math-verify's defaults; else one parse() option changed
    st.just({}), st.just({}), st.just({}), st.just({}), st.just({}), st.just({}),
    st.sampled_from([{"fallback_mode": "no_fallback"}, {"extraction_mode": "first_match"},
                     {"extraction_config": ("expr", "latex")}, {"extraction_config": ("latex",)},
                     {"boxed_match_priority": 0}]))


def test_property_fast_path_verdict_is_math_verify_verdict():
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    # try_extract_without_anchor is drawn too: a short answer is read without an anchor whatever it says
    @given(_pair(), _VERIFY_OPTIONS, _PARSE_OPTIONS, st.booleans())
    def check(pair, verify_options, parse_options, anchor):
        kind, prediction, reference = pair
        options = MathVerifyOptions(**verify_options, **parse_options, try_extract_without_anchor=anchor)
        quick = quick_equivalence(prediction, reference, options)
        event(f"{kind}: fast path {quick}")
        seen[quick] += 1
        if parse_options:  # the proof assumes math-verify's default reading: any other -> abstain
            assert quick is None, parse_options
            return
        if quick is not None:
            expected = _math_verify(prediction, reference, verify_options)
            note(f"math-verify: {expected}")
            assert quick is expected

    check()
    total = sum(seen.values())
    assert seen[True] >= MIN_DECIDED_SHARE * total and seen[False] >= MIN_DECIDED_SHARE * total, dict(seen)


@pytest.mark.parametrize("answer", ["\\frac{1}{0}", "0/0", "\\frac{0}{0}"])
def test_fast_path_abstains_where_a_parse_option_changes_the_verdict(answer):
    """Identical answers are equal to math-verify through its string fallback only when sympy cannot compare
    the value (zoo, nan): with fallback_mode=no_fallback math-verify says False, so the fast path must not
    say True, in the scorer either."""
    from math_verify import parse, verify

    latex = f"${answer}$"
    assert verify(parse(latex), parse(latex)) is True
    assert verify(parse(latex, fallback_mode="no_fallback"), parse(latex, fallback_mode="no_fallback")) is False
    options = MathVerifyOptions(fallback_mode="no_fallback")
    assert quick_equivalence(answer, answer) is True and quick_equivalence(answer, answer, options) is None
    batch = [(f"so \\boxed{{{answer}}}", answer, False, {})]
    with RewardScorer(RewardConfig(workers=0)) as scorer:
        assert scorer.score(batch) == [1.0] and scorer.stats.quick == 1
    with RewardScorer(RewardConfig(workers=0, fallback_mode="no_fallback")) as scorer:
        assert scorer.score(batch) == [0.0] and scorer.stats.quick == 0
