"""Memory checks before allocating (memory.py): the KV cache figure equals the engine's real cache, the
per-device sums follow the layouts, and a run that cannot fit is refused before its folder exists."""

from __future__ import annotations

import jax
import pytest

from trainer_utils import tiny_config
from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.memory import TrainMemory, check_train_memory, kv_cache_bytes, train_memory
from ulorl_jax.models import init_model
from ulorl_jax.models import tiny_config as tiny_model_config


def test_kv_cache_bytes_equal_the_engines_cache():
    cfg = tiny_model_config("qwen3", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    engine = PolicyEngine(init_model(cfg), max_concurrent_decodes=3, max_prefill_length=8, max_cache_len=24)
    cache = engine.init_decode_state().cache
    assert kv_cache_bytes(cfg, 3, 24) == sum(x.nbytes for x in jax.tree.leaves(cache) if x.ndim >= 3)


def test_train_memory_per_device_by_layout():
    cfg = tiny_model_config("qwen3", num_hidden_layers=2, num_key_value_heads=2, head_dim=8)
    kv = 8 * 100 * 2 * 2 * 2 * 8 * 4  # slots x positions x layers x (K, V) x kv heads x head_dim x f32
    assert kv_cache_bytes(cfg, 8, 100) == kv
    w = 4096
    for kind, devices, rollout in (("learner", 4, 0), ("replicate", 4, w), ("shard", 4, w // 4),
                                   ("first_device", 1, w)):
        m = train_memory(cfg, w, learner_shards=4, decode_kind=kind, decode_devices=devices, slots=8, max_len=100,
                         shared_host=False)
        assert (m.learner, m.rollout_weights, m.kv_cache) == (4 * w // 4, rollout, kv // devices), kind
    with pytest.raises(ValueError, match=r"needs 15 B.*allows 12 B: lower rollout\.max_concurrent_decodes"):
        check_train_memory(TrainMemory(10, 0, 5), 12, "--max-memory", slots=8, max_len=100)
    check_train_memory(TrainMemory(10, 0, 2), 12, "--max-memory", slots=8, max_len=100)  # fits: no error


def test_train_refuses_a_run_that_cannot_fit_before_creating_its_folder(tmp_path, capsys):
    from ulorl_jax.cli import main
    from ulorl_jax.rl.trainer import Trainer

    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"decode KV cache .* for 8 slots x 44 positions\) but --max-memory allows"):
        Trainer(tiny_config("trainer.total_steps=1"), run, max_memory_gb=1e-4)
    assert not run.exists()
    from trainer_utils import TINY

    assert main(["train", "--config", "tiny_cpu", "--run-dir", str(run), "--max-memory", "0.0001", *TINY]) == 2
    assert "raise --max-memory" in capsys.readouterr().err and not run.exists()
