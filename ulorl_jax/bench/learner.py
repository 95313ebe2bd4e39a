"""Learner train-step throughput and memory: our jitted step vs a PyTorch step on transformers' model.

One run builds a random transformers Qwen3 / Qwen3-MoE (`bench.forward`'s
helpers), loads the same weights into ours, and trains both on the same
samples (prompt + response token ids, GRPO-style advantages, rewards) with the
same UloRL loss: POIS ratio (first update, π_old = this policy), PPO clip,
DMMPT mask (per-sample entropy H̄_i, τ, σ), token-mean (Eq. 10), AdamW with
grad-norm clipping, the same micro-batching (`--micro-batch-rows` rows per
micro-batch, gradients accumulated). Every sample is exactly `--seq-len`
tokens, so packing gives one sample per row and both sides see identical
[rows, seq_len] tensors.

Measured, interleaved so background load hits both alike:
  JAX: `Learner.update(samples)` (host packing + transfer + jitted step);
  torch: the eager loop below (forward, full-vocab log-softmax in float32,
  loss, backward per micro-batch; clip; AdamW step).
Memory: peak RSS growth of this process during one step (sampled every ms;
both frameworks allocate from the same process), and for JAX also XLA's
compiled temp-buffer size. Then `--mem-lengths`: XLA temp memory of the
compiled step for one row of L tokens on a tiny model (compile only), to show
how memory grows with sequence length.

    python -m ulorl_jax.bench.learner [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ulorl_jax.bench import forward as fwd
from ulorl_jax.bench import harness


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model")
    g.add_argument("--model-type", choices=["qwen3", "qwen3_moe"], default="qwen3", help="default qwen3")
    g.add_argument("--hidden-size", type=int, default=128, help="default 128")
    g.add_argument("--layers", type=int, default=2, help="default 2")
    g.add_argument("--heads", type=int, default=4, help="default 4")
    g.add_argument("--kv-heads", type=int, default=2, help="default 2")
    g.add_argument("--head-dim", type=int, default=32, help="default 32")
    g.add_argument("--intermediate-size", type=int, default=256, help="default 256")
    g.add_argument("--experts", type=int, default=4, help="default 4")
    g.add_argument("--top-k", type=int, default=2, help="default 2")
    g.add_argument("--moe-intermediate-size", type=int, default=64, help="default 64")
    g.add_argument("--vocab", type=int, default=2048, help="default 2048")
    g = parser.add_argument_group("step")
    g.add_argument("--samples", type=int, default=8, help="samples per step (default 8)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sample = row length (default 256)")
    g.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sample (default 32)")
    g.add_argument("--micro-batch-rows", type=int, default=2, help="rows per micro-batch (default 2)")
    g.add_argument("--logprob-chunk", type=int, default=128, help="JAX log-prob/entropy chunk (default 128)")
    g.add_argument("--remat", default="full", help="JAX remat policy (default full)")
    g.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default 1)")
    g.add_argument("--iters", type=int, default=3, help="timed steps; median reported (default 3)")
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    g.add_argument("--seed", type=int, default=0, help="default 0")
    g.add_argument("--mem-lengths", default="1024,4096,16384",
                   help="sequence lengths for the memory-vs-length table ('' to skip; default 1024,4096,16384)")
    g.add_argument("--mem-attention", choices=["pallas", "xla", "both"], default="pallas",
                   help="attention of the memory table: pallas (flash, the long-context path; CPU interpret "
                        "mode), xla (materialises [T, T] scores: quadratic), or both (default pallas)")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def settings(args) -> dict:
    defaults = vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))
    return {k: getattr(args, k, v) for k, v in defaults.items() if k != "json"}


def forward_settings(s: dict) -> dict:
    base = fwd.settings(argparse.Namespace())
    base.update({k: s[k] for k in ("model_type", "hidden_size", "layers", "heads", "kv_heads", "head_dim",
                                   "intermediate_size", "experts", "top_k", "moe_intermediate_size", "vocab",
                                   "seed", "threads")})
    base.update(seq_len=s["seq_len"], dtype="float32", torch_attention="sdpa", torch_experts="grouped_mm")
    return base


def make_samples(s: dict, np):
    from ulorl_jax.rl.learner import TrainSample

    rng = np.random.default_rng(s["seed"])
    n, p, o = s["samples"], s["prompt_len"], s["seq_len"] - s["prompt_len"]
    rewards = (np.arange(n) % 2).astype(np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    return [TrainSample(rng.integers(0, s["vocab"], p).tolist(), rng.integers(0, s["vocab"], o).tolist(),
                        float(adv[i]), float(rewards[i])) for i in range(n)]


def torch_step_fn(model, samples, config, s: dict):
    """The same UloRL update in eager PyTorch on transformers' model."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                            eps=config.eps, weight_decay=config.weight_decay)
    device = next(model.parameters()).device
    seqs = torch.as_tensor([x.prompt_ids + x.response_ids for x in samples], dtype=torch.long,
                           device=device)  # [N, L]
    p = s["prompt_len"]
    resp = torch.zeros(seqs.shape, dtype=torch.float32, device=device)
    resp[:, p - 1:-1] = 1.0  # position t scores token t+1
    adv = torch.tensor([x.advantage for x in samples], device=device)[:, None]
    reward = torch.tensor([x.reward for x in samples], device=device)[:, None]
    n_tokens = resp.sum()
    r = s["micro_batch_rows"]

    def step():
        model.train()
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(samples), r):
            ids, m = seqs[i:i + r], resp[i:i + r]
            logits = model(input_ids=ids).logits.float() / config.temperature  # [r, L, V]
            logp_all = torch.log_softmax(logits, dim=-1)
            targets = torch.roll(ids, -1, dims=1)
            logp = logp_all.gather(-1, targets[..., None])[..., 0]
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                hbar = (entropy * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
                mpt = (reward[i:i + r] == 1) & (logp.exp() >= config.tau) & (m > 0)
                armed = {"none": torch.zeros_like(hbar, dtype=torch.bool), "mpt": torch.ones_like(
                    hbar, dtype=torch.bool), "dmmpt": hbar < config.sigma}[config.mask_mode]
                keep = m * (1.0 - (mpt & armed).float())
            ratio = torch.exp(logp - logp.detach())  # POIS, first update
            a = adv[i:i + r]
            surr = torch.minimum(ratio * a, ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high) * a)
            loss = -(surr * keep).sum() / n_tokens
            loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # time the work, not the launch
        return loss

    return step


