"""Is a predicted final answer equivalent to the reference? (ULORL.md §4 "Rewards")

Two layers:
1. `quick_equivalence`: cheap, in-process, never hangs. Normalised strings
   equal -> True; both plain numbers (int, decimal, a/b, \\frac{a}{b}) ->
   numeric comparison. Returns None when it cannot decide.
2. `math_verify_equivalence`: the `math-verify` library (sympy underneath),
   which knows 1/2 == 0.5 == \\frac{1}{2}, (x+1)^2 == x^2+2x+1, sets, ... It
   can hang on adversarial LaTeX, so the scorer runs it in a sandboxed worker
   with a timeout (rewards/sandbox.py). If math-verify cannot parse one side,
   the string fallback (normalised equality) decides.

`answers_equivalent` chains them (no sandbox; tests and in-process use).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_SPACES = re.compile(r"(?:\s|\\[ ,;:!]|\\quad|\\qquad|~)+")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def normalize_answer(answer: str) -> str:
    """Light, safe normalisation for string comparison.

    Strips `$`, `\\left`/`\\right`, `\\text{...}` wrappers, spaces and LaTeX
    spacing, a trailing period, and thousands separators in plain numbers
    ("1,000" -> "1000"). Case is kept (\\Delta is not \\delta). Nothing
    that could make two different answers equal.
    """
    s = answer.strip().strip("$").strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    for _ in range(3):  # nested wrappers, e.g. \text{\textbf{x}}
        s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = _SPACES.sub("", s)
    s = s.rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def parse_number(answer: str) -> Fraction | float | None:
    """A plain number (exact Fraction where possible), or None if `answer` is anything else."""
    s = normalize_answer(answer)
    if _NUMBER.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return float(s)
    if "/" in s:
        num, _, den = s.partition("/")
        if _NUMBER.fullmatch(num) and _NUMBER.fullmatch(den):
            try:
                return Fraction(num) / Fraction(den)
            except ZeroDivisionError:
                return None
    frac = _FRAC.fullmatch(s)
    if frac and _NUMBER.fullmatch(frac.group(2)) and _NUMBER.fullmatch(frac.group(3)):
        try:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
        except ZeroDivisionError:
            return None
        return -value if frac.group(1) == "-" else value
    return None


def numbers_equal(a: Fraction | float, b: Fraction | float, rel_tol: float = 1e-9) -> bool:
    """Exact for two Fractions, else relative tolerance."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)


def quick_equivalence(prediction: str, reference: str) -> bool | None:
    """True / False when cheap rules decide, None when math-verify is needed."""
    if normalize_answer(prediction) == normalize_answer(reference):
        return True
    p, r = parse_number(prediction), parse_number(reference)
    if p is not None and r is not None:
        return numbers_equal(p, r)
    return None


def math_verify_equivalence(prediction: str, reference: str, timeout_s: int | None = None) -> bool:
    """math-verify's verdict, with the string fallback when it parses nothing.

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
