"""Paged vs dense KV cache under one KV memory budget: samples in flight and wall time (issue 16).

    ulorl bench kv [--requests 64] [--global-max-len 512] [--dense-slots 4] [--json]

One long-tailed workload (the segments bench's length distribution, `segment_cost.LengthDistribution`:
each request asks for exactly its drawn length, and no EOS ends it early) runs through the real
`PolicyEngine`, greedy, twice:
- dense: `--dense-slots` slots, each a KV row of prompt + global max positions;
- paged: the same KV memory as pages of `--page-size` positions (dense slots x max length / page size),
  shared by `--paged-slots` slots; samples are admitted while pages last and preempted when they run
  out (then prefilled again, or with `--preemption swap` their pages copied to host memory and back).
Each engine runs the workload once to compile, then `--repeats` timed runs (median reported). Reported:
mean samples in flight per decode step, wall seconds, tokens/s, preemptions, where the wall time went
(decode calls, prefill calls, swap copies, the host loop; ms per decode step), and whether every request's greedy
tokens are equal. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ulorl_jax.bench import harness
from ulorl_jax.bench import segment_cost as sc
from ulorl_jax.choices import PREEMPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=64, help="requests in the workload (default 64)")
    g.add_argument("--global-max-len", type=int, default=512, help="max new tokens of a request (default 512)")
    g.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    g.add_argument("--body", type=float, default=0.8, help="fraction of lengths uniform in [1, max/2] (default 0.8)")
    g.add_argument("--truncated", type=float, default=0.05,
                   help="fraction running to the global max (default 0.05); the rest: (max/2, max]")
    g.add_argument("--seed", type=int, default=0, help="lengths and prompts (default 0)")
    g = parser.add_argument_group("engines")
    g.add_argument("--dense-slots", type=int, default=4,
                   help="dense cache slots; their KV memory is both engines' budget (default 4)")
    g.add_argument("--paged-slots", type=int, default=16,
                   help="paged cache slots (default 16: about what the pool holds for these lengths; an idle "
                        "slot still costs decode work)")
    g.add_argument("--page-size", type=int, default=16, help="positions per KV page (default 16)")
    g.add_argument("--preemption", choices=PREEMPTIONS, default="recompute",
                   help="the paged engine's preempted samples: prefilled again (recompute, the default) or "
                        "their pages kept in host memory (swap)")
    g.add_argument("--steps-per-call", type=int, default=8, help="decode steps per jitted call (default 8)")
    g.add_argument("--repeats", type=int, default=2, help="timed runs per engine after the compile run (default 2)")
    g = parser.add_argument_group("model (tiny Qwen3)")
    g.add_argument("--hidden-size", type=int, default=64, help="default 64")
    g.add_argument("--layers", type=int, default=2, help="default 2")
    g.add_argument("--vocab", type=int, default=512, help="default 512")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def _workload(s: dict):
    from ulorl_jax.decode.engine import Request

    dist = sc.LengthDistribution(s["global_max_len"], body=s["body"], truncated=s["truncated"], seed=s["seed"])
    rng = np.random.default_rng(s["seed"])
    reqs = [Request(rng.integers(1, s["vocab"], size=s["prompt_len"]).tolist(),
                    min(dist(uid), s["global_max_len"]), uid) for uid in range(s["requests"])]
    return dist, reqs


def _measure(engine, reqs, repeats: int, steps_per_call: int) -> tuple[dict, list]:
    params = engine.load_params()
    engine.run(params, reqs, steps_per_call=steps_per_call)  # compile every shape the workload needs
    times, stats, out = [], None, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, stats = engine.run(params, reqs, steps_per_call=steps_per_call)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    # Where the last timed run's wall time went: decode calls (jitted steps + reading their tokens back),
    # prefill calls, swap copies (preemption="swap"), and the host loop between them (admission, pages,
    # bookkeeping).
    split = {"decode_s": stats.decode_seconds, "prefill_s": stats.prefill_seconds, "swap_s": stats.swap_seconds,
             "host_s": times[-1] - stats.decode_seconds - stats.prefill_seconds - stats.swap_seconds,
             "ms_per_decode_step": 1e3 * stats.decode_seconds / max(stats.decode_steps, 1)}
    return {"in_flight": stats.in_flight, "seconds": seconds, "times_s": times, **split,
            "tokens_per_s": stats.tokens_decoded / seconds, "tokens": stats.tokens_decoded,
            "slots": engine.max_concurrent_decodes, "kv_positions": _kv_positions(engine),
            "preemptions": stats.preemptions, "peak_pages": stats.peak_pages,
            "prefill_calls": stats.prefill_calls, "decode_calls": stats.generate_calls}, out


def _kv_positions(engine) -> int:
    if engine.paged:
        return engine.num_pages * engine.page_size
    return engine.max_concurrent_decodes * engine.max_cache_len


def run(args) -> dict:
    s = {k: v for k, v in vars(args).items() if k not in ("json", "func", "command", "bench")}
    for name in ("requests", "global_max_len", "prompt_len", "dense_slots", "paged_slots", "page_size",
                 "steps_per_call", "repeats", "hidden_size", "layers", "vocab"):
        if not isinstance(s[name], int) or s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {s[name]!r}")
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import GREEDY
    from ulorl_jax.models import init_model, tiny_config

    dist, reqs = _workload(s)
    max_len = s["prompt_len"] + s["global_max_len"]
    model = init_model(tiny_config("qwen3", vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                                   intermediate_size=2 * s["hidden_size"], num_hidden_layers=s["layers"],
                                   num_attention_heads=max(1, s["hidden_size"] // 16), num_key_value_heads=1,
                                   head_dim=16, max_position_embeddings=max(2048, max_len)), seed=s["seed"])
    common = dict(max_prefill_length=s["prompt_len"], max_cache_len=max_len, sampling=GREEDY)
    dense = PolicyEngine(model, max_concurrent_decodes=s["dense_slots"], kv_cache="dense", **common)
    pages = s["dense_slots"] * max_len // s["page_size"]  # the dense cache's memory, whole pages
    paged = PolicyEngine(model, max_concurrent_decodes=s["paged_slots"], kv_cache="paged", page_size=s["page_size"],
                         num_pages=pages, preemption=s["preemption"], **common)
    load_before, cpu_before = harness.loadavg(), harness.cpu_sample()
    out = {}
    completions = {}
    for name, engine in (("dense", dense), ("paged", paged)):
        out[name], completions[name] = _measure(engine, reqs, s["repeats"], s["steps_per_call"])
    background = harness.background_load(cpu_before, harness.cpu_sample())
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    equal = all(a.tokens == b.tokens for a, b in zip(completions["dense"], completions["paged"]))
    return {"bench": "kv", "settings": s, "length_distribution": dist.describe(), **out,
            "in_flight_ratio": out["paged"]["in_flight"] / out["dense"]["in_flight"],
            "speedup": out["dense"]["seconds"] / out["paged"]["seconds"], "greedy_equal": equal, "machine": machine}


def format_table(r: dict) -> str:
    s = r["settings"]
    lines = [f"KV cache: {s['requests']} requests, lengths {r['length_distribution']}; prompt {s['prompt_len']}, "
             f"tiny Qwen3 (hidden {s['hidden_size']}, {s['layers']} layers), greedy; paged preemption: "
             f"{s['preemption']}",
             f"{'cache':<6} {'slots':>5} {'KV positions':>12} {'in flight':>9} {'seconds':>8} {'tokens/s':>9} "
             f"{'preempted':>9} {'peak pages':>10} {'ms/step':>7} {'decode':>6} {'prefill':>7} {'swap':>5} {'host':>5}"]
    for name in ("dense", "paged"):
        x = r[name]
        peak = f"{x['peak_pages']}" if name == "paged" else "-"
        lines.append(f"{name:<6} {x['slots']:>5} {x['kv_positions']:>12} {x['in_flight']:>9.1f} {x['seconds']:>8.2f} "
                     f"{x['tokens_per_s']:>9.0f} {x['preemptions']:>9} {peak:>10} {x['ms_per_decode_step']:>7.3f} "
                     f"{x['decode_s']:>6.2f} {x['prefill_s']:>7.2f} {x['swap_s']:>5.2f} {x['host_s']:>5.2f}")
    lines.append("(ms/step: wall of a decode call / its steps; decode, prefill, swap, host: seconds of the last timed "
                 "run)")
    lines.append(f"paged / dense: {r['in_flight_ratio']:.2f}x samples in flight, {r['speedup']:.2f}x faster; "
                 f"greedy tokens equal: {r['greedy_equal']}")
    lines += [line for line in (harness.cpu_load_line(r["machine"]),) if line]
    return "\n".join(lines)


def _cli(args) -> int:
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "kv", "paged vs dense KV cache under one memory budget: "
                                    "samples in flight, wall time, equal greedy tokens", __doc__, add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.kv", __doc__, add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
