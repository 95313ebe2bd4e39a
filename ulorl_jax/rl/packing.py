"""Sequence packing: variable-length samples into fixed rows [R, L] with segment ids.

Each sample is prompt + response, placed whole in one row (first-fit
decreasing). Row position p scores the *next* token of its own sample, so a
response token j (sequence index P + j) is scored at position P + j − 1, and a
sample's last position scores nothing. Segment ids (1, 2, ... within a row,
0 = padding) keep attention inside a sample; positions restart at 0 for every
sample, so a packed sample sees exactly what it would see alone.

Per-token arrays carry everything the loss needs about a sample (advantage,
reward, rollout log-prob, sample index), so the loss never needs to know how
samples were laid out. The per-sample entropy H̄_i of DMMPT is a segment
reduction over `sample_index` (see `ulorl_jax.rl.learner`).

Host-side numpy: packing changes shapes, so it happens outside jit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ulorl_jax.buckets import pow2_ceil
from ulorl_jax.rl.policy_losses import Segments, aggregation_weights


@dataclasses.dataclass
class TrainSample:
    """One finished rollout sample, as the learner takes it.

    logprobs: rollout log-prob of each response token (the convention in
    the decode engine: log softmax(logits / T)[token]); SAIS's π_old. None when
    the rollout did not record them (then is_mode="sais" is unavailable and the
    log-prob mismatch metric skips the sample).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    reward: float
    logprobs: list[float] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class PackedBatch(NamedTuple):
    """Packed rows; every array is numpy. Shapes: [R, L] unless noted."""

    tokens: np.ndarray  # int32 input tokens, 0 on padding
    targets: np.ndarray  # int32 token scored at each position (next token of the same sample), 0 elsewhere
    segment_ids: np.ndarray  # int32, 1.. per sample within a row, 0 = padding
    positions: np.ndarray  # int32, restart at 0 per sample
    response_mask: np.ndarray  # float32, 1 where `targets` is a response token
    advantages: np.ndarray  # float32, the sample's advantage on its response positions
    rewards: np.ndarray  # float32, the sample's reward on its response positions
    rollout_logprobs: np.ndarray  # float32, rollout log-prob of `targets` (0 where unknown)
    has_rollout_logprobs: np.ndarray  # float32, 1 where rollout_logprobs is known
    sample_index: np.ndarray  # int32, index of the sample in the input list (0 on padding)
    sample_lengths: np.ndarray  # [S_pad] float32 response tokens |o_i| per sample (0 for padding samples)
    placement: tuple[tuple[int, int], ...]  # per input sample: (row, start column)

    @property
    def num_samples(self) -> int:
        return len(self.placement)

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields as a dict (what the jitted step takes)."""
        return {k: v for k, v in self._asdict().items() if k != "placement"}


def validate_samples(samples: Sequence[TrainSample], row_len: int, *, need_rewards_01: bool = False,
                     need_logprobs: bool = False) -> None:
    """Host-side checks; raises ValueError naming the sample and the problem."""
    if not samples:
        raise ValueError("no samples to train on (empty list)")
    for i, s in enumerate(samples):
        where = f"sample {i}"
        if len(s.prompt_ids) < 1:
            raise ValueError(f"{where}: prompt_ids is empty; the first response token needs a prompt token to follow")
        if len(s.response_ids) < 1:
            raise ValueError(f"{where}: response_ids is empty")
        if s.length > row_len:
            raise ValueError(f"{where}: prompt {len(s.prompt_ids)} + response {len(s.response_ids)} = {s.length} "
                             f"tokens is longer than row_len={row_len}; raise row_len")
        if min(min(s.prompt_ids), min(s.response_ids)) < 0:
            raise ValueError(f"{where}: negative token id")
        if not math.isfinite(s.advantage):
            raise ValueError(f"{where}: advantage is {s.advantage}")
        if not math.isfinite(s.reward):
            raise ValueError(f"{where}: reward is {s.reward}")
        if need_rewards_01 and s.reward not in (0, 1):
            raise ValueError(f"{where}: reward={s.reward} is not in {{0, 1}}, which the MPT / DMMPT mask needs "
                             "(mask_mode='none' accepts any reward)")
        if s.logprobs is not None:
            if len(s.logprobs) != len(s.response_ids):
                raise ValueError(f"{where}: logprobs has {len(s.logprobs)} entries for {len(s.response_ids)} "
                                 "response tokens")
            if not np.isfinite(np.asarray(s.logprobs, np.float64)).all():
                raise ValueError(f"{where}: logprobs contain NaN or inf")
        elif need_logprobs:
            raise ValueError(f"{where}: logprobs is None, but is_mode='sais' needs the rollout log-probs")


def assign_rows(lengths: Sequence[int], row_len: int) -> list[tuple[int, int]]:
    """First-fit decreasing: (row, start) for each length, in input order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    free: list[int] = []  # remaining space per row
    placement: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in order:
        n = lengths[i]
        if n > row_len:
            raise ValueError(f"sample {i} has {n} tokens, longer than row_len={row_len}")
        for r, space in enumerate(free):
            if space >= n:
                placement[i] = (r, row_len - space)
                free[r] -= n
                break
        else:
            placement[i] = (len(free), 0)
            free.append(row_len - n)
    return placement


