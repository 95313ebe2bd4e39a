"""Training checkpoints: exact round trip, keep-last-N, atomic commit, corrupt-latest fallback, HF export."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulorl_jax.checkpoint import CheckpointError, TrainCheckpointer, export_hf
from ulorl_jax.models import init_model, tiny_config

# Dense: what is checkpointed does not depend on the architecture (MoE export is covered by test_hf_io).
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, num_hidden_layers=2)


def _model(seed: int = 0, **changes):
    return init_model(tiny_config("qwen3", **{**CONFIG, **changes}), seed=seed)


def _train_state(seed: int = 0):
    """params / opt_state of an adamw after one update (so mu, nu and count are non-trivial).

    The gradient is random: what matters here is the optimizer state's structure and values.
    """
    model = _model(seed)
    _, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
    return model, optax.apply_updates(params, updates), opt_state


def _meta(step):
    return {"step": step, "data_position": 17 * step, "policy_version": step,
            "pools": {"unfinished": [{"uid": 3, "response_ids": [1, 2, 3], "logprobs": [-0.5, -1.25, -0.125]}],
                      "experience": []}}


def _assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def state():
    return _train_state()


def test_round_trip_is_exact(tmp_path, state):
    _, params, opt_state = state
    rng = jax.random.fold_in(jax.random.key(7), 3)
    with TrainCheckpointer(tmp_path / "checkpoints", keep_last=3, async_save=True) as ckpt:
        ckpt.save(5, params=params, opt_state=opt_state, rng=rng, meta=_meta(5))
        ckpt.wait()
        assert ckpt.latest_step() == 5
    # A new process (new checkpointer) restores into fresh targets of another seed.
    _, params_t, opt_t = _train_state(seed=1)
    with TrainCheckpointer(tmp_path / "checkpoints") as ckpt:
        params2, opt2, rng2, meta = ckpt.restore(params_target=params_t, opt_state_target=opt_t)
    _assert_same(params2, params)
    _assert_same(opt2, opt_state)
    assert type(params2) is type(params) and type(opt2) is type(opt_state)
    assert int(opt2[0].count) == 1
    np.testing.assert_array_equal(jax.random.key_data(rng2), jax.random.key_data(rng))
    assert jax.random.key_impl(rng2) == jax.random.key_impl(rng)
    np.testing.assert_array_equal(jax.random.uniform(rng2, (4,)), jax.random.uniform(rng, (4,)))
    assert meta == _meta(5)


def test_raw_uint32_rng_and_sharded_bfloat16_targets(tmp_path, state):
    """Restores take the targets' dtypes and shardings (abstract ShapeDtypeStruct targets)."""
    _, params, opt_state = state
    rng = np.asarray([123, 456], np.uint32)
    with TrainCheckpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, rng=rng, meta={})
    mesh = jax.make_mesh((8,), ("fsdp",))
    replicated = NamedSharding(mesh, P())

    def target(x):
        spec = P("fsdp") if x.ndim >= 1 and x.shape[0] % 8 == 0 else P()
        dtype = jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=NamedSharding(mesh, spec))

    params_t = jax.tree.map(target, params)
    with TrainCheckpointer(tmp_path) as ckpt:
        params2, opt2, rng2, _ = ckpt.restore(params_target=params_t, opt_state_target=opt_state)
    for got, want, t in zip(jax.tree.leaves(params2), jax.tree.leaves(params), jax.tree.leaves(params_t)):
        assert got.dtype == jnp.bfloat16 and got.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    assert any(t.sharding != replicated for t in jax.tree.leaves(params_t))  # something really was sharded
    _assert_same(opt2, opt_state)
    assert rng2.dtype == np.uint32
    np.testing.assert_array_equal(np.asarray(rng2), rng)


def test_keep_last_n(tmp_path, state):
    _, params, opt_state = state
    with TrainCheckpointer(tmp_path, keep_last=2, async_save=True) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, params=params, opt_state=opt_state, rng=jax.random.key(step), meta=_meta(step))
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["3", "4"]


