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

import numpy as np

_BOX_START = re.compile(r"\\(?:boxed|fbox)")
_TOKEN = re.compile(r" +([^\s$]+)")  # `\boxed 5`: one token after spaces
_SPACE = re.compile(r"\s*")


def count_boxes(text: str) -> int:
    """How many `\\boxed` / `\\fbox` commands `text` holds (complete or not)."""
    return len(_BOX_START.findall(text))


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text`.

    Braces inside are balanced (`\\boxed{\\{1,2\\}}` keeps escaped `\\{` `\\}`
    as text). `\\boxed 5` (no braces, one token) is accepted as LaTeX allows.
    An unclosed `\\boxed{` (a truncated response) is not an answer.
    Linear time in len(text) (`_last_boxed_reference` is the plain version it
    is tested against): brace depths are one cumulative sum, and whether a
    box closes is one look-up of the minimum depth after it.
    """
    starts = np.fromiter((m.end() for m in _BOX_START.finditer(text)), dtype=np.int64)
    if not starts.size:
        return None
    n = len(text)
    depth, suffix_min = _brace_depths(text)
    # drop, all at once, every `\\boxed{` that never closes (a degenerate response may hold 10^5 of them)
    brace = starts[starts < n - 1]
    brace = brace[depth[brace] > depth[brace - 1]]  # text[pos] is an unescaped `{`
    unclosed = brace[suffix_min[brace + 1] >= depth[brace]]
    starts = np.setdiff1d(starts, unclosed, assume_unique=True).tolist()
    for pos in reversed(starts):
        if pos < n and text[pos] == " ":  # `\boxed 5`
            token = _TOKEN.match(text, pos)
            if token:
                return token.group(1)
            continue
        if pos < n and text[pos].isalpha():  # `\boxedfoo`: another command, not a box
            continue
        pos = _SPACE.match(text, pos).end()
        if pos >= n or text[pos] != "{":
            continue
        # the box closes iff the depth falls below its own level somewhere after its `{`
        if pos + 1 < n and suffix_min[pos + 1] < depth[pos]:
            close = pos + 1 + int(np.argmax(depth[pos + 1:] < depth[pos]))
            return text[pos + 1 : close].strip()
    return None


def _brace_depths(text: str) -> tuple[np.ndarray, np.ndarray]:
    """depth[i]: unescaped `{` minus `}` in text[: i + 1]; suffix_min[i]: min(depth[i:]).

    A brace right after a backslash is escaped (content, not structure).
    """
    codes = np.frombuffer(text.encode("latin-1", "replace"), dtype=np.uint8)  # one byte per character
    step = (codes == ord("{")).astype(np.int32) - (codes == ord("}"))
    step[1:][codes[:-1] == ord("\\")] = 0
    depth = np.cumsum(step, dtype=np.int32)
    suffix_min = np.minimum.accumulate(depth[::-1])[::-1]
    return depth, suffix_min


def _last_boxed_reference(text: str) -> str | None:
    """Plain quadratic-time version of `last_boxed` (each box scanned on its own), for tests."""
    for match in reversed(list(_BOX_START.finditer(text))):
        pos = match.end()
        if pos < len(text) and text[pos] == " ":
            token = _TOKEN.match(text, pos)
            if token:
                return token.group(1)
            continue
        if pos < len(text) and text[pos].isalpha():
            continue
        pos = _SPACE.match(text, pos).end()
        if pos >= len(text) or text[pos] != "{":
            continue
        depth, i = 0, pos
        while i < len(text):
            ch = text[i]
            if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":  # escaped brace is content
                i += 2
                continue
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                return text[pos + 1 : i].strip()
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
