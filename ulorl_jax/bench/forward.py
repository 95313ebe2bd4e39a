"""Forward and forward+backward throughput: our JAX model vs Hugging Face PyTorch.

One run builds a random transformers `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`,
saves it to a temporary folder and loads the same weights into ours with
`ulorl_jax.models.hf.from_pretrained`; both then see the same random tokens.

Measured, side by side:
  (a) forward to logits: JAX `nnx.jit(model(tokens))` + `block_until_ready`;
      torch `model(input_ids).logits` under `torch.inference_mode()`.
  (b) forward + backward of the mean next-token cross-entropy w.r.t. all
      parameters: JAX `nnx.value_and_grad` inside `nnx.jit`, blocking on the
      grads; torch `loss.backward()` (grads reset to None before each step).

Each case gets one first call (for JAX: trace + compile + one run, reported
separately), then `--warmup` untimed calls, then `--iters` timed calls. The
timed calls interleave the four cases, so background load on a shared machine
hits both frameworks alike. Reported: median wall time, tokens/s
(batch * seq_len / median) and the ratio JAX tokens/s / torch tokens/s
(> 1: JAX is faster).

Background load is measured too (Linux): the share of all cores that other
processes used, and the hypervisor stole, during the timed calls.

Correctness (reported, never asserted): max |logits diff|, loss diff and the
max |grad diff| over every parameter (ours mapped to HF names and layout).

Torch runs transformers' defaults: `sdpa` attention and, for MoE, the
`grouped_mm` experts path (`--torch-attention eager`, `--torch-experts
eager|batched_mm` select the others; on a 2-core CPU `eager` experts time
about the same as `grouped_mm`, `batched_mm` is far slower).
Ours runs `attention_impl="xla"`, `moe_impl="ragged"`. `--threads` sets torch's
intra-op threads; XLA's CPU client sizes its own thread pool (all cores) and
has no per-run knob.

    python -m ulorl_jax.bench.forward [--model-type qwen3] [--json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

from ulorl_jax.bench import harness

TORCH_ATTENTION = ("sdpa", "eager")
TORCH_EXPERTS = ("grouped_mm", "eager", "batched_mm")


def add_model_arguments(parser: argparse.ArgumentParser, model_type: str = "qwen3_moe") -> None:
    """The benchmark model's shape flags (shared by the benches that build a tiny model from them)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model-type", choices=["qwen3", "qwen3_moe"], default=model_type,
                   help=f"dense Qwen3 or Qwen3-MoE (default {model_type})")
    g.add_argument("--hidden-size", type=int, default=256, help="default 256")
    g.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    g.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    g.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    g.add_argument("--head-dim", type=int, default=32, help="default 32")
    g.add_argument("--intermediate-size", type=int, default=512, help="dense MLP width (default 512)")
    g.add_argument("--experts", type=int, default=8, help="MoE experts (default 8)")
    g.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    g.add_argument("--moe-intermediate-size", type=int, default=128, help="expert MLP width (default 128)")
    g.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_arguments(parser)
    g = parser.add_argument_group("run")
    g.add_argument("--batch", type=int, default=4, help="default 4")
    g.add_argument("--seq-len", type=int, default=256, help="default 256")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="parameter and compute dtype of both models (default float32)")
    g.add_argument("--warmup", type=int, default=2, help="untimed calls after the first (default 2)")
    g.add_argument("--iters", type=int, default=5, help="timed calls; the median is reported (default 5)")
    g.add_argument("--threads", type=int, default=os.cpu_count(),
                   help=f"torch intra-op threads (default os.cpu_count() = {os.cpu_count()})")
    g.add_argument("--seed", type=int, default=0, help="weight and token seed (default 0)")
    g.add_argument("--torch-attention", choices=TORCH_ATTENTION, default="sdpa",
                   help="transformers attention implementation (default sdpa)")
    g.add_argument("--torch-experts", choices=TORCH_EXPERTS, default="grouped_mm",
                   help="transformers MoE experts implementation (default grouped_mm, transformers' default)")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


