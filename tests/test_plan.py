"""`ulorl plan`: abstract lowering / compiling on the 8 fake CPU devices of conftest, the layer
extrapolation against a full compile, and the memory figure against the measured peak of a real step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ulorl_jax.config import load_config

TINY = ["model.arch.num_hidden_layers=3", "model.arch.vocab_size=256", "data.max_prompt_len=16",
        "rollout.global_max_len=48", "trainer.micro_batch_rows=8", "mesh.fsdp=-1"]


@pytest.mark.slow
def test_small_config_extrapolation_matches_full_compile():
    """Compile 1 and 2 layers, extrapolate to 3; compile all 3: the figures agree."""
    from ulorl_jax.plan import plan

    cfg = load_config("tiny_cpu", TINY)
    ext = plan(cfg, 8, layers="1,2", skip_decode=False)
    full = plan(cfg, 8, layers="full", skip_decode=False)
    assert ext["extrapolated"] and not full["extrapolated"]
    assert ext["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    for step in ("train", "decode"):
        e, f = ext[step], full[step]
        assert e["argument_bytes"] == pytest.approx(f["argument_bytes"], rel=0.02)
        assert e["peak_bytes"] == pytest.approx(f["peak_bytes"], rel=0.15), step
        assert e["param_bytes"] == f["param_bytes"]  # exactly linear in layers
    assert full["train"]["fits"] and full["fits"]
    # The train step's arguments hold params + AdamW (m, v) per device: about 3x the sharded params.
    t = full["train"]
    assert t["param_bytes"] + t["optimizer_bytes"] <= t["argument_bytes"] <= 1.2 * (t["param_bytes"] +
                                                                                   t["optimizer_bytes"]) + 2**20


def test_qwen3_4b_on_a_fake_mesh_lowered(capsys):
    """The real 4B shapes, fsdp over 8 fake devices: lowering only (seconds), nothing allocated."""
    from ulorl_jax.cli import main

    rc = main(["plan", "--config", "qwen3_4b", "--devices", "8", "--lower-only", "--seq-len", "256",
               "--decode-cache-len", "256", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["compiled"] is False and r["mesh"]["fsdp"] == 8
    params = r["model"]["params"]
    assert 3.9e9 < params < 4.1e9  # Qwen3-4B (tied embeddings)
    # f32 master weights sharded 8 ways, AdamW m and v the same again each.
    assert r["train"]["param_bytes"] == pytest.approx(params * 4 / 8, rel=0.01)
    assert r["train"]["optimizer_bytes"] == pytest.approx(2 * params * 4 / 8, rel=0.01)
    assert r["train"]["fits"]


def test_plan_rejects_too_many_devices():
    from ulorl_jax.cli import main

    assert main(["plan", "--config", "tiny_cpu", "--devices", "16", "--lower-only"]) == 2


MEASURE = r"""
import json, sys
from ulorl_jax.models import tiny_config
from ulorl_jax.plan import compile_train_step, measure_train_step
from ulorl_jax.rl.learner import LearnerConfig
from ulorl_jax.sharding import make_mesh, MeshConfig
import jax
mc = tiny_config("qwen3", vocab_size=8192, hidden_size=64, num_hidden_layers=2, max_position_embeddings=4096)
out = {}
for scan in (False, True):  # unrolled layers, and the scanned layers of the shipped full-size configs
    lc = LearnerConfig(row_len=1024, micro_batch_rows=2, logprob_chunk=1024, remat="full", scan_layers=scan)
    planned = compile_train_step(mc, lc, make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1]), 2, 1024)
    out["scanned" if scan else "unrolled"] = {"planned": planned, "measured": measure_train_step(mc, lc, 2, 1024)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_memory_figure_within_factor_of_measured_peak():
    """Plan (abstract compile) vs the real step's peak RSS growth, in a fresh process whose allocator
    returns freed buffers to the OS (MALLOC_MMAP_THRESHOLD_), so RSS follows XLA's live buffers.
    Stated factor: the plan's transient bytes (temp + non-aliased outputs) are within 2x of the
    measured growth."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for layers, r in results.items():
        p, m = r["planned"], r["measured"]
        transient = p["temp_bytes"] + max(p["output_bytes"] - p["alias_bytes"], 0)
        assert p["temp_bytes"] == m["temp_bytes"], layers  # same program as the Learner's own jit
        assert transient > 20 * 2**20, layers  # big enough to stand out of RSS noise
        ratio = m["rss_growth_bytes"] / transient
        print(f"{layers}: planned transient {transient / 2**20:.1f} MiB, measured RSS growth "
              f"{m['rss_growth_bytes'] / 2**20:.1f} MiB, ratio {ratio:.2f}")
        assert 0.5 <= ratio <= 2.0, layers


@pytest.mark.parametrize("mesh_shape", [dict(data=4, fsdp=1, tensor=2), dict(data=2, fsdp=4)])
def test_decode_state_bytes_follow_the_engine_layout(mesh_shape):
    """`plan`'s decode-state bytes per device are those of the engine's own state on the same mesh
    (the KV cache split over slots and, with tensor > 1, over KV heads)."""
    import jax

    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.plan import compile_decode_step
    from ulorl_jax.sharding import MeshConfig, make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
    cfg = tiny_config("qwen3", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    mesh = make_mesh(MeshConfig(**mesh_shape))
    planned = compile_decode_step(cfg, mesh, slots=8, cache_len=32, compile=False)
    engine = PolicyEngine(init_model(cfg), max_concurrent_decodes=8, max_prefill_length=16, max_cache_len=32,
                          mesh=mesh)
    state = engine.init_decode_state()
    per_device = sum(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(state))
    whole = sum(x.nbytes for x in jax.tree.leaves(state))
    assert planned["decode_state_bytes"] == per_device < whole


def test_decode_concurrency_follows_the_plans_memory():
    """The KV budget is what the compiled plan leaves (capacity - learner params and AdamW - the decode
    step's working set); dense and paged in flight follow from it; the KV bytes per position assumed are
    those of the engine's own decode state on the same mesh."""
    from ulorl_jax.bench.kv_concurrency import DEFAULT_PAGE_SIZE, kv_bytes_per_token
    from ulorl_jax.plan import plan

    cfg = load_config("tiny_cpu", TINY)
    r = plan(cfg, 8, device_memory_gb=0.05, layers="full")
    c, t, d = r["decode_concurrency"], r["train"], r["decode"]
    working = d["temp_bytes"] + max(d["output_bytes"] - d["alias_bytes"], 0)
    assert c["decode_working_bytes"] == working > 0
    assert c["kv_budget_bytes"] == int(0.05e9) - t["param_bytes"] - t["optimizer_bytes"] - working > 0
    per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32
    assert c["kv_bytes_per_token"] == per_token == kv_bytes_per_token(cfg.model.model_config())
    assert c["max_len"] == d["cache_len"] == 16 + 48 and c["prompt_len"] == 16
    assert c["dense"] == c["kv_budget_bytes"] // (64 * per_token)
    assert c["page_size"] == (getattr(cfg.rollout, "page_size", None) or DEFAULT_PAGE_SIZE)
    assert c["paged"] == int(c["kv_budget_bytes"] // (c["page_size"] * per_token) // c["in_flight_pages"])
    assert c["dense_total"] == 8 * c["dense"] and c["paged_total"] == 8 * c["paged"]
    # One slot per device: the engine's decode state per device is that slot's KV (+ segment ids etc.).
    kv = d["slots"] // 8 * d["cache_len"] * per_token
    assert kv <= d["decode_state_bytes"] <= 1.05 * kv


def test_decode_concurrency_kv_heads_split_over_tensor():
    """mesh.tensor=2: the engine splits the 2 KV heads over it, so a position costs half on each device."""
    from ulorl_jax.plan import plan

    cfg = load_config("tiny_cpu", TINY + ["mesh.tensor=2"])
    r = plan(cfg, 8, device_memory_gb=0.05, compile=False, page_size=8)
    c, d = r["decode_concurrency"], r["decode"]
    assert c["kv_head_shards"] == 2 and c["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 4 // 2
    assert c["decode_working_bytes"] is None  # lowered only: not counted
    assert c["kv_budget_bytes"] == int(0.05e9) - r["train"]["param_bytes"] - r["train"]["optimizer_bytes"]
    assert c["page_size"] == 8 and c["paged"] >= c["dense"] > 0
    kv = d["slots"] // 4 * d["cache_len"] * c["kv_bytes_per_token"]  # slots over data x fsdp x expert = 4
    assert kv <= d["decode_state_bytes"] <= 1.1 * kv


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 16, 64])
def test_full_size_plan_prints_decode_concurrency(devices):
    """`ulorl plan` for Qwen3-30B-A3B at 128k on 8 / 16 / 64 H200s (141 GB): the decode-concurrency lines,
    their figures equal to the JSON's and to the hand formula. Lowered only (seconds, not the minutes of a
    full compile), so the KV memory is capacity - sharded params - AdamW moments."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "ulorl_jax.cli", "plan", "--config", "qwen3_30b_a3b_128k",
                          "--devices", str(devices), "--lower-only", "--page-size", "256", "--json"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    c, t = r["decode_concurrency"], r["train"]
    assert r["devices"] == devices and r["device_memory_gb"] == 141.0
    line = re.search(r"^decode concurrency, samples in flight per device: dense (\d+), paged (\d+) \(.*page 256\); "
                     r"all (\d+) devices: dense (\d+), paged (\d+);", out.stdout, re.M)
    assert line, out.stdout
    dense, paged = int(line[1]), int(line[2])
    assert (dense, paged, int(line[3])) == (c["dense"], c["paged"], devices)
    assert (int(line[4]), int(line[5])) == (devices * dense, devices * paged)
    budget = int(141e9 - t["param_bytes"] - t["optimizer_bytes"])
    assert c["kv_budget_bytes"] == budget
    assert c["kv_bytes_per_token"] == 48 * 2 * 4 * 128 * 2 and c["max_len"] == 2048 + 131072
    assert dense == budget // ((2048 + 131072) * 98304) >= 1
    assert paged == int(budget // (256 * 98304) // c["in_flight_pages"])
    assert paged > 2 * dense  # the long tail: a sample in flight holds ~39k of its 133k positions
    for text in ("KV memory", "learner params + AdamW moments", "98,304 B per position", "positions = ",
                 "lengths: 80% uniform in [1, 65536]"):
        assert text in out.stdout, text