def _memory_vs_length(s: dict, lengths: list[int]) -> list[dict]:
    """XLA temp memory of the compiled train step for one row of L tokens (compile only)."""

    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rl.learner import Learner, LearnerConfig, TrainSample

    out = []
    impls = ("xla", "pallas") if s.get("mem_attention", "pallas") == "both" else (s.get("mem_attention", "pallas"),)
    for impl in impls:
        cfg = tiny_config("qwen3", vocab_size=s["vocab"], num_hidden_layers=2, attention_impl=impl,
                          max_position_embeddings=max(lengths))
        for length in lengths:
            learner = Learner(init_model(cfg, 0), LearnerConfig(row_len=length, micro_batch_rows=1,
                                                                logprob_chunk=s["logprob_chunk"],
                                                                remat=s["remat"]))
            sample = TrainSample([1] * 16, [2] * (length - 16), 1.0, 1.0)
            start = time.perf_counter()
            compiled = learner.lower_update([sample]).compile()
            mem = compiled.memory_analysis()
            out.append({"attention": impl, "seq_len": length, "temp_bytes": int(mem.temp_size_in_bytes),
                        "compile_s": time.perf_counter() - start})
    return out


def run(args) -> dict:
    s = settings(args)
    if s["prompt_len"] < 1 or s["prompt_len"] >= s["seq_len"]:
        raise ValueError(f"--prompt-len must be in [1, --seq-len) (got {s['prompt_len']}, {s['seq_len']})")
    if s["iters"] < 1 or s["warmup"] < 0:
        raise ValueError(f"need --iters >= 1 and --warmup >= 0 (got {s['iters']}, {s['warmup']})")
    if s["samples"] % s["micro_batch_rows"]:
        raise ValueError(f"--samples={s['samples']} must be a multiple of --micro-batch-rows")

    import numpy as np
    import torch

    from ulorl_jax.models.hf import from_pretrained
    from ulorl_jax.rl.learner import Learner, LearnerConfig

    fs = forward_settings(s)
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    load_before = harness.loadavg()
    config = fwd.model_config(fs)
    torch_model = fwd.build_torch_model(config, fs)
    with tempfile.TemporaryDirectory(prefix="ulorl-bench-") as folder:
        torch_model.save_pretrained(folder)
        jax_model = from_pretrained(folder, dtype="float32")
    lconf = LearnerConfig(lr=1e-6, row_len=s["seq_len"], micro_batch_rows=s["micro_batch_rows"],
                          logprob_chunk=s["logprob_chunk"], remat=s["remat"], mask_mode="dmmpt")
    learner = Learner(jax_model, lconf)
    samples = make_samples(s, np)
    torch_step = torch_step_fn(torch_model, samples, lconf, s)
    n_tokens = s["samples"] * s["seq_len"]

    cases = {"jax": lambda: learner.update(samples), "torch": torch_step}
    first = {}
    for name, fn in cases.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    for _ in range(s["warmup"]):
        for fn in cases.values():
            fn()
    times = {k: [] for k in cases}
    peak = {k: 0 for k in cases}
    cpu_before = harness.cpu_sample()
    for _ in range(s["iters"]):
        for name, fn in cases.items():
            with harness.PeakRSS() as rss:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            peak[name] = max(peak[name], rss.growth)
    background = harness.background_load(cpu_before, harness.cpu_sample())
    compiled = learner.lower_update(samples).compile()
    jax_temp = int(compiled.memory_analysis().temp_size_in_bytes)

    result = {"bench": "learner", "settings": s, "tokens_per_step": n_tokens,
              "model": {"model_type": config.model_type,
                        "params": int(sum(p.numel() for p in torch_model.parameters()))}}
    jx, tc = harness.timing_stats(times["jax"], n_tokens), harness.timing_stats(times["torch"], n_tokens)
    result["train_step"] = {"jax": jx, "torch": tc, "ratio_jax_over_torch": jx["tokens_per_s"] / tc["tokens_per_s"]}
    result["first_call_s"] = first
    result["memory"] = {"jax_peak_rss_growth_bytes": peak["jax"], "torch_peak_rss_growth_bytes": peak["torch"],
                        "jax_xla_temp_bytes": jax_temp}
    lengths = [int(x) for x in str(s["mem_lengths"]).split(",") if x.strip()]
    result["memory_vs_length"] = _memory_vs_length(s, lengths) if lengths else []
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    result["machine"] = machine
    return result


