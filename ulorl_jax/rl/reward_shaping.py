"""DAPO's overlong buffer: a soft length penalty added to the reward (verl's `reward_model.overlong_buffer`,
here `reward.overlong_buffer`).

A response of length |o| with a maximum length L_max and a buffer of `len` tokens gets

    penalty = min(−(|o| − (L_max − len)) / len · penalty_factor, 0)

i.e. 0 up to L_max − len, then falling linearly to −penalty_factor at L_max (verl's DAPO reward manager).

How it meets UloRL's "truncated = reward 0" rule (ULORL.md §1 termination 3, §4), a choice:
- the task reward stays as UloRL defines it (0/1; a truncated sample scores 0), and the penalty is added on
  top of it: a truncated sample ends with −penalty_factor, a correct one inside the buffer with 1 − penalty;
- only the advantages see the shaped reward. The DMMPT mask (which needs rewards in {0, 1} to find the
  positive samples) and dynamic sampling (which drops all-correct / all-wrong groups, as DAPO's
  `filter_groups.metric: acc`) keep the task reward.
Host-side numpy, like the advantages it feeds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["overlong_penalty", "shaped_rewards"]


def overlong_penalty(response_lengths: np.ndarray, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """float32 penalties (<= 0) for response lengths (any shape), verl's formula."""
    if buffer_len <= 0 or buffer_len > max_response_len:
        raise ValueError(f"reward.overlong_buffer.len={buffer_len}: expected 1 .. the max response length "
                         f"({max_response_len})")
    expected_len = max_response_len - buffer_len
    exceed_len = np.asarray(response_lengths, np.float64) - expected_len
    return np.minimum(-exceed_len / buffer_len * penalty_factor, 0.0).astype(np.float32)


def shaped_rewards(rewards: np.ndarray, response_lengths: np.ndarray, max_response_len: int,
                   buffer: Any) -> tuple[np.ndarray, dict[str, float]]:
    """(rewards + overlong penalty, metrics) when `buffer.enable`, else (rewards, {}); `buffer` has verl's
    fields enable, len, penalty_factor, log (`config.OverlongBufferOptions`)."""
    rewards = np.asarray(rewards, np.float32)
    if not buffer.enable:
        return rewards, {}
    penalty = overlong_penalty(response_lengths, max_response_len, buffer.len, buffer.penalty_factor)
    metrics = {"overlong_reward_mean": float(penalty.mean()), "overlong_fraction": float((penalty < 0).mean())}
    return rewards + penalty, metrics if buffer.log else {}
