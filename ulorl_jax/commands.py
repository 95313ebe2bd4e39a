"""`ulorl train`, `ulorl eval` and `ulorl demo`: the trainer from the command line.

    ulorl train --config FILE --run-dir DIR [--resume] [key=value ...]
    ulorl eval  [--run-dir DIR [--step S] | --model DIR] [--config FILE] [--data FILE] [--k K] [key=value ...]
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
import time
from pathlib import Path

OVERRIDES_HELP = "config overrides as dotted key=value, e.g. algorithm.mask_mode=none trainer.total_steps=20"

# `--quick`: the same demo, small enough for CI (about 2.5 minutes on 2 idle cores).
QUICK_OVERRIDES = ["trainer.sft_steps=100", "trainer.total_steps=8", "trainer.train_batch_size=8",
                   "trainer.ppo_mini_batch_size=64", "trainer.eval_every=0", "eval.k=1", "checkpoint.save_every=0",
                   "data.synthetic.num_eval=16"]


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

    initialize_from_args(args)  # --distributed, --coordinator, ... or a detected srun/mpirun: before jax runs
    from ulorl_jax.metrics import ProgressDisplay
    from ulorl_jax.rl.trainer import Trainer
    from ulorl_jax.warm_start import run_warm_start

    _quiet_libraries()
    if args.resume and args.config and Path(args.config).name == "config.yaml" and not Path(args.config).exists():
        raise ValueError(f"--config {args.config}: not found; a run killed before it wrote its config.yaml has "
                         f"trained nothing yet: start it again with the config you first gave it")
    cfg = _load(args.config, args.overrides)
    trainer = Trainer(cfg, args.run_dir, resume=args.resume, max_memory_gb=args.max_memory)
    if trainer.resumed and trainer.is_primary:
        print(f"ulorl train: resumed from checkpoint {trainer.step} in {trainer.checkpointer.directory}")
    try:
        if cfg.trainer.sft_steps and not trainer.resumed:
            run_warm_start(trainer, cfg)
        # With several processes, process 0 alone shows the progress.
        display = ProgressDisplay(cfg.trainer.total_steps, start_step=trainer.step) if trainer.is_primary else \
            contextlib.nullcontext()
        with display as progress:
            trainer.fit(progress)
    finally:
        trainer.close()
    if trainer.is_primary:
        from ulorl_jax.metrics import read_metrics

        records = read_metrics(trainer.run_dir / "metrics.jsonl")
        trained = sum(int(r.get("trained_samples", 0)) for r in records)
        updated = sum(1 for r in records if r.get("trained_samples"))

        def count(n: int, noun: str) -> str:
            return f"{n} {noun}" + ("" if n == 1 else "s")

        print(f"ulorl train: {count(trainer.step, 'step')} done; {count(trained, 'sample')} trained in {updated} of "
              f"{count(len(records), 'logged step')}; run folder {args.run_dir}")
        if records and not trained:
            print("warning: nothing was trained: every complete group had equal rewards (see reward_mean and "
                  "groups_dropped_* in metrics.jsonl); a policy that never (or always) earns the reward needs "
                  "other data or a warm start", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------


def _eval(args) -> int:
    from ulorl_jax import model_source
    from ulorl_jax.memory import format_bytes
    from ulorl_jax.rl import evaluation

    _quiet_libraries()
    if args.run_dir and args.model:
        raise ValueError("give --run-dir or --model, not both (--model also takes a run folder)")
    where = args.run_dir or args.model
    if args.step is not None and where is None:
        raise ValueError("--step picks a checkpoint of --run-dir (or of a run folder given as --model)")
    source = model_source.resolve(where, args.step) if where else None
    if source is not None and source.kind == "run" and args.config is None:
        cfg = model_source.run_config(source.path, args.overrides)  # the run's own config
    else:  # a model folder: the config (default: schema defaults) names it as its model
        implied = [f"model.path={source.path}"] if source is not None and source.kind != "run" else []
        if args.config is None and args.data:  # schema defaults have no training data, which eval never uses
            implied.append(f"data.train_files=[{args.data}]")
        cfg = _load(args.config, implied + list(args.overrides))
    if source is None:  # the config's model: model.path, else a fresh model from model.arch
        loaded = _config_model(cfg)
    else:
        loaded = model_source.load(source, dtype=None if source.kind == "run" else cfg.model.param_dtype,
                                   overrides=args.overrides if args.config is None else None)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.source.describe()} has no tokenizer files ("
                         f"{', '.join(model_source.TOKENIZER_FILES)}): set model.tokenizer=DIR")
    prompts = _eval_prompts(cfg, args.data, loaded.tokenizer)
    plan = evaluation.plan_eval(cfg, loaded.model.config, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                max_memory_gb=args.max_memory)
    for note in plan.notes:
        print(note)
    data_name = args.data or ", ".join(cfg.data.eval_files) or "the synthetic task's held-out split"
    print(f"evaluating {loaded.source.describe()} on {len(prompts)} prompts ({data_name}), k={plan.k}, "
          f"up to {plan.max_new_tokens} new tokens, {plan.slots} decode slots "
          f"(KV cache {format_bytes(plan.kv_cache_bytes)})")
    out = _eval_output_path(args, loaded.source, plan.k)  # a bad --out is refused before the work
    start = time.perf_counter()
    result, samples = evaluation.run_eval(cfg, loaded, prompts, plan)
    result["seconds"] = time.perf_counter() - start
    result |= _eval_record(args, cfg, loaded.source, plan)
    print(f"avg@{plan.k} accuracy {result['eval_accuracy']:.4f} over {result['eval_samples']} samples; "
          f"mean length {result['eval_length_mean']:.1f}; truncated {result['eval_truncated_fraction']:.3f}")
    passes = [f"pass@{key.rsplit('_', 1)[1]} {value:.4f}" for key, value in result.items()
              if key.startswith("eval_pass_at_")]
    if passes:
        print("unbiased " + ", ".join(passes))
    if out is not None:
        written = _write_eval_files(out, result, samples, overwrite=bool(args.out))
        print(f"results: {written}; samples: {result['samples_file']}")
    if args.json:
        print(json.dumps(result))
    return 0


def _eval_record(args, cfg, source, plan) -> dict:
    """What a result of `ulorl eval` was computed from: the checkpoint, the data, the generation and sampling
    settings, the whole reward section and the overrides."""
    import dataclasses

    from ulorl_jax.config import config_to_dict
    from ulorl_jax.rl.build import eval_sampling_params
    from ulorl_jax.rl.evaluation import eval_seed

    as_dict = config_to_dict(cfg)
    if args.data or cfg.data.eval_files:
        given = [args.data] if args.data else list(cfg.data.eval_files)
        data = {"files": given, "resolved": [str(Path(f).resolve()) for f in given],
                "from": "--data" if args.data else "data.eval_files"}
    else:
        data = {"synthetic": as_dict["data"]["synthetic"], "from": "data.synthetic (held-out split)"}
    return {"model": source.describe(), "step": source.step,
            "checkpoint": {"kind": source.kind, "path": str(source.path), "resolved": str(Path(source.path).resolve()),
                           "step": source.step},
            "data": data, "k": plan.k, "max_new_tokens": plan.max_new_tokens, "max_prompt_len": plan.max_prompt_len,
            "decode_slots": plan.slots, "seed": eval_seed(cfg),
            "sampling": dataclasses.asdict(eval_sampling_params(cfg)), "reward": as_dict["reward"],
            "config": args.config, "overrides": list(args.overrides)}


def _config_model(cfg):
    """`ulorl eval --config C` without --model / --run-dir: C's model.path, or a fresh model from model.arch."""
    from ulorl_jax import model_source
    from ulorl_jax.model_source import build_tokenizer
    from ulorl_jax.rl.build import build_model

    if cfg.model.path is not None:
        return model_source.load(model_source.resolve(cfg.model.path), dtype=cfg.model.param_dtype)
    tokenizer = build_tokenizer(cfg)
    source = model_source.ModelSource("config", Path("model.arch"))
    return model_source.LoadedModel(build_model(cfg, tokenizer, seed=cfg.trainer.seed), tokenizer, source, cfg)


