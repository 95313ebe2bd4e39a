"""Multi-process JAX: 2 processes on 127.0.0.1 (4 fake CPU devices each) against one 8-device process.

The workers are this file run as a script (`python tests/test_distributed.py worker ...`): each joins
`jax.distributed` through `ulorl_jax.distributed.initialize` (gloo CPU collectives), builds the same
learner over the global 8-device mesh and takes one step, and decodes its share of the prompts with
`DistributedRollout`. The test compares both with the same work done here, in one process with the
8 fake devices of conftest. The end-to-end test runs `ulorl train --coordinator ...` in 2 processes
(2 RL steps, then `--resume` for a third) against one 8-device `ulorl train` of 3 steps.
Bounded: every subprocess has a timeout and is killed on failure.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
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
    from ulorl_jax.types import PromptItem

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


def _segment_rollout():
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import SamplingParams
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout

    model = init_model(tiny_config("qwen3", **MODEL_KW), seed=0)
    engine = PolicyEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_cache_len=16)
    cfg = RolloutConfig(global_max_len=MAX_LEN, num_segments=2, samples_per_prompt=N, max_prompt_len=8,
                        sampling=SamplingParams(temperature=1.0))
    return SegmentRollout(engine, cfg, length_oracle=lambda s: 2 + (s.uid * 5) % 9)


def _rollout(process_index=None, process_count=None):
    import jax

    from ulorl_jax.rollout.distributed import DistributedRollout

    rollout = _segment_rollout()
    engine = rollout.engine
    dist = DistributedRollout(rollout, process_index, process_count)
    ended = []
    for step in range(3):  # with 2 segments of 4 tokens, every sample ends within 2 steps
        report = dist.step(engine.load_params(), _prompts() if step == 0 else [], 0, jax.random.PRNGKey(7 + step))
        assert [s.uid for s in report.ended] == sorted(s.uid for s in report.ended)
        ended += report.ended
    assert len(dist.experience_pool) == len(ended)  # global: every process holds every ended sample
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


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Outputs of `procs` (stdout+stderr) once all exit within `timeout_s`; all are killed on a timeout."""
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return logs


def _assert_ok(procs: list[subprocess.Popen], logs: list[str], names: list[str]) -> None:
    for name, p, log in zip(names, procs, logs):
        assert p.returncode == 0, f"{name} failed (rc {p.returncode}):\n{log[-3000:]}"


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
    names = ["worker 0", "worker 1"]
    _assert_ok(procs, _wait(procs, TIMEOUT_S), names)

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


# `ulorl train` end to end: the tiny synthetic run (1 layer: less to compile) on a mesh over all 8 devices;
# 2 segments and 2 rollout rounds per step, so step 1 already trains complete groups and every checkpoint
# holds carried-over samples on both processes.
TRAIN_OVERRIDES = ["model.arch.num_hidden_layers=1", "mesh.fsdp=-1", "trainer.micro_batch_rows=8",
                   "rollout.num_segments=2", "trainer.dynamic_sampling_max_rounds=2", "rollout.prefill_buckets=[44]",
                   "checkpoint.save_every=1", "checkpoint.keep_last=3"]
TRAIN_TIMEOUT_S = 400  # per launch of 3 processes; well above the measured time: a hang is killed


def _train(run_dir, steps: int, env: dict, *, devices: int, process_id: int | None = None,
           coordinator: str | None = None, resume: bool = False) -> subprocess.Popen:
    """`ulorl train` of the tiny run for `steps` RL steps as a child with `devices` fake CPU devices
    (with `process_id`: one of 2 processes joined through `coordinator`)."""
    from trainer_utils import MOVING, TINY, train_command

    cmd = train_command(run_dir, TINY + MOVING + TRAIN_OVERRIDES + [f"trainer.total_steps={steps}"], resume=resume)
    if resume:  # the run's own config, as a resumed run is started (README), not the shipped tiny_cpu
        cmd[cmd.index("--config") + 1] = str(Path(run_dir) / "config.yaml")
    if process_id is not None:
        cmd += ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(process_id)]
    env = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_processes(run_dir, steps: int, env: dict, resume: bool = False) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{_free_port()}"
    return [_train(run_dir, steps, env, devices=4, process_id=i, coordinator=coordinator, resume=resume)
            for i in range(2)]


