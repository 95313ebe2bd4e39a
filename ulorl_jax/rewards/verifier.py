"""Generative verifier: a judge model decides whether two answers are equivalent (ULORL.md §4 "Rewards").

Rule-based equivalence misjudges "27cm" vs "0.27m" or "1/2" vs "one half";
the paper asked a model instead. Here a local HF (or ulorl) model served by
our decode engine (decode/engine.py) reads a prompt built from
`VERIFIER_TEMPLATE` (question, reference, candidate answer), decodes greedily
for a few tokens, and its first "yes" / "no" is the verdict. Output with
neither is `None` (the scorer counts it as `unparsable`, reward 0).

The scorer (rewards/scorer.py, kind="verifier") extracts the candidate's final
answer and skips the judge when the cheap rules already say "equal".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

VERIFIER_TEMPLATE = (
    "Decide whether the candidate's final answer is equivalent to the reference answer "
    "(same value, same meaning; units and notation may differ).\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Candidate answer: {prediction}\n"
    "Reply with one word: yes or no."
)

_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """True for "yes", False for "no" (the first one in `text`), None when neither appears."""
    match = _VERDICT.search(text)
    return None if match is None else match.group(1).lower() == "yes"


@dataclasses.dataclass
class VerifierConfig:
    model_dir: str | None = None  # HF or ulorl folder (or pass model= and tokenizer=)
    tokenizer_dir: str | None = None  # default: model_dir
    template: str = VERIFIER_TEMPLATE  # fields: {question}, {reference}, {prediction}
    max_new_tokens: int = 8
    max_field_chars: int = 400  # longer fields keep their last characters (the final answer is at the end)
    slots: int = 16  # concurrent decodes


def verifier_prompt(template: str, prediction: str, reference: str, question: str = "",
                    max_field_chars: int = 400) -> str:
    """The judge's user message."""
    def clip(s: str) -> str:
        return s if len(s) <= max_field_chars else "..." + s[-max_field_chars:]

    return template.format(question=clip(question), reference=clip(reference), prediction=clip(prediction))


class GenerativeVerifier:
    """`judge(items)` -> one verdict (True / False / None) per (prediction, reference, metadata)."""

    def __init__(self, config: VerifierConfig, *, model: Any = None, tokenizer: Any = None):
        if config.max_new_tokens < 1:
            raise ValueError(f"verifier max_new_tokens must be >= 1, got {config.max_new_tokens}")
        for field in ("{reference}", "{prediction}"):
            if field not in config.template:
                raise ValueError(f"verifier template must contain {field}")
        if model is None:
            if not config.model_dir:
                raise ValueError("GenerativeVerifier needs VerifierConfig.model_dir or model=")
            from ulorl_jax.models.native import load_any

            model = load_any(config.model_dir)
        if tokenizer is None:
            from transformers import AutoTokenizer

            folder = config.tokenizer_dir or config.model_dir
            if not folder:
                raise ValueError("GenerativeVerifier needs VerifierConfig.tokenizer_dir / model_dir or tokenizer=")
            tokenizer = AutoTokenizer.from_pretrained(folder)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self._engines: dict[int, Any] = {}  # by max prompt length bucket: one compile per bucket
        self.last_outputs: list[str] = []  # raw judge outputs of the last call (diagnostics)

    def prompt_ids(self, prediction: str, reference: str, metadata: dict | None = None) -> list[int]:
        from ulorl_jax.data.prompts import encode_prompt

        question = str((metadata or {}).get("prompt", ""))
        text = verifier_prompt(self.config.template, prediction, reference, question, self.config.max_field_chars)
        return encode_prompt(self.tokenizer, text)

    def _engine(self, longest: int):
        from ulorl_jax.decode.engine import PolicyEngine
        from ulorl_jax.decode.sampling import SamplingParams

        size = 1 << max(6, (longest - 1).bit_length())  # power-of-two prompt capacity
        if size not in self._engines:
            eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
            self._engines[size] = PolicyEngine(
                self.model, max_concurrent_decodes=self.config.slots, max_prefill_length=size,
                max_cache_len=size + self.config.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                eos_token_ids=eos)
        return self._engines[size]

    def judge(self, items: Sequence[tuple[str, str, dict]]) -> list[bool | None]:
        if not items:
            return []
        import jax

        from ulorl_jax.decode.engine import Request

        prompts = [self.prompt_ids(p, r, m) for p, r, m in items]
        engine = self._engine(max(len(p) for p in prompts))
        requests = [Request(p, self.config.max_new_tokens, jax.random.PRNGKey(0)) for p in prompts]
        completions, _ = engine.run(engine.load_params(), requests)
        self.last_outputs = [self.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
        return [parse_verdict(text) for text in self.last_outputs]
