"""Context parallelism (the `context` mesh axis): the load-balanced layout, attention over context shards
and the whole learner step, each against one device on natural rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from learner_utils import VOCAB, assert_trees_close, small_config

from ulorl_jax.models.attention import AttentionMask, get_attention_impl
from ulorl_jax.models.config import tiny_config
from ulorl_jax.models.context_attention import context_parallel_attention
from ulorl_jax.models.context_layout import (
    causal_pairs,
    causal_tiles,
    check_row_len,
    from_layout,
    layout_order,
    natural_order,
    shard_positions,
    to_layout,
)
from ulorl_jax.models.qwen3 import init_model
from ulorl_jax.rl.learner import Learner, TrainSample
from ulorl_jax.sharding import (
    BATCH_AXES,
    CONTEXT_AXIS,
    MeshConfig,
    MeshError,
    make_mesh,
    mesh_context,
)

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")


# ---------------------------------------------------------------------------
# The layout (pure)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("context", [1, 2, 4, 8])
def test_layout_is_a_permutation_and_from_layout_inverts_it(context):
    row_len = 16 * context
    order = layout_order(row_len, context)
    assert sorted(order.tolist()) == list(range(row_len))
    x = np.arange(3 * row_len).reshape(3, row_len) * 7
    np.testing.assert_array_equal(from_layout(to_layout(x, context), context), x)
    # shard i holds chunks i and 2C-1-i: the first and the last chunk share shard 0
    c = row_len // (2 * context)
    first = order[: row_len // context]
    np.testing.assert_array_equal(first, np.r_[0:c, row_len - c:row_len])


@pytest.mark.parametrize("context", [2, 4, 8])
def test_shard_positions_and_natural_order_match_the_layout(context):
    row_len = 8 * context
    order = layout_order(row_len, context)
    for shard, local in enumerate(order.reshape(context, -1)):
        np.testing.assert_array_equal(np.asarray(shard_positions(shard, row_len, context)), local)
    # the gathered laid-out row (shard-major), put back in natural order, is 0 .. L-1
    gathered = jnp.asarray(order)[None, :, None]
    np.testing.assert_array_equal(np.asarray(natural_order(gathered, context))[0, :, 0], np.arange(row_len))


def test_load_balance_of_a_128k_row():
    """Each shard's causal work at 128k tokens, by formula (pairs) and by blockwise's tile count, against a
    brute-force count for a short row."""
    for context in (2, 4, 8):
        pairs = causal_pairs(131072, context)
        assert pairs.max() / pairs.mean() <= 1.0 + 1e-9
        tiles = causal_tiles(131072, context, 256, 256)
        assert tiles.max() / tiles.mean() <= 1.15
        contiguous = causal_pairs(131072, context, balanced=False)
        # what the layout avoids: the last contiguous piece does (2C - 1) / C times the mean
        np.testing.assert_allclose(contiguous.max() / contiguous.mean(), (2 * context - 1) / context, rtol=1e-3)
    row_len, context = 48, 3
    q = layout_order(row_len, context).reshape(context, -1)
    brute = [int(sum(p + 1 for p in shard)) for shard in q]
    np.testing.assert_array_equal(causal_pairs(row_len, context), brute)


def test_bad_row_lengths_name_the_option():
    check_row_len(8, 4)
    with pytest.raises(MeshError, match=r"trainer.row_len=12 does not divide into 2 x mesh.context = 8.*e.g. 16"):
        check_row_len(12, 4)
    with pytest.raises(MeshError, match=r"trainer.row_len=6 is shorter than the 8 chunks mesh.context=4"):
        check_row_len(6, 4)


# ---------------------------------------------------------------------------
# Attention over context shards == one device
# ---------------------------------------------------------------------------


def _packed_ids(rows: int, row_len: int, seed: int) -> np.ndarray:
    """Segment ids of packed rows: samples of random lengths (crossing any chunk boundary), padding at the end."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, row_len), np.int32)
    for r in range(rows):
        pos, seg = 0, 1
        while pos < row_len - 3:
            n = int(rng.integers(3, row_len // 2))
            ids[r, pos:pos + n] = seg
            pos, seg = pos + n, seg + 1
    return ids


@needs_8
@pytest.mark.parametrize("impl", ["xla", "blockwise", "pallas"])
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=1, context=8), MeshConfig(fsdp=2, context=4),
                                      MeshConfig(fsdp=2, context=2, tensor=2)])
