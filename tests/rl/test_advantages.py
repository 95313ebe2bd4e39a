"""GRPO advantages and dynamic sampling against NumPy."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ulorl_jax.rl import (
    DynamicSamplingReport,
    dynamic_sampling_keep,
    dynamic_sampling_report,
    grpo_advantages,
    grpo_advantages_host,
)

EPS = 1e-6


def numpy_grpo(rewards, *, norm_by_std=True):
    r = np.asarray(rewards, np.float64)
    centred = r - r.mean(axis=1, keepdims=True)
    return centred / (r.std(axis=1, ddof=0, keepdims=True) + EPS) if norm_by_std else centred


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_grid_matches_numpy(norm_by_std):
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (16, 8)).astype(np.float32)
    rewards[0] = 1  # constant groups -> zero advantage, no division blow-up
    rewards[1] = 0
    adv = jax.jit(grpo_advantages, static_argnames="norm_by_std")(rewards, norm_by_std=norm_by_std)
    np.testing.assert_allclose(adv, numpy_grpo(rewards, norm_by_std=norm_by_std), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(adv)[:2] == 0.0)


def test_grpo_population_std():
    # One correct out of 8: mean 1/8, population std sqrt(7)/8 -> Â = sqrt(7) for the winner.
    rewards = np.zeros((1, 8), np.float32)
    rewards[0, 3] = 1
    adv = np.asarray(grpo_advantages(rewards))
    assert adv[0, 3] == pytest.approx(np.sqrt(7), rel=1e-5)
    assert adv[0, 0] == pytest.approx(-1 / np.sqrt(7), rel=1e-5)


def test_grpo_group_ids_ragged_and_shuffled():
    rng = np.random.default_rng(1)
    sizes = [8, 3, 5, 1]
    ids = np.concatenate([np.full(n, 10 * g + 7) for g, n in enumerate(sizes)])  # non-contiguous labels
    rewards = rng.random(ids.size).astype(np.float32)
    perm = rng.permutation(ids.size)
    ids, rewards = ids[perm], rewards[perm]
    expected = np.zeros(ids.size)
    for g in np.unique(ids):
        sel = ids == g
        expected[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + EPS)
    adv = jax.jit(grpo_advantages)(rewards, ids)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    # Same answer as the grid form when groups are equal-sized rows.
    grid = rng.integers(0, 2, (4, 8)).astype(np.float32)
    flat = grpo_advantages(grid.reshape(-1), np.repeat(np.arange(4), 8))
    np.testing.assert_allclose(flat.reshape(4, 8), grpo_advantages(grid), rtol=1e-5, atol=1e-6)


def test_grpo_shape_errors():
    with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
        grpo_advantages(np.zeros(8))
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(np.zeros(8), np.zeros(7, np.int32))


def test_dynamic_sampling_drops_exactly_constant_groups():
    rewards = np.array(
        [
            [1, 1, 1, 1],  # all correct -> drop
            [0, 1, 0, 0],
            [0, 0, 0, 0],  # all wrong -> drop
            [1, 1, 0, 1],
            [0, 0, 0, 0],  # all wrong -> drop
        ],
        np.float32,
    )
    keep = dynamic_sampling_keep(rewards)
    assert keep.dtype == bool
    np.testing.assert_array_equal(keep, [False, True, False, True, False])
    report = dynamic_sampling_report(rewards)
    assert report == DynamicSamplingReport(kept=2, dropped_all_correct=1, dropped_all_wrong=2)
    assert report.dropped == 3
    assert report.keep == (False, True, False, True, False)  # what the trainer filters by
    # Kept groups are exactly those with a nonzero advantage somewhere.
    has_signal = np.abs(np.asarray(grpo_advantages(rewards))).max(axis=1) > 0
    np.testing.assert_array_equal(keep, has_signal)


def test_dynamic_sampling_random_vs_numpy():
    rng = np.random.default_rng(2)
    rewards = rng.integers(0, 2, (64, 4))
    expected = np.array([len(set(row.tolist())) > 1 for row in rewards])
    np.testing.assert_array_equal(dynamic_sampling_keep(rewards), expected)
    report = dynamic_sampling_report(rewards)
    assert report.kept == expected.sum()
    np.testing.assert_array_equal(report.keep, expected)
    assert report.dropped_all_correct == int((rewards.sum(1) == 4).sum())
    assert report.dropped_all_wrong == int((rewards.sum(1) == 0).sum())
    assert report.dropped_other_constant == 0


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_host_advantages_bitwise_equal_unpadded_in_few_shapes(norm_by_std):
    """The trainer's call: group counts that change every step compile no new shape once a bucket is
    compiled, and every group's advantages are bitwise those of the unpadded call."""
    from ulorl_jax.bench.harness import CompileCounter

    rng = np.random.default_rng(5)
    grpo_advantages_host(np.zeros((1, 8), np.float32), norm_by_std=norm_by_std)  # compiles the 16-group bucket
    with CompileCounter() as compiles:
        for groups in (1, 3, 5, 9, 13, 16):
            rewards = rng.integers(0, 2, (groups, 8)).astype(np.float32)
            before = compiles.count
            host = grpo_advantages_host(rewards, norm_by_std=norm_by_std)
            assert compiles.count == before, f"{groups} groups compiled a new shape"
            assert isinstance(host, np.ndarray) and host.shape == (groups, 8)
            np.testing.assert_array_equal(host, np.asarray(grpo_advantages(rewards, norm_by_std=norm_by_std)))
            np.testing.assert_allclose(host, numpy_grpo(rewards, norm_by_std=norm_by_std), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_groups, G"):
        grpo_advantages_host(np.zeros(8, np.float32))