def _eval_prompts(cfg, data: str | None, tokenizer) -> list:
    """--data, else data.eval_files, else the synthetic task's held-out split."""
    from ulorl_jax.data.sources import SyntheticTask, eval_prompts, prompt_file_stream

    files = [data] if data else list(cfg.data.eval_files)
    if files:
        stream = prompt_file_stream(files, cfg.data, tokenizer, cfg.data.max_prompt_len, shuffle=False,
                                    held_out=True)
        return stream.take(len(stream))
    if cfg.data.synthetic is not None:
        task = SyntheticTask.from_options(cfg.data.synthetic)
        return eval_prompts(task.eval, tokenizer, cfg.data.apply_chat_template)
    raise ValueError("nothing to evaluate: give --data FILE (jsonl, parquet or a datasets folder) or "
                     "data.eval_files (or data.synthetic)")


def _eval_output_path(args, source, k: int) -> Path | None:
    """--out (overwritten if it exists), else for a run RUN/eval/step_<S>_<DATA>_k<K>.json where DATA is the
    --data file's (or folder's) name with its suffix, or "eval" for the config's held-out set; when that name is
    taken, the first free of step_<S>_<DATA>_k<K>-2.json, -3, ... (`_write_eval_files` claims it). The run's
    own files are left alone. None: nothing to write (a model folder without --out)."""
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder: give a file name such as {out / 'eval.json'}")
        return out
    if source.kind != "run":
        return None
    data = Path(args.data).name if args.data else "eval"
    return source.path / "eval" / f"step_{source.step}_{data}_k{k}.json"