def test_attention_over_context_shards_equals_one_device(impl, mesh_cfg):
    rows, row_len, hq, hkv, d = 2, 1024 if impl == "blockwise" else 64, 4, 2, 8
    mesh = make_mesh(mesh_cfg)
    context = mesh_cfg.context
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (rows, row_len, hq, d))
    k = jax.random.normal(key[1], (rows, row_len, hkv, d))
    v = jax.random.normal(key[2], (rows, row_len, hkv, d))
    g = jax.random.normal(key[3], (rows, row_len, hq, d))
    ids = jnp.asarray(_packed_ids(rows, row_len, 1))
    natural = AttentionMask(ids, ids, jnp.broadcast_to(jnp.arange(row_len), ids.shape))

    def loss_ref(q, k, v):
        return jnp.sum(get_attention_impl("xla")(q, k, v, natural) * g)

    out_ref = get_attention_impl("xla")(q, k, v, natural)
    grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)

    lay = lambda x: jnp.asarray(to_layout(np.asarray(x), context, axis=1))
    unlay = lambda x: from_layout(np.asarray(x), context, axis=1)
    ql, kl, vl, gl, idsl = lay(q), lay(k), lay(v), lay(g), lay(ids)

    def run(q, k, v, ids):
        mask = AttentionMask(ids, ids, jnp.zeros_like(ids), is_self_attention=True)  # q_index unused here
        return context_parallel_attention(impl, q, k, v, mask, jax.sharding.get_abstract_mesh())

    def loss(q, k, v, ids):
        return jnp.sum(run(q, k, v, ids) * gl)

    sh = NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS, None, None)))
    args = (put(ql), put(kl), put(vl), jax.device_put(idsl, sh))
    out = jax.jit(mesh_context(run, mesh))(*args)
    grads = jax.jit(mesh_context(jax.grad(loss, argnums=(0, 1, 2)), mesh))(*args)
    real = np.asarray(ids)[..., None, None] > 0
    np.testing.assert_allclose(np.where(real, unlay(out), 0), np.where(real, out_ref, 0), rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(unlay(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_each_shards_attention_on_one_device_equals_its_rows_of_the_reference(impl):
    """What one context shard computes (its two chunks' queries at their natural positions against the whole
    row), run shard by shard on the default device: a GPU where there is one (benchmarks/gpu_suite.py runs
    this file's one-device tests there; several GPUs are not available to it)."""
    context, rows, row_len, hq, hkv, d = 4, 1, 1024, 4, 2, 16
    key = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(key[0], (rows, row_len, hq, d))
    k = jax.random.normal(key[1], (rows, row_len, hkv, d))
    v = jax.random.normal(key[2], (rows, row_len, hkv, d))
    ids = jnp.asarray(_packed_ids(rows, row_len, 3))
    natural = AttentionMask(ids, ids, jnp.broadcast_to(jnp.arange(row_len), ids.shape))
    ref = np.asarray(get_attention_impl("xla")(q, k, v, natural))
    real = np.asarray(ids) > 0
    for shard in range(context):
        pos = np.asarray(shard_positions(shard, row_len, context))
        def one(q, k, v, q_ids, kv_ids, q_pos):
            return get_attention_impl(impl)(q, k, v, AttentionMask(q_ids, kv_ids, q_pos, is_self_attention=False))

        out = np.asarray(jax.jit(one)(q[:, pos], k, v, ids[:, pos], ids, jnp.asarray(pos)[None]))
        np.testing.assert_allclose(out[real[:, pos]], ref[:, pos][real[:, pos]], rtol=2e-5, atol=2e-5,
                                   err_msg=f"shard {shard}")


# ---------------------------------------------------------------------------
# The learner step == one device
# ---------------------------------------------------------------------------

ROW_LEN = 64


def _samples(seed: int, n: int) -> list[TrainSample]:
    """Samples of 20-40 tokens (several per 64-token row, crossing the chunk boundaries of every context
    size), positive advantages (a loss that is not a cancelling sum) and rollout log-probs."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, o = int(rng.integers(2, 6)), int(rng.integers(18, 35))
        out.append(TrainSample(rng.integers(0, VOCAB, p).tolist(), rng.integers(0, VOCAB, o).tolist(),
                               advantage=float(rng.uniform(0.5, 1.5)) * (1 if i % 3 else -1), reward=float(i % 2),
                               logprobs=(-rng.uniform(0.5, 4.0, o)).tolist()))
    return out


def _model(kind: str):
    extra = dict(num_experts=8, moe_intermediate_size=16) if kind == "moe" else {}
    return init_model(tiny_config("qwen3_moe" if kind == "moe" else "qwen3", vocab_size=VOCAB, hidden_size=32,
                                  head_dim=8, num_hidden_layers=2, **extra), seed=3)


def _compare_step(kind: str, meshes, **conf_kw):
    model = _model(kind)
    samples = _samples(4, 10)
    conf = small_config(row_len=ROW_LEN, micro_batch_rows=2, logprob_chunk=8, mask_mode="mpt", tau=0.02,
                        aux_loss_coef=0.01 if kind == "moe" else 0.0, **conf_kw)
    ref = Learner(model, conf)
    _, batch_ref = ref.pack(samples)
    assert batch_ref["tokens"].shape[0] >= 2  # gradients accumulated over micro-batches
    rows = batch_ref["segment_ids"].reshape(-1, ROW_LEN)
    assert sum(len(set(ids[ids > 0].tolist())) >= 2 for ids in rows) >= 3  # several samples per row
    loss_ref, g_ref = ref.gradients(samples)
    logp_ref, ent_ref = ref._score_batch(batch_ref)
    for mesh_cfg in meshes:
        size = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.expert * mesh_cfg.context * mesh_cfg.tensor
        learner = Learner(model, conf, make_mesh(mesh_cfg, jax.devices()[:size]))
        assert learner.context == mesh_cfg.context
        loss, grads = learner.gradients(samples)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, err_msg=f"loss {mesh_cfg}")
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(g_ref)):
            a, b = np.asarray(a), np.asarray(b)  # every leaf, relative to its own largest element
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(),
                                       err_msg=f"gradient {jax.tree_util.keystr(path)} {mesh_cfg}")
        _, batch = learner.pack(samples)
        logp, ent = (from_layout(x, learner.context) for x in learner._score_batch(batch))
        real = batch_ref["segment_ids"] > 0
        np.testing.assert_allclose(logp[real], logp_ref[real], rtol=1e-5, atol=1e-6, err_msg=f"log p {mesh_cfg}")
        np.testing.assert_allclose(ent[real], ent_ref[real], rtol=1e-5, atol=1e-6, err_msg=f"entropy {mesh_cfg}")
    return ref


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("scan,remat", [(False, "none"), (True, "full")])
def test_dense_step_over_context_shards_equals_one_device(scan, remat):
    _compare_step("dense", [MeshConfig(fsdp=1, context=2), MeshConfig(fsdp=2, context=4),
                            MeshConfig(fsdp=1, context=8)], scan_layers=scan, remat=remat)


@needs_8
@pytest.mark.slow
@pytest.mark.parametrize("scan,remat", [(False, "full"), (True, "none")])
def test_moe_step_over_context_shards_equals_one_device(scan, remat):
    _compare_step("moe", [MeshConfig(fsdp=1, context=4), MeshConfig(fsdp=1, expert=2, context=4)],
                  scan_layers=scan, remat=remat)


@needs_8
@pytest.mark.slow
def test_update_over_context_shards_equals_one_device():
    """The whole update (AdamW, metrics incl. DMMPT's masked fraction and the MoE aux loss) at context 4."""
    model = _model("moe")
    samples = _samples(7, 10)
    conf = small_config(row_len=ROW_LEN, micro_batch_rows=2, logprob_chunk=8, aux_loss_coef=0.01)
    ref = Learner(model, conf)
    m_ref = ref.update(samples)
    learner = Learner(model, conf, make_mesh(MeshConfig(fsdp=2, context=4)))
    m = learner.update(samples)
    for key in ("loss", "grad_norm", "masked_fraction", "entropy", "aux_loss", "ratio_mean", "nll"):
        np.testing.assert_allclose(m[key], m_ref[key], rtol=1e-5, err_msg=key)
    assert_trees_close(learner.params, ref.params, 1e-4, 2e-5, "params")


@needs_8
def test_learner_refuses_a_row_that_does_not_split():
    with pytest.raises(MeshError, match=r"trainer.row_len=60 does not divide into 2 x mesh.context = 8"):
        Learner(_model("dense"), small_config(row_len=60, micro_batch_rows=2),
                make_mesh(MeshConfig(fsdp=2, context=4)))


# ---------------------------------------------------------------------------
# `ulorl train` with mesh.context
# ---------------------------------------------------------------------------


@needs_8
@pytest.mark.slow
def test_training_over_context_shards_matches_one_device_and_resumes(tmp_path):
    """Four steps at mesh.context=4 (fsdp 2 x context 4: 8 devices) give the metrics of four steps on one
    device; the same steps as 2 + resume + 2 do too. Rollout decodes on the first device in both, so both
    learners see the same samples (2 rollout rounds per step: updates at steps 2-4)."""
    from trainer_utils import MOVING
    from trainer_utils import tiny_config as run_config

    from ulorl_jax.metrics import read_metrics
    from ulorl_jax.rl.trainer import Trainer

    common = (*MOVING, "trainer.row_len=48", "rollout.decode_mesh=first_device", "checkpoint.save_every=2",
              "trainer.dynamic_sampling_max_rounds=2")
    context = ("mesh.fsdp=2", "mesh.context=4")

    def fit(folder, *extra, steps=4, resume=False):
        trainer = Trainer(run_config(*common, *extra, f"trainer.total_steps={steps}"), tmp_path / folder,
                          resume=resume)
        try:
            trainer.fit()
            return trainer.learner
        finally:
            trainer.close()

    one = fit("one")
    assert one.context == 1 and one.mesh.size == 1
    sharded = fit("context", *context)
    assert sharded.context == 4 and sharded.mesh.size == 8
    fit("split", *context, steps=2)
    fit("split", *context, resume=True)
    keep = ("loss", "grad_norm", "entropy", "nll", "masked_fraction", "reward_mean", "trained_samples", "tokens")
    ref = read_metrics(tmp_path / "one")
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    assert sum(r["trained_samples"] for r in ref[2:]) > 0 and sum(r.get("grad_norm", 0) for r in ref) > 0
    for folder in ("context", "split"):
        got = read_metrics(tmp_path / folder)
        assert [r["step"] for r in got] == [1, 2, 3, 4], folder
        for a, b in zip(got, ref):
            for key in keep:
                if key in b:
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-7, err_msg=f"{folder} step "
                                               f"{b['step']} {key}")
