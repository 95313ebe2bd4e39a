"""GRPO group advantages and DAPO dynamic sampling (ULORL.md §4).

- `grpo_advantages`: Â_i = (R_i − mean(R_group)) / (std(R_group) + eps), one
  advantage per sample (the loss broadcasts it over the sample's tokens).
  std is the *population* std (ddof=0), as in the GRPO/DeepSeekMath formula;
  verl's torch.std default is ddof=1, which scales Â by sqrt((G−1)/G)
  (≈ 0.935 at G = 8) and changes nothing else. jnp, jit-safe.
- `dynamic_sampling_keep`: drop groups whose rewards are all equal (all 0 or
  all 1 for binary rewards): their advantages are all 0 and carry no gradient.
  Host-side numpy, because filtering changes the batch shape.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ulorl_jax.buckets import pow2_ceil


def grpo_advantages(
    rewards: jnp.ndarray,
    group_ids: jnp.ndarray | None = None,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> jnp.ndarray:
    """GRPO advantages, float32, same shape as `rewards`.

    Either rewards [num_groups, G] (one row per prompt), or rewards [N] with
    group_ids [N] (any integer labels; groups may be ragged and interleaved).
    With norm_by_std=False only the group mean is subtracted (Dr. GRPO style).
    """
    r = jnp.asarray(rewards, jnp.float32)
    if group_ids is None:
        if r.ndim != 2:
            raise ValueError(f"rewards must be [num_groups, G] without group_ids, got shape {r.shape}")
        mean = r.mean(axis=-1, keepdims=True)
        std = r.std(axis=-1, keepdims=True)  # ddof=0
    else:
        ids = jnp.asarray(group_ids)
        if r.ndim != 1 or ids.shape != r.shape:
            raise ValueError(f"with group_ids, rewards and group_ids must both be [N]; got {r.shape} and {ids.shape}")
        same = (ids[:, None] == ids[None, :]).astype(jnp.float32)  # [N, N] same-group indicator
        count = same.sum(axis=-1)  # >= 1 (the sample itself)
        mean = same @ r / count  # 'nm,m->n'
        std = jnp.sqrt(same @ (r - mean) ** 2 / count)  # per-sample own-group std, ddof=0
    centred = r - mean
    return centred / (std + eps) if norm_by_std else centred


HOST_GROUPS_MIN_PAD = 16  # grpo_advantages_host's smallest padded group count


def grpo_advantages_host(rewards: np.ndarray, *, norm_by_std: bool = True) -> np.ndarray:
    """`grpo_advantages` of a step's host rewards [num_groups, G], as NumPy.

    Dynamic sampling changes the group count from step to step, and op-by-op jnp compiles every primitive
    again for each new count (0.2-0.5 s each time). The count is padded to a power of two (at least
    HOST_GROUPS_MIN_PAD) with all-zero groups, whose advantages are 0 and are cut off again: a few compiled
    shapes per run, and each group's advantages bitwise those of the unpadded call (a NumPy formula would
    differ from XLA's in the last bit and change a run's trajectory)."""
    r = np.asarray(rewards, np.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {r.shape}")
    n = r.shape[0]
    size = pow2_ceil(n, HOST_GROUPS_MIN_PAD)
    padded = np.zeros((size, r.shape[1]), np.float32)
    padded[:n] = r
    return np.asarray(grpo_advantages(padded, norm_by_std=norm_by_std))[:n]


@dataclasses.dataclass(frozen=True)
class DynamicSamplingReport:
    """Group counts of one dynamic-sampling pass."""

    kept: int
    dropped_all_correct: int  # every reward == 1
    dropped_all_wrong: int  # every reward == 0
    dropped_other_constant: int = 0  # all equal to another value (non-binary rewards)
    keep: tuple[bool, ...] = dataclasses.field(default=(), compare=False)  # per group, dynamic_sampling_keep

    @property
    def dropped(self) -> int:
        return self.dropped_all_correct + self.dropped_all_wrong + self.dropped_other_constant


def dynamic_sampling_keep(rewards: np.ndarray) -> np.ndarray:
    """bool [num_groups]: True for groups with at least two distinct rewards."""
    r = np.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {r.shape}")
    return ~(r == r[:, :1]).all(axis=-1)


def dynamic_sampling_report(rewards: np.ndarray) -> DynamicSamplingReport:
    """Why each group of rewards [num_groups, G] was kept or dropped."""
    r = np.asarray(rewards)
    keep = dynamic_sampling_keep(r)
    all_correct = (r == 1).all(axis=-1)
    all_wrong = (r == 0).all(axis=-1)
    return DynamicSamplingReport(
        kept=int(keep.sum()),
        dropped_all_correct=int(all_correct.sum()),
        dropped_all_wrong=int(all_wrong.sum()),
        dropped_other_constant=int((~keep & ~all_correct & ~all_wrong).sum()),
        keep=tuple(bool(k) for k in keep),
    )
