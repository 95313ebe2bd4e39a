"""Incremental decoding over the KV cache equals the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_utils import random_tokens
from ulorl_jax.models import init_model, tiny_config

ATOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request):
    return init_model(tiny_config(request.param), seed=3)


@pytest.mark.parametrize("prefill", [1, 6])
def test_prefill_then_single_steps_equal_full_forward(model, prefill):
    tokens = jnp.asarray(random_tokens(2, 14, vocab=128, seed=4))
    full = np.asarray(model(tokens))
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    cache = model.init_cache(2, 32)
    logits, cache = step(model, tokens[:, :prefill], cache)
    pieces = [np.asarray(logits)]
    for i in range(prefill, tokens.shape[1]):
        logits, cache = step(model, tokens[:, i:i + 1], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=ATOL, rtol=0)
    assert np.asarray(cache.index).tolist() == [14, 14]


def test_prefill_logits_in_pieces_equal_full_forward(model, monkeypatch):
    """A prefill chunk of more than CPU_LOGITS_PIECE positions takes its logits in pieces of the token axis
    on CPU (here 4, 4, 4 and 2 of 14): they equal the full forward's one matmul."""
    from ulorl_jax.models import qwen3

    tokens = jnp.asarray(random_tokens(2, 14, vocab=128, seed=4))
    full = np.asarray(model(tokens))  # 28 positions: one matmul
    monkeypatch.setattr(qwen3, "CPU_LOGITS_PIECE", 8)
    logits, _ = model.decode_step(tokens, model.init_cache(2, 32))
    np.testing.assert_allclose(np.asarray(logits), full, atol=ATOL, rtol=0)


def test_left_padded_prefill_then_decode_equals_each_alone(model):
    lengths = [7, 3]
    t = max(lengths)
    prompts = random_tokens(2, t, vocab=128, seed=5)
    mask = np.zeros_like(prompts)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1
    continuation = random_tokens(2, 4, vocab=128, seed=6)
    cache = model.init_cache(2, 16)
    first, cache = model.decode_step(jnp.asarray(prompts), cache, attention_mask=jnp.asarray(mask))
    steps = []
    for i in range(continuation.shape[1]):
        logits, cache = model.decode_step(jnp.asarray(continuation[:, i:i + 1]), cache)
        steps.append(np.asarray(logits)[:, 0])
    for b, n in enumerate(lengths):
        seq = np.concatenate([prompts[b, t - n:], continuation[b]])[None]
        alone = np.asarray(model(jnp.asarray(seq)))[0]
        np.testing.assert_allclose(np.asarray(first)[b, t - n:], alone[:n], atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.stack([s[b] for s in steps]), alone[n:], atol=ATOL, rtol=0)
    assert np.asarray(cache.position).tolist() == [n + 4 for n in lengths]


def test_decode_step_compiles_once_for_new_weights(model):
    """Params are an explicit argument: new weights must not trigger a recompile."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, cache)

    tokens = jnp.ones((2, 1), jnp.int32)
    step(state, tokens, model.init_cache(2, 8))
    shifted = jax.tree_util.tree_map(lambda x: x * 1.01, state)
    step(shifted, tokens, model.init_cache(2, 8))
    assert step._cache_size() == 1


def test_cache_layout_insert_rows_equals_one_insert_per_row():
    """decode/cache_layout.py: a prefill batch's rows land in their slots in one scatter, exactly as one
    `insert_prefix` per row; padding rows (slot >= slots) change nothing; the rest of a slot row is masked."""
    from ulorl_jax.decode import cache_layout
    from ulorl_jax.models.qwen3 import KVCache

    m = init_model(tiny_config("qwen3", num_hidden_layers=1), seed=0)
    rng = np.random.default_rng(0)
    full = cache_layout.init_slots(m, 4, 12)
    full = full._replace(k=tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in full.k),
                         segment_ids=jnp.ones_like(full.segment_ids))  # stale data of earlier requests
    rows = cache_layout.prefill_cache(m, 3, 5)
    rows = KVCache(tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in rows.k),
                   tuple(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in rows.v),
                   jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], jnp.int32),
                   jnp.asarray([3, 5, 1], jnp.int32), jnp.asarray([3, 5, 1], jnp.int32))
    slots = jnp.asarray([2, 4, 0], jnp.int32)  # row 1 is padding: slot 4 >= 4 slots
    got = cache_layout.insert_rows(full, rows, slots)
    want = full
    for r, slot in ((0, 2), (2, 0)):
        one = jax.tree.map(lambda a, r=r: a[r:r + 1], rows)
        want = cache_layout.insert_prefix(want, one, slot)
    np.testing.assert_array_equal(np.asarray(got.segment_ids), np.asarray(want.segment_ids))
    np.testing.assert_array_equal(np.asarray(got.index), np.asarray(want.index))
    np.testing.assert_array_equal(np.asarray(got.position), np.asarray(want.position))
    for a, b in zip(got.k + got.v, want.k + want.v):  # equal where attended to (segment id != 0)
        live = np.asarray(want.segment_ids)[:, :, None, None] != 0
        np.testing.assert_array_equal(np.where(live, np.asarray(a), 0), np.where(live, np.asarray(b), 0))
    assert np.asarray(got.segment_ids)[[1, 3]].all()  # untouched slots keep their rows
