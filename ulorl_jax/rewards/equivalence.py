"""Is a predicted final answer equivalent to the reference? (ULORL.md §4 "Rewards")

math-verify (sympy underneath) is the judge: it knows 1/2 == 0.5 ==
\\frac{1}{2}, (x+1)^2 == x^2+2x+1, sets, and rounds floats to 6 places
(\\frac{1}{3} == 0.333333). It can hang on adversarial LaTeX, so the scorer
runs it in a sandboxed worker with a timeout (rewards/sandbox.py).

Two layers:
1. `quick_equivalence`: in-process, constant work per character, and never
   a verdict math-verify would not give. It decides only
   - the same math-verify input on both sides (`8` and `$8$` are both read as
     `$8$`) -> True: math-verify compares its extracted strings too, so a pair
     of identical inputs is always equal to it;
   - two canonical decimal integers (`-12`, `0`, `340`; no `+`, no leading
     zeros, at most 100 digits) -> their string equality: math-verify reads
     both as sympy Integers and compares those exactly.
   Everything else (`0.5` vs `1/2`, `1,000` vs `1000`, `2 3` vs `23`) is
   None: math-verify decides.
   Both rules hold under any of math-verify's `verify` options
   (`MathVerifyOptions`: float rounding, numeric precision, strictness, set /
   relation comparison): identical inputs stay identical and integers are
   compared exactly. They rely on math-verify's default reading of `$...$`
   (the first rule on its string fallback: `\\frac{1}{0}` is sympy's zoo, which
   equals nothing, but its string equals itself), so with any non-default
   `parse` option the fast path abstains (`try_extract_without_anchor`
   aside: a short answer is always read without an anchor).
2. `math_verify_equivalence` / `math_verify_response_equivalence`:
   math-verify's verdict on a short answer / on a whole response (its own
   extraction), with math-verify's options (`MathVerifyOptions`). When
   math-verify parses nothing on one side, normalised string equality
   (`normalize_answer`) decides. A bare answer (no `$`, no `\\boxed`) is read
   as LaTeX, as if written `$...$` (`_as_latex`; only when "latex" is an
   extraction target); a reference, like a boxed answer, needs no anchor
   (`MathVerifyOptions.for_answers`).

`answers_equivalent` chains 1 and 2 (no sandbox; tests and in-process use).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_SPACES = re.compile(r"(?:\s|\\[ ,;:!]|\\quad(?![A-Za-z])|\\qquad(?![A-Za-z])|~)+")
_SIZING = re.compile(r"\\(?:left|right)(?![A-Za-z])")  # not the start of \leftarrow, \rightarrow, ...
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")  # 1,000 and 12,345.5; not 0,111
# bounded: at most 100 digits and a 3-digit exponent; anything longer is not a number here
_NUMBER = re.compile(r"[+-]?(?:\d{1,100}(?:\.\d{0,100})?|\.\d{1,100})(?:[eE][+-]?\d{1,3})?")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_CANONICAL_INTEGER = re.compile(r"0|-?[1-9]\d{0,99}")
_MAX_QUICK_CHARS = 10_000  # longer answers go to math-verify whole (the quick rules stay ~µs)


@dataclasses.dataclass(frozen=True)
class MathVerifyOptions:
    """math-verify's own options, by its own names and with its own defaults (math_verify 0.9:
    `verify(gold, target, float_rounding, numeric_precision, strict, allow_set_relation_comp)` and
    `parse(pred, extraction_config, fallback_mode, extraction_mode)`). `reward.<name>` in the run config.

    extraction_config names the targets in math-verify's order of preference: "latex"
    (LatexExtractionConfig, with `boxed_match_priority` and `try_extract_without_anchor`), "expr"
    (ExprExtractionConfig, with `try_extract_without_anchor`), "string" (StringExtractionConfig with its
    default strings A-D, lower-cased). Frozen and picklable: it travels to the sandbox workers with each call.
    """

    # verify(): how two parsed answers are compared
    float_rounding: int = 6  # decimal places floats are rounded to (math-verify's tests call it `precision`)
    numeric_precision: int = 15  # significant digits of numeric (evalf) comparisons
    strict: bool = True  # False: variables matched by position (x+1 == y+1), sets comparable with tuples
    allow_set_relation_comp: bool = False  # True: a relation may equal a set (1 < x < 2 == (1, 2)) either way
    # parse(): how an answer is found in a text
    extraction_config: tuple[str, ...] = ("latex", "expr")
    boxed_match_priority: int = 50  # LatexExtractionConfig: 0 = \boxed{} before "final answer is", -1 = off
    try_extract_without_anchor: bool = True  # False: only after "answer" / "final answer is" (or in a box)
    fallback_mode: str = "first_match"  # also keep the first match's string | "no_fallback"
    extraction_mode: str = "any_match"  # try matches until one parses | "first_match"

    def verify_kwargs(self) -> dict[str, Any]:
        return {"float_rounding": self.float_rounding, "numeric_precision": self.numeric_precision,
                "strict": self.strict, "allow_set_relation_comp": self.allow_set_relation_comp}

    def parse_kwargs(self) -> dict[str, Any]:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig

        anchor = self.try_extract_without_anchor
        targets = {"latex": lambda: LatexExtractionConfig(try_extract_without_anchor=anchor,
                                                          boxed_match_priority=self.boxed_match_priority),
                   "expr": lambda: ExprExtractionConfig(try_extract_without_anchor=anchor),
                   "string": lambda: StringExtractionConfig(try_extract_without_anchor=anchor)}
        return {"extraction_config": [targets[name]() for name in self.extraction_config],
                "fallback_mode": self.fallback_mode, "extraction_mode": self.extraction_mode}

    @property
    def default_parsing(self) -> bool:
        """Every `parse` option at math-verify's default: the reading the fast path's proof assumes."""
        return all(getattr(self, name) == getattr(DEFAULT_OPTIONS, name) for name in PARSE_OPTIONS)

    def for_answers(self) -> "MathVerifyOptions":
        """The options for reading an answer itself (a reference, a boxed answer), not a response: no anchor
        ("answer:", "final answer is") is needed, as math-verify's `math_metric` keeps gold and prediction
        extraction targets apart. Otherwise with try_extract_without_anchor=false math-verify reads nothing
        from a reference `34`, and every reward would be 0."""
        return dataclasses.replace(self, try_extract_without_anchor=True)

    @property
    def reads_latex(self) -> bool:
        return "latex" in self.extraction_config

    def validate(self) -> None:
        """Raise ValueError (ConfigError) naming `reward.<option>`, the value and what is expected; the bounds
        are the run config's (ulorl_jax/options.py), written once."""
        from ulorl_jax.options import check_option  # lazily: it imports jax, which sandbox workers never need

        for name in MATH_VERIFY_OPTIONS:
            value = getattr(self, name)
            check_option(f"reward.{name}", list(value) if isinstance(value, tuple) else value)


