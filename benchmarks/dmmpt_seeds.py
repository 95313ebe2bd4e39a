"""DMMPT vs its ablations over seeds on the demo task (issue 18; results in benchmarks/results/dmmpt.md).

    python benchmarks/dmmpt_seeds.py --root runs/seeds                  # run what is missing, then report
    python benchmarks/dmmpt_seeds.py --root runs/seeds --report-only    # report the runs already there

Each (mask mode, seed) is a plain `ulorl demo` run in ROOT/MODE-sSEED with `algorithm.mask_mode=MODE
trainer.seed=SEED` (the warm start depends on the seed only, so the modes of one seed start from the same
policy). The report reads each run's summary.json: held-out avg@k and pass@k before and after RL (mean and
standard error over seeds) and the entropy of trained samples over the last quarter of steps against
[0.5 sigma, 2 sigma]; it draws one entropy plot from the runs' metrics.jsonl with the seeds of a mode as a
mean line and a shaded range (`ulorl plot --compare` with repeated labels).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

MODES = ("dmmpt", "none", "mpt")


def run_missing(root: Path, modes, seeds, extra: list[str]) -> None:
    for seed in seeds:
        for mode in modes:
            run = root / f"{mode}-s{seed}"
            if (run / "summary.json").is_file():
                continue
            command = [sys.executable, "-m", "ulorl_jax.cli", "demo", "--run-dir", str(run),
                       f"algorithm.mask_mode={mode}", f"trainer.seed={seed}", *extra]
            print("+", " ".join(command), flush=True)
            subprocess.run(command, check=True)


def _mean_se(values) -> str:
    values = np.asarray(values, dtype=float)
    se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{values.mean():.3f} ± {se:.3f}"


def report(root: Path, modes, seeds) -> str:
    from ulorl_jax.demo import entropy_band
    from ulorl_jax.plot import plot_compare

    lines = ["| mask_mode | seeds | avg@8 before | avg@8 after | gain | pass@8 before | pass@8 after | "
             "entropy, last quarter (per seed) | in [0.5σ, 2σ] |", "|---|---|---|---|---|---|---|---|---|"]
    runs, labels = [], []
    for mode in modes:
        found = [(seed, root / f"{mode}-s{seed}") for seed in seeds
                 if (root / f"{mode}-s{seed}" / "summary.json").is_file()]
        if not found:
            continue
        s = [json.loads((run / "summary.json").read_text()) for _, run in found]
        sigma = s[0]["sigma"]
        tails = [x["entropy_last_quarter"] for x in s]  # the demo's summary: mean over the last quarter
        inside = sum(entropy_band(t, sigma) == "inside [0.5σ, 2σ]" for t in tails)
        lines.append(
            f"| {mode} | {','.join(str(seed) for seed, _ in found)} | "
            f"{_mean_se([x['accuracy_before'] for x in s])} | {_mean_se([x['accuracy_after'] for x in s])} | "
            f"{_mean_se([x['accuracy_after'] - x['accuracy_before'] for x in s])} | "
            f"{_mean_se([x['pass_at_k_before']['8'] for x in s])} | "
            f"{_mean_se([x['pass_at_k_after']['8'] for x in s])} | "
            f"{' / '.join(f'{t:.3f}' for t in tails)} | {inside} of {len(tails)} |")
        runs += [run for _, run in found]
        labels += [mode] * len(found)
    if runs:
        out = plot_compare(runs, labels, root / "entropy_by_mode.png")
        lines.append(f"\nentropy plot: {out}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding one run folder per mode and seed")
    parser.add_argument("--modes", default=",".join(MODES), help="mask modes (default dmmpt,none,mpt)")
    parser.add_argument("--seeds", default="0,1,2", help="trainer.seed values (default 0,1,2)")
    parser.add_argument("--report-only", action="store_true", help="do not start runs; report those present")
    parser.add_argument("overrides", nargs="*", help="extra key=value options for every run")
    args = parser.parse_args(argv)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        run_missing(args.root, modes, seeds, args.overrides)
    print(report(args.root, modes, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
