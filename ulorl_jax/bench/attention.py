"""Kernel throughput: attention (fwd, fwd+bwd), decode attention, MoE grouped matmul.

Side by side in one run, on the default JAX device:
  * attention forward and forward+backward TFLOP/s (causal FLOPs counted as
    half; fwd = 4*B*Hq*T^2*D, fwd+bwd = 3.5x that) for our Pallas kernel,
    ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` and
    ``"xla"`` (XLA's default; skipped where its [T, T] scores would not
    fit) and PyTorch's ``scaled_dot_product_attention`` (on CUDA when torch
    sees a GPU, else on CPU);
  * decode attention achieved bandwidth (K/V bytes read / time) vs the HBM
    peak of known GPUs, Pallas split-KV vs XLA;
  * grouped matmul TFLOP/s for Qwen3-30B-A3B expert shapes (128 experts,
    top-8, hidden 2048, expert width 768) vs ``jax.lax.ragged_dot`` and a dense
    matmul of the same FLOPs.

On CPU the Pallas kernels run only in interpret mode, which says nothing
about speed: they are left out of the timings (``pallas: interpret, not
timed``) but still checked once against XLA at the smallest shape. cuDNN
needs a GPU. A case that fails (e.g. XLA's [T, T] scores out of memory at
128k) is reported with its error instead of a figure.

    ulorl bench attention [--json] [--markdown benchmarks/results/attention.md]
    python benchmarks/attention.py          # GPU: full table -> benchmarks/results/attention.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform as _platform
import statistics
import sys
import time

from ulorl_jax.bench import harness

MAX_SCORES_GB = 40.0  # XLA attention beyond this is skipped instead of run out of memory
HBM_PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}  # vendor peaks, GB/s

GPU_DEFAULTS = dict(seq_lens="4096,16384,65536,131072", batch=1, heads=32, kv_heads=4, head_dim=128,
                    dtype="bfloat16", decode_batch=8, decode_len=131072, gmm_tokens=8192,
                    experts=128, top_k=8, hidden=2048, expert_width=768, iters=10, warmup=2)
CPU_DEFAULTS = dict(seq_lens="256,512", batch=1, heads=8, kv_heads=2, head_dim=64,
                    dtype="float32", decode_batch=4, decode_len=4096, gmm_tokens=256,
                    experts=8, top_k=2, hidden=256, expert_width=128, iters=3, warmup=1)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("shapes (defaults: the issue's table on GPU, small on CPU)")
    g.add_argument("--seq-lens", help="comma-separated attention lengths (GPU 4096,...,131072; CPU 256,512)")
    for name, help_ in (("batch", "attention batch"), ("heads", "query heads (GPU 32)"),
                        ("kv-heads", "kv heads (GPU 4)"), ("head-dim", "GPU 128"),
                        ("decode-batch", "decode slots (GPU 8)"), ("decode-len", "decode cache length (GPU 131072)"),
                        ("gmm-tokens", "MoE tokens; rows = tokens * top-k (GPU 8192)"),
                        ("experts", "GPU 128"), ("top-k", "GPU 8"), ("hidden", "GPU 2048"),
                        ("expert-width", "GPU 768"), ("iters", "timed calls, median reported"),
                        ("warmup", "untimed calls after the first")):
        g.add_argument(f"--{name}", type=int, help=help_)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], help="GPU bfloat16, CPU float32")
    g.add_argument("--time-interpreted", action="store_true",
                   help="time the Pallas kernels even in CPU interpret mode (exercises the GPU code path of "
                        "this script; the figures mean nothing)")
    g.add_argument("--skip", default="", help="comma-separated parts to skip: attention,decode,gmm,torch")
    g.add_argument("--markdown", help="also write the table (machine, date, command) to this .md file")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def settings(args, backend: str) -> dict:
    base = GPU_DEFAULTS if backend == "gpu" else CPU_DEFAULTS
    s = {k: (getattr(args, k, None) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    s["seq_lens"] = [int(x) for x in str(s["seq_lens"]).split(",") if x]
    s["time_interpreted"] = bool(getattr(args, "time_interpreted", False))
    s["skip"] = {x for x in (getattr(args, "skip", "") or "").split(",") if x}
    unknown = s["skip"] - {"attention", "decode", "gmm", "torch"}
    if unknown:
        raise ValueError(f"--skip: unknown parts {sorted(unknown)}; allowed attention, decode, gmm, torch")
    if s["heads"] % s["kv_heads"]:
        raise ValueError(f"--heads {s['heads']} must be a multiple of --kv-heads {s['kv_heads']}")
    if s["iters"] < 1 or s["warmup"] < 0:
        raise ValueError(f"need --iters >= 1 and --warmup >= 0 (got {s['iters']}, {s['warmup']})")
    return s


def _time(fn, s) -> dict:
    """First call (compile) + warmup + median of iters; fn must block."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    for _ in range(s["warmup"]):
        fn()
    times = []
    for _ in range(s["iters"]):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "first_call_s": first}


