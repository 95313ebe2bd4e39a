"""`ulorl plot RUN_DIR`: PNG charts of a run's metrics.jsonl into RUN_DIR/plots/.

Charts (each skipped with a message when its metrics are absent):
  reward.png           reward_mean and held-out eval_accuracy vs step
  entropy.png          entropy vs step with the DMMPT target σ (ULORL.md §3)
  response_length.png  histogram of response_lengths (last steps), else mean/max length vs step
  pools.png            unfinished / experience pool sizes vs step (ULORL.md §1)
`plot_compare` overlays one metric (entropy by default) of several runs, e.g. DMMPT vs no masking; runs
given the same label (seeds of one setting) become one mean line with their spread shaded.
Metric names are listed in ulorl_jax/metrics.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

import yaml

from ulorl_jax.metrics import read_metrics

__all__ = ["plot_run", "plot_compare", "group_curves", "run_sigma", "add_parser"]


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported on first use: `ulorl --help` stays fast)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where `key` is a number."""
    pairs = [(r["step"], r[key]) for r in records
             if "step" in r and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


SMOOTH = 10  # steps in the trailing mean drawn over noisy per-step curves


def _trailing_mean(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot_smoothed(ax, steps, values, label: str, color=None) -> None:
    """Raw per-step values faintly, their trailing mean on top (one legend entry)."""
    line, = ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
    ax.plot(steps, _trailing_mean(values), color=line.get_color(), label=f"{label} ({SMOOTH}-step mean)")


def run_sigma(run_dir: str | os.PathLike) -> float | None:
    """algorithm.sigma from RUN_DIR/config.yaml (the trainer saves the resolved config there), if present."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        sigma = (yaml.safe_load(path.read_text()) or {}).get("algorithm", {}).get("sigma")
    except (yaml.YAMLError, AttributeError):
        return None
    return float(sigma) if isinstance(sigma, (int, float)) else None


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_reward(records, out: Path):
    steps, reward = _series(records, "reward_mean")
    esteps, acc = _series(records, "eval_accuracy")
    if not steps and not esteps:
        return "reward.png skipped: no reward_mean or eval_accuracy in metrics"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(steps, reward, label="train reward (mean)", color="tab:blue", alpha=0.8)
    if esteps:
        ax.plot(esteps, acc, "o-", label="held-out accuracy (avg@k)", color="tab:green")
    ax.set(xlabel="RL step", ylabel="reward / accuracy", title="Reward and held-out accuracy", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "reward.png")


def _plot_entropy(records, out: Path, sigma: float | None):
    steps, entropy = _series(records, "entropy")
    if not steps:
        return "entropy.png skipped: no entropy in metrics"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot_smoothed(ax, steps, entropy, "entropy of trained samples", color="tab:purple")
    esteps, eentropy = _series(records, "eval_entropy")
    if esteps:
        ax.plot(esteps, eentropy, "o-", color="tab:green", label="entropy on held-out samples")
    if sigma is not None:
        _sigma_lines(ax, sigma, f"σ = {sigma:g} (DMMPT target)")
    ax.set(xlabel="RL step", ylabel="entropy (nats)", title="Policy entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "entropy.png")


def _plot_lengths(records, out: Path):
    lists = [(r["step"], r["response_lengths"]) for r in records
             if isinstance(r.get("response_lengths"), list) and r["response_lengths"]]
    if lists:
        last = lists[-max(1, len(lists) // 4):]  # the last quarter of the run
        lengths = [x for _, ls in last for x in ls if isinstance(x, (int, float))]
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color="tab:orange", edgecolor="black")
        ax.set(xlabel="response length (tokens)", ylabel="samples",
               title=f"Response lengths, steps {last[0][0]}-{last[-1][0]} ({len(lengths)} samples)")
        ax.grid(alpha=0.3)
        return _save(fig, out / "response_length.png")
    steps, mean = _series(records, "response_length_mean")
    msteps, longest = _series(records, "response_length_max")
    if not steps and not msteps:
        return "response_length.png skipped: no response_lengths / response_length_mean / response_length_max"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(steps, mean, label="mean", color="tab:orange")
    if msteps:
        ax.plot(msteps, longest, label="max", color="tab:brown", alpha=0.7)
    ax.set(xlabel="RL step", ylabel="response length (tokens)", title="Response length")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "response_length.png")


def _plot_pools(records, out: Path):
    series = {label: _series(records, key) for label, key in
              (("unfinished pool", "pool_unfinished"), ("experience pool", "pool_experience"))}
    if not any(s[0] for s in series.values()):
        return "pools.png skipped: no pool_unfinished or pool_experience in metrics"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (steps, values) in series.items():
        if steps:
            ax.plot(steps, values, label=label, drawstyle="steps-post")
    ax.set(xlabel="RL step", ylabel="samples", title="Pool sizes")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "pools.png")


def plot_run(run_dir: str | os.PathLike, sigma: float | None = None, out_dir: str | os.PathLike | None = None,
             ) -> tuple[list[Path], list[str]]:
    """Charts of one run -> (written PNG paths, messages for the charts skipped).

    `sigma` (the entropy target line) defaults to the run's config.yaml algorithm.sigma.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    sigma = sigma if sigma is not None else run_sigma(run_dir)
    written, skipped = [], []
    for result in (_plot_reward(records, out), _plot_entropy(records, out, sigma), _plot_lengths(records, out),
                   _plot_pools(records, out)):
        (written if isinstance(result, Path) else skipped).append(result)
    if sigma is None and any(p.name == "entropy.png" for p in written):
        skipped.append("entropy.png: no σ line (no config.yaml with algorithm.sigma; pass --sigma)")
    return written, skipped


def group_curves(series: Sequence[tuple[Sequence[int], Sequence[float]]]) -> tuple[list[int], list[float],
                                                                                    list[float], list[float]]:
    """(steps, mean, low, high) over several runs' (steps, values) of one metric: each run's
    trailing mean, then the mean, min and max across runs at every step all of them logged."""
    smoothed = [dict(zip(steps, _trailing_mean(values))) for steps, values in series]
    common = sorted(set.intersection(*(set(s) for s in smoothed))) if smoothed else []
    columns = [[run[step] for run in smoothed] for step in common]
    return (common, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns])


def _sigma_lines(ax, sigma: float, label: str) -> None:
    """The entropy target σ, and the band [0.5σ, 2σ] that ULORL.md's mechanism is read against
    (DMMPT inside it, no masking falling below, always masking rising above)."""
    ax.axhline(sigma, color="tab:red", linestyle="--", label=label)
    for bound, band_label in ((0.5 * sigma, "0.5σ and 2σ"), (2 * sigma, None)):  # one legend entry for both
        ax.axhline(bound, color="tab:red", linestyle=":", linewidth=0.8, alpha=0.6, label=band_label)


def plot_compare(run_dirs: Sequence[str | os.PathLike], labels: Sequence[str] | None, out: str | os.PathLike,
                 metric: str = "entropy", sigma: float | None = None) -> Path:
    """Overlay `metric` vs step of several runs in one PNG at `out` (e.g. DMMPT vs mask_mode=none).
    Runs that share a label (seeds of one setting) are drawn as one line: the mean of their trailing
    means, with the range across them shaded."""
    labels = list(labels) if labels else [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(run_dirs)} run folders but {len(labels)} labels")
    groups: dict[str, list] = {}
    for run_dir, label in zip(run_dirs, labels):
        steps, values = _series(read_metrics(run_dir), metric)
        if steps:
            groups.setdefault(label, []).append((steps, values))
        if sigma is None and metric == "entropy":
            sigma = run_sigma(run_dir)
    if not groups:
        raise ValueError(f"none of {[str(d) for d in run_dirs]} has {metric!r} in its metrics.jsonl")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, series in groups.items():
        if len(series) == 1:
            _plot_smoothed(ax, *series[0], label)
            continue
        steps, mean, low, high = group_curves(series)
        line, = ax.plot(steps, mean, label=f"{label} (mean of {len(series)} runs, {SMOOTH}-step means; "
                                           "shaded: min-max)")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    if sigma is not None and metric == "entropy":
        _sigma_lines(ax, sigma, f"σ = {sigma:g}")
    ax.set(xlabel="RL step", ylabel=metric, title=f"{metric} by run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)


def _main(args) -> int:
    if args.compare:
        runs = [args.run_dir, *args.compare]
        out = Path(args.out) if args.out else Path(args.run_dir) / "plots" / f"compare_{args.metric}.png"
        path = plot_compare(runs, args.labels, out, metric=args.metric, sigma=args.sigma)
        print(f"wrote {path}")
        return 0
    written, skipped = plot_run(args.run_dir, sigma=args.sigma, out_dir=args.out)
    for path in written:
        print(f"wrote {path}")
    for message in skipped:
        print(message)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `ulorl plot` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plot", help="charts of a run's metrics.jsonl (PNG files in RUN_DIR/plots/)",
        description="Reward and held-out accuracy, entropy with the σ line, response lengths and pool sizes "
                    "vs step, read from RUN_DIR/metrics.jsonl. Charts whose metrics are missing are skipped "
                    "with a message. With --compare, overlay one metric of several runs (runs sharing a label: "
                    "mean line, min-max shaded).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder with metrics.jsonl")
    parser.add_argument("--sigma", type=float, default=None,
                        help="entropy target line (default: algorithm.sigma from RUN_DIR/config.yaml)")
    parser.add_argument("--out", default=None,
                        help="output folder (default RUN_DIR/plots); with --compare, the PNG file")
    parser.add_argument("--compare", nargs="+", metavar="OTHER_RUN", default=None,
                        help="other run folders to overlay with RUN_DIR in one chart")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="legend labels, one per run (with --compare); runs with the same label (seeds of "
                             "one setting) are drawn as their mean with the min-max range shaded")
    parser.add_argument("--metric", default="entropy", help="metric to overlay with --compare (default entropy)")
    parser.set_defaults(func=_main)
    return parser
