"""`ulorl` command line: train, eval, demo, generate, serve, data, plot, convert, export, bench.

Each subcommand has its own `--help`. Every `ulorl bench ...` prints a table
and, with `--json`, one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _convert(args) -> int:
    from ulorl_jax.model_source import copy_tokenizer_files
    from ulorl_jax.models.hf import from_pretrained, save_pretrained
    from ulorl_jax.models.native import load_native, save_native

    start = time.perf_counter()
    if args.direction == "hf-to-ulorl":
        model = from_pretrained(args.src, dtype=args.dtype or "float32")
        save_native(model, args.dst)
    else:
        runtime = {"param_dtype": args.dtype, "dtype": args.dtype} if args.dtype else {}
        model = load_native(args.src, **runtime)
        save_pretrained(model, args.dst, expert_layout=args.expert_layout)
    copied = copy_tokenizer_files(args.src, args.dst)
    print(f"converted {args.src} -> {args.dst} ({args.direction}, {model.config.model_type}, "
          f"{model.config.param_dtype}; {'tokenizer copied' if copied else 'no tokenizer files in the source'}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


def _export(args) -> int:
    from ulorl_jax import model_source
    from ulorl_jax.models.hf import save_pretrained

    start = time.perf_counter()
    source = model_source.resolve(args.src, args.step)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: choose a new output folder (nothing is overwritten)")
    loaded = model_source.load(source, dtype=args.dtype)
    save_pretrained(loaded.model, out, expert_layout=args.expert_layout)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out)
    print(f"exported {loaded.source.describe()} -> {out} (Hugging Face folder: {loaded.model.config.model_type}, "
          f"{loaded.model.config.param_dtype}, "
          f"{'with its tokenizer' if loaded.tokenizer is not None else 'no tokenizer: the source has none'}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ulorl",
        description="UloRL (ultra-long output RL) on Qwen3 / Qwen3-MoE in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from ulorl_jax import commands  # train, eval, demo

    commands.add_parsers(sub)

    convert = sub.add_parser(
        "convert", help="convert between Hugging Face and ulorl model folders",
        description="hf-to-ulorl: HF folder (config.json + safetensors) -> ulorl folder "
                    "(model_config.json + orbax params). ulorl-to-hf: the reverse; the output loads with "
                    "transformers.AutoModelForCausalLM.from_pretrained.")
    convert.add_argument("direction", choices=["hf-to-ulorl", "ulorl-to-hf"])
    convert.add_argument("src", help="source folder")
    convert.add_argument("dst", help="destination folder (created)")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                         help="parameter dtype to write (default: float32 from HF, as stored from ulorl)")
    convert.add_argument("--expert-layout", choices=["per_expert", "fused"], default=None,
                         help="ulorl-to-hf MoE tensor layout (default: the layout the model came from)")
    convert.set_defaults(func=_convert)

    export = sub.add_parser(
        "export", help="write a run's checkpoint (or any model folder) as a Hugging Face folder",
        description="SRC: a run folder (its latest checkpoint), RUN/checkpoints/STEP, a ulorl or an HF model "
                    "folder. OUT gets config.json (with architectures), safetensors and the tokenizer files, "
                    "so transformers' AutoModelForCausalLM and AutoTokenizer load it.")
    export.add_argument("src", help="run folder, RUN/checkpoints/STEP, ulorl or HF model folder")
    export.add_argument("out", help="output folder (created; must be new or empty)")
    export.add_argument("--step", type=int, default=None, help="checkpoint step of a run folder (default: latest)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="parameter dtype to write (default: as trained / stored)")
    export.add_argument("--expert-layout", choices=["per_expert", "fused"], default=None,
                        help="MoE tensor layout (default: per_expert, the layout transformers writes)")
    export.set_defaults(func=_export)

    from ulorl_jax.rollout import (
        generate,  # `ulorl generate`: segment rollout with fixed weights
    )

    generate.add_parser(sub)
    from ulorl_jax.decode import (
        serve,  # `ulorl serve`: JetStream's orchestrator + gRPC (extra: jetstream)
    )

    serve.add_parser(sub)
    from ulorl_jax import plot  # `ulorl plot RUN_DIR`

    plot.add_parser(sub)
    from ulorl_jax.data import clean  # `ulorl data clean IN OUT`

    clean.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks; each prints a table (and JSON with --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from ulorl_jax.bench import (
        attention,
        compare,
        decode,
        forward,
        kv,
        learner,
        segments,
    )

    for bench_module in (forward, decode, attention, learner, segments, compare, kv):
        bench_module.add_parser(bench_sub)
    from ulorl_jax import plan

    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers prints "PyTorch was not found..." at import when torch is absent; we use it for
    # tokenizers and configs only, so that advice is noise to every ulorl command.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # our errors name the bad thing: show them plainly
        print(f"ulorl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
