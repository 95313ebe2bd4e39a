"""Decode throughput: our PolicyEngine vs transformers' `generate` (PyTorch), same model and prompts.

One run builds a random HF model (bench/forward.py's builder), loads the same
weights into ours, and decodes the same `--batch` random prompts of
`--prompt-len` tokens for exactly `--new-tokens` greedy tokens on both sides
(no EOS, so lengths are equal):
  ours:  `PolicyEngine.run` (batched prefill into the slots, then `generate_steps`
         with `--steps-per-call` steps per jitted call), `--batch` slots;
  torch: `model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`,
         KV cache on, `torch.inference_mode()`.
Timed end to end (prefill included) after one untimed first call each; the
timed calls interleave. Reported: median wall time, generated tokens/s and the
ratio ours / torch (> 1: ours faster), plus our prefill / decode split, the
fraction of greedy tokens on which the two agree, and slot occupancy: on the
equal-length run and on a continuous-batching run of 2 x batch requests with
mixed lengths (uniform in [N/4, N]) over `--batch` slots.

    ulorl bench decode [--json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from ulorl_jax.bench import forward as fwd
from ulorl_jax.bench import harness


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    fwd.add_model_arguments(parser, model_type="qwen3")
    g = parser.add_argument_group("run")
    g.add_argument("--batch", type=int, default=8, help="prompts = engine slots (default 8)")
    g.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    g.add_argument("--new-tokens", type=int, default=64, help="generated tokens per prompt (default 64)")
    g.add_argument("--steps-per-call", type=int, default=16, help="our decode steps per jitted call (default 16)")
    g.add_argument("--iters", type=int, default=3, help="timed runs per side; median reported (default 3)")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    g.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default 0)")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "decode", "decode tokens/s: our engine vs transformers "
                                    "generate", __doc__, add_arguments, _cli)


def _cli(args) -> int:
    harness.require_torch("bench decode")
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def run(args) -> dict:
    s = {k: getattr(args, k) for k in vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))
         if k != "json"}
    for k in ("batch", "prompt_len", "new_tokens", "steps_per_call", "iters"):
        if s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {s[k]}")
    import jax
    import numpy as np
    import torch

    from ulorl_jax.decode.engine import PolicyEngine, Request
    from ulorl_jax.decode.sampling import GREEDY
    from ulorl_jax.models.hf import from_pretrained

    if s["threads"]:
        torch.set_num_threads(s["threads"])
    load_before = harness.loadavg()
    b, p_len, n = s["batch"], s["prompt_len"], s["new_tokens"]
    fs = {**s, "seq_len": p_len + n, "dtype": "float32", "torch_attention": "sdpa", "torch_experts": "grouped_mm"}
    config = fwd.model_config(fs)
    torch_model = fwd.build_torch_model(config, fs)
    with tempfile.TemporaryDirectory(prefix="ulorl-bench-") as folder:
        torch_model.save_pretrained(folder)
        jax_model = from_pretrained(folder, dtype="float32")
    prompts = np.random.default_rng(s["seed"]).integers(0, s["vocab"], size=(b, p_len), dtype=np.int64)

    engine = PolicyEngine(jax_model, max_concurrent_decodes=b, max_prefill_length=p_len, max_cache_len=p_len + n,
                          prefill_buckets=(p_len,), sampling=GREEDY)
    params = engine.load_params()
    requests = [Request(prompts[i].tolist(), n, i) for i in range(b)]

    def ours():
        return engine.run(params, requests, steps_per_call=s["steps_per_call"])

    input_ids = torch.as_tensor(prompts)

    def theirs():
        with torch.inference_mode():
            return torch_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                        do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                        pad_token_id=0, use_cache=True)

    first = {}
    for name, fn in (("jax", ours), ("torch", theirs)):
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    cpu_before = harness.cpu_sample()
    times = {"jax": [], "torch": []}
    last = {}
    for _ in range(s["iters"]):
        for name, fn in (("jax", ours), ("torch", theirs)):
            t0 = time.perf_counter()
            last[name] = fn()
            times[name].append(time.perf_counter() - t0)
    background = harness.background_load(cpu_before, harness.cpu_sample())

    completions, stats = last["jax"]
    ours_tokens = np.array([c.tokens for c in completions])  # [B, N]
    torch_tokens = last["torch"][:, p_len:].numpy()
    agree = float(np.mean(ours_tokens == torch_tokens))

    # Continuous batching with mixed lengths: 2B requests over B slots.
    budgets = np.random.default_rng(s["seed"] + 1).integers(max(1, n // 4), n + 1, size=2 * b)
    mixed = [Request(prompts[i % b].tolist(), int(budgets[i]), 100 + i) for i in range(2 * b)]
    engine.run(params, mixed, steps_per_call=s["steps_per_call"])  # untimed: compiles its prefill shapes
    t0 = time.perf_counter()
    _, mixed_stats = engine.run(params, mixed, steps_per_call=s["steps_per_call"])
    mixed_s = time.perf_counter() - t0

    # Prefill alone: the batch's prompts into their slots, batched (`prefill_many`, one call) vs one
    # request per call (JetStream's `prefill` + `insert`, a host copy of each first token, as `run` did
    # before batched prefill); and a group of `--batch` samples of one prompt (one shared prefill row).
    group = [Request(prompts[0].tolist(), n, 200 + i) for i in range(b)]

    def batched(reqs):
        state, first = engine.prefill_many(params, engine.init_decode_state(), reqs, list(range(b)))
        jax.block_until_ready(state)
        return first

    def one_per_call(reqs):
        state, first = engine.init_decode_state(), []
        for slot, r in enumerate(reqs):
            prefix, _ = engine.prefill(params=params, padded_tokens=np.asarray(r.prompt_ids), true_length=p_len,
                                       rng=r.key, max_new_tokens=r.max_new_tokens)
            state = engine.insert(prefix, state, slot)
            first.append(jax.device_get((prefix.token, prefix.logprob, prefix.sampling_logprob, prefix.done)))
        jax.block_until_ready(state)
        return first

    prefill_cases = {"batched": lambda: batched(requests), "one_per_call": lambda: one_per_call(requests),
                     "group_batched": lambda: batched(group), "group_one_per_call": lambda: one_per_call(group)}
    prefill_times = {k: [] for k in prefill_cases}
    firsts = {k: fn() for k, fn in prefill_cases.items()}  # compiles; the first tokens, compared below
    for _ in range(max(3, s["iters"])):
        for k, fn in prefill_cases.items():
            t0 = time.perf_counter()
            fn()
            prefill_times[k].append(time.perf_counter() - t0)
    prefill = {k: {"median_s": statistics.median(v), "tokens_per_s": b * p_len / statistics.median(v)}
               for k, v in prefill_times.items()}
    prefill["speedup_batched"] = prefill["one_per_call"]["median_s"] / prefill["batched"]["median_s"]
    prefill["speedup_group"] = prefill["group_one_per_call"]["median_s"] / prefill["group_batched"]["median_s"]
    # Both ways give each request the same first token (and log-prob up to XLA's batch-shape rounding).
    for kind in ("", "group_"):
        batched_first, one = firsts[f"{kind}batched"], firsts[f"{kind}one_per_call"]
        one_tokens = np.array([int(np.asarray(t).reshape(-1)[0]) for t, *_ in one])
        one_logprobs = np.array([float(np.asarray(lp).reshape(-1)[0]) for _, lp, *_ in one])
        prefill[f"{kind}first_tokens_equal"] = bool(np.array_equal(np.asarray(batched_first.tokens), one_tokens))
        prefill[f"{kind}first_logprob_max_diff"] = float(np.abs(np.asarray(batched_first.logprobs)
                                                                - one_logprobs).max())

    tokens = b * n
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "bench": "decode",
        "settings": s,
        "model": {"model_type": config.model_type, "params": int(sum(p.numel() for p in torch_model.parameters())),
                  "torch_attention": torch_model.config._attn_implementation},
        "generated_tokens": tokens,
        "jax": {"median_s": med["jax"], "tokens_per_s": tokens / med["jax"], "times_s": times["jax"],
                "first_call_s": first["jax"], "prefill_s": stats.prefill_seconds, "decode_s": stats.decode_seconds,
                "slot_occupancy": stats.slot_occupancy, "compiled_executables": engine.compile_count()},
        "torch": {"median_s": med["torch"], "tokens_per_s": tokens / med["torch"], "times_s": times["torch"],
                  "first_call_s": first["torch"]},
        "ratio_jax_over_torch": med["torch"] / med["jax"],
        "greedy_token_agreement": agree,
        "continuous_batching": {"requests": 2 * b, "slots": b, "tokens": mixed_stats.tokens_decoded,
                                "seconds": mixed_s, "tokens_per_s": mixed_stats.tokens_decoded / mixed_s,
                                "slot_occupancy": mixed_stats.slot_occupancy},
        "prefill": prefill,
    }
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    result["machine"] = machine
    return result


def format_table(r: dict) -> str:
    s, m, mc, j, t, cb = r["settings"], r["model"], r["machine"], r["jax"], r["torch"], r["continuous_batching"]
    pf = r["prefill"]
    lines = [
        f"ulorl bench decode: {m['model_type']}, {s['layers']} layers, hidden {s['hidden_size']}, vocab {s['vocab']}; "
        f"{m['params']:,} params; float32 greedy",
        f"batch {s['batch']} x (prompt {s['prompt_len']} + {s['new_tokens']} new) = {r['generated_tokens']} generated "
        f"tokens/run; median of {s['iters']}; ours: {s['batch']} slots, {s['steps_per_call']} steps/call; "
        f"torch: generate ({m['torch_attention']}), threads {mc['torch_threads']}",
        "",
        f"{'':<22}{'run ms':>10}{'tok/s':>10}{'first call s':>14}",
        f"{'ours (JAX engine)':<22}{j['median_s'] * 1e3:>10.1f}{j['tokens_per_s']:>10,.0f}{j['first_call_s']:>14.2f}",
        f"{'transformers generate':<22}{t['median_s'] * 1e3:>10.1f}{t['tokens_per_s']:>10,.0f}"
        f"{t['first_call_s']:>14.2f}",
        f"ratio ours / torch: {r['ratio_jax_over_torch']:.2f}x   greedy token agreement: "
        f"{r['greedy_token_agreement']:.3f}",
        f"ours split (last run): prefill {j['prefill_s'] * 1e3:.1f} ms, decode {j['decode_s'] * 1e3:.1f} ms; "
        f"slot occupancy {j['slot_occupancy']:.2f}; {j['compiled_executables']} executables compiled",
        f"continuous batching, {cb['requests']} mixed-length requests on {cb['slots']} slots: {cb['tokens']} tokens "
        f"in {cb['seconds']:.2f}s ({cb['tokens_per_s']:,.0f} tok/s), slot occupancy {cb['slot_occupancy']:.2f}",
        f"prefill of {s['batch']} prompts x {s['prompt_len']} tokens into their slots (median of "
        f"{max(3, s['iters'])}): "
        f"batched {pf['batched']['tokens_per_s']:,.0f} tok/s vs one request per call "
        f"{pf['one_per_call']['tokens_per_s']:,.0f} tok/s ({pf['speedup_batched']:.1f}x); a group of "
        f"{s['batch']} samples of one prompt: {pf['group_batched']['tokens_per_s']:,.0f} vs "
        f"{pf['group_one_per_call']['tokens_per_s']:,.0f} tok/s ({pf['speedup_group']:.1f}x); first tokens "
        f"equal: {pf['first_tokens_equal'] and pf['group_first_tokens_equal']} (log-probs within "
        f"{max(pf['first_logprob_max_diff'], pf['group_first_logprob_max_diff']):.1e})",
        f"machine: {mc['cpu']}, {mc['cpus_usable']} usable CPUs; JAX {mc['jax']}, torch {mc['torch']}, "
        f"transformers {mc['transformers']}; load avg before {mc['loadavg_before']} after {mc['loadavg_after']}; "
        f"{mc['date']}",
    ]
    lines += [line for line in (harness.cpu_load_line(mc),) if line]
    return "\n".join(lines)
