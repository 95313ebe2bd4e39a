"""The jitted train step and `Learner`: POIS first update, accumulation, sharding, safety, state, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from learner_utils import DENSE, VOCAB, assert_trees_close, random_samples, small_config

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl.learner import Learner, LearnerConfig, TrainSample
from ulorl_jax.sharding import MeshConfig, MeshError, make_mesh


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def dense_learner():
    """One compiled learner shared by the cheap tests (each recompile costs tens of seconds here)."""
    return Learner(init_model(tiny_config("qwen3", **DENSE), seed=0), small_config())


# ---------------------------------------------------------------------------
# Config and input validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("is_mode", "tois", r"algorithm.is_mode='tois': expected one of \['pois', 'sais'\]"),
    ("mask_mode", "always", "algorithm.mask_mode"),
    ("loss_agg_mode", "seq-mean", "algorithm.loss_agg_mode"),
    ("remat", "some", "trainer.remat"),
    ("tau", 1.5, r"algorithm.tau=1.5: expected a probability in \(0, 1\]"),
    ("sigma", 0.0, r"algorithm.sigma=0.0: expected a target entropy > 0"),
    ("clip_ratio_low", 1.0, "algorithm.clip_ratio_low"),
    ("lr", -1.0, "optim.lr"),
    ("betas", (0.9, 1.0), r"optim.betas=\(0.9, 1.0\): expected two values in \[0, 1\)"),
    ("grad_clip", 0.0, "optim.grad_clip"),
    ("ppo_mini_batch_size", 0, "trainer.ppo_mini_batch_size"),
    ("micro_batch_rows", 0, "trainer.micro_batch_rows"),
    ("temperature", 0.0, "rollout.temperature"),
])
def test_config_rejects_bad_values(field, value, match):
    """LearnerConfig names the bad value by its YAML key, with the bound options.py holds for both."""
    with pytest.raises(ValueError, match=match):
        LearnerConfig(**{field: value})
    with pytest.raises(ValueError, match="unknown learner option"):
        LearnerConfig.from_dict({"clip_ratio": 0.2})


@pytest.mark.parametrize("override", ["algorithm.sigma=0", "algorithm.tau=1.5", "optim.betas=[0.9,1.0]",
                                      "optim.lr=-1", "trainer.micro_batch_rows=0", "algorithm.clip_ratio_low=1.0"])
def test_learner_and_yaml_reject_a_value_with_one_message(override):
    """One set of bounds: the run config refuses the value with the message LearnerConfig gives."""
    import yaml

    from ulorl_jax.config import ConfigError, load_config
    from ulorl_jax.rl.learner import OPTION_SECTIONS

    key, raw = override.split("=")
    section, name = key.split(".")
    assert name in OPTION_SECTIONS[section]
    value = yaml.safe_load(raw)
    with pytest.raises(ConfigError) as from_yaml:
        load_config("tiny_cpu", [override])
    with pytest.raises(ConfigError) as from_learner:
        LearnerConfig(**{name: tuple(value) if isinstance(value, list) else value})
    assert str(from_yaml.value).split(":")[0].split("=")[0] == key
    assert str(from_learner.value).split("=")[0] == key
    assert str(from_yaml.value).split(": expected ")[1] == str(from_learner.value).split(": expected ")[1]


def test_learner_config_takes_every_option_from_the_run_config():
    """build.learner_config copies nothing by hand: every OPTION_SECTIONS field set to a non-default value in
    the YAML arrives in the LearnerConfig; the fields outside it are the derived ones."""
    import dataclasses

    from ulorl_jax.config import load_config
    from ulorl_jax.rl.build import learner_config
    from ulorl_jax.rl.learner import OPTION_SECTIONS

    changed = {"algorithm.is_mode": "sais", "algorithm.mask_mode": "mpt", "algorithm.tau": 0.9,
               "algorithm.sigma": 0.3, "algorithm.entropy_mode": "batch", "algorithm.clip_ratio_low": 0.1,
               "algorithm.clip_ratio_high": 0.28, "algorithm.loss_agg_mode": "seq-mean-token-mean",
               "algorithm.entropy_coeff": 0.01, "algorithm.aux_loss_coef": 0.001, "algorithm.loss_mode": "gspo",
               "algorithm.clip_ratio_c": 2.5, "algorithm.loss_scale_factor": 512.0, "algorithm.tau_pos": 0.9,
               "algorithm.tau_neg": 1.2, "optim.lr": 3e-6,
               "optim.warmup_steps": 7, "optim.weight_decay": 0.1, "optim.betas": [0.8, 0.95], "optim.eps": 1e-6,
               "optim.grad_clip": 0.5, "trainer.ppo_mini_batch_size": 4, "trainer.ppo_epochs": 2,
               "trainer.micro_batch_rows": 2, "trainer.row_len": 4096, "trainer.remat": "dots",
               "trainer.scan_layers": True, "trainer.logprob_chunk": 64}
    # rollout correction is refused under SAIS (a no-op there): its keys in a second config, with POIS
    corrected = {"algorithm.rollout_correction.rollout_is": "token",
                 "algorithm.rollout_correction.rollout_is_threshold": "0.5_5.0",
                 "algorithm.rollout_correction.rollout_rs": "seq_mean_k3",
                 "algorithm.rollout_correction.rollout_rs_threshold": 0.01}
    assert set(changed) | set(corrected) == {f"{s}.{n}" for s, names in OPTION_SECTIONS.items() for n in names}
    default = LearnerConfig()
    for options in (changed, corrected):
        lc = learner_config(load_config("tiny_cpu", [f"{k}={v}".replace(" ", "") for k, v in options.items()]))
        for key, value in options.items():
            got = getattr(lc, key.rsplit(".", 1)[1])
            assert (list(got) if isinstance(got, tuple) else got) == value, key
            assert got != getattr(default, key.rsplit(".", 1)[1]), f"{key}: pick a non-default value"
    derived = {f.name for f in dataclasses.fields(LearnerConfig)} - {n for v in OPTION_SECTIONS.values() for n in v}
    assert derived == {"temperature"}
    assert learner_config(load_config("tiny_cpu", ["optim.grad_clip=null"])).grad_clip is None


def test_bad_samples_raise_before_any_compute(dense_learner):
    good = random_samples(0, 2)
    cases = [
        ([TrainSample([1], [2, 3], float("nan"), 1.0)], "sample 0: advantage is nan"),
        ([TrainSample([1], [2, 3], 1.0, 1.0, [-0.1])], "sample 0: logprobs has 1 entries for 2 response tokens"),
        ([TrainSample([1], [2, 3], 1.0, 1.0, [-0.1, float("inf")])], "logprobs contain NaN or inf"),
        ([good[0], TrainSample([1], [2, 3], 1.0, 0.5)], r"sample 1: reward=0.5 is not in \{0, 1\}"),
        ([TrainSample([1] * 10, [2] * 10, 1.0, 1.0)], "longer than row_len=16"),
        ([], "no samples"),
    ]
    before = _host(dense_learner.params)
    for samples, match in cases:
        with pytest.raises(ValueError, match=match):
            dense_learner.update(samples)
    assert_trees_close(dense_learner.params, before, 0, 0, "params after rejected input")
    sais = Learner.__new__(Learner)  # validation only: no model needed
    sais.config = small_config(is_mode="sais")
    with pytest.raises(ValueError, match="is_mode='sais' needs the rollout log-probs"):
        Learner.update(sais, random_samples(0, 2, logprobs=False))


def test_micro_batch_rows_must_divide_over_data_shards():
    mesh = make_mesh(MeshConfig(fsdp=8))
    with pytest.raises(MeshError, match="micro_batch_rows=4 must be a multiple of the mesh's 8 data shards"):
        Learner(init_model(tiny_config("qwen3", **DENSE), seed=0), small_config(micro_batch_rows=4), mesh)


# ---------------------------------------------------------------------------
# The step on one device
# ---------------------------------------------------------------------------


def test_pois_first_update_ratio_one_then_learns(dense_learner):
    samples = random_samples(1, 5)
    before = _host(dense_learner.params)
    step0 = dense_learner.step
    m = dense_learner.update(samples)
    assert m["ratio_mean"] == 1.0 and m["ratio_max"] == 1.0  # POIS: π_old is this very policy
    assert m["clip_fraction_low"] == 0.0 and m["clip_fraction_high"] == 0.0
    assert m["updates"] == 1 and m["skipped"] == 0 and dense_learner.step == step0 + 1
    assert m["tokens"] == sum(len(s.response_ids) for s in samples)
    assert 0.0 <= m["padding_fraction"] < 1.0 and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert m["logprob_mismatch_tokens"] == m["tokens"] and m["logprob_mismatch_mean_abs"] > 0
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(_host(dense_learner.params)))]
    assert all(changed)
    # Same policy, second call: the mismatch against the rollout log-probs is recomputed, the ratio is 1 again.
    m2 = dense_learner.update(samples)
    assert m2["ratio_max"] == 1.0 and m2["logprob_mismatch_mean_abs"] != m["logprob_mismatch_mean_abs"]


def test_non_finite_step_is_skipped_inside_jit(dense_learner, caplog):
    _, batch = dense_learner.pack(random_samples(2, 4))
    batch["old_from_current"] = np.asarray(True)
    batch["advantages"] = batch["advantages"].copy()
    batch["advantages"][batch["response_mask"] > 0] = np.nan  # injected past host validation
    before_params, before_opt = _host(dense_learner.params), _host(dense_learner.opt_state)
    step0 = dense_learner.step
    with caplog.at_level("WARNING"):
        m = dense_learner.apply(batch)
    assert m["skipped"] == 1.0 and not np.isfinite(m["loss"])
    assert dense_learner.step == step0 and "left unchanged" in caplog.text
    assert_trees_close(dense_learner.params, before_params, 0, 0, "params")
    assert_trees_close(dense_learner.opt_state, before_opt, 0, 0, "opt_state")
    ok = dense_learner.update(random_samples(2, 4))  # and the learner carries on
    assert ok["skipped"] == 0 and dense_learner.step == step0 + 1


def test_jit_cache_stays_small_and_state_round_trips(dense_learner):
    for seed, n in enumerate([3, 4, 5, 6, 7]):  # varying sample counts -> few shape buckets
        dense_learner.update(random_samples(10 + seed, n))
    # Buckets: rows (a power of two) x sample slots (a power of two); here at most 2 x 2.
    seen = dense_learner.jit_cache_sizes()["train"]
    assert seen <= 4
    for seed, n in reversed(list(enumerate([3, 4, 5, 6, 7]))):  # seen buckets, new params: no recompile
        dense_learner.update(random_samples(10 + seed, n))
    assert dense_learner.jit_cache_sizes()["train"] == seen

    saved = _host(dense_learner.state_dict())
    other = Learner(init_model(tiny_config("qwen3", **DENSE), seed=99), small_config())
    other.load_state_dict(saved)
    assert other.step == dense_learner.step
    samples = random_samples(20, 5)
    m1, m2 = dense_learner.update(samples), other.update(samples)
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    assert_trees_close(dense_learner.params, other.params, 0, 0, "params after restore + update")
    with pytest.raises(ValueError, match="lacks 'opt_state'"):
        other.load_state_dict({"params": saved["params"], "step": 1})


def test_placed_batch_is_not_put_again_and_applies_the_same(dense_learner):
    """`update` places a batch once and `apply` takes it as it is; a numpy batch gives the same update."""
    samples = random_samples(31, 4)
    _, batch = dense_learner.pack(samples)
    batch["old_from_current"] = np.asarray(True)
    placed = dense_learner.put_batch(batch)
    assert dense_learner.put_batch(placed) is placed
    assert all(isinstance(v, jax.Array) for v in placed.values())
    start = _host(dense_learner.state_dict())
    from_numpy = dense_learner.apply(batch)
    params_numpy = _host(dense_learner.params)
    dense_learner.load_state_dict(start)
    from_placed = dense_learner.apply(placed)
    assert from_placed == from_numpy
    assert_trees_close(dense_learner.params, params_numpy, 0, 0, "params after a placed vs a numpy batch")
    assert not np.allclose(jax.tree.leaves(params_numpy)[0], jax.tree.leaves(start["params"])[0])  # it moved


def test_sft_update_lowers_nll(dense_learner):
    samples = random_samples(5, 4)
    first = dense_learner.sft_update(samples)
    for _ in range(15):
        last = dense_learner.sft_update(samples)
    assert last["loss"] < first["loss"] - 0.5 and last["nll"] == pytest.approx(last["loss"], rel=1e-4)


@pytest.mark.slow
def test_mean_entropy_equals_numpy_softmax_entropy(dense_learner):
    """Learner.mean_entropy == mean over response tokens of -sum p log p from the model's own logits."""
    from flax import nnx

    samples = random_samples(7, 5, logprobs=False)
    model = nnx.merge(dense_learner.graphdef, dense_learner.params, dense_learner._other)
    total, count = 0.0, 0
    for s in samples:
        tokens = np.asarray([s.prompt_ids + s.response_ids])
        logits = np.asarray(model(jnp.asarray(tokens)), np.float64)[0]  # [T, V]
        logits -= logits.max(-1, keepdims=True)
        p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        h = -(p * np.log(p)).sum(-1)  # entropy of the distribution that predicts token t + 1
        total += h[len(s.prompt_ids) - 1:tokens.shape[1] - 1].sum()
        count += len(s.response_ids)
    assert dense_learner.mean_entropy(samples) == pytest.approx(total / count, rel=1e-4)


