"""Synthetic running-sum task: determinism, trace correctness (independent checker), noise, long tail."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from ulorl_jax.data.synthetic import (
    SyntheticConfig,
    SyntheticProblem,
    distribution_stats,
    generate_problems,
    length_stats,
    make_splits,
    noisy_trace,
    operand_count_pmf,
    problem_rows,
    split_of,
    trace_lengths,
    write_jsonl,
)
from ulorl_jax.rewards import rule_reward

LINE = re.compile(r"^([a-z])(\d+)=(\d+)$")


def check_trace(prompt: str, text: str) -> tuple[int, int, int | None]:
    """Independent checker: (steps, wrong steps, boxed value); also checks the trace reads the prompt."""
    head, _, operands = prompt.partition(": ")
    modulus = int(head.split()[-1])
    labelled = operands.split()
    labels, xs = [t[0] for t in labelled], [int(t[1:]) for t in labelled]
    assert labels == [chr(ord("a") + i) for i in range(len(xs))]
    lines = text.split("\n")
    boxed = re.fullmatch(r"\\boxed\{(\d+)\}", lines[-1])
    steps = lines[:-1]
    assert len(steps) == len(xs)
    wrong = 0
    previous = 0
    for line, label, x in zip(steps, labels, xs):
        got_label, b, c = LINE.match(line).groups()
        assert got_label == label and int(b) == x  # each line copies its operand from the prompt
        wrong += (previous + x) % modulus != int(c)
        previous = int(c)
    return len(steps), wrong, int(boxed.group(1)) if boxed else None


def test_generation_is_deterministic():
    config = SyntheticConfig(max_operands=20)
    a = generate_problems(config, 50, seed=3)
    assert a == generate_problems(config, 50, seed=3)
    assert a != generate_problems(config, 50, seed=4)
    assert all(config.min_operands <= len(p.operands) <= config.max_operands for p in a)
    assert all(0 <= x < config.modulus for p in a for x in p.operands)


def test_correct_trace_checks_out():
    config = SyntheticConfig(max_operands=26, modulus=7)
    for problem in generate_problems(config, 200, seed=0):
        text = problem.trace()
        steps, wrong, boxed = check_trace(problem.prompt, text)
        assert wrong == 0
        assert boxed == sum(problem.operands) % 7 == int(problem.answer)
        assert rule_reward(text, problem.answer) == 1.0


def test_example_from_the_docstring():
    problem = SyntheticProblem((3, 5, 8, 2))
    assert problem.prompt == "sum mod 10: a3 b5 c8 d2"
    assert problem.trace() == "a3=3\nb5=8\nc8=6\nd2=8\n\\boxed{8}"
    assert problem.answer == "8"


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_noise_rate_near_p(p):
    config = SyntheticConfig(min_operands=5, max_operands=20)
    rng = np.random.default_rng(1)
    steps_total = wrong_total = 0
    for problem in generate_problems(config, 400, seed=2):
        text, wrong = noisy_trace(problem, p, rng)
        steps, checked_wrong, boxed = check_trace(problem.prompt, text)
        assert checked_wrong == wrong
        steps_total += steps
        wrong_total += wrong
        if wrong == 0:
            assert boxed == int(problem.answer)
    rate = wrong_total / steps_total
    sigma = math.sqrt(p * (1 - p) / steps_total)
    assert abs(rate - p) < 4 * sigma, (rate, p, steps_total)


def test_noisy_answers_are_sometimes_wrong():
    problems = generate_problems(SyntheticConfig(min_operands=4, max_operands=8), 300, seed=5)
    rows = problem_rows(problems, noise_p=0.2, seed=0)
    rewards = [rule_reward(r["response"], r["answer"]) for r in rows]
    assert 0.2 < np.mean(rewards) < 0.9  # neither all right nor all wrong


def test_operand_counts_follow_the_power_law():
    config = SyntheticConfig(min_operands=2, max_operands=12, tail_alpha=1.3)
    counts = np.array([len(p.operands) for p in generate_problems(config, 20_000, seed=0)])
    ks = np.arange(2, 13)
    expected = (ks - 1.0) ** -1.3
    expected /= expected.sum()
    np.testing.assert_allclose(operand_count_pmf(config), expected)
    observed = np.array([(counts == k).mean() for k in ks])
    np.testing.assert_allclose(observed, expected, atol=0.012)


def test_long_tail_property():
    # Trace length is affine in the operand count (5 per line + 9), capped at 26 labelled operands,
    # so the tail is bounded: with alpha 1.5 the longest traces are ~6x the median.
    stats = distribution_stats(SyntheticConfig(max_operands=26, tail_alpha=1.5), n=5000, seed=0)["trace_length"]
    assert stats["mean"] > stats["p50"]  # right-skewed
    assert stats["max"] >= 5 * stats["p50"]  # a few many times longer than the typical one
    assert stats["p90"] >= 2.5 * stats["p50"]


def test_length_stats_against_numpy():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    s = length_stats(lengths)
    assert s["mean"] == np.mean(lengths) and s["max"] == 9 and s["p50"] == np.median(lengths)
    with pytest.raises(ValueError):
        length_stats([])


def test_trace_lengths_in_tokens():
    from ulorl_jax.data.tokenizer import build_tokenizer

    problems = [SyntheticProblem((3, 5, 8, 2))]
    assert trace_lengths(problems) == [len("a3=3\nb5=8\nc8=6\nd2=8\n\\boxed{8}")]
    assert trace_lengths(problems, build_tokenizer()) == [trace_lengths(problems)[0] + 1]  # + eos


def test_splits_are_disjoint_and_sized(tmp_path):
    splits = make_splits(SyntheticConfig(max_operands=10), 300, 100, seed=0)
    assert len(splits["train"]) == 300 and len(splits["eval"]) == 100
    assert not {p.prompt for p in splits["train"]} & {p.prompt for p in splits["eval"]}
    assert splits == make_splits(SyntheticConfig(max_operands=10), 300, 100, seed=0)
    path = write_jsonl(problem_rows(splits["eval"]), tmp_path / "eval.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"prompt": splits["eval"][0].prompt, "answer": splits["eval"][0].answer,
                       "num_operands": len(splits["eval"][0].operands)}


def test_impossible_split_and_bad_config():
    tiny = SyntheticConfig(min_operands=1, max_operands=1, modulus=4)  # only 4 problems exist
    if not any(split_of(SyntheticProblem((i,), 4), 0.2) == "eval" for i in range(4)):
        with pytest.raises(ValueError, match="too few distinct problems"):
            make_splits(tiny, 5, 1, seed=0)
    else:  # the hash changed: the split fills
        assert len(make_splits(tiny, 5, 1, seed=0)["eval"]) == 1
    with pytest.raises(ValueError, match="min_operands"):
        SyntheticConfig(min_operands=5, max_operands=3)
    with pytest.raises(ValueError, match="noise"):
        noisy_trace(SyntheticProblem((1, 2)), 1.5, np.random.default_rng(0))


def test_harder_held_out_split():
    """data.synthetic.eval_min_operands: held-out problems have at least that many operands, never
    overlap training, and training is the split it would be without the option."""
    from ulorl_jax.data.sources import SyntheticTask

    base = {"max_operands": 16, "tail_alpha": 1.2, "num_train": 256, "num_eval": 64, "seed": 3}
    plain = SyntheticTask.from_options(base)
    hard = SyntheticTask.from_options({**base, "eval_min_operands": 8})
    assert len(hard.eval) == 64 and min(len(p.operands) for p in hard.eval) == 8
    assert max(len(p.operands) for p in hard.eval) <= 16
    assert min(len(p.operands) for p in plain.eval) < 8  # the option changed the held-out split
    assert hard.train == plain.train
    assert not {p.prompt for p in hard.train} & {p.prompt for p in hard.eval}
    for bad in (1, 17, 8.0, "8"):
        with pytest.raises(ValueError, match=r"eval_min_operands=.*\[2, 16\]"):
            SyntheticTask.from_options({**base, "eval_min_operands": bad})