def _mb(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def format_table(result: dict) -> str:
    s, m, mc = result["settings"], result["model"], result["machine"]
    r, mem = result["train_step"], result["memory"]
    lines = [
        f"ulorl bench learner: {m['model_type']}, {s['layers']} layers, hidden {s['hidden_size']}, "
        f"vocab {s['vocab']}; {m['params']:,} params",
        f"{s['samples']} samples x {s['seq_len']} tokens = {result['tokens_per_step']:,} tokens/step, "
        f"micro-batches of {s['micro_batch_rows']} rows; UloRL loss (POIS, DMMPT, token-mean) + AdamW; "
        f"median of {s['iters']} after {s['warmup']} warmup",
        "",
        f"{'':<8}{'step ms':>10}{'tokens/s':>12}{'peak RSS growth MiB':>22}",
        f"{'JAX':<8}{r['jax']['median_s'] * 1e3:>10.1f}{r['jax']['tokens_per_s']:>12,.0f}"
        f"{_mb(mem['jax_peak_rss_growth_bytes']):>22}",
        f"{'torch':<8}{r['torch']['median_s'] * 1e3:>10.1f}{r['torch']['tokens_per_s']:>12,.0f}"
        f"{_mb(mem['torch_peak_rss_growth_bytes']):>22}",
        f"JAX/torch tokens/s: {r['ratio_jax_over_torch']:.2f}x; JAX XLA temp buffers {_mb(mem['jax_xla_temp_bytes'])} "
        f"MiB; first call JAX {result['first_call_s']['jax']:.1f}s (compile), torch "
        f"{result['first_call_s']['torch']:.1f}s",
    ]
    if result["memory_vs_length"]:
        lines += ["", "XLA temp memory of the train step vs sequence length (tiny qwen3, 1 row, compile only):",
                  f"{'attention':<11}{'seq_len':>9}{'temp MiB':>11}{'MiB / 1k tok':>14}"]
        for row in result["memory_vs_length"]:
            lines.append(f"{row['attention']:<11}{row['seq_len']:>9}{_mb(row['temp_bytes']):>11}"
                         f"{row['temp_bytes'] / 2**20 / (row['seq_len'] / 1024):>14.2f}")
    lines.append(f"machine: {mc['cpu']}, {mc['cpus_usable']} usable CPUs; load avg before {mc['loadavg_before']} "
                 f"after {mc['loadavg_after']}; {mc['date']}")
    lines += [line for line in (harness.cpu_load_line(mc),) if line]
    return "\n".join(lines)


def _cli(args) -> int:
    harness.require_torch("bench learner")
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "learner", "UloRL train-step tokens/s and memory: JAX vs "
                                    "PyTorch (HF)", __doc__.split("\n\n")[0], add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.learner", __doc__.split("\n\n")[0], add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
