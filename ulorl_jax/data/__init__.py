"""Prompt data: readers, RL prompt stream, cleaning, the synthetic long-tail task, a local tokenizer.

`prompts` (PromptStream & co.) imports the decode engine and thus JAX; it is
loaded on first use so that `ulorl data clean` and the readers stay light.
"""

# Readers (jsonl / parquet / datasets folder) and bad-row reports
from ulorl_jax.data.readers import BadRow, detect_format, read_rows

# Cleaning (ULORL.md "Data cleaning"; `ulorl data clean`)
from ulorl_jax.data.clean import CleanConfig, CleanReport, clean_file, clean_rows, content_rule_hits

# Synthetic verifiable task with long-tailed trace lengths
from ulorl_jax.data.synthetic import (
    SyntheticConfig,
    SyntheticProblem,
    distribution_stats,
    generate_problems,
    length_stats,
    make_splits,
    noisy_trace,
    problem_rows,
    trace_lengths,
    write_jsonl,
)

# Local character-level tokenizer with a Qwen-style chat template
from ulorl_jax.data.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, build_tokenizer, synthetic_alphabet

# RL prompt stream (lazy: data/prompts.py imports numpy and the tokenizer stack)
_LAZY = {"PromptDataConfig", "PromptRecord", "PromptStream", "encode_prompt", "load_prompts", "PromptItem"}


def __getattr__(name: str):
    if name in _LAZY:
        from ulorl_jax.data import prompts

        return getattr(prompts, name)
    raise AttributeError(f"module 'ulorl_jax.data' has no attribute {name!r}")


__all__ = [
    "BadRow",
    "detect_format",
    "read_rows",
    "CleanConfig",
    "CleanReport",
    "clean_file",
    "clean_rows",
    "content_rule_hits",
    "SyntheticConfig",
    "SyntheticProblem",
    "distribution_stats",
    "generate_problems",
    "length_stats",
    "make_splits",
    "noisy_trace",
    "problem_rows",
    "trace_lengths",
    "write_jsonl",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "build_tokenizer",
    "synthetic_alphabet",
    *sorted(_LAZY),
]
