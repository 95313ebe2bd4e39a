"""Held-out accuracy from n samples per problem: avg@k and the unbiased pass@k.

avg@n is the mean reward over all samples. pass@k is the chance that at least
one of k samples drawn without replacement from a problem's n is correct,
estimated without bias from c correct out of n (Chen et al. 2021, the Codex
paper):  pass@k = 1 - C(n - c, k) / C(n, k),  averaged over problems.
Entropy collapse shows in pass@k (exploration) more than in avg@k.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct of `n` samples (k <= n).

    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which equals
    1 - C(n-c, k) / C(n, k) without the huge binomials."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_ladder(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, 2, 4, 8 (those <= n)."""
    return [k for k in (1, 2, 4, 8) if k <= n]


def grouped_pass_at_k(rewards_by_problem: Iterable[Sequence[float]], ks: Sequence[int] | None = None
                      ) -> dict[str, float]:
    """{"pass@k": mean over problems} for each k; every problem needs the same n >= max(ks).

    A reward counts as correct when it is >= 0.5 (rewards are in {0, 1})."""
    groups = [list(g) for g in rewards_by_problem]
    if not groups:
        return {}
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"grouped_pass_at_k: problems have different sample counts {sorted(sizes)}")
    n = sizes.pop()
    ks = pass_at_k_ladder(n) if ks is None else list(ks)
    return {f"pass@{k}": float(np.mean([pass_at_k(n, sum(r >= 0.5 for r in g), k) for g in groups]))
            for k in ks}
