"""`ulorl train`, `ulorl eval` and `ulorl demo`: the trainer from the command line.

    ulorl train --config FILE --run-dir DIR [--resume] [key=value ...]
    ulorl eval  --config FILE [--run-dir DIR | --model DIR] [--data FILE.jsonl] [key=value ...]
    ulorl demo  [--quick] [--run-dir DIR] [key=value ...]

`ulorl demo` is `ulorl train --config tiny_cpu` with a supervised warm start,
held-out accuracy before and after RL, a summary and plots: the same code path
a pod run takes, at a size that fits a laptop-class CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import time

OVERRIDES_HELP = "config overrides as dotted key=value, e.g. algorithm.mask_mode=none trainer.total_steps=20"

# `--quick`: the same demo, small enough for CI (about 2.5 minutes on 2 idle cores).
QUICK_OVERRIDES = ["trainer.sft_steps=100", "trainer.total_steps=8", "trainer.eval_every=0", "eval.k=1",
                   "checkpoint.save_every=0", "data.synthetic.num_eval=16"]


def _quiet_libraries() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("orbax", "jax._src"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Orbax logs a failed background save as an absl ERROR with its traceback; the trainer reports the
    # failure itself in one line (and the CLI exits 2), so keep the terminal readable.
    logging.getLogger("absl").setLevel(logging.CRITICAL)


def _load(config: str | None, overrides: list[str]):
    from ulorl_jax.config import load_config

    return load_config(config, overrides)


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------


def _train(args) -> int:
    from ulorl_jax.distributed import initialize_from_args

    initialize_from_args(args)  # --coordinator/--num-processes/--process-id: before jax touches a device
    from ulorl_jax.metrics import ProgressDisplay
    from ulorl_jax.rl.trainer import Trainer

    _quiet_libraries()
    cfg = _load(args.config, args.overrides)
    trainer = Trainer(cfg, args.run_dir, resume=args.resume)
    try:
        if cfg.trainer.sft_steps and not args.resume:
            _warm_start(trainer, cfg)
        # With several processes, process 0 alone shows the progress.
        display = ProgressDisplay(cfg.trainer.total_steps, start_step=trainer.step) if trainer.is_primary else \
            contextlib.nullcontext()
        with display as progress:
            trainer.fit(progress)
    finally:
        trainer.close()
    if trainer.is_primary:
        print(f"ulorl train: {trainer.step} steps done; run folder {args.run_dir}")
    return 0


def _warm_start(trainer, cfg) -> list[dict]:
    from rich.progress import Progress

    t = cfg.trainer
    batch = t.sft_batch_size or t.train_batch_size * cfg.rollout.n
    with Progress(transient=True, disable=not (sys.stdout.isatty() and trainer.is_primary)) as bar:
        task = bar.add_task("supervised warm start", total=t.sft_steps)
        history = trainer.warm_start(t.sft_steps, batch, t.sft_lr,
                                     progress=lambda i, m: bar.update(task, completed=i))
    last = history[-1] if history else {}
    if trainer.is_primary:
        print(f"warm start: {t.sft_steps} supervised steps on noisy traces (batch {batch}, lr {t.sft_lr:g}), "
              f"final loss {last.get('loss', float('nan')):.3f}")
    return history


# ---------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------


def _eval(args) -> int:
    from ulorl_jax.rl.trainer import Trainer

    _quiet_libraries()
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.data:
        overrides += [f"data.eval_files=[{args.data}]", "data.synthetic=null"]
        if not any(o.startswith("data.train_files") for o in overrides):  # the trainer wants a prompt stream
            overrides.append(f"data.train_files=[{args.data}]")
    cfg = _load(args.config, overrides)
    with tempfile.TemporaryDirectory(prefix="ulorl-eval-") as scratch:  # a run folder only when none is given
        trainer = Trainer(cfg, args.run_dir or scratch, resume=bool(args.run_dir))
        try:
            start = time.perf_counter()
            result = trainer.evaluate(k=args.k)
            result["seconds"] = time.perf_counter() - start
        finally:
            trainer.close()
    if not result:
        raise ValueError("nothing to evaluate: give --data FILE.jsonl or data.eval_files (or data.synthetic)")
    print(f"avg@{args.k or cfg.eval.k} accuracy {result['eval_accuracy']:.4f} over {result['eval_samples']} samples; "
          f"mean length {result['eval_length_mean']:.1f}; truncated {result['eval_truncated_fraction']:.3f}")
    if args.json:
        print(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------


def _demo(args) -> int:
    from ulorl_jax.demo import run_demo

    _quiet_libraries()
    overrides = (QUICK_OVERRIDES if args.quick else []) + list(args.overrides)
    summary = run_demo(args.run_dir, overrides, quick=args.quick)
    if args.json:
        print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------------
# argparse
# ---------------------------------------------------------------------------


def add_parsers(sub) -> None:
    train = sub.add_parser(
        "train", help="run UloRL training from a YAML config",
        description="Segment rollout + POIS + DMMPT training. Writes RUN_DIR/metrics.jsonl, TensorBoard events, "
                    "checkpoints/ and config.yaml; `ulorl plot RUN_DIR` draws the curves. Shipped configs: "
                    "tiny_cpu, qwen3_4b, qwen3_8b, qwen3_30b_a3b_128k, qwen3_30b_a3b_128k_yarn.")
    train.add_argument("--config", required=True, help="YAML file, or the name of a shipped config (e.g. tiny_cpu)")
    train.add_argument("--run-dir", required=True, help="run folder (created)")
    train.add_argument("--resume", action="store_true", help="continue from the latest committed checkpoint")
    train.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    from ulorl_jax.distributed import add_arguments as add_distributed_arguments

    add_distributed_arguments(train)
    train.set_defaults(func=_train)

    ev = sub.add_parser(
        "eval", help="avg@k accuracy on a jsonl benchmark (eval sampling: T 0.85, top-k 20, top-p 0.95)",
        description="Samples k answers per prompt with the eval sampling settings (eval.*) and reports avg@k "
                    "accuracy, mean response length and truncation rate. Weights: the latest checkpoint of "
                    "--run-dir, or --model (HF or ulorl folder), or the config's model.")
    ev.add_argument("--config", default=None, help="YAML file or shipped config name (default: schema defaults)")
    ev.add_argument("--run-dir", default=None, help="evaluate this run's latest checkpoint")
    ev.add_argument("--model", default=None, help="HF or ulorl model folder (sets model.path)")
    ev.add_argument("--data", default=None, help="jsonl with `prompt` and `answer` fields (sets data.eval_files)")
    ev.add_argument("--k", type=int, default=None, help="samples per prompt (default eval.k)")
    ev.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    ev.set_defaults(func=_eval)

    demo = sub.add_parser(
        "demo", help="the embedded CPU demo: a tiny Qwen3-MoE learns a synthetic task with UloRL (~15 min)",
        description="Builds a tiny Qwen3-MoE policy and a character tokenizer locally, warm-starts it on "
                    "step-by-step traces that are sometimes wrong, then runs UloRL (segment rollout, POIS, DMMPT) "
                    "on 2 CPU cores. Prints held-out accuracy before and after RL, entropy against sigma and "
                    "segment statistics, and writes plots to RUN_DIR/plots/.")
    demo.add_argument("--quick", action="store_true", help="a ~2.5 minute version (for CI and a first look)")
    demo.add_argument("--run-dir", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object as the last line")
    demo.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    demo.set_defaults(func=_demo)
