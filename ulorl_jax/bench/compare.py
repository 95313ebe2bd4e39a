"""XLA vs PyTorch side by side: learner step and decode for the same Qwen3-MoE config and tokens.

    ulorl bench compare [--json] [--torch-compile off|learner|all]

One run builds a random transformers `Qwen3MoeForCausalLM` (bench/forward.py's
builder), loads the same weights into ours, and measures, interleaved:
  learner step (forward + backward + AdamW, the UloRL loss of bench/learner.py
  on the same samples): JAX `Learner.update` vs PyTorch eager, and PyTorch with
  `torch.compile` on the model (inductor) where it compiles;
  forward to logits (`--forward`; on in the sweep): the model on the learner's
  rows in one call, JAX `nnx.jit` vs PyTorch eager / compiled under
  `inference_mode`;
  decode (greedy, fixed length, KV cache): our `PolicyEngine.run` vs
  transformers `generate` eager (and `torch.compile`d forward with a static
  cache with `--torch-compile all`).
Reported: tokens/s, ratios JAX / torch (> 1: JAX faster), peak RSS growth
during a step (both frameworks allocate in this process), XLA's temp buffers,
first-call (compile) times, the backend (CPU here; GPU when one is present).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from ulorl_jax import choices
from ulorl_jax.bench import forward as fwd
from ulorl_jax.bench import harness
from ulorl_jax.bench import learner as bl


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model (Qwen3-MoE)")
    g.add_argument("--hidden-size", type=int, default=128, help="default 128")
    g.add_argument("--layers", type=int, default=2, help="default 2")
    g.add_argument("--experts", type=int, default=8, help="default 8")
    g.add_argument("--top-k", type=int, default=2, help="default 2")
    g.add_argument("--moe-intermediate-size", type=int, default=64, help="default 64")
    g.add_argument("--vocab", type=int, default=2048, help="default 2048")
    g = parser.add_argument_group("workload")
    g.add_argument("--samples", type=int, default=4, help="learner samples per step (default 4)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per learner sample (default 128)")
    g.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (learner and decode; default 16)")
    g.add_argument("--decode-batch", type=int, default=4, help="decode prompts = engine slots (default 4)")
    g.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per prompt (default 32)")
    g.add_argument("--logprob-chunk", type=int, default=1024,
                   help="JAX learner's log-prob / entropy chunk in positions, at most the row length (default "
                        "1024, trainer.logprob_chunk's default; torch's step computes a row's logits at once)")
    g.add_argument("--remat", choices=choices.REMAT, default="full",
                   help="JAX learner's remat policy (default full, trainer.remat's default; torch eager keeps "
                        "every activation, as `none` does)")
    g.add_argument("--iters", type=int, default=3, help="timed repetitions; median reported (default 3)")
    g.add_argument("--torch-compile", choices=["off", "learner", "all"], default="learner",
                   help="torch.compile the learner model (default), also the decode forward (all), or neither")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    g.add_argument("--attention-impl", choices=["blockwise", "xla", "cudnn", "pallas"], default="blockwise",
                   help="JAX side's attention (default blockwise; xla = the materialised reference)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="device of the torch side (default cpu; JAX uses its default backend)")
    g.add_argument("--seed", type=int, default=0, help="default 0")
    g.add_argument("--skip-decode", action="store_true", help="no decode comparison")
    g.add_argument("--forward", action="store_true",
                   help="also time the model forward to logits on the learner's rows (on in the sweep)")
    g = parser.add_argument_group("sequence-length sweep")
    g.add_argument("--sweep-seq-lens", default=None, metavar="L1,L2,...",
                   help="learner step at each row length with the same total tokens (e.g. 256,2048,8192), "
                        "one table; decode is skipped")
    g.add_argument("--sweep-tokens", type=int, default=8192, help="tokens per learner step in the sweep (default 8192)")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def settings(args) -> dict:
    defaults = vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))
    return {k: getattr(args, k, v) for k, v in defaults.items() if k not in ("json", "sweep_seq_lens", "sweep_tokens")}


def run(args) -> dict:
    s = settings(args)
    for k in ("hidden_size", "layers", "experts", "top_k", "vocab", "samples", "seq_len", "prompt_len",
              "decode_batch", "new_tokens", "iters", "moe_intermediate_size", "logprob_chunk"):
        if s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {s[k]}")
    if s["prompt_len"] >= s["seq_len"]:
        raise ValueError(f"--prompt-len={s['prompt_len']} must be < --seq-len={s['seq_len']}")
    import jax
    import numpy as np
    import torch

    from ulorl_jax.decode.engine import PolicyEngine, Request
    from ulorl_jax.decode.sampling import GREEDY
    from ulorl_jax.models.hf import from_pretrained
    from ulorl_jax.rl.learner import Learner, LearnerConfig

    if s["threads"]:
        torch.set_num_threads(s["threads"])
    load_before = harness.loadavg()
    ls = {**bl.settings(argparse.Namespace()), "model_type": "qwen3_moe", "hidden_size": s["hidden_size"],
          "layers": s["layers"], "experts": s["experts"], "top_k": s["top_k"],
          "moe_intermediate_size": s["moe_intermediate_size"], "vocab": s["vocab"], "samples": s["samples"],
          "seq_len": max(s["seq_len"], s["prompt_len"] + s["new_tokens"]), "prompt_len": s["prompt_len"],
          "micro_batch_rows": 1, "seed": s["seed"], "threads": s["threads"]}
    ls["seq_len"] = s["seq_len"]
    fs = bl.forward_settings(ls)
    fs["seq_len"] = max(s["seq_len"], s["prompt_len"] + s["new_tokens"])
    config = fwd.model_config(fs)
    torch_model = fwd.build_torch_model(config, fs)
    with tempfile.TemporaryDirectory(prefix="ulorl-bench-") as folder:
        torch_model.save_pretrained(folder)
        jax_model = from_pretrained(folder, dtype="float32", attention_impl=s["attention_impl"])
        torch_compiled_src = fwd.build_torch_model(config, fs)  # same seed: same weights, separate optimizer
    device = torch.device(s["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (a CPU-only torch build, or no GPU)")
    torch_model.to(device)
    torch_compiled_src.to(device)
    result = {"bench": "compare", "settings": s, "backend": {"jax": jax.default_backend(), "torch": device.type},
              "model": {"model_type": "qwen3_moe", "params": int(sum(p.numel() for p in torch_model.parameters()))}}

    # -- learner step -------------------------------------------------------------------
    lconf = LearnerConfig(lr=1e-6, row_len=s["seq_len"], micro_batch_rows=1,
                          logprob_chunk=min(s["logprob_chunk"], s["seq_len"]),
                          remat=s["remat"], mask_mode="dmmpt")
    learner = Learner(jax_model, lconf)
    samples = bl.make_samples(ls, np)
    cases = {"jax": lambda: learner.update(samples), "torch_eager": bl.torch_step_fn(torch_model, samples, lconf, ls)}
    compile_note, compiled_model = "off", None
    if s["torch_compile"] in ("learner", "all"):
        try:
            compiled_model = torch.compile(torch_compiled_src)
            cases["torch_compile"] = bl.torch_step_fn(compiled_model, samples, lconf, ls)
            compile_note = "ok"
        except Exception as err:  # noqa: BLE001  (reported, not fatal)
            compile_note = f"failed: {type(err).__name__}: {err}"[:300]
    cpu_before = harness.cpu_sample()
    learn, _ = _time_cases(cases, s["iters"], s["samples"] * s["seq_len"], compile_note)
    learn["jax"]["xla_temp_bytes"] = int(learner.lower_update(samples).compile()
                                         .memory_analysis().temp_size_in_bytes)
    result["learner_step"] = learn

    if s["forward"]:
        compiled_ran = "tokens_per_s" in learn["torch_compile"]  # created, and its first call compiled
        result["forward"] = _forward(s, learner.model, torch_model, compiled_model if compiled_ran else None)
    if s["skip_decode"]:
        machine = harness.machine_info()
        machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(),
                       cpu_during_timing=harness.background_load(cpu_before, harness.cpu_sample()))
        result["machine"] = machine
        return result

    # -- decode -------------------------------------------------------------------------
    b, p_len, n = s["decode_batch"], s["prompt_len"], s["new_tokens"]
    prompts = np.random.default_rng(s["seed"] + 1).integers(0, s["vocab"], size=(b, p_len), dtype=np.int64)
    engine = PolicyEngine(learner.model, max_concurrent_decodes=b, max_prefill_length=p_len,
                          max_cache_len=p_len + n, prefill_buckets=(p_len,), sampling=GREEDY)
    params = learner.params  # the learner's current weights, no copy (params are an argument)
    requests = [Request(prompts[i].tolist(), n, i) for i in range(b)]
    ids = torch.as_tensor(prompts, device=device)
    torch_model.eval()

    def torch_generate(model, **kw):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0, **kw)
        return out.cpu()  # a host copy, as the engine returns: the timing includes the device's work

    dcases = {"jax": lambda: engine.run(params, requests, steps_per_call=16),
              "torch_eager": lambda: torch_generate(torch_model)}
    dnote = "off (--torch-compile all to try)"
    if s["torch_compile"] == "all":
        try:
            torch_model.forward = torch.compile(torch_model.forward)
            dcases["torch_compile"] = lambda: torch_generate(torch_model, cache_implementation="static")
            dnote = "ok"
        except Exception as err:  # noqa: BLE001
            dnote = f"failed: {type(err).__name__}: {str(err)[:240]}"
    dec, last = _time_cases(dcases, s["iters"], b * n, dnote)
    background = harness.background_load(cpu_before, harness.cpu_sample())
    ours = np.array([c.tokens for c in last["jax"][0]])  # [B, N]
    # Both models took the same number of identical updates (lr 1e-6), so greedy tokens should agree.
    dec["greedy_token_agreement"] = float(np.mean(ours == last["torch_eager"][:, p_len:].numpy()))
    result["decode"] = dec
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    result["machine"] = machine
    return result


def _time_cases(cases: dict, iters: int, n_tokens: int, compile_note: str) -> tuple[dict, dict]:
    """One first call each (JAX compiles, torch.compile compiles: a failure there is reported, not raised),
    then `iters` interleaved timed calls -> ({name: timing stats + first call + peak RSS growth, ratios,
    "torch_compile": {"status": ...}}, {name: the last call's result})."""
    first = {}
    for name in list(cases):
        t0 = time.perf_counter()
        try:
            cases[name]()
        except Exception as err:  # noqa: BLE001  (torch.compile errors surface at the first call)
            if name != "torch_compile":
                raise
            compile_note = f"failed: {type(err).__name__}: {str(err)[:240]}"
            del cases[name]
            continue
        first[name] = time.perf_counter() - t0
    times = {k: [] for k in cases}
    peak = {k: 0 for k in cases}
    last = {}
    for _ in range(iters):
        for name, fn in cases.items():
            with harness.PeakRSS() as rss:
                t0 = time.perf_counter()
                last[name] = fn()
                times[name].append(time.perf_counter() - t0)
            peak[name] = max(peak[name], rss.growth)
    out = {name: {**harness.timing_stats(times[name], n_tokens), "first_call_s": first[name],
                  "peak_rss_growth_bytes": peak[name]} for name in cases}
    for name in cases:
        if name != "jax":
            out[f"ratio_jax_over_{name}"] = out["jax"]["tokens_per_s"] / out[name]["tokens_per_s"]
    out["torch_compile"] = out.get("torch_compile", {}) | {"status": compile_note}
    return out, last


def _forward(s: dict, jax_model, torch_model, torch_compiled) -> dict:
    """The model forward to logits on the learner's rows (all of them in one call): JAX `nnx.jit` vs torch
    under `inference_mode`, eager and (when the learner's compiled) `torch.compile`d."""
    import jax
    import numpy as np
    import torch
    from flax import nnx

    tokens = np.random.default_rng(s["seed"] + 2).integers(0, s["vocab"], size=(s["samples"], s["seq_len"]))
    tokens_jax = jax.numpy.asarray(tokens, jax.numpy.int32)
    tokens_torch = torch.as_tensor(tokens, dtype=torch.long, device=next(torch_model.parameters()).device)
    jax_forward = nnx.jit(lambda model, t: model(t))

    def torch_forward(model):
        with torch.inference_mode():
            logits = model(input_ids=tokens_torch).logits
        if tokens_torch.device.type == "cuda":
            torch.cuda.synchronize()
        return logits

    cases = {"jax": lambda: jax.block_until_ready(jax_forward(jax_model, tokens_jax)),
             "torch_eager": lambda: torch_forward(torch_model)}
    if torch_compiled is not None:
        cases["torch_compile"] = lambda: torch_forward(torch_compiled)
    note = "ok" if torch_compiled is not None else "off"
    return _time_cases(cases, s["iters"], s["samples"] * s["seq_len"], note)[0]


def run_sweep(args) -> dict:
    """The learner step at each of --sweep-seq-lens with --sweep-tokens tokens per step, side by side."""
    try:
        lengths = [int(x) for x in str(args.sweep_seq_lens).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-seq-lens must be comma-separated integers, got {args.sweep_seq_lens!r}") from None
    if not lengths or any(n < 1 or args.sweep_tokens % n for n in lengths):
        raise ValueError(f"--sweep-seq-lens {args.sweep_seq_lens}: every length must divide --sweep-tokens "
                         f"{args.sweep_tokens}")
    rows = []
    for length in lengths:
        one = argparse.Namespace(**{**vars(args), "seq_len": length, "samples": args.sweep_tokens // length,
                                    "skip_decode": True, "forward": True})
        r = run(one)
        rows.append({"seq_len": length, "samples": one.samples, "learner_step": r["learner_step"],
                     "forward": r["forward"], "machine": r["machine"]})
    return {"bench": "compare-sweep", "tokens_per_step": args.sweep_tokens, "settings": settings(args),
            "backend": r["backend"], "model": r["model"], "rows": rows}


def format_sweep(r: dict) -> str:
    lines = [f"ulorl bench compare sweep: {r['tokens_per_step']:,} tokens per step; JAX on "
             f"{r['backend']['jax'].upper()}, torch on {r['backend']['torch'].upper()}; attention_impl "
             f"{r['settings']['attention_impl']}, remat {r['settings']['remat']}"]
    for key, title in (("learner_step", "learner step (UloRL loss + AdamW)"), ("forward", "forward to logits")):
        lines += ["", title,
                  f"{'row':>6}{'rows':>6}{'JAX tok/s':>11}{'eager tok/s':>13}{'JAX/eager':>11}{'compile tok/s':>15}"
                  f"{'JAX/compile':>13}{'JAX RSS MiB':>13}{'eager RSS MiB':>15}"
                  + (f"{'XLA temp MiB':>14}" if key == "learner_step" else "")]
        for row in r["rows"]:
            L = row[key]
            comp = L.get("torch_compile", {})
            lines.append(
                f"{row['seq_len']:>6}{row['samples']:>6}{L['jax']['tokens_per_s']:>11,.0f}"
                f"{L['torch_eager']['tokens_per_s']:>13,.0f}{L['ratio_jax_over_torch_eager']:>11.2f}"
                + (f"{comp['tokens_per_s']:>15,.0f}{L['ratio_jax_over_torch_compile']:>13.2f}"
                   if "tokens_per_s" in comp else f"{'-':>15}{'-':>13}")
                + f"{L['jax']['peak_rss_growth_bytes'] / 2**20:>13.1f}"
                  f"{L['torch_eager']['peak_rss_growth_bytes'] / 2**20:>15.1f}"
                + (f"{L['jax']['xla_temp_bytes'] / 2**20:>14.1f}" if key == "learner_step" else ""))
    mc = r["rows"][-1]["machine"]
    lines.append(f"machine: {mc['cpu']}, {mc['cpus_usable']} usable CPUs; JAX {mc['jax']}, torch {mc['torch']}; "
                 f"{mc['date']}")
    return "\n".join(lines)


def format_table(r: dict) -> str:
    s, mc, L = r["settings"], r["machine"], r["learner_step"]
    dev = f"JAX on {r['backend']['jax'].upper()}, torch on {r['backend']['torch'].upper()}"
    lines = [f"ulorl bench compare: qwen3_moe {r['model']['params']:,} params (hidden {s['hidden_size']}, "
             f"{s['layers']} layers, {s['experts']} experts top-{s['top_k']}, vocab {s['vocab']}); {dev}",
             "", f"learner step: {s['samples']} samples x {s['seq_len']} tokens, UloRL loss + AdamW, JAX remat "
                 f"{s['remat']}, median of {s['iters']}",
             f"{'':<16}{'step ms':>10}{'tokens/s':>11}{'JAX / it':>10}{'peak RSS MiB':>14}{'first call s':>14}"]
    for name in ("jax", "torch_eager", "torch_compile"):
        v = L.get(name, {})
        if "tokens_per_s" not in v:
            continue
        ratio = L.get(f"ratio_jax_over_{name}", 1.0)
        lines.append(f"{name:<16}{v['median_s'] * 1e3:>10.1f}{v['tokens_per_s']:>11,.0f}{ratio:>10.2f}"
                     f"{v['peak_rss_growth_bytes'] / 2**20:>14.1f}{v['first_call_s']:>14.1f}")
    lines.append(f"torch.compile (learner): {L['torch_compile']['status']}; JAX XLA temp buffers "
                 f"{L['jax']['xla_temp_bytes'] / 2**20:.1f} MiB")
    if "forward" in r:
        F = r["forward"]
        lines += ["", f"forward to logits: {s['samples']} x {s['seq_len']} tokens in one call, median of {s['iters']}",
                  f"{'':<16}{'call ms':>10}{'tokens/s':>11}{'JAX / it':>10}{'peak RSS MiB':>14}{'first call s':>14}"]
        for name in ("jax", "torch_eager", "torch_compile"):
            v = F.get(name, {})
            if "tokens_per_s" in v:
                lines.append(f"{name:<16}{v['median_s'] * 1e3:>10.1f}{v['tokens_per_s']:>11,.0f}"
                             f"{F.get(f'ratio_jax_over_{name}', 1.0):>10.2f}"
                             f"{v['peak_rss_growth_bytes'] / 2**20:>14.1f}{v['first_call_s']:>14.1f}")
    if "decode" not in r:
        return "\n".join(lines)
    D = r["decode"]
    lines += ["", f"decode: {s['decode_batch']} prompts x ({s['prompt_len']} + {s['new_tokens']} greedy), median of "
                  f"{s['iters']}", f"{'':<16}{'run ms':>10}{'tokens/s':>11}{'JAX / it':>10}{'first call s':>14}"]
    for name in ("jax", "torch_eager", "torch_compile"):
        v = D.get(name, {})
        if "tokens_per_s" not in v:
            continue
        ratio = D.get(f"ratio_jax_over_{name}", 1.0)
        lines.append(f"{name:<16}{v['median_s'] * 1e3:>10.1f}{v['tokens_per_s']:>11,.0f}{ratio:>10.2f}"
                     f"{v['first_call_s']:>14.1f}")
    lines.append(f"torch.compile (decode): {D['torch_compile']['status']}; greedy token agreement JAX vs torch "
                 f"{D['greedy_token_agreement']:.3f}")
    lines.append(f"machine: {mc['cpu']}, {mc['cpus_usable']} usable CPUs; JAX {mc['jax']}, torch {mc['torch']}, "
                 f"transformers {mc['transformers']}; load avg {mc['loadavg_before']} -> {mc['loadavg_after']}; "
                 f"{mc['date']}")
    lines += [line for line in (harness.cpu_load_line(mc),) if line]
    return "\n".join(lines)


def _cli(args) -> int:
    harness.require_torch("bench compare")
    if args.sweep_seq_lens:
        result = run_sweep(args)
        return harness.print_result(result, format_sweep(result), args.json)
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "compare", "XLA vs PyTorch: learner step and decode, same "
                                    "Qwen3-MoE and tokens (eager and torch.compile)", __doc__, add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.compare", __doc__, add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