def test_several_mini_batches_and_epochs():
    """POIS recomputes π_old once: the first update still has ratio 1; later ones move away from it."""
    learner = Learner(init_model(tiny_config("qwen3", **DENSE), seed=0),
                      small_config(ppo_mini_batch_size=3, ppo_epochs=2))
    m = learner.update(random_samples(3, 6))
    assert m["updates"] == 4 and learner.step == 4
    assert m["ratio_max"] > 1.0  # later updates see a moved policy
    assert m["logprob_mismatch_tokens"] == m["tokens"]


@pytest.mark.slow
def test_accumulation_over_micro_batches_equals_one_big_batch():
    rng = np.random.default_rng(7)  # 8 samples of 8 tokens -> 4 full rows of 16 (two samples per row)
    samples = [TrainSample(rng.integers(0, VOCAB, 2).tolist(), rng.integers(0, VOCAB, 6).tolist(),
                           float(rng.normal()), float(i % 2), (-rng.uniform(0.5, 4, 6)).tolist()) for i in range(8)]
    model = init_model(tiny_config("qwen3", **DENSE), seed=0)
    big = Learner(model, small_config(micro_batch_rows=4))
    small = Learner(model, small_config(micro_batch_rows=1))
    assert big.pack(samples)[1]["tokens"].shape[:2] == (1, 4)
    assert small.pack(samples)[1]["tokens"].shape[:2] == (4, 1)
    loss_b, grads_b = big.gradients(samples)
    loss_s, grads_s = small.gradients(samples)
    np.testing.assert_allclose(loss_s, loss_b, rtol=1e-6)
    assert_trees_close(grads_s, grads_b, 1e-5, 1e-7, "grads")
    mb, ms = big.update(samples), small.update(samples)
    assert mb["tokens"] == ms["tokens"] and mb["masked_fraction"] == ms["masked_fraction"]
    np.testing.assert_allclose(ms["grad_norm"], mb["grad_norm"], rtol=1e-5)
    assert_trees_close(small.params, big.params, 1e-5, 1e-6, "params")