def pack_samples(samples: Sequence[TrainSample], row_len: int, *, row_multiple: int = 1,
                 pow2_groups: bool = True, min_rows: int = 0) -> PackedBatch:
    """Pack samples into [R, row_len] rows.

    R is the number of rows first-fit needs, rounded up so R / row_multiple is
    a power of two (`pow2_groups`, which keeps the set of shapes the jitted
    step sees small) or a plain multiple of `row_multiple`; at least
    `min_rows`. The sample axis of `sample_lengths` is padded to a power of two.
    """
    validate_samples(samples, row_len)
    placement = assign_rows([s.length for s in samples], row_len)
    used = 1 + max(r for r, _ in placement)
    groups = max(-(-max(used, min_rows) // row_multiple), 1)
    rows = (pow2_ceil(groups) if pow2_groups else groups) * row_multiple
    shape = (rows, row_len)
    tokens = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    response_mask = np.zeros(shape, np.float32)
    advantages = np.zeros(shape, np.float32)
    rewards = np.zeros(shape, np.float32)
    rollout_lp = np.zeros(shape, np.float32)
    has_lp = np.zeros(shape, np.float32)
    sample_index = np.zeros(shape, np.int32)
    sample_lengths = np.zeros((pow2_ceil(len(samples)),), np.float32)
    next_segment = np.ones((rows,), np.int32)
    for i, (s, (r, start)) in enumerate(zip(samples, placement)):
        seq = np.asarray(list(s.prompt_ids) + list(s.response_ids), np.int32)
        n, p, o = len(seq), len(s.prompt_ids), len(s.response_ids)
        sl = slice(start, start + n)
        tokens[r, sl] = seq
        targets[r, start:start + n - 1] = seq[1:]
        segment_ids[r, sl] = next_segment[r]
        next_segment[r] += 1
        positions[r, sl] = np.arange(n)
        sample_index[r, sl] = i
        resp = slice(start + p - 1, start + p - 1 + o)  # positions scoring the response tokens
        response_mask[r, resp] = 1.0
        advantages[r, resp] = s.advantage
        rewards[r, resp] = s.reward
        if s.logprobs is not None:
            rollout_lp[r, resp] = np.asarray(s.logprobs, np.float32)
            has_lp[r, resp] = 1.0
        sample_lengths[i] = o
    return PackedBatch(tokens, targets, segment_ids, positions, response_mask, advantages, rewards, rollout_lp,
                       has_lp, sample_index, sample_lengths, tuple(placement))


def unpack_tokens(packed: PackedBatch, values: np.ndarray, samples: Sequence[TrainSample]) -> list[np.ndarray]:
    """Per-sample response-token values from a packed [R, L] array (e.g. log-probs)."""
    values = np.asarray(values)
    out = []
    for s, (r, start) in zip(samples, packed.placement):
        p, o = len(s.prompt_ids), len(s.response_ids)
        out.append(values[r, start + p - 1:start + p - 1 + o])
    return out


def loss_weights(packed: PackedBatch, loss_agg_mode: str, loss_scale_factor: float | None = None) -> np.ndarray:
    """float32 [R, L] per-token weights w with loss = Σ w · ℓ_token, for any of verl's `agg_loss` modes
    (`ulorl_jax.rl.policy_losses.aggregation_weights`, the one definition):

    "token-mean" (Eq. 10): w = 1 / Σ_i |o_i| (masked tokens still count); "token-sum": 1;
    "seq-mean-token-sum": 1 / N; "seq-mean-token-mean": 1 / (|o_i| · N);
    "seq-mean-token-sum-norm": 1 / (N · loss_scale_factor) (None: 1 here; the learner's step divides by
    its `algorithm.loss_scale_factor`). N counts the samples with a response.
    Zero off the response. Because the weights are global, micro-batch losses
    simply add up to the mini-batch loss.
    """
    segments = Segments(np.asarray(packed.sample_index), np.asarray(packed.sample_lengths))
    return np.asarray(aggregation_weights(packed.response_mask, segments, loss_agg_mode, loss_scale_factor),
                      np.float32)
