"""The rollout's domain types, shared by data (prompts), decode (segment rollout), distributed and
rl (trainer, evaluation): a prompt to roll out and a sample in flight. Plain dataclasses with no
imports from the package, so any module can name them without depending on the engine."""

from __future__ import annotations

import dataclasses

FINISH_REASONS = ("eos", "length")


@dataclasses.dataclass
class Sample:
    uid: int
    prompt_index: int  # group id
    sample_index: int  # 0..n-1
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # per response token (sampling.py convention)
    policy_versions: list[int] = dataclasses.field(default_factory=list)  # per response token
    segments: int = 0  # rollout steps it took part in
    finish_reason: str | None = None  # None while unfinished; "eos" | "length"
    metadata: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
            "logprobs": list(self.logprobs), "policy_versions": list(self.policy_versions),
            "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown fields {sorted(unknown)}")
        s = cls(**{k: d[k] for k in names if k in d})
        if s.finish_reason not in (None,) + FINISH_REASONS:
            raise ValueError(f"Sample.from_dict: finish_reason={s.finish_reason!r} not in {FINISH_REASONS}")
        if not (len(s.response_ids) == len(s.logprobs) == len(s.policy_versions)):
            raise ValueError(f"Sample.from_dict (uid {s.uid}): response_ids, logprobs and policy_versions "
                             f"lengths differ ({len(s.response_ids)}, {len(s.logprobs)}, {len(s.policy_versions)})")
        return s


@dataclasses.dataclass(frozen=True)
class PromptItem:
    prompt_index: int
    prompt_ids: list[int]
    metadata: dict = dataclasses.field(default_factory=dict)