def _samples_path(out: Path) -> Path:
    """The per-sample jsonl written beside a results file: X.json -> X.samples.jsonl."""
    return out.with_name(out.name.removesuffix(".json") + ".samples.jsonl")


def _write_eval_files(out: Path, result: dict, samples: list[dict], *, overwrite: bool) -> Path:
    """Write `result` to `out` and `samples` (one JSON line each) beside it (`_samples_path`). Without
    `overwrite`, an existing name is never replaced: out-2.json, out-3.json, ... (the first pair of free names,
    taken with an exclusive create) is used instead, and `result` names the files actually written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.name.removesuffix(".json")
    for n in range(1, 1_000_000):
        path = out if n == 1 else out.with_name(f"{stem}-{n}.json")
        if overwrite:
            break
        if _samples_path(path).exists():
            continue
        try:
            path.open("x").close()  # claim the name; a concurrent `ulorl eval` takes the next one
            break
        except FileExistsError:
            continue
    else:
        raise ValueError(f"{out.parent}: no free result file name after {stem}-999999.json")
    result["results_file"], result["samples_file"] = str(path), str(_samples_path(path))
    _samples_path(path).write_text("".join(json.dumps(r) + "\n" for r in samples))
    path.write_text(json.dumps(result, indent=2))
    return path


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------


def _demo(args) -> int:
    from ulorl_jax.demo import run_demo

    _quiet_libraries()
    overrides = (QUICK_OVERRIDES if args.quick else []) + list(args.overrides)
    summary = run_demo(args.run_dir, overrides, quick=args.quick, config=args.config)
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
    train.add_argument("--max-memory", type=float, default=None, metavar="GB",
                       help="memory budget per device, checked before allocating: the learner's weights, gradients "
                            "and AdamW moments, the rollout's weights and KV cache (default: the device's free "
                            "memory, or 80%% of host RAM on CPU)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    from ulorl_jax.distributed import add_arguments as add_distributed_arguments

    add_distributed_arguments(train)
    train.set_defaults(func=_train)

    ev = sub.add_parser(
        "eval", help="avg@k and pass@k accuracy on a benchmark: jsonl, parquet or a datasets folder (eval sampling: "
                     "T 0.85, top-k 20, top-p 0.95)",
        description="Samples k answers per prompt with the eval sampling settings (eval.*) and reports avg@k "
                    "accuracy, the unbiased pass@k (k = 1, 2, 4, 8 up to --k), mean response length and "
                    "truncation rate. Weights: a checkpoint of --run-dir (default latest, named in the output), "
                    "or --model (HF or ulorl folder, run folder, checkpoint), or the config's model. Nothing in "
                    "the run folder is changed. With a run (or --out), the results go to a JSON file that records "
                    "the checkpoint, the data, k, the generation length, the sampling and reward settings and the "
                    "overrides, and every sample (prompt_index, sample_index, text, tokens, answer, reward, "
                    "finish_reason) goes to a jsonl beside it (X.json -> X.samples.jsonl). Default file: "
                    "RUN/eval/step_S_DATA_kK.json, DATA the --data file's name with its suffix (\"eval\" for the "
                    "config's held-out set); an existing result is never replaced: the next free name "
                    "step_S_DATA_kK-2.json, -3, ... is used.")
    ev.add_argument("--config", default=None,
                    help="YAML file or shipped config name (default: the run's config.yaml with --run-dir, "
                         "else schema defaults)")
    ev.add_argument("--run-dir", default=None, help="evaluate a checkpoint of this run (default: its latest)")
    ev.add_argument("--step", type=int, default=None, help="the checkpoint step of --run-dir (default: latest)")
    ev.add_argument("--model", default=None,
                    help="HF or ulorl model folder, a run folder or RUN/checkpoints/STEP")
    ev.add_argument("--data", default=None, metavar="FILE",
                    help="the benchmark: a .jsonl (or .json lines) file, a .parquet file or a Hugging Face datasets "
                         "save_to_disk folder, with `prompt` and `answer` fields (data.prompt_key / "
                         "data.answer_key, or data.eval_prompt_key / eval_answer_key); default: data.eval_files, "
                         "else the synthetic task's held-out split")
    ev.add_argument("--k", type=int, default=None, help="samples per prompt (default eval.k)")
    ev.add_argument("--max-new-tokens", type=int, default=None,
                    help="generation length (default eval.max_new_tokens, else rollout.global_max_len, capped to "
                         "the model's positions minus the longest prompt)")
    ev.add_argument("--max-memory", type=float, default=None, metavar="GB",
                    help="refuse to start when the decode KV cache needs more (default: the device's free "
                         "memory, or 80%% of host RAM on CPU)")
    ev.add_argument("--out", default=None, metavar="FILE.json",
                    help="write the results here as JSON and the samples beside it (FILE.samples.jsonl); both are "
                         "overwritten if they exist (default with a run: RUN/eval/step_S_DATA_kK.json, never "
                         "overwritten: -2, -3, ... when taken; with a model folder: no files)")
    ev.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    ev.set_defaults(func=_eval)

    demo = sub.add_parser(
        "demo",
        help="the embedded CPU demo: a tiny Qwen3-MoE learns a synthetic task with UloRL (~5 min on 2 idle cores)",
        description="Builds a tiny Qwen3-MoE policy and a character tokenizer locally, warm-starts it on "
                    "step-by-step traces that are sometimes wrong, then runs UloRL (segment rollout, POIS, DMMPT) "
                    "on 2 CPU cores. Prints held-out accuracy before and after RL, entropy against sigma and "
                    "segment statistics, and writes plots to RUN_DIR/plots/.")
    demo.add_argument("--quick", action="store_true", help="a ~2.5 minute version (for CI and a first look)")
    demo.add_argument("--run-dir", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--config", default="tiny_cpu",
                      help="the demo's config: tiny_cpu (UloRL, default) or a baseline on the same task: grpo_tiny_cpu, "
                           "dapo_tiny_cpu, gspo_tiny_cpu, cispo_tiny_cpu (README \"Baselines\")")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object as the last line")
    demo.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    demo.set_defaults(func=_demo)