DEFAULT_OPTIONS = MathVerifyOptions()
VERIFY_OPTIONS = ("float_rounding", "numeric_precision", "strict", "allow_set_relation_comp")
PARSE_OPTIONS = ("extraction_config", "boxed_match_priority", "try_extract_without_anchor", "fallback_mode",
                 "extraction_mode")
MATH_VERIFY_OPTIONS = VERIFY_OPTIONS + PARSE_OPTIONS


def math_verify_options(source: Any) -> MathVerifyOptions:
    """The MathVerifyOptions of any object with those attributes (a RewardConfig, the run config's reward)."""
    values = {name: getattr(source, name) for name in MATH_VERIFY_OPTIONS}
    if isinstance(values["extraction_config"], list):
        values["extraction_config"] = tuple(values["extraction_config"])
    options = MathVerifyOptions(**values)
    options.validate()
    return options


def normalize_answer(answer: str) -> str:
    """Light normalisation for the string fallback (used only where math-verify parses nothing).

    Strips `$`, the sizing commands `\\left` / `\\right` (not `\\leftarrow`),
    `\\text{...}` wrappers, a trailing period, thousands separators in a plain
    number written without spaces (`1,000` -> `1000`; not `0,111`, not
    `32, 349`), and spaces and LaTeX spacing, except that digits on both sides
    of a space stay apart (`2 3` is not `23`). Case is kept (\\Delta is not \\delta).
    """
    s = answer.strip().strip("$").strip()
    s = _SIZING.sub("", s).replace("\\!", "")
    for _ in range(3):  # nested wrappers, e.g. \text{\textbf{x}}
        s = _TEXT_WRAPPERS.sub(r"\1", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = _SPACES.sub(lambda m: " " if _digits_around(s, m.start(), m.end()) else "", s)
    return s.rstrip(".")


def _digits_around(s: str, start: int, end: int) -> bool:
    return 0 < start and end < len(s) and s[start - 1].isdigit() and s[end].isdigit()


def parse_number(answer: str) -> Fraction | None:
    """A plain number (int, decimal, a/b, \\frac{a}{b}) as an exact Fraction, or None for anything else.

    Bounded work: more than 100 digits or an exponent beyond 3 digits is not a
    number here (None). Not used for reward verdicts (math-verify rounds
    floats; see the module docstring): a helper for data tools and tests.
    """
    s = normalize_answer(answer)
    if len(s) > 512:
        return None
    if _NUMBER.fullmatch(s):
        return Fraction(s)
    if "/" in s:
        num, _, den = s.partition("/")
        if _NUMBER.fullmatch(num) and _NUMBER.fullmatch(den):
            return _ratio(Fraction(num), Fraction(den))
    frac = _FRAC.fullmatch(s)
    if frac and _NUMBER.fullmatch(frac.group(2)) and _NUMBER.fullmatch(frac.group(3)):
        value = _ratio(Fraction(frac.group(2)), Fraction(frac.group(3)))
        return -value if value is not None and frac.group(1) == "-" else value
    return None


def _ratio(num: Fraction, den: Fraction) -> Fraction | None:
    return None if den == 0 else num / den


def quick_equivalence(prediction: str, reference: str, options: MathVerifyOptions | None = None) -> bool | None:
    """True / False only where that is math-verify's verdict under `options` (module docstring); None: ask
    math-verify. Any non-default `parse` option: None."""
    if options is not None and not options.for_answers().default_parsing:
        return None
    if len(prediction) > _MAX_QUICK_CHARS or len(reference) > _MAX_QUICK_CHARS:
        return None
    pred, ref = _as_latex(prediction), _as_latex(reference)
    if pred == ref:
        return True
    if _CANONICAL_INTEGER.fullmatch(pred[1:-1]) and _CANONICAL_INTEGER.fullmatch(ref[1:-1]) \
            and pred[0] == pred[-1] == ref[0] == ref[-1] == "$":
        return False  # two different canonical integers are two different values
    return None


def math_verify_equivalence(prediction: str, reference: str, timeout_s: int | None = None,
                            options: MathVerifyOptions | None = None) -> bool:
    """math-verify's verdict on two short answers, with the string fallback when it parses nothing.

    timeout_s: math-verify's own signal.alarm timeout (main thread only);
    None inside sandbox workers, where the parent enforces the timeout by
    killing the worker. options: math-verify's parse / verify options (None: its defaults).
    """
    from math_verify import parse, verify

    options = (options or DEFAULT_OPTIONS).for_answers()
    gold = parse(_as_latex(reference, options), parsing_timeout=timeout_s, **options.parse_kwargs())
    pred = parse(_as_latex(prediction, options), parsing_timeout=timeout_s, **options.parse_kwargs())
    if not gold or not pred:
        return normalize_answer(prediction) == normalize_answer(reference)
    return bool(verify(gold, pred, timeout_seconds=timeout_s, **options.verify_kwargs()))


def math_verify_response_equivalence(response: str, reference: str, timeout_s: int | None = None,
                                     options: MathVerifyOptions | None = None) -> bool:
    """math-verify's verdict on a whole response, read by math-verify's own extraction.

    With the default options the response is searched for LaTeX (`$\\frac13$`,
    `\\boxed{...}`; several boxed answers in a row are read as one set:
    `\\boxed{1}, \\boxed{2}`) and for plain expressions ("The answer is 34").
    Nothing extracted -> False. The reference is read as in
    `math_verify_equivalence`, with the same options: this is
    `verify(parse(reference), parse(response))` as math-verify's own tests call it.
    """
    from math_verify import parse, verify

    options = options or DEFAULT_OPTIONS
    pred = parse(response, parsing_timeout=timeout_s, **options.parse_kwargs())
    if not pred:
        return False
    answer_options = options.for_answers()
    gold = parse(_as_latex(reference, answer_options), parsing_timeout=timeout_s, **answer_options.parse_kwargs())
    if not gold:
        return any(isinstance(p, str) and normalize_answer(p) == normalize_answer(reference) for p in pred)
    return bool(verify(gold, pred, timeout_seconds=timeout_s, **options.verify_kwargs()))


def _as_latex(answer: str, options: MathVerifyOptions | None = None) -> str:
    """Wrap a bare answer in $...$ so math-verify's LaTeX extractor reads it; an answer that starts with `$`
    or holds a `\\boxed` (a reference with several boxes) is math-verify's to read as written, and so is
    every answer when "latex" is not among the extraction targets (`$10/9$` is 10 to the expr target)."""
    s = answer.strip()
    if s.startswith("$") or "\\boxed" in s or not (options or DEFAULT_OPTIONS).reads_latex:
        return s
    return f"${s}$"


def answers_equivalent(prediction: str, reference: str, timeout_s: int | None = None,
                       options: MathVerifyOptions | None = None) -> bool:
    """Quick rules first, then math-verify (in this process, no sandbox)."""
    quick = quick_equivalence(prediction, reference, options)
    if quick is not None:
        return quick
    return math_verify_equivalence(prediction, reference, timeout_s=timeout_s, options=options)