@functools.cache
def _initial_params():
    """The run's params before training (nnx.State): the restore template of its checkpoints."""
    from flax import nnx
    from trainer_utils import MOVING, tiny_config

    from ulorl_jax.model_source import build_tokenizer
    from ulorl_jax.rl.build import build_model

    cfg = tiny_config(*MOVING, *TRAIN_OVERRIDES)
    return nnx.state(build_model(cfg, build_tokenizer(cfg), seed=cfg.trainer.seed), nnx.Param)


def _checkpoint(run_dir, step: int, item: str = "params") -> tuple[list[np.ndarray], dict]:
    """(leaves of `item`: params or opt_state, run meta) of checkpoint `step`."""
    import jax
    import optax
    from trainer_utils import MOVING, leaves, tiny_config

    from ulorl_jax.checkpoint import TrainCheckpointer
    from ulorl_jax.rl.build import learner_config
    from ulorl_jax.rl.learner import make_optimizer

    target = _initial_params()
    if item == "opt_state":
        tx: optax.GradientTransformation = make_optimizer(learner_config(tiny_config(*MOVING, *TRAIN_OVERRIDES)))
        target = jax.eval_shape(tx.init, target)
    with TrainCheckpointer(Path(run_dir) / "checkpoints", async_save=False) as ckpt:
        return leaves(ckpt.restore_tree(step, item, target)), ckpt.read_meta(step)["user"]


def _assert_same_run(two, one, step: int) -> None:
    """Checkpoint `step` of the 2-process run equals the 1-process run's: params within 1e-5 (gloo and
    in-process all-reduces sum in different orders), the optimizer's moments (running means of the gradient
    and its square: AdamW's step is close to lr x sign(g), so equal params alone would not show a gradient
    summed wrongly across processes) within 1e-4 of their scale, the same carried-over samples, split by
    process."""
    (got, meta2), (ref, meta1) = _checkpoint(two, step), _checkpoint(one, step)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    moments, ref_moments = _checkpoint(two, step, "opt_state")[0], _checkpoint(one, step, "opt_state")[0]
    assert any(np.abs(m).max() > 0 for m in ref_moments if m.size > 1), "the optimizer state is all zero"
    for a, b in zip(moments, ref_moments, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(float(np.abs(b).max()), 1e-30))
    pools = meta2["rollout"]["unfinished_pools"]
    assert len(pools) == 2 and all(pools), "each process carries its own samples over"
    _assert_same_samples(sorted((d for p in pools for d in p), key=lambda d: d["uid"]),
                         sorted(meta1["rollout"]["unfinished_pool"], key=lambda d: d["uid"]))
    _assert_same_samples(meta2["rollout"]["experience_pool"], meta1["rollout"]["experience_pool"])
    assert meta2["process_count"] == 2 and meta1["process_count"] == 1


def _assert_same_samples(got: list[dict], ref: list[dict]) -> None:
    """Same samples (Sample.to_dict), log-probs within 1e-5: one process decodes with the learner's sharded
    params, each of the 2 with a whole local copy, and XLA may order a sharded reduction differently."""
    strip = lambda d: {k: v for k, v in d.items() if k != "logprobs"}  # noqa: E731
    assert [strip(d) for d in got] == [strip(d) for d in ref]
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def two_step_runs(tmp_path_factory):
    """(2-process run folder after 2 steps, 1-process run folder after 3 steps, child env), run side by side."""
    from trainer_utils import subprocess_env

    root = tmp_path_factory.mktemp("train")
    env = subprocess_env(compile_cache=root / "xla-cache")  # a resumed run reuses its first run's executables
    two, one = root / "two", root / "one"
    procs = _two_processes(two, 2, env) + [_train(one, 3, env, devices=8)]
    _assert_ok(procs, _wait(procs, TRAIN_TIMEOUT_S), ["process 0", "process 1", "one process"])
    return two, one, env