def _guard(fn):
    """Run a case; failures (OOM, unsupported) become an error string."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported, not hidden
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"}


def _torch_device():
    try:
        import torch
    except ModuleNotFoundError:
        return None, None
    return torch, ("cuda" if torch.cuda.is_available() else "cpu")


def _attention(s, backend, jax, jnp, kernels) -> list[dict]:
    dtype = jnp.dtype(s["dtype"])
    rows = []
    torch, tdev = _torch_device() if "torch" not in s["skip"] else (None, None)
    for t in s["seq_lens"]:
        b, hq, hkv, d = s["batch"], s["heads"], s["kv_heads"], s["head_dim"]
        keys = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(keys[0], (b, t, hq, d), dtype)
        k = jax.random.normal(keys[1], (b, t, hkv, d), dtype)
        v = jax.random.normal(keys[2], (b, t, hkv, d), dtype)
        flops_fwd = 4.0 * b * hq * t * t * d * 0.5  # causal: half
        impls = {
            "pallas": lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
            "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
            "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        }
        row = {"seq_len": t, "flops_fwd": flops_fwd}
        score_gb = b * hq * t * t * 4 / 1e9  # XLA's f32 [T, T] scores per call
        for name, fn in impls.items():
            if name == "pallas" and backend != "gpu" and not s["time_interpreted"]:
                row[name] = {"skipped": "interpret mode on CPU: not timed"}
                continue
            if name == "cudnn" and backend != "gpu":
                row[name] = {"skipped": "needs a GPU"}
                continue
            if name == "xla" and score_gb > MAX_SCORES_GB:
                row[name] = {"skipped": f"would materialise >= {score_gb:,.0f} GB of [T, T] scores"}
                continue
            fwd = jax.jit(fn)
            train = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                                     argnums=(0, 1, 2)))
            res = {}
            for case, f, mult in (("fwd", fwd, 1.0), ("fwd_bwd", train, 3.5)):
                r = _guard(lambda f=f: _time(lambda: jax.block_until_ready(f(q, k, v)), s))
                if "median_s" in r:
                    r["tflops"] = flops_fwd * mult / r["median_s"] / 1e12
                res[case] = r
            row[name] = res
        if torch is not None:
            row["torch_sdpa"] = _guard(lambda: _torch_attention(torch, tdev, s, t, flops_fwd))
            row["torch_sdpa"]["device"] = tdev
        rows.append(row)
    # Correctness of the kernel against XLA at the smallest shape (interpret on CPU).
    t = min(s["seq_lens"])
    keys = jax.random.split(jax.random.key(0), 3)
    small = [jax.random.normal(kk, (1, t, s["heads"] if i == 0 else s["kv_heads"], s["head_dim"]), jnp.float32)
             for i, kk in enumerate(keys)]
    o = jax.jit(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True))(*small)
    o_ref = jax.jit(lambda q, k, v: kernels.mha_reference(q, k, v, causal=True))(*small)
    rows.append({"check": f"pallas vs xla, f32, T={t}", "max_abs_diff": float(jnp.max(jnp.abs(o - o_ref)))})
    return rows


def _torch_attention(torch, dev, s, t, flops_fwd) -> dict:
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[s["dtype"]]
    b, hq, hkv, d = s["batch"], s["heads"], s["kv_heads"], s["head_dim"]
    gen = torch.Generator(device=dev).manual_seed(t)
    q, k, v = (torch.randn((b, h, t, d), generator=gen, device=dev, dtype=tdtype, requires_grad=True)
               for h in (hq, hkv, hkv))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def fwd():
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
        sync()

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True, enable_gqa=True).float().sum().backward()
        sync()

    res = {}
    for case, f, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, 3.5)):
        r = _guard(lambda f=f: _time(f, s))
        if "median_s" in r:
            r["tflops"] = flops_fwd * mult / r["median_s"] / 1e12
        res[case] = r
    return res


def _decode(s, backend, jax, jnp, kernels, device_kind) -> dict:
    dtype = jnp.dtype(s["dtype"])
    b, sl, hq, hkv, d = s["decode_batch"], s["decode_len"], s["heads"], s["kv_heads"], s["head_dim"]
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, hq, d), dtype)
    k = jax.random.normal(keys[1], (b, sl, hkv, d), dtype)
    v = jax.random.normal(keys[2], (b, sl, hkv, d), dtype)
    lengths = jnp.full((b,), sl, jnp.int32)
    bytes_read = 2 * b * sl * hkv * d * dtype.itemsize  # K and V once
    peak = next((p for name, p in HBM_PEAK_GBS.items() if name in device_kind), None)
    out = {"batch": b, "cache_len": sl, "bytes": bytes_read, "hbm_peak_gbs": peak}
    impls = {"pallas": lambda q, k, v: kernels.decode_attention(q, k, v, lengths),
             "xla": lambda q, k, v: kernels.decode_attention_reference(q, k, v, lengths)}
    for name, fn in impls.items():
        if name == "pallas" and backend != "gpu" and not s["time_interpreted"]:
            out[name] = {"skipped": "interpret mode on CPU: not timed"}
            continue
        f = jax.jit(fn)
        r = _guard(lambda f=f: _time(lambda: jax.block_until_ready(f(q, k, v)), s))
        if "median_s" in r:
            r["gbs"] = bytes_read / r["median_s"] / 1e9
            r["frac_of_peak"] = r["gbs"] / peak if peak else None
        out[name] = r
    return out


def _gmm(s, backend, jax, jnp, kernels) -> dict:
    import numpy as np

    dtype = jnp.dtype(s["dtype"])
    e, m = s["experts"], s["gmm_tokens"] * s["top_k"]
    k_dim, n_dim = s["hidden"], s["expert_width"]
    rng = np.random.default_rng(0)
    sizes = np.bincount(rng.integers(0, e, m), minlength=e).astype(np.int32)  # uniform routing
    keys = jax.random.split(jax.random.key(2), 3)
    lhs = jax.random.normal(keys[0], (m, k_dim), dtype)
    rhs = (jax.random.normal(keys[1], (e, k_dim, n_dim), jnp.float32) * 0.05).astype(dtype)
    dense_rhs = rhs[0]
    gs = jnp.asarray(sizes)
    flops = 2.0 * m * k_dim * n_dim
    out = {"rows": m, "k": k_dim, "n": n_dim, "experts": e, "flops_fwd": flops}
    impls = {"pallas": lambda a, b: kernels.grouped_matmul(a, b, gs),
             "ragged_dot": lambda a, b: jax.lax.ragged_dot(a, b, gs),
             "dense": lambda a, b: a @ b}
    for name, fn in impls.items():
        if name == "pallas" and backend != "gpu" and not s["time_interpreted"]:
            out[name] = {"skipped": "interpret mode on CPU: not timed"}
            continue
        w = dense_rhs if name == "dense" else rhs
        fwd = jax.jit(fn)
        train = jax.jit(jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b).astype(jnp.float32)), argnums=(0, 1)))
        res = {}
        for case, f, mult in (("fwd", fwd, 1.0), ("fwd_bwd", train, 3.0)):
            r = _guard(lambda f=f: _time(lambda: jax.block_until_ready(f(lhs, w)), s))
            if "median_s" in r:
                r["tflops"] = flops * mult / r["median_s"] / 1e12
            res[case] = r
        out[name] = res
    return out


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from ulorl_jax import kernels

    backend = jax.default_backend()
    s = settings(args, backend)
    device_kind = str(jax.devices()[0].device_kind)
    result = {"bench": "attention", "backend": backend, "settings": {**s, "skip": sorted(s["skip"])}}
    if "attention" not in s["skip"]:
        result["attention"] = _attention(s, backend, jax, jnp, kernels)
    if "decode" not in s["skip"]:
        result["decode"] = _decode(s, backend, jax, jnp, kernels, device_kind)
    if "gmm" not in s["skip"]:
        result["gmm"] = _gmm(s, backend, jax, jnp, kernels)
    torch, tdev = _torch_device()
    result["machine"] = {
        "jax": jax.__version__, "backend": backend, "device": device_kind, "device_count": jax.device_count(),
        "torch": getattr(torch, "__version__", None), "torch_device": tdev,
        "cpu": _platform.processor() or _platform.machine(), "platform": _platform.platform(),
        "python": _platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": _command(),
    }
    return result


def _command() -> str:
    import os

    prog = os.path.basename(sys.argv[0])
    head = "ulorl" if prog == "ulorl" else f"python {os.path.relpath(sys.argv[0])}"
    return " ".join([head, *sys.argv[1:]])


def _cell(r: dict | None, key: str) -> str:
    if not r:
        return "-"
    if "skipped" in r:
        return "n/a"
    if "error" in r:
        return "error"
    return f"{r[key]:.3g}"


def format_table(result: dict) -> str:
    s, mc = result["settings"], result["machine"]
    lines = [f"ulorl bench attention on {mc['device']} ({mc['backend']}), {s['dtype']}, jax {mc['jax']}, "
             f"torch {mc['torch']} ({mc['torch_device']}); median of {s['iters']} after {s['warmup']} warmup",
             f"{mc['date']}; command: {mc['command']}", ""]
    notes = set()
    if "attention" in result:
        lines.append(f"Attention TFLOP/s (causal, batch {s['batch']}, GQA {s['heads']}/{s['kv_heads']}, "
                     f"head_dim {s['head_dim']}; fwd+bwd = 3.5x fwd FLOPs)")
        impls = ("pallas", "cudnn", "xla", "torch_sdpa")
        header = "| seq | " + " | ".join(f"{i} fwd | {i} fwd+bwd" for i in impls) + " |"
        lines += [header, "|" + "---|" * (1 + 2 * len(impls))]
        for row in result["attention"]:
            if "check" in row:
                lines.append(f"\ncheck: {row['check']}: max |diff| {row['max_abs_diff']:.2e}")
                continue
            cells = []
            for i in impls:
                r = row.get(i) or {}
                for case in ("fwd", "fwd_bwd"):
                    c = r if ("skipped" in r or "error" in r) else r.get(case)
                    cells.append(_cell(c, "tflops"))
                    for x in (r, r.get(case) or {}):
                        if "skipped" in x:
                            notes.add(f"{i}: {x['skipped']}")
                        if "error" in x:
                            notes.add(f"{i} @ {row['seq_len']}: {x['error']}")
            lines.append(f"| {row['seq_len']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "decode" in result:
        dec = result["decode"]
        peak = dec["hbm_peak_gbs"]
        lines.append(f"Decode attention, {dec['batch']} slots x {dec['cache_len']} cached tokens "
                     f"({dec['bytes'] / 1e9:.2f} GB of K/V): GB/s" + (f" (HBM peak {peak:,.0f})" if peak else ""))
        for name in ("pallas", "xla"):
            r = dec[name]
            frac = f" = {r['frac_of_peak']:.0%} of peak" if r.get("frac_of_peak") else ""
            lines.append(f"  {name:<8} {_cell(r, 'gbs')}{frac}")
            if "skipped" in r:
                notes.add(f"{name}: {r['skipped']}")
            if "error" in r:
                notes.add(f"decode {name}: {r['error']}")
        lines.append("")
    if "gmm" in result:
        g = result["gmm"]
        lines.append(f"Grouped matmul TFLOP/s: rows {g['rows']} ({s['gmm_tokens']} tokens x top-{s['top_k']}), "
                     f"{g['experts']} experts, [{g['k']} -> {g['n']}]; fwd+bwd = 3x fwd FLOPs")
        lines += ["| impl | fwd | fwd+bwd |", "|---|---|---|"]
        for name in ("pallas", "ragged_dot", "dense"):
            r = g[name]
            cells = [_cell(r if "skipped" in r or "error" in r else r.get(c), "tflops") for c in ("fwd", "fwd_bwd")]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            for x in (r, *(r.get(c, {}) for c in ("fwd", "fwd_bwd"))):
                if "error" in x:
                    notes.add(f"gmm {name}: {x['error']}")
        lines.append("")
    if notes:
        lines += ["Notes:"] + [f"- {n}" for n in sorted(notes)]
    return "\n".join(lines)


def write_markdown(result: dict, path: str) -> None:
    import os

    mc = result["machine"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# Kernel benchmark: attention, decode, grouped matmul\n\n"
                f"- machine: {mc['device']} ({mc['backend']}), {mc['platform']}\n"
                f"- date: {mc['date']}\n- command: `{mc['command']}`\n"
                f"- jax {mc['jax']}, torch {mc['torch']} ({mc['torch_device']})\n\n"
                f"```\n{format_table(result)}\n```\n")


def _main(args) -> int:
    result = run(args)
    print(format_table(result))
    if args.markdown:
        write_markdown(result, args.markdown)
        print(f"wrote {args.markdown}")
    if args.json:
        print(json.dumps(result))
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(
        bench_subparsers, "attention", "attention / decode / grouped-matmul kernel throughput vs cuDNN, XLA, torch",
        __doc__.split("\n\n")[0] + " See `python benchmarks/attention.py` for the GPU table.", add_arguments, _main)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.attention", __doc__, add_arguments, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
