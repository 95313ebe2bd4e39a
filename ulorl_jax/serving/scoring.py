"""Log-probs of given tokens under the served model: the prompt's (`echo`) and each token's top-k.

One jitted full forward (models/qwen3.py `forward`, the learner's) per call, padded to a power-of-two
length bucket (one compile per bucket). Log-probs are the model's raw log-softmax in float32, with no
temperature, as vLLM reports them by default; the decode path is untouched, so a request without
`logprobs` / `echo` pays nothing for them.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulorl_jax.buckets import pow2_ceil

SMALLEST_BUCKET = 16


class Scores(NamedTuple):
    """For positions 1..L-1 of the scored ids: each id's log-prob given the ids before it, and the top-k
    alternatives there (ids and log-probs, most likely first)."""

    logprobs: np.ndarray  # [L-1] f32
    top_ids: np.ndarray  # [L-1, K] int32
    top_logprobs: np.ndarray  # [L-1, K] f32


def _score_impl(graphdef, params, rest, tokens, length, *, k: int):
    """tokens [1, T] (right-padded past `length`) -> log p(tokens[t+1] | tokens[:t+1]) [T] and top-k [T, K]."""
    model = nnx.merge(graphdef, params, rest)
    mask = (jnp.arange(tokens.shape[1])[None, :] < length).astype(jnp.int32)  # [1, T]
    logits = model.forward(tokens, attention_mask=mask).logits[0].astype(jnp.float32)  # [T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.roll(tokens[0], -1)  # [T]: the next id (the last row's is unused)
    lp = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, k)  # [T, K]
    return lp, top_ids.astype(jnp.int32), top_lp


class Scorer:
    """`score(ids)`: Scores of `ids` (at most `max_len` of them) under `model`'s current parameters."""

    def __init__(self, model: Any, max_len: int, top_k: int):
        self._graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self.max_len = int(max_len)
        self.top_k = min(int(top_k), model.config.vocab_size)
        g = self._graphdef
        self._jit = jax.jit(lambda params, rest, tokens, length, *, k: _score_impl(g, params, rest, tokens, length, k=k),
                            static_argnames=("k",))
        self._lock = threading.Lock()  # one forward at a time: requests share the cores with the engine

    def bucket(self, length: int) -> int:
        return min(max(pow2_ceil(length), SMALLEST_BUCKET), pow2_ceil(self.max_len))

    def score(self, ids: list[int]) -> Scores:
        if not 2 <= len(ids) <= self.max_len:
            raise ValueError(f"scoring needs 2 to {self.max_len} tokens, got {len(ids)}")
        tokens = np.zeros((1, self.bucket(len(ids))), np.int32)
        tokens[0, :len(ids)] = ids
        with self._lock:
            lp, top_ids, top_lp = jax.device_get(self._jit(self._params, self._rest, tokens, np.int32(len(ids)),
                                                           k=self.top_k))
        n = len(ids) - 1
        return Scores(lp[:n], top_ids[:n], top_lp[:n])
