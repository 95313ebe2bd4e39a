"""A verifiable task with long-tailed trace lengths, small enough for a tiny policy to learn.

Modular running sums: the prompt "sum mod 10: a3 b5 c8 d2" asks for the sum
of the labelled operands mod 10; the step-by-step trace writes one line per
operand — its label, its value and the running sum — then the boxed answer:

    a3=3
    b5=8
    c8=6
    d2=8
    \\boxed{8}

Every step is a local rule a 2-layer policy learns quickly: the next label
follows the previous one, its value is looked up by label in the prompt (an
induction-head copy), and the new running sum adds it to the value written
one line up (a fixed distance back).

The number of operands K is drawn from a truncated discrete power law,
P(K = k) ∝ (k − min_operands + 1)^(−tail_alpha) on [min_operands, max_operands]:
most problems are short and a few are many times longer — the long tail that
segment rollout (ULORL.md §1) is built for. Trace length grows linearly in K.

`noisy_trace` writes each step's result wrong with probability p (a wrong
digit, uniformly among the others) and carries the wrong running value on,
so the trace stays self-consistent but its answer is often wrong: the
"sometimes wrong" warm-start SFT data. Train and eval splits are disjoint
by problem (assigned by a hash of the prompt).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

PROMPT_PREFIX = "sum mod {modulus}: "
LABELS = "abcdefghijklmnopqrstuvwxyz"  # operand i is labelled LABELS[i]


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the operand-count distribution and the modulus."""

    min_operands: int = 2
    max_operands: int = 26
    tail_alpha: float = 1.5  # larger: fewer long problems
    modulus: int = 10

    def __post_init__(self):
        if self.max_operands > len(LABELS):
            raise ValueError(f"max_operands={self.max_operands}: at most {len(LABELS)} operands (labels a-z)")
        if not 1 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 1 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        if not self.tail_alpha > 0:
            raise ValueError(f"tail_alpha must be > 0, got {self.tail_alpha}")
        if self.modulus < 2:
            raise ValueError(f"modulus must be >= 2, got {self.modulus}")


@dataclasses.dataclass(frozen=True)
class SyntheticProblem:
    operands: tuple[int, ...]
    modulus: int = 10

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX.format(modulus=self.modulus) + " ".join(
            f"{LABELS[i]}{x}" for i, x in enumerate(self.operands))

    @property
    def answer(self) -> str:
        """The reference answer: sum of the operands mod `modulus`."""
        return str(sum(self.operands) % self.modulus)

    def trace(self) -> str:
        """The correct step-by-step response, ending in \\boxed{answer}."""
        return noisy_trace(self, 0.0, np.random.default_rng(0))[0]


def operand_count_pmf(config: SyntheticConfig) -> np.ndarray:
    """P(K = k) for k = min_operands .. max_operands (array index k - min_operands)."""
    ranks = np.arange(1, config.max_operands - config.min_operands + 2, dtype=np.float64)
    weights = ranks ** -config.tail_alpha
    return weights / weights.sum()


def generate_problems(config: SyntheticConfig, n: int, seed: int | Sequence[int]) -> list[SyntheticProblem]:
    """`n` problems, a pure function of (config, n, seed); seed may be a sequence of ints."""
    rng = np.random.default_rng(seed)
    counts = config.min_operands + rng.choice(len(operand_count_pmf(config)), size=n, p=operand_count_pmf(config))
    return [SyntheticProblem(tuple(int(x) for x in rng.integers(0, config.modulus, size=int(k))), config.modulus)
            for k in counts]


def noisy_trace(problem: SyntheticProblem, p: float, rng: np.random.Generator) -> tuple[str, int]:
    """(response text, number of wrong steps): each step's result is wrong with probability p.

    A wrong step writes a uniformly chosen wrong value and the trace continues
    from what it wrote, so every line's sum is "previous line's sum + its operand".
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"noise probability p must be in [0, 1], got {p}")
    m = problem.modulus
    running = 0
    lines, wrong = [], 0
    for i, x in enumerate(problem.operands):
        result = (running + x) % m
        if p > 0 and rng.random() < p:
            result = (result + int(rng.integers(1, m))) % m  # any of the m - 1 other values
            wrong += 1
        lines.append(f"{LABELS[i]}{x}={result}")
        running = result
    lines.append(f"\\boxed{{{running}}}")
    return "\n".join(lines), wrong


def split_of(problem: SyntheticProblem, eval_fraction: float) -> str:
    """"eval" or "train", fixed by a hash of the prompt (so splits never share a problem)."""
    bucket = zlib.crc32(problem.prompt.encode()) % 10_000
    return "eval" if bucket < eval_fraction * 10_000 else "train"


def make_splits(config: SyntheticConfig, n_train: int, n_eval: int, seed: int,
                eval_fraction: float = 0.2) -> dict[str, list[SyntheticProblem]]:
    """Disjoint train / eval problem lists drawn from the same distribution (rejection by split)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    want = {"train": n_train, "eval": n_eval}
    out: dict[str, list[SyntheticProblem]] = {"train": [], "eval": []}
    chunk = max(64, n_train + n_eval)
    for round_ in range(1000):
        for problem in generate_problems(config, chunk, seed=[seed, round_]):
            split = split_of(problem, eval_fraction)
            if len(out[split]) < want[split]:
                out[split].append(problem)
        if all(len(out[s]) >= want[s] for s in want):
            return out
    raise ValueError(f"could not draw {n_train} train / {n_eval} eval problems from {config} "
                     f"(eval_fraction={eval_fraction}); the distribution has too few distinct problems")


def problem_rows(problems: Iterable[SyntheticProblem], *, noise_p: float | None = None,
                 seed: int = 0) -> list[dict]:
    """JSON rows {"prompt", "answer", "num_operands"} (+ "response", "wrong_steps" when noise_p is given)."""
    rng = np.random.default_rng(seed)
    rows = []
    for problem in problems:
        row = {"prompt": problem.prompt, "answer": problem.answer, "num_operands": len(problem.operands)}
        if noise_p is not None:
            row["response"], row["wrong_steps"] = noisy_trace(problem, noise_p, rng)
        rows.append(row)
    return rows


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """mean, p50, p90, p99, max (and n) of a list of lengths, for run summaries."""
    a = np.asarray(lengths, dtype=np.float64)
    if a.size == 0:
        raise ValueError("length_stats: no lengths")
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def trace_lengths(problems: Iterable[SyntheticProblem], tokenizer=None) -> list[int]:
    """Response lengths of the correct traces: tokens (+1 for eos) with a tokenizer, else characters."""
    if tokenizer is None:
        return [len(p.trace()) for p in problems]
    return [len(tokenizer.encode(p.trace(), add_special_tokens=False)) + 1 for p in problems]


def distribution_stats(config: SyntheticConfig, n: int = 10_000, seed: int = 0, tokenizer=None) -> dict:
    """Length statistics of the correct traces of `n` problems (and of the operand counts)."""
    problems = generate_problems(config, n, seed)
    return {"trace_length": length_stats(trace_lengths(problems, tokenizer)),
            "num_operands": length_stats([len(p.operands) for p in problems])}
