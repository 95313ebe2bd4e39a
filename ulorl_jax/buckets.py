"""Shape buckets: a size rounded up, so that a jitted function meets a few shapes in a run instead of one
per size (the engine's prefill rows and fanout, the learner's packed rows, per-sample keys, a step's GRPO
groups)."""

from __future__ import annotations


def pow2_ceil(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= n (1 for n <= 1), and at least `at_least` (a power of two)."""
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())