def test_half_written_step_is_ignored(tmp_path, state, caplog):
    """Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames on commit: an interrupted save leaves only that."""
    _, params, opt_state = state
    with TrainCheckpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(2, params=params, opt_state=opt_state, rng=jax.random.key(0), meta=_meta(2))
    partial = tmp_path / "3.orbax-checkpoint-tmp-1733200000000000"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "junk").write_bytes(b"\x00" * 10)
    with TrainCheckpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [2]
        with caplog.at_level(logging.WARNING):
            *_, meta = ckpt.restore(params_target=params, opt_state_target=opt_state)
    assert meta["step"] == 2
    assert "could not be restored" not in caplog.text


# A failed read inside orbax's async machinery leaves an "event loop is closed" note at exit.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["array_data", "meta_json"])
def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path, state, caplog, damage):
    _, params, opt_state = state
    with TrainCheckpointer(tmp_path, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, params=params, opt_state=opt_state, rng=jax.random.key(step), meta=_meta(step))
    if damage == "array_data":
        for f in (tmp_path / "2" / "params").rglob("*"):
            if f.is_file() and "d" in f.parent.name:  # tensorstore data files (ocdbt .../d/...)
                f.write_bytes(b"garbage")
        damaged = [f for f in (tmp_path / "2" / "params").rglob("*") if f.is_file() and f.read_bytes() == b"garbage"]
        assert damaged, "found no array data files to corrupt"
    else:
        for f in (tmp_path / "2" / "meta").rglob("*"):
            if f.is_file():
                f.write_text("{not json")
    with TrainCheckpointer(tmp_path) as ckpt:
        with caplog.at_level(logging.WARNING, logger="ulorl_jax.checkpoint"):
            params2, _, _, meta = ckpt.restore(params_target=params, opt_state_target=opt_state)
        assert meta["step"] == 1
        assert "checkpoint step 2" in caplog.text and "trying the previous one" in caplog.text
        _assert_same(params2, params)
        with pytest.raises(Exception):  # an explicit step does not fall back
            ckpt.restore(2, params_target=params, opt_state_target=opt_state)


def test_target_mismatch_is_named_not_skipped(tmp_path, state):
    model, params, opt_state = state
    with TrainCheckpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0), meta={})
        _, other, other_opt = _train_state_of(num_hidden_layers=1)
        with pytest.raises(CheckpointError, match=r"params: leaf #\d+ is 'layers\.1\..*' in the checkpoint"):
            ckpt.restore(params_target=other, opt_state_target=other_opt)
        wider = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], x.shape[-1] + 1), x.dtype) if x.ndim else x,
                             params)
        with pytest.raises(CheckpointError, match=r"params\.embed_tokens: shape \(96, 32\) in the checkpoint, "
                                                  r"\(96, 33\)"):
            ckpt.restore(params_target=wider, opt_state_target=opt_state)


def _train_state_of(**changes):
    model = _model(0, **changes)
    _, params = nnx.split(model, nnx.Param)
    return model, params, optax.adamw(1e-2).init(params)


def test_empty_directory(tmp_path, state):
    _, params, opt_state = state
    with TrainCheckpointer(tmp_path / "none") as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ckpt.restore(params_target=params, opt_state_target=opt_state)


def test_export_hf_loads_in_transformers_with_equal_logits(tmp_path, state):
    torch = pytest.importorskip("torch")
    import transformers

    model, params, opt_state = state
    with TrainCheckpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        ckpt.save(3, params=params, opt_state=opt_state, rng=jax.random.key(0), meta={})
    template = _model(42)  # other weights: must be replaced
    export_hf(tmp_path / "checkpoints", None, template, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 96, (2, 12))
    with torch.no_grad():
        hf_logits = hf(torch.tensor(tokens)).logits.numpy()
    trained = nnx.merge(nnx.graphdef(model), params, nnx.state(model, nnx.Not(nnx.Param)))
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(trained, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(hf_logits, ours, atol=2e-4, rtol=2e-4)
    with pytest.raises(CheckpointError, match=r"step 9 not in"):
        export_hf(tmp_path / "checkpoints", 9, template, tmp_path / "hf2")
