"""The embedded CPU demo: UloRL on a tiny Qwen3-MoE policy and a synthetic task.

1. config `tiny_cpu` (+ overrides), a fresh tiny policy and a character tokenizer;
2. supervised warm start on step-by-step traces that are sometimes wrong;
3. held-out avg@k accuracy of the warm start;
4. UloRL: segment rollout, POIS, DMMPT (the trainer, as `ulorl train` runs it);
5. held-out avg@k accuracy after RL, a summary, plots and summary.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def run_demo(run_dir: str | Path | None, overrides: list[str], *, quick: bool = False,
             config: str = "tiny_cpu") -> dict:
    import jax

    from ulorl_jax.config import load_config
    from ulorl_jax.data.synthetic import distribution_stats
    from ulorl_jax.metrics import ProgressDisplay, read_metrics
    from ulorl_jax.plot import plot_run
    from ulorl_jax.rl.trainer import Trainer
    from ulorl_jax.warm_start import run_warm_start

    wall = time.perf_counter()
    run_dir = Path(run_dir) if run_dir else default_run_dir()
    cfg = load_config(config, overrides)  # tiny_cpu, or a baseline on its task (grpo_tiny_cpu, ...)
    trainer = Trainer(cfg, run_dir)
    a, r = cfg.algorithm, cfg.rollout
    params = sum(x.size for x in jax.tree.leaves(trainer.learner.params))
    m = trainer.learner.model.config
    print(f"ulorl demo{' --quick' if quick else ''}: tiny {m.model_type} policy ({params:,} parameters, "
          f"{m.num_hidden_layers} layers, {m.num_experts} experts top-{m.num_experts_per_tok}) on "
          f"{jax.default_backend()}; run folder {run_dir}")
    held_out = [len(p.operands) for p in trainer.task.eval]  # data.synthetic.eval_min_operands: a harder split
    harder = (f", held-out {min(held_out)}-{max(held_out)}"
              if held_out and min(held_out) > trainer.task.config.min_operands else "")
    print(f"task: running sums mod {trainer.task.config.modulus}, {trainer.task.config.min_operands}-"
          f"{trainer.task.config.max_operands} operands (long-tailed{harder}); rollout {r.global_max_len} tokens in "
          f"{r.num_segments} segments of {r.global_max_len // r.num_segments}, n={r.n}; is_mode={a.is_mode}, "
          f"mask_mode={a.mask_mode} (tau {a.tau}, sigma {a.sigma})")
    try:
        t0 = time.perf_counter()
        if cfg.trainer.sft_steps:
            run_warm_start(trainer, cfg)
        sft_s = time.perf_counter() - t0
        before = trainer.evaluate()
        print(f"held-out avg@{cfg.eval.k} accuracy after warm start: {before['eval_accuracy']:.3f}")
        t0 = time.perf_counter()
        with ProgressDisplay(cfg.trainer.total_steps) as progress:
            trainer.fit(progress)
        rl_s = time.perf_counter() - t0
        after = trainer.evaluate()
    finally:
        trainer.close()
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = _summary(cfg, records, before, after, sft_s, rl_s, time.perf_counter() - wall,
                       distribution_stats(trainer.task.config, tokenizer=trainer.tokenizer))
    summary["quick"] = quick
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    written, _ = plot_run(run_dir)
    _print_summary(summary, run_dir, written)
    if quick:
        _print_smoke_note(summary, load_config(config, []))
    return summary


def _print_smoke_note(s: dict, full) -> None:
    """What a --quick run can and cannot show, and where the full demo's evidence is."""
    from ulorl_jax.data.sources import SyntheticTask

    step = 1.0 / max(s["eval_prompts"] * s["eval_k"], 1)
    full_eval = len(SyntheticTask.from_options(full.data.synthetic).eval)
    print()
    print(f"This was a smoke run: {s['steps']} RL steps, held-out avg@{s['eval_k']} on {s['eval_prompts']} prompts "
          f"(one prompt more or less right moves it by {step:.3f}). It shows that the whole pipeline runs; it is "
          f"too short to show learning. The full `ulorl demo` ({full.trainer.total_steps} RL steps, avg@{full.eval.k} "
          f"on {full_eval} held-out prompts, about 5.5 minutes on 2 idle CPU cores) is the run that "
          f"shows RL's gain over the warm start (and, run with algorithm.mask_mode=none or mpt and "
          f"algorithm.tau=0.3, how the masking modes hold the entropy); its measured figures are in "
          f"benchmarks/results/demo.md and dmmpt.md.")


def entropy_band(entropy: float | None, sigma: float) -> str | None:
    """Where `entropy` sits against DMMPT's band [0.5σ, 2σ] (ULORL.md: DMMPT inside, no masking below,
    always masking above): "below 0.5σ", "inside [0.5σ, 2σ]" or "above 2σ"."""
    if entropy is None:
        return None
    if entropy < 0.5 * sigma:
        return "below 0.5σ"
    return "above 2σ" if entropy > 2 * sigma else "inside [0.5σ, 2σ]"


