"""The paged KV cache: decoding through scattered pages equals the full forward and the dense cache."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_utils import random_tokens
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.models import paged_kv

ATOL = 1e-4
PAGE = 4


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request):
    return init_model(tiny_config(request.param), seed=3)


def paged_cache(model, table):
    cfg = model.config
    return paged_kv.init_paged_cache(cfg.num_hidden_layers, 12, PAGE, cfg.num_key_value_heads, cfg.head_dim,
                                     jnp.float32, len(table), len(table[0]))._replace(
        page_table=jnp.asarray(table, jnp.int32))


def test_prefill_and_steps_through_scattered_pages_equal_full_forward(model):
    """Slot 0 owns pages out of order, slot 1 interleaved with it; 14 tokens cross three page boundaries.
    Entries past the pages a slot needs hold the "no page" id (12)."""
    tokens = jnp.asarray(random_tokens(2, 14, vocab=128, seed=4))
    full = np.asarray(model(tokens))
    table = [[7, 2, 9, 0, 12], [1, 8, 3, 11, 12]]
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    logits, cache = step(model, tokens[:, :5], paged_cache(model, table))
    pieces = [np.asarray(logits)]
    for i in range(5, 14):
        logits, cache = step(model, tokens[:, i:i + 1], cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=ATOL, rtol=0)
    assert np.asarray(cache.index).tolist() == [14, 14]
    # Pages nobody owns were never written.
    for unused in (4, 5, 6, 10):
        assert not np.asarray(cache.k[0][unused]).any()


def test_idle_slot_writes_only_its_own_page(model):
    """A finished slot still runs through the step (attention_mask 0): its write lands at its frozen
    index inside its own page, and a slot without pages writes nowhere."""
    table = [[3, 12], [12, 12]]
    cache = paged_cache(model, table)._replace(index=jnp.asarray([2, 0], jnp.int32))
    before = [np.asarray(a) for a in cache.k]
    _, after = model.decode_step(jnp.asarray([[5], [6]]), cache, attention_mask=jnp.asarray([[0], [0]]))
    for layer, (b, a) in enumerate(zip(before, after.k)):
        a = np.asarray(a)
        changed = {int(p) for p in np.flatnonzero(np.any(a != b, axis=(1, 2, 3)))}
        assert changed <= {3}, f"layer {layer} wrote pages {changed}"


def test_insert_rows_then_decode_equals_dense_cache(model):
    """Prefill rows computed in a dense scratch cache, copied into pages (a padding row dropped), then
    decoding: the same logits as decoding on in the dense cache."""
    lengths = [6, 3]
    prompts = random_tokens(2, 8, vocab=128, seed=7)
    mask = (np.arange(8)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    _, rows = model.decode_step(jnp.asarray(prompts), model.init_cache(2, 12), attention_mask=jnp.asarray(mask))
    lens = jnp.asarray(lengths, jnp.int32)
    cache = paged_cache(model, [[12, 12, 12], [5, 0, 9], [2, 10, 12]])
    # Row 0 -> slot 1, row 1 -> slot 2; a third row aimed at slot 3 (>= slots) is padding.
    pad_k = tuple(jnp.concatenate([a, a[:1]]) for a in rows.k)
    pad_v = tuple(jnp.concatenate([a, a[:1]]) for a in rows.v)
    paged = paged_kv.insert_rows(cache, pad_k, pad_v, jnp.asarray([6, 3, 5], jnp.int32),
                                 jnp.asarray([1, 2, 3], jnp.int32))
    assert np.asarray(paged.index).tolist() == [0, 6, 3]
    dense = rows._replace(index=lens, position=lens)
    nxt = jnp.asarray(random_tokens(2, 1, vocab=128, seed=8))
    for _ in range(3):
        want, dense = model.decode_step(nxt, dense)
        got, paged = model.decode_step(jnp.concatenate([nxt[:1], nxt]), paged)
        np.testing.assert_allclose(np.asarray(got)[1:], np.asarray(want), atol=ATOL, rtol=0)
        nxt = jnp.argmax(want[:, -1:], axis=-1).astype(jnp.int32)


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot-rows", "gathered-rows"])
@pytest.mark.parametrize("groups", [1, 4])
def test_ragged_decode_attention_equals_the_dense_reference(groups, one_hot, monkeypatch):
    """Every page read once by its owner: equal to gathering each slot's pages and attending densely, on
    ragged lengths (0, 1, a page boundary and one past it), pages out of order, and pages nobody owns;
    with the owners' queries picked by the one-hot matmul (small pools) and by a gather (large ones)."""
    from ulorl_jax.kernels.reference import decode_attention_reference

    monkeypatch.setattr(paged_kv, "ONE_HOT_MAX_ENTRIES", 1 << 16 if one_hot else 0)

    rng = np.random.default_rng(0)
    b, hkv, d, pages = 4, 2, 8, 11
    q = jnp.asarray(rng.normal(size=(b, hkv * groups, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(pages, PAGE, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(pages, PAGE, hkv, d)), jnp.float32)
    table = jnp.asarray([[9, 2, 11], [4, 11, 11], [0, 7, 5], [11, 11, 11]], jnp.int32)  # 1, 3, 6, 8, 10 unowned
    lengths = jnp.asarray([5, 4, 12, 0], jnp.int32)
    got = paged_kv.ragged_decode_attention(q, k, v, table, lengths)
    want = decode_attention_reference(q, paged_kv.gather_pages(k, table), paged_kv.gather_pages(v, table), lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert not np.asarray(got[3]).any()


def test_owner_rows_equal_the_owners_rows_bit_for_bit(monkeypatch):
    """The one-hot matmul picks exactly x[owner] (no rounding), in float32 and bfloat16; pages nobody owns
    (owner = B) get zeros. The gather branch agrees on every owned page."""
    rng = np.random.default_rng(1)
    owner = jnp.asarray([3, 0, 5, 2, 2, 5, 1, 4, 0], jnp.int32)  # 5 = nobody (B = 5)
    owned = np.asarray(owner) < 5
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.normal(size=(5, 24)) * 1e3, dtype)
        got = np.asarray(paged_kv.owner_rows(x, owner).astype(jnp.float32))
        want = np.asarray(x.astype(jnp.float32))[np.clip(np.asarray(owner), 0, 4)]
        np.testing.assert_array_equal(got[owned], want[owned])
        assert not got[~owned].any()
        monkeypatch.setattr(paged_kv, "ONE_HOT_MAX_ENTRIES", 0)
        gathered = np.asarray(paged_kv.owner_rows(x, owner).astype(jnp.float32))
        np.testing.assert_array_equal(gathered[owned], want[owned])
        monkeypatch.undo()


def test_pallas_decode_reads_the_pages_in_place():
    """attention_impl=pallas decodes through `kernels.paged_decode` (interpret mode on CPU): the same
    logits as the XLA path on the same pages."""
    tokens = jnp.asarray(random_tokens(2, 9, vocab=128, seed=9))
    table = [[7, 2, 9, 12], [1, 8, 3, 12]]
    out = {}
    for impl in ("xla", "pallas"):
        m = init_model(tiny_config("qwen3", attention_impl=impl), seed=3)
        logits, cache = m.decode_step(tokens[:, :5], paged_cache(m, table))
        steps = []
        for i in range(5, 9):
            logits, cache = m.decode_step(tokens[:, i:i + 1], cache)
            steps.append(np.asarray(logits))
        out[impl] = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(out["pallas"], out["xla"], atol=ATOL, rtol=0)
