"""pass@k (rl/pass_at_k.py) against the binomial formula written out by hand."""

from math import comb

import pytest

from ulorl_jax.rl.pass_at_k import grouped_pass_at_k, pass_at_k, pass_at_k_ladder


def _by_hand(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 64])
def test_pass_at_k_equals_the_binomial_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_by_hand(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_known_values():
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_grouped_pass_at_k_averages_problems():
    rewards = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]]
    got = grouped_pass_at_k(rewards)
    assert set(got) == {"pass@1", "pass@2", "pass@4"}
    for k in (1, 2, 4):
        want = sum(_by_hand(4, sum(g), k) for g in rewards) / 3
        assert got[f"pass@{k}"] == pytest.approx(want)
    assert got["pass@1"] == pytest.approx(sum(map(sum, rewards)) / 12)  # pass@1 is avg@n


def test_ladder_and_bad_input():
    assert pass_at_k_ladder(1) == [1] and pass_at_k_ladder(6) == [1, 2, 4] and pass_at_k_ladder(32) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError, match="different sample counts"):
        grouped_pass_at_k([[1, 0], [1]])
    assert grouped_pass_at_k([]) == {}