@pytest.mark.slow
def test_train_two_processes_equals_one_process(two_step_runs):
    """`ulorl train` in 2 processes x 4 devices, 2 RL steps == the same run in 1 process x 8 devices; each
    process decodes on all 4 of its devices (rollout.decode_mesh=auto: replicate), the one process on the
    learner's 8."""
    from trainer_utils import leaves

    from ulorl_jax.metrics import read_metrics

    two, one, _ = two_step_runs
    lines, ref = read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2], "metrics.jsonl is written by process 0 alone"
    assert [r["decode_devices"] for r in lines] == [8, 8], "4 devices with distinct slots per process, 2 processes"
    assert [r["decode_devices"] for r in ref] == [8, 8, 8]
    assert all(r["trained_uids"] for r in lines)
    assert [r["trained_uids"] for r in lines] == [r["trained_uids"] for r in ref[:2]]
    assert not list(two.glob("*.tmp")) and (two / "config.yaml").exists()
    _assert_same_run(two, one, 2)
    moved = [float(np.abs(a - b).max()) for a, b in zip(_checkpoint(one, 2)[0], leaves(_initial_params()))]
    assert max(moved) > 1e-3, f"two RL steps moved no weight ({max(moved)}): the comparison would be empty"


@pytest.mark.slow
def test_train_two_processes_resume(two_step_runs, tmp_path):
    """2 steps + `--resume` for 1 in 2 processes == 3 straight steps in 1 process; a resume in 1 process
    of the 2-process checkpoint is refused, naming both counts."""
    from ulorl_jax.metrics import read_metrics

    first, one, env = two_step_runs
    two, refused = tmp_path / "two", tmp_path / "refused"
    shutil.copytree(first, two)
    shutil.copytree(first, refused)
    procs = _two_processes(two, 3, env, resume=True) + [_train(refused, 3, env, devices=1, resume=True)]
    logs = _wait(procs, TRAIN_TIMEOUT_S)
    _assert_ok(procs[:2], logs[:2], ["process 0", "process 1"])
    assert procs[2].returncode == 2, logs[2][-3000:]
    assert "written by 2 process(es) but this run has 1" in logs[2] and "--num-processes 2" in logs[2]

    lines, ref = read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert [r["trained_uids"] for r in lines] == [r["trained_uids"] for r in ref]
    _assert_same_run(two, one, 3)


def test_rollout_state_resumes_each_process_pool():
    """Process i of a resumed run takes unfinished pool i; a state saved by another process count is refused."""
    from ulorl_jax.rollout.distributed import DistributedRollout
    from ulorl_jax.types import Sample

    pools = [[Sample(uid, uid // N, uid % N, [1, 2], [3], [-0.5], [0], 1).to_dict() for uid in uids]
             for uids in ([0, 1], [2, 3, 4])]
    ended = Sample(5, 2, 1, [1, 2], [3, 4], [-0.5, -0.25], [0, 0], 1, "eos").to_dict()
    state = {"unfinished_pools": pools, "experience_pool": [ended], "next_uid": 6, "steps_done": 1}
    rollout = _segment_rollout()
    dist = DistributedRollout(rollout, process_index=1, process_count=2)
    dist.load_state_dict(state)
    assert [s.uid for s in rollout.unfinished_pool] == [2, 3, 4] and not rollout.experience_pool.samples
    assert [s.to_dict() for s in dist.experience_pool.samples] == [ended]
    assert (dist.next_uid, rollout.steps_done) == (6, 1)
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) but this run has 3.*--num-processes 2"):
        DistributedRollout(rollout, process_index=0, process_count=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved by 1 process\(es\) but this run has 2"):
        DistributedRollout(rollout, process_index=0, process_count=2).load_state_dict(rollout.state_dict())


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
