"""Final-answer extraction from a model's response (ULORL.md §4 "Rewards").

The reward compares the *final* answer only, so both extractors return the
last answer in the text:
- `last_boxed`: the content of the last `\\boxed{...}` (or `\\fbox{...}`),
  with nested braces balanced, e.g. `\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`.
- `extract_answer(text, pattern)`: a user regex (its first group, or the whole
  match when it has none), last match wins; without a pattern, `last_boxed`.
Pure functions of strings; None when there is no answer.
"""

from __future__ import annotations

import functools
import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text`.

    Braces inside are balanced (`\\boxed{\\{1,2\\}}` keeps escaped `\\{` `\\}`
    as text). `\\boxed 5` (no braces, one token) is accepted as LaTeX allows.
    An unclosed `\\boxed{` (a truncated response) is not an answer.
    """
    starts = [m.start() for cmd in _BOX_COMMANDS for m in re.finditer(re.escape(cmd), text)]
    for start in sorted(starts, reverse=True):
        cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        pos = start + len(cmd)
        if pos < len(text) and text[pos] == " ":  # `\boxed 5`
            token = re.match(r" +([^\s$]+)", text[pos:])
            if token:
                return token.group(1)
            continue
        if pos < len(text) and text[pos].isalpha():  # `\boxedfoo`: another command, not a box
            continue
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            continue
        content = _balanced(text, pos)
        if content is not None:
            return content.strip()
    return None


def _balanced(text: str, open_pos: int) -> str | None:
    """Text between text[open_pos] == '{' and its matching '}', or None if unclosed."""
    depth = 0
    i = open_pos
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":  # escaped brace is content
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


@functools.lru_cache(maxsize=64)
def compile_answer_pattern(pattern: str) -> re.Pattern:
    """Compile a user answer regex; a bad one raises ValueError naming it."""
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"answer_pattern {pattern!r} is not a valid regex: {err}") from None


def extract_answer(text: str, pattern: str | None = None) -> str | None:
    """The final answer in `text`: last regex match if `pattern` is given, else last `\\boxed{}`."""
    if pattern is None:
        return last_boxed(text)
    matches = list(compile_answer_pattern(pattern).finditer(text))
    if not matches:
        return None
    last = matches[-1]
    answer = last.group(1) if last.re.groups else last.group(0)
    return None if answer is None else answer.strip()
