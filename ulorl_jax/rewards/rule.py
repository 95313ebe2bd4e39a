"""The rule-based reward: 1 iff the final answer is equivalent to the reference (ULORL.md §4).

`rule_reward` is the whole rule as one pure function (extract -> quick rules
-> math-verify). The scorer splits it: `quick_rule_reward` runs in-process
and decides the pairs whose verdict it can prove is math-verify's (the same
answer as the reference, two integers); the rest go to `math_verify_reward`
in a sandboxed worker, because math-verify can hang.

extraction="boxed" (the paper's rule) compares the last \\boxed{} (or the
`answer_pattern` match); extraction="math_verify" hands the whole response (or
the pattern's match) to math-verify's own extraction (`math_verify_response_reward`,
always sandboxed). Every math-verify call takes math-verify's own options
(`MathVerifyOptions`: the scorer passes the run's `reward.*` ones).
"""

from __future__ import annotations

from ulorl_jax.rewards.equivalence import (
    MathVerifyOptions,
    answers_equivalent,
    math_verify_equivalence,
    math_verify_response_equivalence,
    quick_equivalence,
)
from ulorl_jax.rewards.extract import count_boxes, extract_answer, last_boxed


def reference_answer(reference: str) -> str:
    """The reference's answer as math-verify is to read it: the content of its \\boxed{} if it has exactly
    one; the whole reference if it has several (math-verify reads boxes in a row, `\\boxed{1}, \\boxed{2}`,
    as one set, and otherwise the last one); else the reference itself."""
    if "\\boxed" not in reference and "\\fbox" not in reference:
        return reference.strip()
    if count_boxes(reference) > 1:
        return reference.strip()
    boxed = last_boxed(reference)
    return (boxed if boxed is not None else reference).strip()


def quick_rule_reward(answer: str, reference: str, options: MathVerifyOptions | None = None) -> float | None:
    """1.0 / 0.0 when cheap rules decide, None when math-verify must judge."""
    verdict = quick_equivalence(answer, reference, options)
    return None if verdict is None else float(verdict)


def math_verify_reward(answer: str, reference: str, options: MathVerifyOptions | None = None) -> float:
    """math-verify's verdict on an extracted answer as 0/1 (run it under a timeout: rewards/sandbox.py)."""
    _quiet_math_verify()
    return float(math_verify_equivalence(answer, reference, timeout_s=None, options=options))


def math_verify_response_reward(response: str, reference: str, options: MathVerifyOptions | None = None) -> float:
    """math-verify's verdict on a whole response (its own extraction) as 0/1; sandboxed like the above."""
    _quiet_math_verify()
    return float(math_verify_response_equivalence(response, reference, timeout_s=None, options=options))


def boxed_response_reward(response: str, reference: str, answer_pattern: str | None = None,
                          options: MathVerifyOptions | None = None) -> float:
    """The whole boxed rule, extraction included, as 0/1: for responses long enough that even linear
    extraction is more than a few milliseconds of the trainer's time (sandboxed like the above)."""
    _quiet_math_verify()
    return rule_reward(response, reference, answer_pattern=answer_pattern, timeout_s=None, options=options)


def _quiet_math_verify() -> None:
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: we enforce it


def rule_reward(text: str, reference: str, *, answer_pattern: str | None = None, extraction: str = "boxed",
                truncated: bool = False, timeout_s: int | None = 5, options: MathVerifyOptions | None = None) -> float:
    """Unsandboxed reference version of the rule: 0 if truncated or no answer, else 0/1 by equivalence."""
    if truncated:
        return 0.0
    answer = extract_answer(text, answer_pattern) if answer_pattern or extraction == "boxed" else text
    if answer is None:
        return 0.0
    if extraction == "math_verify":
        return float(math_verify_response_equivalence(answer, reference_answer(reference), timeout_s=timeout_s,
                                                      options=options))
    return float(answers_equivalent(answer, reference_answer(reference), timeout_s=timeout_s, options=options))