def _tail_mean(records: list[dict], key: str, frac: float = 0.25) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    n = max(1, int(len(values) * frac))
    return float(np.mean(values[-n:]))


def _summary(cfg, records, before, after, sft_s, rl_s, wall_s, task_lengths) -> dict:
    ended = [n for r in records for n in r.get("response_lengths", [])]
    entropy_tail = _tail_mean(records, "entropy")
    return {
        "accuracy_before": before["eval_accuracy"], "accuracy_after": after["eval_accuracy"],
        "eval_k": cfg.eval.k, "eval_prompts": before["eval_samples"] // max(cfg.eval.k, 1),
        "mask_mode": cfg.algorithm.mask_mode, "is_mode": cfg.algorithm.is_mode, "sigma": cfg.algorithm.sigma,
        "entropy_first": next((r["entropy"] for r in records if "entropy" in r), None),
        "entropy_last_quarter": entropy_tail,
        "entropy_band": entropy_band(entropy_tail, cfg.algorithm.sigma),
        "eval_entropy_before": before.get("eval_entropy"), "eval_entropy_after": after.get("eval_entropy"),
        "pass_at_k_before": _pass_at_k(before), "pass_at_k_after": _pass_at_k(after),
        "masked_fraction_last_quarter": _tail_mean(records, "masked_fraction"),
        "reward_first_quarter": float(np.mean([r["reward_mean"] for r in records[:max(1, len(records) // 4)]
                                               if r.get("reward_mean") is not None] or [np.nan])),
        "reward_last_quarter": _tail_mean(records, "reward_mean"),
        "steps": len(records), "segments": cfg.rollout.num_segments, "segment_len":
            cfg.rollout.global_max_len // cfg.rollout.num_segments,
        "samples_ended": len(ended),
        "segments_mean": _tail_mean(records, "segments_mean", 1.0),
        "truncated_fraction": _tail_mean(records, "truncated_fraction", 1.0),
        "unfinished_pool_mean": _tail_mean(records, "pool_unfinished", 1.0),
        "response_length_p50": float(np.percentile(ended, 50)) if ended else None,
        "response_length_max": int(max(ended)) if ended else None,
        "task_trace_lengths": task_lengths,
        "seconds_warm_start": sft_s, "seconds_rl": rl_s, "seconds_total": wall_s,
    }


def _pass_at_k(result: dict) -> dict[str, float]:
    """{"1": pass@1, "2": ..., ...} from an eval result's eval_pass_at_K keys."""
    return {key.removeprefix("eval_pass_at_"): v for key, v in result.items() if key.startswith("eval_pass_at_")}


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _print_summary(s: dict, run_dir: Path, plots) -> None:
    print()
    print("== ulorl demo summary ==")
    print(f"held-out accuracy (avg@{s['eval_k']}, {s['eval_prompts']} prompts): "
          f"{_fmt(s['accuracy_before'])} after warm start -> {_fmt(s['accuracy_after'])} after RL "
          f"({100 * (s['accuracy_after'] - s['accuracy_before']):+.1f} points)")
    if s["pass_at_k_after"]:
        print("held-out pass@k (unbiased): " + ", ".join(
            f"pass@{k} {_fmt(s['pass_at_k_before'].get(k))} -> {_fmt(v)}" for k, v in s["pass_at_k_after"].items()))
    print(f"train reward: {_fmt(s['reward_first_quarter'])} (first quarter of steps) -> "
          f"{_fmt(s['reward_last_quarter'])} (last quarter)")
    print(f"entropy (mean per-token, {s['mask_mode']}): {_fmt(s['entropy_first'])} at the first update, "
          f"{_fmt(s['entropy_last_quarter'])} over the last quarter ({s['entropy_band'] or '-'}); "
          f"sigma = {s['sigma']}; masked fraction {_fmt(s['masked_fraction_last_quarter'], '.4f')}")
    print(f"entropy on held-out samples: {_fmt(s['eval_entropy_before'])} after warm start -> "
          f"{_fmt(s['eval_entropy_after'])} after RL")
    print(f"segments: {s['segments']} x {s['segment_len']} tokens; samples took {_fmt(s['segments_mean'], '.2f')} "
          f"segments on average; unfinished pool {_fmt(s['unfinished_pool_mean'], '.1f')} samples on average; "
          f"truncated {_fmt(s['truncated_fraction'])}; response length p50 {_fmt(s['response_length_p50'], '.0f')}, "
          f"max {s['response_length_max']}")
    print(f"time: warm start {s['seconds_warm_start']:.0f}s, RL {s['seconds_rl']:.0f}s, total {s['seconds_total']:.0f}s")
    print(f"plots: {', '.join(str(p) for p in plots) if plots else 'none'}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}  (ulorl plot {run_dir} redraws the plots)")
