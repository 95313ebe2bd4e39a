"""A tiny learner setup shared by the learner, layer-scan, MoE-parallel and sharded-kernel tests."""

from __future__ import annotations

import jax
import numpy as np

from ulorl_jax.rl.learner import LearnerConfig, TrainSample

VOCAB = 48
DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8, num_hidden_layers=1)


def random_samples(seed: int, n: int, *, logprobs: bool = True, max_len: int = 14) -> list[TrainSample]:
    """`n` samples of 1-3 prompt and >= 2 response tokens (at most `max_len` in all), random advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(1, 4))
        o = int(rng.integers(2, max_len - p + 1))
        out.append(TrainSample(rng.integers(0, VOCAB, p).tolist(), rng.integers(0, VOCAB, o).tolist(),
                               advantage=float(rng.normal()), reward=float(i % 2),
                               logprobs=(-rng.uniform(0.5, 4.0, o)).tolist() if logprobs else None))
    return out


def small_config(**kw) -> LearnerConfig:
    """16-token rows, one row per micro-batch, DMMPT, lr 1e-2 (weights move visibly in one step)."""
    base = dict(lr=1e-2, row_len=16, micro_batch_rows=1, logprob_chunk=8, remat="full", sigma=0.2,
                mask_mode="dmmpt", grad_clip=1.0)
    return LearnerConfig(**{**base, **kw})


def assert_trees_close(a, b, rtol, atol, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")
