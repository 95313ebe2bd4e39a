"""`ulorl` command line: train, eval, demo, generate, serve, data, plot, convert, export, bench.

Each subcommand has its own `--help`. Every `ulorl bench ...` prints a table
and, with `--json`, one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

# `ulorl --help` and `ulorl SUB --help` do not import jax (2-5 s): every module imported while the parser is
# built is light (tests/test_install.py checks). These commands' arguments are defined in modules that import
# jax when imported (through ulorl_jax.models or ulorl_jax.memory), so the parser lists them from here, with
# the same one-line help as their module's (checked by the same test), and imports the module only when its
# command is chosen: `ulorl plan ...` and `ulorl bench NAME ...` (their own --help included) load jax, the rest
# of the parser does not. NAME -> (module whose `add_parser(subparsers)` registers it, one-line help).
LAZY_COMMANDS = {
    "plan": ("ulorl_jax.plan", "per-device memory / FLOPs of the train and decode steps at full size "
                               "(compiled on fake devices, no weights allocated)"),
}
LAZY_BENCHES = {
    "forward": ("ulorl_jax.bench.forward", "forward and forward+backward tokens/s: JAX vs PyTorch (HF)"),
    "decode": ("ulorl_jax.bench.decode", "decode tokens/s: our engine vs transformers generate"),
    "attention": ("ulorl_jax.bench.attention",
                  "attention / decode / grouped-matmul kernel throughput vs cuDNN, XLA, torch"),
    "learner": ("ulorl_jax.bench.learner", "UloRL train-step tokens/s and memory: JAX vs PyTorch (HF)"),
    "segments": ("ulorl_jax.bench.segments", "segment-rollout speedup per num_segments (paper Table 1); "
                                             "--model-scale for a GPU cost-model projection"),
    "compare": ("ulorl_jax.bench.compare", "XLA vs PyTorch: learner step and decode, same Qwen3-MoE and tokens "
                                           "(eager and torch.compile)"),
    "kv": ("ulorl_jax.bench.kv", "paged vs dense KV cache under one memory budget: samples in flight, wall time, "
                                 "equal greedy tokens"),
    "context": ("ulorl_jax.bench.context", "context parallelism: per-shard causal load balance, and a row split "
                                           "over context vs rows over fsdp"),
    "serve": ("ulorl_jax.bench.serve", "OpenAI API server under 1 / 8 / 32 concurrent clients: tokens/s and latency "
                                       "percentiles"),
}

# Packages `pip install -e .` leaves out, imported by the commands that use them: top-level module -> the fix.
OPTIONAL_PACKAGES = {
    "torch": "pip install -e '.[bench]' (torch 2.13.0; `ulorl bench` compares against PyTorch)",
    "jetstream": "pip install -e '.[jetstream]' (never the unrelated 'jetstream-pt')",
    "grpc": "pip install -e '.[jetstream]' (grpcio comes with google-jetstream)",
    "datasets": "pip install datasets",
    "wandb": "pip install wandb, or set logging.wandb=false",
}


class LazySubcommands(argparse._SubParsersAction):
    """Subparsers with lazy entries: `add_lazy(NAME, MODULE, HELP)` lists NAME with HELP at once; MODULE's
    `add_parser(subparsers)` registers NAME's real parser only when NAME is on the command line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, str] = {}  # NAME -> module, until loaded
        self.loaded_help: dict[str, str | None] = {}  # NAME -> the help its module registers (tests compare)

    def add_lazy(self, name: str, module: str, help: str) -> None:
        self.lazy[name] = module
        self.add_parser(name, help=help, add_help=False)  # a placeholder: replaced by load() before use

    def load(self, name: str) -> argparse.ArgumentParser:
        module = self.lazy.pop(name, None)
        if module is not None:
            importlib.import_module(module).add_parser(_Into(self, name, module))
        return self._name_parser_map[name]

    def __call__(self, parser, namespace, values, option_string=None):
        if values:
            self.load(values[0])
        super().__call__(parser, namespace, values, option_string)


class _Into:
    """What a lazy module's `add_parser(subparsers)` is given: its `add_parser(NAME, ...)` replaces NAME's
    placeholder with the real parser (the listing and its help stay those of LAZY_COMMANDS / LAZY_BENCHES)."""

    def __init__(self, action: LazySubcommands, name: str, module: str):
        self.action, self.name, self.module = action, name, module

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if name != self.name:
            raise ValueError(f"{self.module}.add_parser registered {name!r} where ulorl_jax/cli.py lists "
                             f"{self.name!r}: make the two names agree")
        self.action.loaded_help[name] = kwargs.pop("help", None)
        kwargs.setdefault("prog", self.action._name_parser_map[name].prog)
        parser = self.action._parser_class(**kwargs)
        self.action._name_parser_map[name] = parser
        return parser


def load_all(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Load every lazy subcommand of `parser` (imports jax): for tools that walk the whole parser tree."""
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name in list(action.choices):
            if isinstance(action, LazySubcommands):
                action.load(name)
            load_all(action.choices[name])
    return parser


def _convert(args) -> int:
    from ulorl_jax.model_source import copy_tokenizer_files
    from ulorl_jax.models.hf import from_pretrained, save_pretrained
    from ulorl_jax.models.native import load_native, save_native

    start = time.perf_counter()
    if args.direction == "hf-to-ulorl" and args.expert_layout is not None:
        raise ValueError(f"--expert-layout applies to ulorl-to-hf (the HF tensor layout to write); a ulorl folder "
                         f"has one layout, so hf-to-ulorl takes no --expert-layout (got {args.expert_layout})")
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
    save_pretrained(loaded.model, out, expert_layout=args.expert_layout or "per_expert")  # as --help says
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=LazySubcommands)

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
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH", action=LazySubcommands)
    for name, (module, help) in LAZY_BENCHES.items():
        bench_sub.add_lazy(name, module, help)
    for name, (module, help) in LAZY_COMMANDS.items():
        sub.add_lazy(name, module, help)
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
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing not in OPTIONAL_PACKAGES:
            raise
        print(f"ulorl {args.command}: error: this command needs the `{missing}` package, which "
              f"`pip install -e .` does not install: {OPTIONAL_PACKAGES[missing]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
