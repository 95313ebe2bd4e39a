"""Per-step metrics: `metrics.jsonl`, TensorBoard events, optional Weights & Biases; a progress line.

`MetricsWriter` appends one JSON object per RL step to `run_dir/metrics.jsonl`
(flushed every step, so a crash loses nothing already logged). A resumed run
opens the file with `resume_step=N`: lines with step >= N are dropped first,
so steps replayed after the restored checkpoint are not duplicated.

Metric names the progress line and `ulorl plot` read (write these from the trainer):
  reward_mean        mean reward of the samples trained on this step, in [0, 1]
  eval_accuracy      held-out avg@k accuracy (steps where an eval ran)
  eval_pass_at_K     held-out unbiased pass@K for K = 1, 2, 4, 8 up to k (same steps; rl/pass_at_k.py)
  entropy            mean per-sample entropy H̄ of the trained samples (ULORL.md §3)
  pool_unfinished    unfinished-pool size after the step's rollout (ULORL.md §1)
  pool_experience    experience-pool size
  response_length_mean / response_length_max   finished responses, tokens
  response_lengths   optional list: every finished response's length this step (histogram)
Any other numeric key is logged and charted in TensorBoard as is.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsWriter", "ProgressDisplay", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    """numpy / jax scalars and arrays -> Python numbers and lists; NaN/inf -> None (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy / jax arrays and scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl (a run folder or the file); a torn last line is ignored."""
    path = Path(path)
    if path.suffix != ".jsonl":  # a run folder
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {path.parent} a run folder?)")
    records = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
    return records


class MetricsWriter:
    """One JSON line per step, TensorBoard scalars (numbers only), optional wandb."""

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "ulorl", config: dict | None = None, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", -1) < resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)  # atomic: never a half-truncated file
        self._file: TextIO = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise ValueError("logging.wandb=true but the wandb package is not installed: pip install wandb, "
                                 "or set logging.wandb=false") from None
            self._wandb = wandb_lib.init(project=wandb_project, dir=str(self.run_dir), config=config,
                                         resume="allow")

    def write(self, step: int, metrics: dict[str, Any]) -> dict:
        """Log `metrics` for `step`; returns the JSON record written."""
        record = {"step": int(step), "time": time.time(), **_jsonable(metrics)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return record

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressDisplay:
    """Live status line for the trainer (rich) on a TTY; one plain line per step otherwise.

        with ProgressDisplay(total_steps, start_step=resumed) as progress:
            progress.update(step, {"reward": ..., "accuracy": ..., "entropy": ..., ...})
    """

    FIELDS = (("reward", "reward_mean", ".3f"), ("acc", "eval_accuracy", ".3f"), ("entropy", "entropy", ".3f"),
              ("unfinished", "pool_unfinished", "d"), ("experience", "pool_experience", "d"))

    def __init__(self, total_steps: int, start_step: int = 0, stream: TextIO | None = None,
                 live: bool | None = None):
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self._first: tuple[int, float] | None = None  # (step, time) the first update arrived
        self._progress = None
        self._last: dict = {}

    def __enter__(self) -> "ProgressDisplay":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]RL step"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                      console=Console(file=self.stream))
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start_step, status="")
        return self

    def status(self, metrics: dict) -> str:
        parts = []
        for label, key, spec in self.FIELDS:
            if key in metrics and metrics[key] is not None:
                value = metrics[key]
                parts.append(f"{label} {format(value, spec) if isinstance(value, (int, float)) else value}")
        return "  ".join(parts)

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the rate of the steps since the first update, or None before there is one.

        The first step of a run (or of a resume) carries the compiles, tens of times a later step on a
        CPU, so it is left out of the rate: counting it made the demo's first line say 2 hours, not 5 minutes.
        """
        if self._first is None or step <= self._first[0]:
            return None
        first_step, first_time = self._first
        return (time.perf_counter() - first_time) / (step - first_step) * (self.total - step)

    def update(self, step: int, metrics: dict) -> None:
        """Report that RL step `step` (1-based count of completed steps) finished with `metrics`."""
        self._last = metrics
        if self._first is None:
            self._first = (step, time.perf_counter())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=self.status(metrics))
            return
        eta = self.eta_s(step)
        line = f"step {step}/{self.total}  {self.status(metrics)}  eta {_eta(eta) if eta is not None else '-'}"
        print(line, file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
