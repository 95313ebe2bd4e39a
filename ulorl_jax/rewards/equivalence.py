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
2. `math_verify_equivalence` / `math_verify_response_equivalence`:
   math-verify's verdict on a short answer / on a whole response (its own
   extraction). When math-verify parses nothing on one side, normalised
   string equality (`normalize_answer`) decides.

`answers_equivalent` chains 1 and 2 (no sandbox; tests and in-process use).
"""

from __future__ import annotations

import re
from fractions import Fraction

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_SPACES = re.compile(r"(?:\s|\\[ ,;:!]|\\quad(?![A-Za-z])|\\qquad(?![A-Za-z])|~)+")
_SIZING = re.compile(r"\\(?:left|right)(?![A-Za-z])")  # not the start of \leftarrow, \rightarrow, ...
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")  # 1,000 and 12,345.5; not 0,111
# bounded: at most 100 digits and a 3-digit exponent; anything longer is not a number here
_NUMBER = re.compile(r"[+-]?(?:\d{1,100}(?:\.\d{0,100})?|\.\d{1,100})(?:[eE][+-]?\d{1,3})?")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_CANONICAL_INTEGER = re.compile(r"0|-?[1-9]\d{0,99}")
_MAX_QUICK_CHARS = 10_000  # longer answers go to math-verify whole (the quick rules stay ~µs)


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


def quick_equivalence(prediction: str, reference: str) -> bool | None:
    """True / False only where that is math-verify's verdict (module docstring); None: ask math-verify."""
    if len(prediction) > _MAX_QUICK_CHARS or len(reference) > _MAX_QUICK_CHARS:
        return None
    pred, ref = _as_latex(prediction), _as_latex(reference)
    if pred == ref:
        return True
    if _CANONICAL_INTEGER.fullmatch(pred[1:-1]) and _CANONICAL_INTEGER.fullmatch(ref[1:-1]) \
            and pred[0] == pred[-1] == ref[0] == ref[-1] == "$":
        return False  # two different canonical integers are two different values
    return None


def math_verify_equivalence(prediction: str, reference: str, timeout_s: int | None = None) -> bool:
    """math-verify's verdict on two short answers, with the string fallback when it parses nothing.

    timeout_s: math-verify's own signal.alarm timeout (main thread only);
    None inside sandbox workers, where the parent enforces the timeout by
    killing the worker.
    """
    from math_verify import parse, verify

    gold = parse(_as_latex(reference), parsing_timeout=timeout_s)
    pred = parse(_as_latex(prediction), parsing_timeout=timeout_s)
    if not gold or not pred:
        return normalize_answer(prediction) == normalize_answer(reference)
    return bool(verify(gold, pred, timeout_seconds=timeout_s))


def math_verify_response_equivalence(response: str, reference: str, timeout_s: int | None = None) -> bool:
    """math-verify's verdict on a whole response, read by math-verify's own extraction.

    The response is searched for LaTeX (`$\\frac13$`, `\\boxed{...}`; several
    boxed answers in a row are read as one set: `\\boxed{1}, \\boxed{2}`) and
    for plain expressions ("The answer is 34"). Nothing extracted -> False.
    The reference is a short answer, read as in `math_verify_equivalence`.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    pred = parse(response, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=timeout_s)
    if not pred:
        return False
    gold = parse(_as_latex(reference), parsing_timeout=timeout_s)
    if not gold:
        return any(isinstance(p, str) and normalize_answer(p) == normalize_answer(reference) for p in pred)
    return bool(verify(gold, pred, timeout_seconds=timeout_s))


def _as_latex(answer: str) -> str:
    """Wrap a bare answer in $...$ so math-verify's LaTeX extractor reads it."""
    s = answer.strip()
    return s if s.startswith("$") else f"${s}$"


def answers_equivalent(prediction: str, reference: str, timeout_s: int | None = None) -> bool:
    """Quick rules first, then math-verify (in this process, no sandbox)."""
    quick = quick_equivalence(prediction, reference)
    if quick is not None:
        return quick
    return math_verify_equivalence(prediction, reference, timeout_s=timeout_s)
