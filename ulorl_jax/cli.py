"""`ulorl` command line: demo, convert, bench.

Each subcommand has its own `--help`. Every `ulorl bench ...` prints a table
and, with `--json`, one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _demo(args) -> int:
    """Build a tiny Qwen3-MoE policy, run a forward pass and a few decode steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ulorl_jax.models import init_model, tiny_config

    config = tiny_config("qwen3_moe")
    model = init_model(config, seed=args.seed)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, config.vocab_size, (2, 16)), jnp.int32)
    start = time.perf_counter()
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    logits.block_until_ready()
    forward_s = time.perf_counter() - start

    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    cache = model.init_cache(2, 16 + args.new_tokens)
    last, cache = step(model, tokens, cache)
    generated = []
    for _ in range(args.new_tokens):  # greedy
        nxt = jnp.argmax(last[:, -1], axis=-1)[:, None].astype(jnp.int32)
        generated.append(np.asarray(nxt)[:, 0])
        last, cache = step(model, nxt, cache)
    print(f"ulorl demo: tiny {config.model_type} policy, {params:,} parameters, "
          f"{config.num_hidden_layers} layers, {config.num_experts} experts (top-{config.num_experts_per_tok})")
    print(f"backend: {jax.default_backend()} ({jax.device_count()} device(s))")
    print(f"forward: tokens {tuple(tokens.shape)} -> logits {tuple(logits.shape)} {logits.dtype} "
          f"in {forward_s:.2f}s (incl. compile)")
    print("logits[0, -1, :5] = [" + ", ".join(f"{v:+.4f}" for v in np.asarray(logits[0, -1, :5])) + "]")
    print(f"greedy continuation (KV cache, {args.new_tokens} tokens): {np.stack(generated, 1).tolist()}")
    print("(the UloRL training demo is not built yet; see README status table)")
    return 0


def _convert(args) -> int:
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
    print(f"converted {args.src} -> {args.dst} ({args.direction}, {model.config.model_type}, "
          f"{model.config.param_dtype}) in {time.perf_counter() - start:.1f}s")
    return 0


def _bench_forward(args) -> int:
    from ulorl_jax.bench import forward

    try:
        import torch  # noqa: F401  (the PyTorch side of the comparison)
    except ModuleNotFoundError:
        raise ValueError("bench forward compares against PyTorch: install it with pip install -e '.[test]'") from None
    result = forward.run(args)
    print(forward.format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ulorl",
        description="UloRL (ultra-long output RL) on Qwen3 / Qwen3-MoE in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="build a tiny Qwen3-MoE policy and run it (CPU, seconds)",
                          description=_demo.__doc__)
    demo.add_argument("--seed", type=int, default=0, help="weight and token seed (default 0)")
    demo.add_argument("--new-tokens", type=int, default=8, help="greedy tokens to decode (default 8)")
    demo.set_defaults(func=_demo)

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

    bench = sub.add_parser("bench", help="benchmarks; each prints a table (and JSON with --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    fwd = bench_sub.add_parser("forward", help="forward and forward+backward tokens/s: JAX vs PyTorch (HF)",
                               description="Same config, same weights, same tokens, side by side in one run.")
    from ulorl_jax.bench import forward

    forward.add_arguments(fwd)
    fwd.set_defaults(func=_bench_forward)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # our errors name the bad thing: show them plainly
        print(f"ulorl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