_ARG_NAMES = ("model_type", "hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size",
              "experts", "top_k", "moe_intermediate_size", "vocab", "batch", "seq_len", "dtype", "warmup",
              "iters", "threads", "seed", "torch_attention", "torch_experts")


def settings(args) -> dict:
    """The bench options, with defaults for any the caller's namespace lacks."""
    defaults = vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))
    return {name: getattr(args, name, defaults[name]) for name in _ARG_NAMES}


def model_config(s: dict):
    from ulorl_jax.models.config import ModelConfig

    moe = s["model_type"] == "qwen3_moe"
    return ModelConfig(
        model_type=s["model_type"], vocab_size=s["vocab"], hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        rope_theta=1_000_000.0, max_position_embeddings=max(2048, s["seq_len"]),
        num_experts=s["experts"] if moe else 0, num_experts_per_tok=s["top_k"] if moe else 0,
        moe_intermediate_size=s["moe_intermediate_size"] if moe else 0, norm_topk_prob=True,
        param_dtype=s["dtype"], dtype=s["dtype"],
    )


def _randomize_(model, seed: int) -> None:
    """O(1) activations at any width: norms 1 + 0.1 N(0,1), embeddings N(0,1),
    every matrix N(0, 1/fan_in) (fan_in is the last axis in torch's layout)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def build_torch_model(config, s: dict):
    import torch
    import transformers

    hf_cfg = config.to_hf_config()
    hf_cfg._attn_implementation = s["torch_attention"]
    cls = transformers.Qwen3ForCausalLM
    if config.model_type == "qwen3_moe":
        hf_cfg._experts_implementation = s["torch_experts"]
        cls = transformers.Qwen3MoeForCausalLM
    model = cls(hf_cfg)
    _randomize_(model, s["seed"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[s["dtype"]]
    return model.to(dtype).eval()


def run(args) -> dict:
    """Build both models, time them side by side, return a JSON-serialisable dict."""
    s = settings(args)
    if s["iters"] < 1 or s["warmup"] < 0:
        raise ValueError(f"need --iters >= 1 and --warmup >= 0 (got {s['iters']}, {s['warmup']})")
    if s["seq_len"] < 2:
        raise ValueError(f"--seq-len must be at least 2 for a next-token loss (got {s['seq_len']})")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from ulorl_jax.models.hf import from_pretrained, hf_state_dict

    load_before = harness.loadavg()
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    config = model_config(s)
    torch_model = build_torch_model(config, s)
    with tempfile.TemporaryDirectory(prefix="ulorl-bench-") as folder:
        torch_model.save_pretrained(folder)
        jax_model = from_pretrained(folder, dtype=s["dtype"])

    b, t = s["batch"], s["seq_len"]
    tokens_np = np.random.default_rng(s["seed"]).integers(0, s["vocab"], size=(b, t), dtype=np.int32)
    tokens_jax = jnp.asarray(tokens_np)
    tokens_torch = torch.as_tensor(tokens_np, dtype=torch.long)
    n_tokens = b * t

    # --- the four cases ----------------------------------------------------------------

    def jax_ce(logits, tokens):
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    @nnx.jit
    def jax_forward(model, tokens):
        return model(tokens)

    @nnx.jit
    def jax_train(model, tokens):
        return nnx.value_and_grad(lambda m: jax_ce(m(tokens), tokens))(model)

    def torch_forward():
        with torch.inference_mode():
            return torch_model(input_ids=tokens_torch).logits

    def torch_train():
        torch_model.zero_grad(set_to_none=True)
        logits = torch_model(input_ids=tokens_torch).logits
        v = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, v),
                                                 tokens_torch[:, 1:].reshape(-1))
        loss.backward()
        return loss

    cases = {
        ("forward", "jax"): lambda: jax.block_until_ready(jax_forward(jax_model, tokens_jax)),
        ("forward", "torch"): torch_forward,
        ("forward_backward", "jax"): lambda: jax.block_until_ready(jax_train(jax_model, tokens_jax)),
        ("forward_backward", "torch"): torch_train,
    }
    first_s, last = {}, {}
    for key, fn in cases.items():  # first call: JAX traces and compiles here
        start = time.perf_counter()
        last[key] = fn()
        first_s[key] = time.perf_counter() - start
    cpu_before = harness.cpu_sample()
    for _ in range(s["warmup"]):
        for key, fn in cases.items():
            last[key] = fn()
    times = {key: [] for key in cases}
    for _ in range(s["iters"]):  # interleaved, so background load hits every case alike
        for key, fn in cases.items():
            start = time.perf_counter()
            last[key] = fn()
            times[key].append(time.perf_counter() - start)
    background = harness.background_load(cpu_before, harness.cpu_sample())

    # --- correctness (reported, not asserted) -----------------------------------------------

    jl = np.asarray(last[("forward", "jax")].astype(jnp.float32))
    tl = last[("forward", "torch")].float().numpy()
    jax_loss, jax_grads = last[("forward_backward", "jax")]
    torch_loss = float(last[("forward_backward", "torch")].detach())
    grad_diff, grad_max, worst, compared, total = _grad_diff(jax_model, jax_grads, torch_model, hf_state_dict, nnx, np)
    correctness = {
        "logits_max_abs_diff": float(np.max(np.abs(jl - tl))),
        "logits_max_abs": float(np.max(np.abs(tl))),
        "loss_jax": float(jax_loss), "loss_torch": torch_loss,
        "loss_abs_diff": abs(float(jax_loss) - torch_loss),
        "grads_max_abs_diff": grad_diff, "grads_max_abs": grad_max, "grads_worst_param": worst,
        "grads_compared": f"{compared}/{total}",
    }

    result = {
        "bench": "forward",
        "settings": s,
        "model": {
            "model_type": config.model_type,
            "params": int(sum(p.numel() for p in torch_model.parameters())),
            "params_jax": int(sum(x.size for x in jax.tree.leaves(nnx.state(jax_model, nnx.Param)))),
            "torch_attention": torch_model.config._attn_implementation,
            "torch_experts": getattr(torch_model.config, "_experts_implementation", None)
            if config.is_moe else None,
            "jax_attention": jax_model.config.attention_impl,
            "jax_moe": jax_model.config.moe_impl if config.is_moe else None,
        },
        "tokens_per_step": n_tokens,
    }
    for case in ("forward", "forward_backward"):
        jx = harness.timing_stats(times[(case, "jax")], n_tokens)
        tc = harness.timing_stats(times[(case, "torch")], n_tokens)
        result[case] = {"jax": jx, "torch": tc, "ratio_jax_over_torch": jx["tokens_per_s"] / tc["tokens_per_s"]}
    result["first_call_s"] = {
        "jax_forward": first_s[("forward", "jax")],
        "jax_forward_backward": first_s[("forward_backward", "jax")],
        "torch_forward": first_s[("forward", "torch")],
        "torch_forward_backward": first_s[("forward_backward", "torch")],
    }
    result["jax_compile_s"] = {  # first call minus one steady-state call
        case: max(0.0, first_s[(case, "jax")] - result[case]["jax"]["median_s"])
        for case in ("forward", "forward_backward")
    }
    result["correctness"] = correctness
    machine = harness.machine_info()
    machine["loadavg_before"] = load_before
    machine["loadavg_after"] = harness.loadavg()
    machine["cpu_during_timing"] = background
    result["machine"] = machine
    return result


def _grad_diff(jax_model, jax_grads, torch_model, hf_state_dict, nnx, np):
    """Max |grad diff| over all parameters, ours written in HF names and torch's
    in-memory (fused expert) layout. Returns (diff, max |grad|, worst name, compared, total)."""
    graphdef, _ = nnx.split(jax_model)
    grads_as_model = nnx.merge(graphdef, jax_grads)
    ours = hf_state_dict(grads_as_model, expert_layout="fused")
    diff, gmax, worst, compared, total = 0.0, 0.0, None, 0, 0
    for name, p in torch_model.named_parameters():
        total += 1
        if p.grad is None or name not in ours:
            continue
        compared += 1
        g = p.grad.float().numpy()
        d = float(np.max(np.abs(ours[name].astype(np.float32) - g)))
        gmax = max(gmax, float(np.max(np.abs(g))))
        if d >= diff:
            diff, worst = d, name
    return diff, gmax, worst, compared, total


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def format_table(result: dict) -> str:
    s, m, mc, c = result["settings"], result["model"], result["machine"], result["correctness"]
    arch = f"{m['model_type']}, {s['layers']} layers, hidden {s['hidden_size']}, vocab {s['vocab']}"
    if m["model_type"] == "qwen3_moe":
        arch += f", {s['experts']} experts top-{s['top_k']} (expert MLP {s['moe_intermediate_size']})"
    else:
        arch += f", MLP {s['intermediate_size']}"
    torch_impl = m["torch_attention"] + (f" + {m['torch_experts']}" if m["torch_experts"] else "")
    jax_impl = m["jax_attention"] + (f" + {m['jax_moe']}" if m["jax_moe"] else "")
    lines = [
        f"ulorl bench forward: {arch}; {m['params']:,} params",
        f"{s['dtype']}, batch {s['batch']} x seq {s['seq_len']} = {result['tokens_per_step']:,} tokens/step; "
        f"median of {s['iters']} after {s['warmup']} warmup; torch threads {mc['torch_threads']}",
        f"JAX {mc['jax']} ({mc['jax_backend']}, {jax_impl})  vs  PyTorch {mc['torch']} "
        f"(transformers {mc['transformers']}, {torch_impl})",
        "",
    ]
    header = f"{'':<18}{'JAX ms':>10}{'torch ms':>10}{'JAX tok/s':>12}{'torch tok/s':>13}{'JAX/torch':>11}"
    lines += [header, "-" * len(header)]
    for case, label in (("forward", "forward"), ("forward_backward", "forward+backward")):
        r = result[case]
        lines.append(f"{label:<18}{r['jax']['median_s'] * 1e3:>10.1f}{r['torch']['median_s'] * 1e3:>10.1f}"
                     f"{_fmt_rate(r['jax']['tokens_per_s']):>12}{_fmt_rate(r['torch']['tokens_per_s']):>13}"
                     f"{r['ratio_jax_over_torch']:>10.2f}x")
    f = result["first_call_s"]
    lines += [
        "",
        f"first call (s): JAX forward {f['jax_forward']:.2f}, JAX fwd+bwd {f['jax_forward_backward']:.2f} "
        f"(trace + compile + 1 run); torch forward {f['torch_forward']:.2f}, "
        f"torch fwd+bwd {f['torch_forward_backward']:.2f}",
        f"correctness: logits max|diff| {c['logits_max_abs_diff']:.2e} (max|logit| {c['logits_max_abs']:.2f}); "
        f"loss {c['loss_jax']:.6f} vs {c['loss_torch']:.6f}; grads max|diff| {c['grads_max_abs_diff']:.2e} "
        f"(max|grad| {c['grads_max_abs']:.2e}, {c['grads_compared']} tensors, worst {c['grads_worst_param']})",
        f"machine: {mc['cpu']}, {mc['cpus_usable']} usable CPUs, {mc['jax_device_count']} JAX device(s); "
        f"load avg before {mc['loadavg_before']} after {mc['loadavg_after']}; {mc['date']}",
    ]
    lines += [line for line in (harness.cpu_load_line(mc),) if line]
    return "\n".join(lines)


DESCRIPTION = "Forward and forward+backward tokens/s, JAX vs PyTorch (HF): same config, weights, tokens."


def _cli(args) -> int:
    harness.require_torch("bench forward")
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "forward", "forward and forward+backward tokens/s: JAX vs "
                                    "PyTorch (HF)", DESCRIPTION, add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.forward", DESCRIPTION, add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
