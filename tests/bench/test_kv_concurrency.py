"""Decode concurrency, dense vs paged KV cache (kv_concurrency.py): each figure against a hand formula,
and the in-flight KV of a segment rollout (Algorithm 1 on lengths) against the closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ulorl_jax.bench.segment_cost import (
    LengthDistribution,
    simulate_pools,
    steady_state,
)
from ulorl_jax.bench.kv_concurrency import (
    decode_concurrency,
    expected_in_flight_pages,
    expected_in_flight_tokens,
    kv_bytes_per_token,
    response_length_pmf,
)

# Qwen3-30B-A3B at 128k (configs/qwen3_30b_a3b_128k.yaml): 48 layers x (K, V) x 4 kv heads x 128 x bf16.
KV_30B = 48 * 2 * 4 * 128 * 2
PROMPT, GLOBAL = 2048, 131072


def test_kv_bytes_per_token_of_qwen3_30b_a3b():
    from ulorl_jax.config import load_config

    mc = load_config("qwen3_30b_a3b_128k").model.model_config()
    assert kv_bytes_per_token(mc) == KV_30B == 98304
    assert kv_bytes_per_token(mc, 2) == KV_30B // 2  # kv heads split over tensor=2


def test_pmf_is_the_length_oracles_distribution():
    dist = LengthDistribution(1024)
    pmf = response_length_pmf(dist)
    assert pmf.sum() == pytest.approx(1.0) and pmf[0] == 0.0
    assert pmf[1] == pytest.approx(0.8 / 512) and pmf[600] == pytest.approx(0.15 / 512)
    assert pmf[1024] == pytest.approx(0.15 / 512 + 0.05)  # the truncated stop at the global max
    drawn = np.minimum([dist(u) for u in range(20000)], 1024)
    mean = float(np.sum(pmf * np.arange(pmf.size)))
    assert drawn.mean() == pytest.approx(mean, rel=0.02)
    assert np.mean(drawn == 1024) == pytest.approx(pmf[1024], abs=0.01)


def test_in_flight_tokens_hand_formula():
    """A sample holds prompt + t positions while it decodes its t-th token, t = 1..L, one decode step each."""
    # One length L: the time-average is prompt + (L + 1) / 2, "about L / 2 plus the prompt".
    pmf = np.zeros(101)
    pmf[100] = 1.0
    assert expected_in_flight_tokens(pmf, 10) == pytest.approx(10 + 101 / 2)
    # Many lengths: weighted by how long each is in flight, prompt + E[L (L + 1) / 2] / E[L].
    pmf = response_length_pmf(LengthDistribution(GLOBAL))
    n = np.arange(pmf.size, dtype=np.float64)
    hand = PROMPT + np.sum(pmf * n * (n + 1) / 2) / np.sum(pmf * n)
    assert expected_in_flight_tokens(pmf, PROMPT) == pytest.approx(hand, rel=1e-9)
    assert hand > PROMPT + np.sum(pmf * n) / 2  # long samples are in flight longer: above E[L] / 2


def test_in_flight_pages_hand_formula():
    """Pages by brute force: every sample, every decode step, ceil(positions / page_size)."""
    dist = LengthDistribution(64, body=0.6, truncated=0.1)
    pmf = response_length_pmf(dist)
    for page in (1, 4, 16, 128):
        num = sum(pmf[length] * sum(math.ceil((5 + t) / page) for t in range(1, length + 1))
                  for length in range(1, 65))
        den = sum(pmf[length] * length for length in range(1, 65))
        assert expected_in_flight_pages(pmf, 5, page) == pytest.approx(num / den, rel=1e-9), page
    assert expected_in_flight_pages(pmf, 5, 1) == pytest.approx(expected_in_flight_tokens(pmf, 5))


@pytest.mark.parametrize("num_segments", [1, 4])
def test_segment_rollout_holds_the_same_kv_in_flight(num_segments):
    """Algorithm 1 on lengths (simulate_pools): in a step a sample decodes tokens start+1..start+d holding
    prompt + start + tau positions at its tau-th; averaged over every decode step of every sample in the
    steady state this is the closed form, whatever the number of segments."""
    dist = LengthDistribution(256)
    traces = steady_state(simulate_pools(dist, global_max_len=256, num_segments=num_segments, prompts_per_step=64,
                                         samples_per_prompt=8, steps=num_segments + 40), num_segments)
    held = steps = 0.0
    for t in traces:
        s, d = t.start.astype(np.float64), t.decoded.astype(np.float64)
        held += np.sum(d * (7 + s) + d * (d + 1) / 2)  # Σ_tau (prompt 7 + start + tau)
        steps += np.sum(d)
    assert held / steps == pytest.approx(expected_in_flight_tokens(response_length_pmf(dist), 7), rel=0.03)


def test_dense_and_paged_against_hand_formula():
    budget = 59_000_000_000
    c = decode_concurrency(budget, KV_30B, max_len=PROMPT + GLOBAL, prompt_len=PROMPT,
                           lengths=LengthDistribution(GLOBAL), page_size=256)
    assert c.dense == math.floor(budget / ((PROMPT + GLOBAL) * KV_30B)) == 4
    assert c.pool_pages == budget // (256 * KV_30B)
    assert c.paged == math.floor(c.pool_pages / c.in_flight_pages)
    # prompt + E[L(L+1)/2]/E[L] = 2048 + 36,912 positions, about 153 pages of 256.
    assert c.in_flight_tokens == pytest.approx(38960, abs=1)
    assert math.ceil(c.in_flight_tokens / 256) <= c.in_flight_pages + 1
    assert c.paged == 15 and c.paged > 3 * c.dense
    none = decode_concurrency(-5, KV_30B, max_len=PROMPT + GLOBAL, prompt_len=PROMPT,
                              lengths=LengthDistribution(GLOBAL))
    assert (none.kv_budget_bytes, none.dense, none.paged) == (0, 0, 0)


def test_paged_grows_as_pages_shrink_and_never_falls_below_dense():
    budget = 120 * 10**9
    common = dict(max_len=PROMPT + GLOBAL, prompt_len=PROMPT, lengths=LengthDistribution(GLOBAL))
    paged = [decode_concurrency(budget, KV_30B, page_size=p, **common) for p in (4096, 1024, 256, 64, 16)]
    counts = [c.paged for c in paged]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert all(c.paged >= c.dense for c in paged)
    # Every sample runs to the global max and one page holds a whole slot: paged = dense exactly.
    one = decode_concurrency(budget, KV_30B, page_size=PROMPT + GLOBAL, max_len=PROMPT + GLOBAL, prompt_len=PROMPT,
                             lengths=LengthDistribution(GLOBAL, body=0.0, truncated=1.0))
    assert one.in_flight_pages == 1.0 and one.paged == one.dense == budget // ((PROMPT + GLOBAL) * KV_30B)


def test_rejects_nonsense():
    with pytest.raises(ValueError, match="page_size"):
        decode_concurrency(10**9, KV_30B, max_len=10, prompt_len=1, lengths=LengthDistribution(8), page_size=0)
