"""`ulorl data clean`: the paper's rule-based data cleaning (ULORL.md §4 "Data cleaning").

Rules, each a pure function of (prompt, answer) and each reported:
- multi_subquestion: enumerated parts "(a) ... (b)", "(i) ... (ii)", "(1) ... (2)",
  "Part a / Part b" (in the prompt or the answer), or two or more questions
  ending in "?" in the prompt. Drop.
- long_answer: reference longer than `max_answer_chars` (spaces removed), a
  matrix / array environment, or several lines. Drop.
- multiple_choice: option lists "(A) ... (B) ...", "A. ... B. ..." on their
  own lines, "Answer choices:", or "which of the following" with a one-letter
  answer. The paper rewrote these into short-answer form with a model; we
  cannot do that by rule, so the default is drop (`--flag multiple_choice`
  keeps them, marked in a "clean_flags" field).
- true_false: "true or false", "true/false", or a yes/no/true/false answer. Drop (or flag).
- proof: "prove that", "show that", "prove or disprove" without a quantity to
  find, or a "proof" answer. Drop (or flag).
- missing_field: no usable prompt / answer (bad rows of the reader too).
- duplicate (opt-in): the same prompt again (whitespace-normalised).
- solved_by_policy (opt-in, `--model DIR`): the current policy answers the
  prompt correctly in all of `--samples` samples ("drop questions the base
  model solves 8/8"); uses the decode engine and the rule reward.
The paper's last rule (drop questions whose reference disagrees with a
consensus of strong models) needs strong models and is not done here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ulorl_jax.data.readers import BadRow, read_rows

CONTENT_RULES = ("multi_subquestion", "long_answer", "multiple_choice", "true_false", "proof")
RULES = ("missing_field", *CONTENT_RULES, "duplicate", "solved_by_policy")
ACTIONS = ("drop", "flag", "off")
DEFAULT_ACTIONS = {"missing_field": "drop", "multi_subquestion": "drop", "long_answer": "drop",
                   "multiple_choice": "drop", "true_false": "drop", "proof": "drop", "duplicate": "off",
                   "solved_by_policy": "drop"}

# -- rules ------------------------------------------------------------------------------

_B = r"(?<![A-Za-z0-9_\\])"  # a marker must not follow a letter/digit: f(1), x(a), \left( are not markers
_ENUM_PAIRS = (
    (rf"{_B}\(a\)", rf"{_B}\(b\)"), (rf"{_B}\(i\)", rf"{_B}\(ii\)"), (rf"{_B}\(1\)", rf"{_B}\(2\)"),
    (r"(?m)^\s*a\)", r"(?m)^\s*b\)"), (r"(?m)^\s*\(?i\)", r"(?m)^\s*\(?ii\)"),
    (r"(?i)\bpart\s*\(?a\)?\b", r"(?i)\bpart\s*\(?b\)?\b"),
)
_QUESTION_END = re.compile(r"\?(?=\s|$|\$)")
_MATRIX = re.compile(r"\\begin\{(?:[pbvBV]?matrix|smallmatrix|array|cases|aligned|align\*?)\}")
_OPTION_PAREN = re.compile(rf"{_B}\(([A-E])\)")
_OPTION_LINE = re.compile(r"(?m)^\s*\(?([A-E])[.):]\s+\S")
_CHOICES_WORDS = re.compile(r"(?i)\b(answer choices|options|choices)\s*:")
_WHICH_OF = re.compile(r"(?i)\bwhich (one )?of the following\b")
_TF_WORDS = re.compile(r"(?i)\btrue\s*(or|/)\s*false\b|\(T/F\)|\bT\s*/\s*F\b")
_TF_ANSWERS = {"true", "false", "yes", "no", "t", "f", "correct", "incorrect"}
_PROOF_WORDS = re.compile(r"(?i)\b(prove|show|demonstrate|verify)\s+that\b|\bprove or disprove\b|^\s*prove\b")
_FIND_WORDS = re.compile(r"(?i)\b(find|compute|calculate|determine|evaluate|what|how many|how much|solve)\b")
_PROOF_ANSWERS = re.compile(r"(?i)^\s*(proof|see proof|proved|q\.?e\.?d\.?|\\blacksquare|\\square|n/?a)?\s*$")


def _plain(answer: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", answer.strip().strip("$").strip())
    return re.sub(r"\s+", "", s)


def is_multi_subquestion(prompt: str, answer: str = "") -> bool:
    for text in (prompt, answer):
        if any(re.search(first, text) and re.search(second, text) for first, second in _ENUM_PAIRS):
            return True
    return len(_QUESTION_END.findall(prompt)) >= 2


def is_long_answer(answer: str, max_chars: int = 50) -> bool:
    return bool(_MATRIX.search(answer)) or "\n" in answer.strip() or "\\\\" in answer \
        or len(_plain(answer)) > max_chars


def is_multiple_choice(prompt: str, answer: str = "") -> bool:
    letters = set(_OPTION_PAREN.findall(prompt))
    if {"A", "B"} <= letters:
        return True
    line_letters = _OPTION_LINE.findall(prompt)
    if len(set(line_letters)) >= 3 and {"A", "B", "C"} <= set(line_letters):
        return True
    one_letter = re.fullmatch(r"\(?([A-Ea-e])\)?", _plain(answer)) is not None
    return bool(one_letter and (_CHOICES_WORDS.search(prompt) or _WHICH_OF.search(prompt)))


def is_true_false(prompt: str, answer: str = "") -> bool:
    return bool(_TF_WORDS.search(prompt)) or _plain(answer).strip(".").lower() in _TF_ANSWERS


def is_proof(prompt: str, answer: str = "") -> bool:
    if _PROOF_ANSWERS.fullmatch(answer) and answer.strip():
        return True
    return bool(_PROOF_WORDS.search(prompt)) and not _FIND_WORDS.search(prompt)


def content_rule_hits(prompt: str, answer: str, max_answer_chars: int = 50) -> list[str]:
    """Names of the content rules (see CONTENT_RULES) that (prompt, answer) breaks, in rule order."""
    checks = {"multi_subquestion": is_multi_subquestion(prompt, answer),
              "long_answer": is_long_answer(answer, max_answer_chars),
              "multiple_choice": is_multiple_choice(prompt, answer),
              "true_false": is_true_false(prompt, answer),
              "proof": is_proof(prompt, answer)}
    return [rule for rule in CONTENT_RULES if checks[rule]]


# -- cleaning a table -------------------------------------------------------------------

@dataclasses.dataclass
class CleanConfig:
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_answer_chars: int = 50
    actions: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ACTIONS))

    def validate(self) -> None:
        unknown = set(self.actions) - set(RULES)
        if unknown:
            raise ValueError(f"unknown cleaning rule(s) {sorted(unknown)}; rules are {RULES}")
        bad = {r: a for r, a in self.actions.items() if a not in ACTIONS}
        if bad:
            raise ValueError(f"cleaning actions must be one of {ACTIONS}, got {bad}")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {self.max_answer_chars}")


@dataclasses.dataclass
class CleanReport:
    total: int = 0
    kept: int = 0
    dropped: int = 0
    flagged: int = 0
    matches: dict[str, int] = dataclasses.field(default_factory=lambda: {r: 0 for r in RULES})
    dropped_by_rule: dict[str, int] = dataclasses.field(default_factory=lambda: {r: 0 for r in RULES})
    dropped_rows: list[dict] = dataclasses.field(default_factory=list)  # {"line", "reasons", "detail"?}
    flagged_rows: list[dict] = dataclasses.field(default_factory=list)
    actions: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        lines = [f"{'rule':<20}{'action':>8}{'matched':>9}{'dropped':>9}"]
        for rule in RULES:
            lines.append(f"{rule:<20}{self.actions.get(rule, '-'):>8}{self.matches[rule]:>9}"
                         f"{self.dropped_by_rule[rule]:>9}")
        lines.append(f"total {self.total}, kept {self.kept}, dropped {self.dropped}, flagged {self.flagged} "
                     "(dropped counts each row once, under its first rule)")
        return "\n".join(lines)


Solver = Callable[[Sequence[dict]], Sequence[tuple[int, int]]]  # rows -> (correct, samples) per row


def clean_rows(rows: Iterable[tuple[int, dict | BadRow]], config: CleanConfig,
               solver: Solver | None = None) -> tuple[list[dict], CleanReport]:
    """Apply the rules to (line, row) pairs; return kept rows (flagged ones carry "clean_flags") and the report."""
    config.validate()
    actions = {rule: config.actions.get(rule, DEFAULT_ACTIONS[rule]) for rule in RULES}
    if solver is None:
        actions["solved_by_policy"] = "off"
    report = CleanReport(actions=actions)
    candidates: list[tuple[int, dict, list[str]]] = []
    seen_prompts: set[str] = set()

    def drop(line: int, reasons: list[str], detail: str = "") -> None:
        report.dropped += 1
        report.dropped_by_rule[reasons[0]] += 1
        entry = {"line": line, "reasons": reasons}
        if detail:
            entry["detail"] = detail
        report.dropped_rows.append(entry)

    for line, row in rows:
        report.total += 1
        if isinstance(row, BadRow):
            report.matches["missing_field"] += 1
            drop(line, ["missing_field"], row.reason)
            continue
        prompt, answer = row.get(config.prompt_key), row.get(config.answer_key)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)  # references are text from here on (one column type in parquet too)
            row = {**row, config.answer_key: answer}
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(answer, str) or not answer.strip():
            report.matches["missing_field"] += 1
            drop(line, ["missing_field"], f"needs a non-empty string {config.prompt_key!r} and "
                                          f"{config.answer_key!r}")
            continue
        hits = content_rule_hits(prompt, answer, config.max_answer_chars)
        key = " ".join(prompt.split())
        if key in seen_prompts:
            hits.append("duplicate")
        seen_prompts.add(key)
        for rule in hits:
            report.matches[rule] += 1
        candidates.append((line, row, [r for r in hits if actions[r] != "off"]))

    survivors = [(line, row, hits) for line, row, hits in candidates
                 if not any(actions[r] == "drop" for r in hits)]
    solved_lines: dict[int, tuple[int, int]] = {}
    if actions["solved_by_policy"] != "off" and survivors:
        for (line, _, _), (correct, samples) in zip(survivors, solver([row for _, row, _ in survivors])):
            if samples > 0 and correct == samples:
                solved_lines[line] = (correct, samples)
    report.matches["solved_by_policy"] = len(solved_lines)

    kept: list[dict] = []
    for line, row, hits in candidates:
        if line in solved_lines:
            hits = hits + ["solved_by_policy"]
        dropping = [r for r in hits if actions[r] == "drop"]
        if dropping:
            drop(line, dropping)
            continue
        flags = [r for r in hits if actions[r] == "flag"]
        if flags:
            report.flagged += 1
            report.flagged_rows.append({"line": line, "flags": flags})
            row = {**row, "clean_flags": flags}
        kept.append(row)
    report.kept = len(kept)
    return kept, report


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write rows as .jsonl or .parquet (by suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist(list(rows))
        except (pa.ArrowTypeError, pa.ArrowInvalid) as err:
            raise ValueError(f"cannot write {str(path)!r} as parquet: a column mixes value types ({err}); "
                             "write .jsonl instead") from None
        pq.write_table(table, path)
    elif path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"output {str(path)!r}: use a .jsonl or .parquet file name")
    return path


def clean_file(in_path: str | Path, out_path: str | Path, config: CleanConfig, *, report_path: str | Path | None = None,
               solver: Solver | None = None, split: str = "train") -> CleanReport:
    kept, report = clean_rows(read_rows(in_path, split=split), config, solver)
    write_rows(kept, out_path)
    if report_path is not None:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps({"input": str(in_path), "output": str(out_path),
                                                 **report.to_dict()}, indent=1) + "\n")
    return report


# -- "solved n/n by the current policy" -------------------------------------------------

def policy_solver(model_dir: str, *, samples: int = 8, max_new_tokens: int = 1024, temperature: float = 0.85,
                  seed: int = 0, tokenizer_dir: str | None = None, prompt_key: str = "prompt",
                  answer_key: str = "answer", slots: int = 64, reward_timeout_s: float = 5.0,
                  on_progress: Callable[[int], None] | None = None) -> Solver:
    """A Solver that samples the policy in `model_dir` `samples` times per prompt and counts correct answers."""

    def solve(rows: Sequence[dict]) -> list[tuple[int, int]]:
        import jax

        from ulorl_jax import model_source
        from ulorl_jax.data.prompts import encode_prompt
        from ulorl_jax.decode.engine import PolicyEngine, Request
        from ulorl_jax.decode.sampling import SamplingParams
        from ulorl_jax.rewards import RewardConfig, RewardScorer

        loaded = model_source.load(model_source.resolve(model_dir))  # HF / ulorl folder, run or checkpoint
        model = loaded.model
        tokenizer = model_source.load_tokenizer(tokenizer_dir) if tokenizer_dir else loaded.tokenizer
        if tokenizer is None:
            raise ValueError(f"{tokenizer_dir or model_dir} has no tokenizer files: pass one with --tokenizer")
        prompts = [encode_prompt(tokenizer, row[prompt_key]) for row in rows]
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        longest = max(len(p) for p in prompts)
        engine = PolicyEngine(model, max_concurrent_decodes=max(1, min(slots, len(rows) * samples)),
                              max_prefill_length=longest, max_cache_len=longest + max_new_tokens,
                              sampling=SamplingParams(temperature=temperature), eos_token_ids=eos)
        base = jax.random.PRNGKey(seed)
        requests = [Request(p, max_new_tokens, jax.random.fold_in(jax.random.fold_in(base, i), s))
                    for i, p in enumerate(prompts) for s in range(samples)]
        completions, _ = engine.run(engine.load_params(), requests, on_tokens=on_progress)
        batch = []
        for n, c in enumerate(completions):
            text = tokenizer.decode(c.tokens, skip_special_tokens=True)
            batch.append((text, str(rows[n // samples][answer_key]), c.stop == "budget", {}))
        with RewardScorer(RewardConfig(timeout_s=reward_timeout_s)) as scorer:
            rewards = scorer.score(batch)
        return [(int(sum(rewards[i * samples:(i + 1) * samples])), samples) for i in range(len(rows))]

    return solve


# -- CLI --------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    """Register `ulorl data clean` on the top-level subparsers."""
    data = subparsers.add_parser("data", help="prompt data tools (clean)")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    p = data_sub.add_parser(
        "clean", help="rule-based cleaning of a prompt table (ULORL.md 'Data cleaning')",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="input .jsonl, .parquet or datasets folder")
    p.add_argument("output", help="output .jsonl or .parquet: the rows kept, unchanged except numeric answers "
                                  "written as strings and flagged rows carrying 'clean_flags'")
    p.add_argument("--report", help="write a JSON report (counts per rule, dropped lines and reasons) here")
    p.add_argument("--prompt-key", default="prompt", help="prompt field (default: prompt)")
    p.add_argument("--answer-key", default="answer", help="reference answer field (default: answer)")
    p.add_argument("--split", default="train", help="split of a datasets folder (default: train)")
    p.add_argument("--max-answer-chars", type=int, default=50,
                   help="long_answer: references longer than this, spaces removed (default: 50)")
    p.add_argument("--flag", action="append", default=[], choices=RULES, metavar="RULE",
                   help="keep rows matching RULE, marked in 'clean_flags', instead of dropping (repeatable)")
    p.add_argument("--off", action="append", default=[], choices=RULES, metavar="RULE",
                   help="do not apply RULE (repeatable)")
    p.add_argument("--dedupe", action="store_true", help="drop repeated prompts (rule 'duplicate')")
    p.add_argument("--model", help="policy: HF or ulorl folder, run folder or RUN/checkpoints/STEP; drop the prompts "
                   "it solves in all --samples samples")
    p.add_argument("--tokenizer", help="tokenizer folder for --model (default: the model folder)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt for --model (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="response budget for --model (default: 1024)")
    p.add_argument("--temperature", type=float, default=0.85, help="sampling temperature for --model (default 0.85)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for --model (default: 0)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    p.set_defaults(func=_clean_command)


def _clean_command(args) -> int:
    actions = dict(DEFAULT_ACTIONS)
    actions["duplicate"] = "drop" if args.dedupe else "off"
    for rule in args.flag:
        actions[rule] = "flag"
    for rule in args.off:
        actions[rule] = "off"
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    config = CleanConfig(prompt_key=args.prompt_key, answer_key=args.answer_key,
                         max_answer_chars=args.max_answer_chars, actions=actions)
    solver = None
    if args.model:
        solver = policy_solver(args.model, samples=args.samples, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, tokenizer_dir=args.tokenizer,
                               prompt_key=args.prompt_key, answer_key=args.answer_key)
    start = time.perf_counter()
    report = clean_file(args.input, args.output, config, report_path=args.report, solver=solver, split=args.split)
    print(report.table())
    print(f"wrote {report.kept} rows to {args.output}" + (f", report to {args.report}" if args.report else "")
          + f" in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if args.json:
        summary = {k: v for k, v in report.to_dict().items() if k not in ("dropped_rows", "flagged_rows")}
        print(json.dumps(summary))
    return 0
