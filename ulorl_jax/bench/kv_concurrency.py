"""Decode concurrency at full size: how many samples one device keeps in flight with a dense KV cache
(every slot holds `max_len` = prompt + global_max_len positions) vs a paged one (a pool of `page_size`
position pages, taken as a sample grows, given back when it ends), for `ulorl plan`.

A sample in flight holds the prompt plus what it has decoded so far, rounded up to pages. Averaged over
the time it is in flight, a sample decoding from 0 to its length L holds prompt + L / 2; averaged over the
samples in flight at any moment, a long sample counts for as long as it decodes, so the mean is
prompt + E[L (L + 1) / 2] / E[L], above prompt + E[L] / 2 for the long-tailed lengths of ULORL.md §1.
Segments (Algorithm 1) do not change it: between steps an unfinished sample holds nothing (it is
re-prefilled from prompt + earlier segments), and within a step it holds prompt + its length so far, so
its pages summed over its life are the same as in one uninterrupted decode.

The lengths are `bench.segment_cost.LengthDistribution`, the long-tailed workload the segment benchmark
forces (a length oracle), here taken exactly from its probabilities instead of by drawing samples.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ulorl_jax.bench.segment_cost import (
    LengthDistribution,
    simulate_pools,
    steady_state,
)
from ulorl_jax.memory import kv_cache_bytes

DEFAULT_PAGE_SIZE = 256


def kv_bytes_per_token(model_config, kv_head_shards: int = 1) -> int:
    """KV bytes one position of one sample takes on the device that holds it: layers x (K, V) x
    kv_heads / kv_head_shards x head_dim x the compute dtype's size. The engine keeps a slot's rows on one
    device (slots split over the batch axes) and splits KV heads over the kv_heads mesh axis when they
    divide (`decode/cache_layout.cache_specs`)."""
    return kv_cache_bytes(model_config, 1, 1) // kv_head_shards


def response_length_pmf(lengths: LengthDistribution) -> np.ndarray:
    """pmf[n] = P(a sample decodes exactly n response tokens), n = 0..global_max_len: the distribution's
    body and tail as stated, its truncated samples stopped at the global max (ULORL.md §1, case 3)."""
    g, half = lengths.global_max_len, lengths.global_max_len // 2
    pmf = np.zeros(g + 1)
    pmf[1:half + 1] = lengths.body / half
    pmf[half + 1:] += (1.0 - lengths.body - lengths.truncated) / (g - half)
    pmf[g] += lengths.truncated
    return pmf


def in_flight_weights(pmf: np.ndarray) -> np.ndarray:
    """w[t] = P(a sample decodes its t-th token), t = 1..G (w[0] = 0): the share of decode steps spent by
    a sample that has decoded t tokens, up to the normalisation Σ w = E[L]."""
    survival = pmf[::-1].cumsum()[::-1]  # survival[t] = P(L >= t)
    return np.concatenate([[0.0], survival[1:]])


def expected_in_flight_tokens(pmf: np.ndarray, prompt_len: int) -> float:
    """Mean positions (prompt + decoded so far) a sample in flight holds."""
    w = in_flight_weights(pmf)
    t = np.arange(w.size)
    return float(prompt_len + np.sum(w * t) / np.sum(w))


def expected_in_flight_pages(pmf: np.ndarray, prompt_len: int, page_size: int) -> float:
    """Mean pages a sample in flight holds: ceil((prompt + decoded so far) / page_size), averaged the same way."""
    w = in_flight_weights(pmf)
    pages = -(-(prompt_len + np.arange(w.size)) // page_size)
    return float(np.sum(w * pages) / np.sum(w))


def rollout_batch(lengths: LengthDistribution, *, num_segments: int, prompts_per_step: int,
                  samples_per_prompt: int, steps: int = 8) -> float:
    """Mean samples an RL step decodes in steady state (new samples + the unfinished pool), Algorithm 1 on
    lengths alone (`simulate_pools`): more in flight than this has nothing to decode."""
    traces = simulate_pools(lengths, global_max_len=lengths.global_max_len, num_segments=num_segments,
                            prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                            steps=num_segments + steps)
    return float(np.mean([t.decoded.size for t in steady_state(traces, num_segments)]))


@dataclasses.dataclass(frozen=True)
class DecodeConcurrency:
    """Samples in flight per device, dense vs paged KV cache, and the figures they come from."""

    kv_budget_bytes: int  # device memory left for the KV cache
    kv_bytes_per_token: int  # per position of one sample, on its device
    max_len: int  # a dense slot's positions: prompt + global_max_len
    prompt_len: int
    page_size: int
    pool_pages: int  # pages of page_size positions in the budget
    mean_response_len: float  # E[L]
    in_flight_tokens: float  # mean positions a sample in flight holds
    in_flight_pages: float  # the same in pages
    dense: int  # floor(budget / (max_len x kv_bytes_per_token))
    paged: int  # floor(pool_pages / in_flight_pages)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def decode_concurrency(kv_budget_bytes: int, kv_bytes_per_token: int, *, max_len: int, prompt_len: int,
                       lengths: LengthDistribution, page_size: int = DEFAULT_PAGE_SIZE) -> DecodeConcurrency:
    """Dense: every slot reserves `max_len` positions. Paged: the budget is a pool of pages, a sample in
    flight holds `expected_in_flight_pages` of them on average (steady state; above the mean, the engine
    preempts)."""
    if page_size < 1 or kv_bytes_per_token < 1 or max_len < 1:
        raise ValueError(f"page_size={page_size}, kv_bytes_per_token={kv_bytes_per_token} and max_len={max_len} "
                         "must be >= 1")
    budget = max(int(kv_budget_bytes), 0)
    pmf = response_length_pmf(lengths)
    pool_pages = budget // (page_size * kv_bytes_per_token)
    pages = expected_in_flight_pages(pmf, prompt_len, page_size)
    return DecodeConcurrency(
        kv_budget_bytes=budget, kv_bytes_per_token=kv_bytes_per_token, max_len=max_len, prompt_len=prompt_len,
        page_size=page_size, pool_pages=pool_pages,
        mean_response_len=float(np.sum(pmf * np.arange(pmf.size))),
        in_flight_tokens=expected_in_flight_tokens(pmf, prompt_len), in_flight_pages=pages,
        dense=budget // (max_len * kv_bytes_per_token), paged=int(pool_pages // pages))
