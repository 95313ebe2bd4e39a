"""Tokens to text on the host: a choice's text as it grows, stop strings, and log-prob fields.

As vLLM: the text skips special tokens (EOS ends a choice and is not in its text); a stop string ends
the choice and is cut off with whatever followed it; a streamed delta holds back the characters that
may still become a stop string, and an incomplete UTF-8 character.
"""

from __future__ import annotations

from typing import Any

from ulorl_jax.serving.scoring import Scores


def token_string(tokenizer: Any, token: int) -> str:
    """One token as text (special tokens included), or `token_id:N` without a tokenizer (vLLM's spelling)."""
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def decode(tokenizer: Any, tokens: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)


class ChoiceText:
    """One choice's tokens and text; `add` new tokens, `delta()` the text not streamed yet."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length", once ended
        self.stop_reason: str | None = None  # the stop string that ended it
        self._streamed = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: list[int], ended: str = "") -> None:
        """`tokens` generated after the others; `ended`: the engine's reason when it stopped ("eos",
        "budget"). A stop string in the text ends the choice here, whatever the engine says."""
        if self.done:
            return
        seen = len(self.text)
        self.tokens += tokens
        self.text = decode(self.tokenizer, self.tokens)
        if self.stop:
            hits = [(at, s) for s in self.stop if (at := self.text.find(s, max(0, seen - len(s) + 1))) >= 0]
            if hits:
                at, s = min(hits)
                self._cut_at_stop(at, s)
                return
        if ended:
            self.finish_reason = "length" if ended == "budget" else "stop"

    def _cut_at_stop(self, at: int, s: str) -> None:
        """End at the stop string `s` found at `at`: text up to it; tokens up to the one that completed it."""
        self.text, self.finish_reason, self.stop_reason = self.text[:at], "stop", s
        for n in range(1, len(self.tokens) + 1):
            if s in decode(self.tokenizer, self.tokens[:n]):
                self.tokens = self.tokens[:n]
                return

    def delta(self) -> str:
        """Text not streamed yet that can no longer change."""
        end = len(self.text)
        if not self.done:
            end -= self._hold
            while end > self._streamed and self.text[end - 1] == "\ufffd":  # a character cut in its bytes
                end -= 1
        if end <= self._streamed:
            return ""
        out, self._streamed = self.text[self._streamed:end], end
        return out


def completion_logprobs(tokenizer: Any, ids: list[int], scores: Scores | None, start: int, k: int,
                        offset: int = 0) -> dict:
    """/v1/completions `logprobs` of ids[start:]: `tokens`, `token_logprobs`, `top_logprobs` (the k most
    likely and the chosen token), `text_offset` (from `offset`). `scores` are those of all `ids` (row p
    predicts ids[p + 1]); the sequence's first token has no log-prob: null."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in range(start, len(ids)):
        text = token_string(tokenizer, ids[p])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if p == 0 or scores is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp = float(scores.logprobs[p - 1])
        top = {token_string(tokenizer, t): float(v) for t, v in zip(scores.top_ids[p - 1][:k],
                                                                   scores.top_logprobs[p - 1][:k])}
        top.setdefault(text, lp)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: Any, ids: list[int], scores: Scores, start: int, k: int) -> dict:
    """/v1/chat/completions `logprobs` of ids[start:] (start >= 1): `content`, one entry per token."""
    def entry(token: int, lp: float) -> dict:
        text = token_string(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for p in range(start, len(ids)):
        item = entry(ids[p], float(scores.logprobs[p - 1]))
        item["top_logprobs"] = [entry(t, float(v)) for t, v in zip(scores.top_ids[p - 1][:k],
                                                                  scores.top_logprobs[p - 1][:k])]
        content.append(item)
    return {"content": content}