# ---------------------------------------------------------------------------
# Sharded == single device (8 fake CPU devices)
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
def test_sharded_step_equals_single_device():
    cfg = tiny_config("qwen3_moe", vocab_size=VOCAB, hidden_size=32, head_dim=8, num_experts=8,
                      num_hidden_layers=1, moe_intermediate_size=16)
    model = init_model(cfg, seed=5)
    samples = random_samples(8, 20)
    conf = small_config(micro_batch_rows=8, aux_loss_coef=0.01, mask_mode="mpt", tau=0.02)
    ref = Learner(model, conf)
    assert ref.pack(samples)[1]["tokens"].shape[0] == 2  # two micro-batches of 8 rows
    # The gradients themselves: the AdamW step below is close to lr x sign(g) and would hide a gradient
    # scaled wrongly on some shard.
    loss_ref, g_ref = ref.gradients(samples)
    g_scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g_ref))
    m_ref = ref.update(samples)
    assert m_ref["masked_fraction"] > 0 and m_ref["aux_loss"] > 0
    # Tolerance: same math, different reduction order across shards (float32). Gradients alone on a
    # data / fsdp / expert mesh: test_moe_parallel.py; here the whole update (loss, grad norm, AdamW).
    for mesh_cfg in (MeshConfig(fsdp=8), MeshConfig(fsdp=2, expert=4)):
        mesh = make_mesh(mesh_cfg)
        sharded = Learner(model, conf, mesh)
        assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(sharded.params))
        loss, grads = sharded.gradients(samples)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, err_msg=f"loss {mesh_cfg}")
        assert_trees_close(grads, g_ref, 1e-4, 1e-5 * g_scale, f"gradients {mesh_cfg}")
        m = sharded.update(samples)
        for key in ("loss", "grad_norm", "masked_fraction", "entropy", "aux_loss"):
            np.testing.assert_allclose(m[key], m_ref[key], rtol=1e-4, err_msg=f"{key} {mesh_cfg}")
        # Adam divides each gradient element by its own magnitude, so float32 rounding of a near-zero
        # gradient can move that element's step by a fraction of lr (1e-2): params get atol 2e-5 (0.2% of lr).
        assert_trees_close(sharded.params, ref.params, 1e-4, 2e-5, f"params {mesh_cfg}")
