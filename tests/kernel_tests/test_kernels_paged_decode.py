"""Paged flash-decoding kernel and its XLA reference vs the dense decode reference (CPU interpret mode).

Each case builds a dense cache [B, W x page_size, Hkv, D] and the same positions scattered over a pool of
pages in shuffled order; everything in the pool a slot does not own below its length is NaN (other pages,
the rows of a last page past the length), and table entries past a slot's pages hold "no page" (P),
negative and huge ids and another slot's page. Both the kernel and
``paged_decode_attention_reference`` must equal ``decode_attention_reference`` on the dense cache.

Tolerances (max abs error, inputs ~N(0, 1)), as for the dense kernel: f32 2e-5; bf16 vs the f32 reference
on the same values 2e-2.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulorl_jax import kernels
from ulorl_jax.sharding import MeshConfig, make_mesh, mesh_context

INTERPRET = jax.default_backend() == "cpu"  # compiled on a GPU: run with JAX_PLATFORMS=cuda (conftest defaults to cpu)
# Jitted: the op-by-op eager references compile slower than one jit.
dense_reference = jax.jit(kernels.decode_attention_reference)
paged_reference = jax.jit(kernels.paged_decode_attention_reference)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")

# page_size 16, W = 6 pages (96 positions): 0 (output 0), 1, a page boundary and +-1 around two of them,
# the full table. With num_splits=3 each split owns 2 pages, so 33 also crosses a split edge.
PAGE, WIDTH = 16, 6
LENGTHS = [0, 1, 15, 16, 17, 32, 33, 96]


def _paged_cache(seed, lengths, *, page_size, width, hq, hkv, d, dtype=jnp.float32, extra_pages=5):
    """(q, k_pages, v_pages, page_table, lengths, k_dense, v_dense): the dense cache and its paged copy."""
    rng = np.random.default_rng(seed)
    b, s = len(lengths), width * page_size
    q = rng.standard_normal((b, hq, d), np.float32)
    k_dense, v_dense = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))
    num_pages = b * width + extra_pages
    pool_ids = rng.permutation(num_pages)  # slots' pages scattered over the pool, out of order
    k_pages, v_pages = (np.full((num_pages, page_size, hkv, d), np.nan, np.float32) for _ in range(2))
    table = np.empty((b, width), np.int32)
    owned = [-(-n // page_size) for n in lengths]
    for slot, n in enumerate(lengths):
        ids = pool_ids[slot * width: slot * width + owned[slot]]
        table[slot, :owned[slot]] = ids
        for j, page in enumerate(ids):
            rows = min(page_size, n - j * page_size)  # the last page's rows past the length stay NaN
            k_pages[page, :rows] = k_dense[slot, j * page_size: j * page_size + rows]
            v_pages[page, :rows] = v_dense[slot, j * page_size: j * page_size + rows]
    # Past a slot's pages: no page (P), out-of-range ids, a NaN page and a page another slot owns.
    other = table[int(np.argmax(owned)), 0]
    junk = [num_pages, -1, 2**31 - 1, pool_ids[-1], other]
    for slot in range(b):
        for j in range(owned[slot], width):
            table[slot, j] = junk[(slot + j) % len(junk)]
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    return (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table), jnp.asarray(lengths, jnp.int32),
            cast(k_dense), cast(v_dense))


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_f32_ragged_lengths_scattered_pages_gqa(ratio):
    q, kp, vp, table, lengths, k, v = _paged_cache(ratio, LENGTHS, page_size=PAGE, width=WIDTH,
                                                   hq=2 * ratio, hkv=2, d=16)
    want = dense_reference(q, k, v, lengths)
    o = kernels.paged_decode_attention(q, kp, vp, table, lengths, num_splits=3, interpret=INTERPRET)
    assert o.shape == q.shape and o.dtype == q.dtype
    np.testing.assert_allclose(o, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(paged_reference(q, kp, vp, table, lengths), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(o[0], 0.0)  # length 0
    # Independent of the references: one visible position returns its V (the slot's first page, row 0).
    np.testing.assert_allclose(o[1], jnp.repeat(v[1, 0], ratio, axis=0), atol=1e-6)


def test_bf16():
    q, kp, vp, table, lengths, k, v = _paged_cache(8, LENGTHS, page_size=PAGE, width=WIDTH, hq=8, hkv=2, d=32,
                                                   dtype=jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = dense_reference(f32(q), f32(k), f32(v), lengths)
    o = kernels.paged_decode_attention(q, kp, vp, table, lengths, num_splits=3, interpret=INTERPRET)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(o), want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f32(paged_reference(q, kp, vp, table, lengths)), want, atol=2e-2, rtol=2e-2)


def test_small_pages_odd_head_dim_and_default_params():
    # page_size 8 (< 16: rows padded and masked), D = 24 (padded to 32), 5 pages per slot (not a power of
    # two); more splits than pages get capped; then the backend's default knobs.
    lengths = [0, 7, 8, 9, 40]
    q, kp, vp, table, lengths, k, v = _paged_cache(9, lengths, page_size=8, width=5, hq=4, hkv=2, d=24)
    want = dense_reference(q, k, v, lengths)
    for params in (dict(num_splits=16), {}):
        o = kernels.paged_decode_attention(q, kp, vp, table, lengths, interpret=INTERPRET, **params)
        np.testing.assert_allclose(o, want, atol=2e-5, rtol=1e-5, err_msg=str(params))
    np.testing.assert_allclose(paged_reference(q, kp, vp, table, lengths), want, atol=2e-5, rtol=1e-5)


def test_dispatch_pallas_and_xla_agree_and_tpu_falls_back_with_reason(monkeypatch, caplog):
    q, kp, vp, table, lengths, k, v = _paged_cache(10, [3, 17, 48], page_size=PAGE, width=3, hq=4, hkv=2, d=16)
    want = dense_reference(q, k, v, lengths)
    for impl in ("pallas", "xla"):
        got = jax.jit(lambda *a, impl=impl: kernels.paged_decode(*a, impl=impl))(q, kp, vp, table, lengths)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=impl)
    monkeypatch.setattr(kernels.platform, "backend", lambda: "tpu")
    with caplog.at_level(logging.WARNING, logger=kernels.dispatch.__name__):
        got = jax.jit(lambda *a: kernels.paged_decode(*a))(q, kp, vp, table, lengths)
    assert "paged decode attention impl='pallas' falls back to 'xla'" in caplog.text and "'tpu'" in caplog.text
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown paged decode attention impl"):
        kernels.paged_decode(q, kp, vp, table, lengths, impl="cudnn")


@needs_8
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=2, fsdp=2, expert=2), MeshConfig(fsdp=2, expert=2, tensor=2)],
                         ids=["d2f2e2", "f2e2t2"])
def test_sharded_paged_decode_equals_unsharded(mesh_cfg):
    """kernels.paged_decode under a mesh context: one kernel call per (slot, kv head) block, the pool split
    over kv heads only (any slot may own any page), q / table / lengths over the slots."""
    lengths = [1, 48, 17, 33, 0, 40, 16, 47]
    q, kp, vp, table, lengths, _, _ = _paged_cache(11, lengths, page_size=PAGE, width=3, hq=4, hkv=2, d=16)
    fn = lambda *a: kernels.paged_decode(*a, impl="pallas")  # noqa: E731
    want = jax.jit(fn)(q, kp, vp, table, lengths)
    mesh = make_mesh(mesh_cfg)
    rows = kernels.sharded.batch_axes_for(q.shape[0], mesh)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(q, rows, "tensor", None), put(kp, None, None, "tensor", None), put(vp, None, None, "tensor", None),
            put(table, rows, None), put(lengths, rows))
    assert "shard_map" in str(jax.make_jaxpr(mesh_context(fn, mesh))(*args))
    sharded_fn = jax.jit(mesh_context(fn, mesh))
    np.testing.assert_allclose(sharded_fn(*args), want, atol=1e-5, rtol=0)
    hlo = sharded_fn.lower(*args).compile().as_text()
    assert f"f32[{q.shape[0]},{q.shape[1]}" not in hlo  # no device holds every slot's queries
    if mesh.shape["tensor"] > 1:  # and no device the whole pool
        assert "f32[{},{},{},{}]".format(*kp.shape) not in hlo
