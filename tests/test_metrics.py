"""Metrics: JSONL per step (flushed, resume without duplicates), TensorBoard events, wandb guard, progress line."""

from __future__ import annotations

import io
import json
import struct
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.metrics import MetricsWriter, ProgressDisplay, read_metrics


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file under `folder`, parsed from the TFRecord framing by hand."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])  # skip length + its crc
            pos += 12 + length + 4  # record + its crc
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_one_flushed_json_line_per_step_with_array_values(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(0, {"reward_mean": np.float32(0.25), "entropy": jnp.asarray(0.5), "pool_unfinished": np.int64(3),
                     "response_lengths": np.array([4, 7]), "loss": float("nan"), "note": "warmup"})
    records = _lines(tmp_path / "metrics.jsonl")  # read before close: flushed per step
    assert records[0]["step"] == 0 and records[0]["reward_mean"] == 0.25 and records[0]["entropy"] == 0.5
    assert records[0]["pool_unfinished"] == 3 and records[0]["response_lengths"] == [4, 7]
    assert records[0]["loss"] is None and records[0]["note"] == "warmup"
    writer.write(1, {"reward_mean": 0.5})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_resume_drops_steps_at_and_after_the_resume_step(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in range(6):
            writer.write(step, {"reward_mean": step / 10})
    # Resumed from the checkpoint of step 3: steps 3.. are replayed.
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as writer:
        assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        for step in range(3, 5):
            writer.write(step, {"reward_mean": 1.0})
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["reward_mean"] for r in records] == [0.0, 0.1, 0.2, 1.0, 1.0]


def test_torn_last_line_is_ignored(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1, "x"')
    assert read_metrics(tmp_path) == [{"step": 0, "x": 1}]
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=1):
        pass
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 1}]


def test_missing_metrics_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_tensorboard_events_hold_the_numeric_scalars(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.write(1, {"reward_mean": 0.25, "entropy": 0.75, "flag": True, "note": "x", "lengths": [1, 2]})
        writer.write(2, {"reward_mean": 0.5})
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["entropy"] == [(1, 0.75)]
    assert not {"flag", "note", "lengths", "time"} & set(scalars)


def test_wandb_requested_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match=r"logging\.wandb=true but the wandb package is not installed"):
        MetricsWriter(tmp_path, tensorboard=False, wandb=True)


def test_progress_plain_line_per_step_when_not_a_tty():
    stream = io.StringIO()
    with ProgressDisplay(10, start_step=2, stream=stream) as progress:
        progress.update(3, {"reward_mean": 0.5, "eval_accuracy": None, "entropy": 0.21,
                            "pool_unfinished": 4, "pool_experience": 12})
        progress.update(4, {"reward_mean": 0.625})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/10  reward 0.500  entropy 0.210  unfinished 4  experience 12  eta ")
    assert lines[1].startswith("step 4/10  reward 0.625  eta ")


def test_progress_eta_leaves_out_the_first_step(monkeypatch):
    """The first step carries the compiles; the ETA is the later steps' rate times the steps left."""
    import ulorl_jax.metrics as metrics_module

    now = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: now[0])
    stream = io.StringIO()
    with ProgressDisplay(10, stream=stream) as progress:
        for step, t in ((1, 60.0), (2, 62.0), (3, 64.0), (4, 70.0)):  # 60 s of compiles, then 2, 2, 6 s
            now[0] = t
            progress.update(step, {})
    etas = [line.split("eta ")[1] for line in stream.getvalue().splitlines()]
    assert etas == ["-", "00:16", "00:14", "00:20"]  # (62-60)/1*8, (64-60)/2*7, (70-60)/3*6


def test_progress_live_display_runs():
    stream = io.StringIO()
    with ProgressDisplay(4, stream=stream, live=True) as progress:
        for step in range(1, 5):
            progress.update(step, {"reward_mean": step / 4, "entropy": 0.3})
    assert "4/4" in stream.getvalue() and "reward 1.000" in stream.getvalue()
