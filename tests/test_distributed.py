"""Multi-process JAX: 2 processes on 127.0.0.1 (4 fake CPU devices each) against one 8-device process.

The workers are this file run as a script (`python tests/test_distributed.py worker ...`): each joins
`jax.distributed` through `ulorl_jax.distributed.initialize` (gloo CPU collectives), builds the same
learner over the global 8-device mesh and takes one step, and decodes its share of the prompts with
`DistributedRollout`. The test compares both with the same work done here, in one process with the
8 fake devices of conftest. Bounded: every subprocess has a timeout and is killed on failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

MODEL_KW = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16)
N_PROMPTS, N, MAX_LEN = 4, 2, 8
TIMEOUT_S = 150


def _samples():
    from ulorl_jax.rl.packing import TrainSample

    rng = np.random.default_rng(0)
    out = []
    for i in range(8):
        p, o = int(rng.integers(2, 6)), int(rng.integers(3, 10))
        out.append(TrainSample(rng.integers(1, 64, p).tolist(), rng.integers(1, 64, o).tolist(),
                               float(rng.normal()), float(i % 2)))
    return out


def _prompts():
    from ulorl_jax.decode.segment import PromptItem

    rng = np.random.default_rng(1)
    return [PromptItem(i, rng.integers(1, 64, 3 + i).tolist()) for i in range(N_PROMPTS)]


def _learner_result(mesh):
    """One update on the fsdp=8 mesh; params gathered to host."""
    import jax
    from jax.experimental import multihost_utils

    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rl.learner import Learner, LearnerConfig

    learner = Learner(init_model(tiny_config("qwen3", **MODEL_KW), seed=0),
                      LearnerConfig(row_len=16, micro_batch_rows=8, logprob_chunk=16, lr=1e-2), mesh)
    metrics = learner.update(_samples())
    leaves = jax.tree.leaves(learner.params)
    if jax.process_count() > 1:
        leaves = [multihost_utils.process_allgather(x, tiled=True) for x in leaves]
    return metrics, [np.asarray(x) for x in leaves]


def _rollout(process_index=None, process_count=None):
    import jax

    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import SamplingParams
    from ulorl_jax.decode.segment import RolloutConfig, SegmentRollout
    from ulorl_jax.distributed import DistributedRollout
    from ulorl_jax.models import init_model, tiny_config

    model = init_model(tiny_config("qwen3", **MODEL_KW), seed=0)
    engine = PolicyEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_cache_len=16)
    cfg = RolloutConfig(global_max_len=MAX_LEN, num_segments=2, samples_per_prompt=N, max_prompt_len=8,
                        sampling=SamplingParams(temperature=1.0))
    rollout = SegmentRollout(engine, cfg, length_oracle=lambda s: 2 + (s.uid * 5) % 9)
    dist = DistributedRollout(rollout, process_index, process_count)
    ended = []
    for step in range(3):  # with 2 segments of 4 tokens, every sample ends within 2 steps
        ended += dist.step(engine.load_params(), _prompts() if step == 0 else [], 0, jax.random.PRNGKey(7 + step))
    return [(s.uid, s.prompt_index, s.response_ids, s.finish_reason, s.segments) for s in sorted(ended,
                                                                                               key=lambda s: s.uid)]


def _worker(coordinator: str, process_id: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ulorl_jax.distributed import initialize

    assert initialize(coordinator, 2, process_id, timeout_s=60)
    import jax

    from ulorl_jax.sharding import MeshConfig, make_mesh

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    metrics, leaves = _learner_result(make_mesh(MeshConfig(fsdp=8)))
    samples = _rollout()
    if process_id == 0:
        np.savez(out + ".npz", *leaves)
        Path(out + ".json").write_text(json.dumps({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                                                   "samples": samples}))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    import jax

    from ulorl_jax.sharding import MeshConfig, make_mesh

    coordinator = f"127.0.0.1:{_free_port()}"
    out = str(tmp_path / "p0")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, __file__, "worker", coordinator, str(i), out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {i} failed (rc {p.returncode}):\n{log[-3000:]}"

    # The same learner step on one process with 8 devices.
    assert jax.device_count() == 8
    metrics, leaves = _learner_result(make_mesh(MeshConfig(fsdp=8)))
    got = json.loads(Path(out + ".json").read_text())
    other = np.load(out + ".npz")
    assert got["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert len(other.files) == len(leaves)
    for i, ref in enumerate(leaves):
        # AdamW at lr 1e-2 moves each weight by ~1e-2; gloo and in-process all-reduces sum in different
        # orders, and Adam's m / sqrt(v) amplifies that rounding where a gradient is near 0: allow 1e-3 of a step.
        np.testing.assert_allclose(other[f"arr_{i}"], ref, rtol=1e-5, atol=1e-5)

    # The rollout: 2 processes, each with half the prompts, gathered == one process with all of them.
    ref_samples = [list(x) for x in _rollout(0, 1)]
    assert [list(x) for x in got["samples"]] == ref_samples
    assert len(ref_samples) == N_PROMPTS * N


def test_flags_are_validated():
    from ulorl_jax.distributed import check_arguments, shard_bounds

    assert check_arguments(None, None, None) is False
    with pytest.raises(ValueError, match="missing"):
        check_arguments("127.0.0.1:1234", 2, None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_arguments("localhost", 2, 0)
    with pytest.raises(ValueError, match="--process-id"):
        check_arguments("127.0.0.1:1234", 2, 2)
    assert [shard_bounds(5, i, 2) for i in range(2)] == [(0, 3), (3, 5)]
    assert [shard_bounds(4, i, 3) for i in range(3)] == [(0, 2), (2, 3), (3, 4)]


def test_train_parser_has_the_flags():
    from ulorl_jax.cli import build_parser

    args = build_parser().parse_args(["train", "--config", "tiny_cpu", "--run-dir", "x", "--coordinator",
                                      "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1"])
    assert (args.coordinator, args.num_processes, args.process_id) == ("127.0.0.1:1234", 2, 1)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
