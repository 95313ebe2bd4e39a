"""`ulorl plan`: per-device memory and FLOPs of the train step and the decode step at full size,
from XLA's compiled memory / cost analysis, without allocating a single weight.

    ulorl plan --config configs/qwen3_30b_a3b_128k.yaml --devices 64 [--device-memory-gb 141] [--json]

How: the model is built abstractly (`nnx.eval_shape`: ShapeDtypeStructs only);
params, optimizer state, the packed micro-batch and the decode state become
ShapeDtypeStructs carrying their NamedShardings on a mesh of `--devices`
devices (fake CPU devices here: `--xla_force_host_platform_device_count`,
set before jax starts); the learner's real jitted train step
(`rl.learner.build_train_step`) and the engine's real decode step
(`PolicyEngine.generate_steps`, one token) are lowered and compiled. Memory
per device = arguments + temporaries + outputs not aliased to (donated)
arguments, from `compiled.memory_analysis()`.

Layers: with `trainer.scan_layers` (the shipped full-size configs) the train
step runs its decoder layers as one `lax.scan` (models/layer_scan.py), so it
compiles in full at any depth (`--layers auto`, the default). Unrolled
programs (the decode step; train steps without scan) are compiled with
`--layers A,B` decoder layers (default 1,2) and every figure is extrapolated
linearly to the config's layer count: per-layer parameters, optimizer state,
saved remat inputs and KV cache are exactly linear in the layer count; the
transient working set of one layer is counted once. `--layers full` compiles
all of them.

Caveats, printed with the figures: this is XLA's *CPU* compiler's buffer
assignment (GPU fusion and layouts differ; a GPU run's `memory_analysis`
replaces it when one is available); attention is compiled as the Pallas
flash kernel (interpret mode on CPU: O(T) memory, as on GPU) whenever the
config asks for `pallas` or `cudnn`, since both are O(T) on a GPU while the
`xla` reference materialises [T, T] scores; XLA's FLOP count does not multiply
while-loop bodies by their trip count (flash attention, the log-prob chunk
scan), so FLOPs are also given from the analytic formula.

Decode concurrency (`decode_concurrency_plan`, arithmetic in bench/kv_concurrency.py): samples in flight per
device with the dense KV cache (a slot reserves prompt + global_max_len positions) and the paged one (a
pool of `--page-size` pages; a sample in flight holds its prompt + what it has decoded so far, averaged
over the long-tailed lengths), from the device memory the rollout leaves for KV: capacity - the learner's
params and AdamW moments - the compiled decode step's working set. Every assumption is printed with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from ulorl_jax.bench.kv_concurrency import DEFAULT_PAGE_SIZE

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="YAML file or shipped config name (e.g. qwen3_30b_a3b_128k)")
    parser.add_argument("--devices", type=int, required=True, help="accelerators to plan for (mesh size)")
    parser.add_argument("--device-memory-gb", type=float, default=141.0,
                        help="memory per device in GB (default 141: an H200)")
    parser.add_argument("--layers", default="auto",
                        help="decoder layers to compile: two counts to extrapolate from (e.g. 1,2), 'full', or "
                             "'auto' (default: the train step in full when trainer.scan_layers is on, else 1,2; "
                             "the decode step 1,2)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="packed row length (default trainer.row_len or max_prompt_len + global_max_len)")
    parser.add_argument("--decode-slots", type=int, default=None,
                        help="decode slots (concurrent sequences) of the engine (default: one per data shard)")
    parser.add_argument("--decode-cache-len", type=int, default=None,
                        help="KV cache length per slot (default max_prompt_len + global_max_len)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="positions per page of the paged KV cache, for the decode concurrency figures "
                             f"(default rollout.page_size, else {DEFAULT_PAGE_SIZE})")
    parser.add_argument("--skip-decode", action="store_true", help="plan the train step only")
    parser.add_argument("--lower-only", action="store_true",
                        help="lower without compiling (seconds): checks shapes / shardings and reports the "
                             "sharded params + optimizer / decode-state bytes per device (a lower bound)")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. mesh.expert=8 mesh.fsdp=-1 trainer.micro_batch_rows=16")
    return parser


def ensure_devices(n: int, command: str = "ulorl plan") -> None:
    """Fake CPU devices for the mesh; must run before jax initialises a backend (`command` is named in the
    error when jax started first with fewer)."""
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.device_count() < n:
        raise ValueError(f"--devices={n} but this process has {jax.device_count()} {jax.default_backend()} "
                         f"devices (jax started before `{command}` could ask for {n} fake CPU devices: run "
                         f"`{command}` in a fresh process, or set XLA_FLAGS={flag}={n})")


# ---------------------------------------------------------------------------
# Abstract pieces
# ---------------------------------------------------------------------------


def abstract_model(model_config):
    """(graphdef, abstract params, abstract other state, abstract model): ShapeDtypeStructs only."""
    from flax import nnx

    from ulorl_jax.models.qwen3 import Qwen3ForCausalLM

    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(params=0)))
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    return graphdef, params, other, model


def _sds(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compiled_memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
           "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes)}
    out["peak_bytes"] = out["argument_bytes"] + out["temp_bytes"] + max(out["output_bytes"] - out["alias_bytes"], 0)
    return out


def compiled_flops(compiled) -> float:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops", float("nan")))
    except Exception:  # noqa: BLE001  (cost analysis is best effort on some backends)
        return float("nan")


def sharded_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings (the largest shard)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def compile_train_step(model_config, learner_config, mesh, rows: int, row_len: int, compile: bool = True) -> dict:
    """Lower (+ compile) the learner's train step for one micro-batch of `rows` x `row_len` tokens.
    Without `compile`: lowering only (checks shapes and shardings) and the per-device bytes of the
    params and optimizer state from their shardings."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ulorl_jax.models.context_layout import check_row_len
    from ulorl_jax.rl.learner import (
        MICRO_KEYS,
        build_train_step,
        make_optimizer,
        optimizer_shardings,
    )
    from ulorl_jax.sharding import (
        BATCH_AXES,
        CONTEXT_AXIS,
        context_size,
        mesh_context,
        param_shardings,
    )

    check_row_len(row_len, context_size(mesh), what="--seq-len / trainer.row_len")
    graphdef, params, other, _ = abstract_model(model_config)
    param_sh = param_shardings(params, mesh)
    tx = make_optimizer(learner_config)
    params_sds = _sds(params, param_sh)
    opt_sh = optimizer_shardings(tx, params_sds, param_sh, mesh)
    opt_sds = _sds(jax.eval_shape(tx.init, params_sds), opt_sh)
    micro = NamedSharding(mesh, P(None, BATCH_AXES, CONTEXT_AXIS))  # as the Learner lays out its batch
    rep = NamedSharding(mesh, P())
    int_keys = {"tokens", "targets", "segment_ids", "positions", "sample_index"}
    batch = {k: jax.ShapeDtypeStruct((1, rows, row_len), np.int32 if k in int_keys else np.float32, sharding=micro)
             for k in MICRO_KEYS}
    batch.update(sample_lengths=jax.ShapeDtypeStruct((rows,), np.float32, sharding=rep),
                 batch_entropy=jax.ShapeDtypeStruct((), np.float32, sharding=rep),
                 old_from_current=jax.ShapeDtypeStruct((), np.bool_, sharding=rep),
                 aux_scale=jax.ShapeDtypeStruct((), np.float32, sharding=rep))
    step = jax.jit(mesh_context(build_train_step(graphdef, other, tx, learner_config, "policy"), mesh),
                   in_shardings=(param_sh, opt_sh, {k: v.sharding for k, v in batch.items()}),
                   out_shardings=(param_sh, opt_sh, rep), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    lowered = step.lower(params_sds, opt_sds, batch)
    state_bytes = {"param_bytes": sharded_bytes(params_sds), "optimizer_bytes": sharded_bytes(opt_sds)}
    if not compile:
        return {**state_bytes, "lower_s": time.perf_counter() - t0}
    compiled = lowered.compile()
    return {**compiled_memory(compiled), **state_bytes, "xla_flops": compiled_flops(compiled), "compile_s": time.perf_counter() - t0}


def compile_decode_step(model_config, mesh, slots: int, cache_len: int, compile: bool = True) -> dict:
    """Lower + compile one engine decode step (all slots generate one token) on `mesh`, with the decode
    state laid out as the engine lays it out (`decode_state_specs`)."""
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import SamplingParams
    from ulorl_jax.sharding import param_shardings

    _, params, _, model = abstract_model(model_config)
    engine = PolicyEngine(model, max_concurrent_decodes=slots, max_prefill_length=min(cache_len, 16),
                          max_cache_len=cache_len, mesh=mesh, sampling=SamplingParams(temperature=1.0),
                          eos_token_ids=(0,))
    params_sds = _sds(params, param_shardings(params, mesh))
    state_sds = engine.abstract_decode_state()
    t0 = time.perf_counter()
    lowered = engine.lower_generate_steps(params_sds, state_sds, num_steps=1)
    state_bytes = {"param_bytes": sharded_bytes(params_sds), "decode_state_bytes": sharded_bytes(state_sds)}
    if not compile:
        return {**state_bytes, "lower_s": time.perf_counter() - t0}
    compiled = lowered.compile()
    return {**compiled_memory(compiled), **state_bytes, "xla_flops": compiled_flops(compiled), "compile_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


def _extrapolate(a: dict, b: dict, la: int, lb: int, full: int) -> dict:
    out = {}
    for k, va in a.items():
        vb = b[k]
        if k in ("compile_s", "lower_s"):
            out[k] = va + vb
            out[k + "_each"] = [va, vb]  # per compiled layer count: what an unrolled full model would cost
            continue
        slope = (vb - va) / (lb - la)
        v = va + slope * (full - la)
        out[k] = int(round(v)) if isinstance(va, int) else float(v)
        out[k + "_per_layer"] = float(slope)
    return out


def _parse_layers(text: str, full: int) -> tuple[int, ...]:
    if str(text).strip() == "full":
        return (full,)
    try:
        ls = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--layers={text!r}: expected two counts like 1,2 or 'full'") from None
    if len(ls) != 2 or ls[0] < 1 or ls[1] > full:
        raise ValueError(f"--layers={text!r}: need two distinct counts in [1, {full}] (the model has {full} layers)")
    return ls


def plan(cfg, devices: int, *, layers: str = "auto", seq_len: int | None = None, decode_slots: int | None = None,
         decode_cache_len: int | None = None, device_memory_gb: float = 141.0, skip_decode: bool = False,
         config_name: str = "", compile: bool = True, page_size: int | None = None) -> dict:
    import jax

    from ulorl_jax.models.layer_scan import unscannable
    from ulorl_jax.models.shape import ModelShape
    from ulorl_jax.rl.build import learner_config
    from ulorl_jax.sharding import BATCH_AXES, axis_size, make_mesh

    if devices < 1:
        raise ValueError(f"--devices={devices} must be >= 1")
    mc = cfg.model.model_config()
    attention = mc.attention_impl
    if attention in ("cudnn", "pallas"):
        mc = mc.replace(attention_impl="pallas")  # O(T)-memory flash attention, as on the GPU
    mesh = make_mesh(cfg.mesh.mesh_config(), devices=jax.devices()[:devices])
    shards = axis_size(mesh, BATCH_AXES)
    lc = learner_config(cfg)
    row_len = seq_len or lc.row_len
    rows = max(lc.micro_batch_rows, shards)
    rows = -(-rows // shards) * shards
    lc = dataclasses.replace(lc, row_len=row_len, micro_batch_rows=rows, logprob_chunk=min(lc.logprob_chunk, row_len))
    cache_len = decode_cache_len or (cfg.data.max_prompt_len or 0) + cfg.rollout.global_max_len
    slots = decode_slots or shards
    full = mc.num_hidden_layers
    scanned = lc.scan_layers and unscannable(abstract_model(mc)[3].layers) is None
    if str(layers).strip() == "auto":
        train_counts, decode_counts = ((full,) if scanned else (1, 2)), _parse_layers("1,2", full)
    else:
        train_counts = decode_counts = _parse_layers(layers, full)

    def with_layers(n_layers):
        c = mc.replace(num_hidden_layers=n_layers)
        if c.mlp_only_layers:
            c = c.replace(mlp_only_layers=tuple(i for i in c.mlp_only_layers if i < n_layers))
        return c

    def measured(counts, compile_one):
        runs = [compile_one(with_layers(n)) for n in counts]
        return runs[0] if len(counts) == 1 else _extrapolate(runs[0], runs[1], counts[0], counts[1], full)

    train = measured(train_counts, lambda c: compile_train_step(c, lc, mesh, rows, row_len, compile))
    decode = None if skip_decode else measured(
        decode_counts, lambda c: compile_decode_step(c, mesh, slots, cache_len, compile))
    shape = ModelShape.from_model_config("model", mc)
    total, active = shape.params()
    tokens = rows * row_len
    # Analytic: forward 2 N_active per token + causal attention; train = fwd + bwd (2x) + remat recompute (1x),
    # which `attention` skips for the attention (its output and log-sum-exp are kept).
    dense_flops = 2.0 * active * tokens
    attention_flops = 2.0 * shape.layers * shape.heads * shape.head_dim * rows * row_len ** 2
    train_flops = ((4.0 if lc.remat != "none" else 3.0) * dense_flops
                   + (4.0 if lc.remat not in ("none", "attention") else 3.0) * attention_flops)
    capacity = device_memory_gb * 1e9
    result = {
        "config": config_name, "devices": devices, "backend": jax.default_backend(),
        "mesh": dict(mesh.shape), "device_memory_gb": device_memory_gb,
        "model": {"model_type": mc.model_type, "layers": full, "params": total, "active_params": active,
                  "param_dtype": mc.param_dtype, "dtype": mc.dtype, "attention_impl": mc.attention_impl,
                  "config_attention_impl": attention},
        "compiled_layers": list(train_counts), "extrapolated": len(train_counts) > 1, "scan_layers": scanned,
        "train": {**train, "micro_batch_rows": rows, "row_len": row_len, "tokens_per_micro_batch": tokens,
                  "analytic_flops_per_micro_batch": train_flops,
                  "analytic_flops_per_micro_batch_per_device": train_flops / devices},
    }
    if decode is not None:
        result["decode_compiled_layers"] = list(decode_counts)
        result["decode_concurrency"] = decode_concurrency_plan(
            cfg, mc, mesh, train, decode if compile else None, capacity=capacity, cache_len=cache_len,
            slots=slots, page_size=page_size)
    if not compile:  # lowered only: the sharded state bytes are the memory figure (a lower bound)
        result["compiled"] = False
        result["train"]["fits"] = train["param_bytes"] + train["optimizer_bytes"] <= capacity
        if decode is not None:
            result["decode"] = {**decode, "slots": slots, "cache_len": cache_len,
                                "fits": decode["param_bytes"] + decode["decode_state_bytes"] <= capacity}
        result["fits"] = result["train"]["fits"] and (decode is None or result["decode"]["fits"])
        return result
    result["compiled"] = True
    result["train"]["fits"] = train["peak_bytes"] <= capacity
    if decode is not None:
        result["decode"] = {**decode, "slots": slots, "cache_len": cache_len,
                            "kv_bytes_per_slot": 2 * full * cache_len * mc.num_key_value_heads * mc.head_dim * (
                                2 if mc.dtype in ("bfloat16", "float16") else 4),
                            "analytic_flops_per_token_step": 2.0 * active * slots + 4.0 * shape.layers * shape.heads
                            * shape.head_dim * cache_len * slots,
                            "fits": decode["peak_bytes"] <= capacity}
    result["fits"] = result["train"]["fits"] and (decode is None or result["decode"]["fits"])
    return result


def kv_head_shards(model_config, mesh) -> int:
    """How many ways the engine splits a sample's KV heads on `mesh`: the kv_heads rule's axes when they
    divide the KV heads, else 1 (as `decode/cache_layout.cache_specs` lays the cache out)."""
    from ulorl_jax.sharding import DEFAULT_PARAM_RULES, axis_size

    shards = axis_size(mesh, DEFAULT_PARAM_RULES["kv_heads"])
    return shards if model_config.num_key_value_heads % shards == 0 else 1


def decode_concurrency_plan(cfg, model_config, mesh, train: dict, decode: dict | None, *, capacity: float,
                            cache_len: int, slots: int, page_size: int | None = None) -> dict:
    """Samples in flight per device during the rollout, dense vs paged KV cache (kv_concurrency.py).

    KV memory per device = capacity - what stays on the device through the rollout: the learner's params
    and AdamW moments (the engine decodes from the learner's params: decode_mesh learner, the layout this
    plan compiles) - the decode step's working set as compiled (temporaries + outputs not aliased to its
    donated state; `decode` None: lowered only, not counted). The paged figure uses the config's prompt
    length (data.max_prompt_len, every prompt taken at the maximum, no prompt pages shared in a group) and
    the long-tailed lengths of `bench.segment_cost.LengthDistribution` over rollout.global_max_len."""
    from ulorl_jax.bench.kv_concurrency import (
        decode_concurrency,
        kv_bytes_per_token,
        rollout_batch,
    )
    from ulorl_jax.bench.segment_cost import LengthDistribution

    r = cfg.rollout
    if page_size is None:  # rollout.page_size arrives with the paged engine; before it, the default
        page_size = getattr(r, "page_size", None) or DEFAULT_PAGE_SIZE
    mc = model_config
    heads = kv_head_shards(mc, mesh)
    per_token = kv_bytes_per_token(mc, heads)
    itemsize = kv_bytes_per_token(mc) // (2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim)
    resident = train["param_bytes"] + train["optimizer_bytes"]
    working = None
    if decode is not None:
        working = decode["temp_bytes"] + max(decode["output_bytes"] - decode["alias_bytes"], 0)
    prompt_len = cfg.data.max_prompt_len or 0
    # A sample ends by global_max_len, or where a dense slot of `cache_len` (--decode-cache-len) runs out.
    lengths = LengthDistribution(max(2, min(r.global_max_len, cache_len - prompt_len)))
    c = decode_concurrency(int(capacity - resident - (working or 0)), per_token, max_len=cache_len,
                           prompt_len=prompt_len, lengths=lengths, page_size=page_size)
    batch = rollout_batch(lengths.scaled(r.global_max_len), num_segments=r.num_segments,
                          prompts_per_step=cfg.trainer.train_batch_size, samples_per_prompt=r.n)
    devices = mesh.size
    return {**c.as_dict(), "capacity_bytes": int(capacity), "resident_bytes": int(resident),
            "decode_working_bytes": working, "decode_working_slots": slots, "kv_head_shards": heads,
            "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "kv_itemsize": itemsize,
            "lengths": lengths.describe(), "lengths_body": lengths.body, "lengths_truncated": lengths.truncated,
            "response_max_len": lengths.global_max_len, "num_segments": r.num_segments,
            "new_samples_per_step": cfg.trainer.train_batch_size * r.n,
            "rollout_batch": batch, "rollout_batch_per_device": batch / devices,
            "dense_total": c.dense * devices, "paged_total": c.paged * devices}


def format_concurrency(r: dict) -> list[str]:
    """The decode-concurrency lines of the table (`decode_concurrency_plan`'s figures)."""
    c, m = r["decode_concurrency"], r["model"]
    gb, devices = 1e9, r["devices"]
    ratio = f"{c['paged'] / c['dense']:.1f}x" if c["dense"] else "dense: none"
    working = ("not counted (lowered only)" if c["decode_working_bytes"] is None else
               f"{c['decode_working_bytes'] / gb:.2f} GB decode step working set ({c['decode_working_slots']} slots)")
    slot_bytes = c["max_len"] * c["kv_bytes_per_token"]
    return [
        f"decode concurrency, samples in flight per device: dense {c['dense']}, paged {c['paged']} ({ratio}, "
        f"page {c['page_size']}); all {devices} devices: dense {c['dense_total']}, paged {c['paged_total']}; "
        f"a step decodes ~{c['rollout_batch']:.0f} samples ({c['new_samples_per_step']} new + the unfinished pool "
        f"of {c['num_segments']} segments; {c['rollout_batch_per_device']:.1f}/device)",
        f"  KV memory {c['kv_budget_bytes'] / gb:.2f} GB/device = {c['capacity_bytes'] / gb:g} capacity - "
        f"{c['resident_bytes'] / gb:.2f} learner params + AdamW moments (resident through the rollout; the engine "
        f"decodes from these params) - {working}",
        f"  KV {c['kv_bytes_per_token']:,} B per position on the device holding the sample = {m['layers']} layers "
        f"x K,V x {c['kv_heads']} kv heads / {c['kv_head_shards']} x {c['head_dim']} x {c['kv_itemsize']} B "
        f"({m['dtype']}); dense slot: {c['max_len']:,} positions = {slot_bytes / gb:.2f} GB",
        f"  paged: pool of {c['pool_pages']:,} pages x {c['page_size']}; a sample in flight holds on average "
        f"{c['in_flight_tokens']:,.0f} positions = {c['in_flight_pages']:.1f} pages (prompt {c['prompt_len']:,} + "
        f"E[L(L+1)/2]/E[L] decoded, E[L] = {c['mean_response_len']:,.0f}); lengths: {c['lengths']}",
    ]


def _layers_line(step: str, counts: list[int], full: int, scanned: bool) -> str:
    how = "scanned" if scanned else "unrolled"
    if len(counts) == 1:
        return f"{step}: all {full} layers compiled ({how})"
    return f"{step}: {' and '.join(map(str, counts))} layers compiled ({how}), extrapolated linearly to {full}"


def format_table(r: dict) -> str:
    m, t = r["model"], r["train"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"ulorl plan {r['config']}: {m['model_type']} {m['params'] / 1e9:.2f}B params ({m['active_params'] / 1e9:.2f}B "
        f"active), {m['layers']} layers, params {m['param_dtype']}, compute {m['dtype']}, attention "
        f"{m['attention_impl']} (config: {m['config_attention_impl']})",
        f"{r['devices']} devices, mesh {mesh}; capacity {r['device_memory_gb']:g} GB/device; compiled with XLA "
        f"{r['backend'].upper()} (fake devices) — an estimate of a GPU run",
        _layers_line("train", r["compiled_layers"], m["layers"], r.get("scan_layers", False)) + (
            "; " + _layers_line("decode", r["decode_compiled_layers"], m["layers"], False)
            if "decode_compiled_layers" in r else ""),
        "",
        f"{'step':<8}{'GB/device':>12}{'args GB':>10}{'temp GB':>12}{'out GB':>9}{'GB/layer':>10}{'TFLOP/dev':>11}"
        f"{'fits':>6}  shape",
    ]

    def row(name, d, shape):
        per_layer = d.get("peak_bytes_per_layer")
        fl = d.get("analytic_flops_per_micro_batch_per_device", d.get("analytic_flops_per_token_step", 0) /
                   max(r["devices"], 1))
        return (f"{name:<8}{d['peak_bytes'] / 1e9:>12.3f}{d['argument_bytes'] / 1e9:>10.3f}{d['temp_bytes'] / 1e9:>12.3f}"
                f"{max(d['output_bytes'] - d['alias_bytes'], 0) / 1e9:>9.3f}"
                f"{(per_layer / 1e9 if per_layer is not None else float('nan')):>10.3f}{fl / 1e12:>11.3f}"
                f"{('yes' if d['fits'] else 'NO'):>6}  {shape}")

    lines.append(row("train", t, f"micro-batch {t['micro_batch_rows']} rows x {t['row_len']} tokens"))
    if "decode" in r:
        d = r["decode"]
        lines.append(row("decode", d, f"{d['slots']} slots x cache {d['cache_len']} "
                                      f"(KV {d['kv_bytes_per_slot'] / 1e9:.1f} GB/slot)"))
    lines += [f"TFLOP/dev: analytic (train: one micro-batch fwd+bwd+remat; decode: one token for every slot); "
              f"XLA's count (loop bodies once): train {t['xla_flops'] / 1e12:.1f} TFLOP/device"
              + (f", decode {r['decode']['xla_flops'] / 1e12:.3f}" if "decode" in r else ""),
              f"compile time {t['compile_s'] + r.get('decode', {}).get('compile_s', 0):.0f}s; "
              f"fits: {'yes' if r['fits'] else 'NO'}"]
    if "decode_concurrency" in r:
        lines += format_concurrency(r)
    return "\n".join(lines)


def format_lowered(r: dict) -> str:
    t = r["train"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"ulorl plan {r['config']} (lowered only, not compiled): {r['model']['model_type']} "
             f"{r['model']['params'] / 1e9:.2f}B params; {r['devices']} devices, mesh {mesh}",
             f"train: params {t['param_bytes'] / 1e9:.2f} GB + optimizer {t['optimizer_bytes'] / 1e9:.2f} GB per "
             f"device (activations not counted); fits: {'yes' if t['fits'] else 'NO'}"]
    if "decode" in r:
        d = r["decode"]
        lines.append(f"decode: params {d['param_bytes'] / 1e9:.2f} GB + decode state {d['decode_state_bytes'] / 1e9:.2f}"
                     f" GB per device ({d['slots']} slots x {d['cache_len']}); fits: {'yes' if d['fits'] else 'NO'}")
    if "decode_concurrency" in r:
        lines += format_concurrency(r)
    return "\n".join(lines)


def _cli(args) -> int:
    if args.devices < 1:
        raise ValueError(f"--devices={args.devices} must be >= 1")
    ensure_devices(args.devices)
    from ulorl_jax.config import load_config

    cfg = load_config(args.config, args.overrides)
    result = plan(cfg, args.devices, layers=args.layers, seq_len=args.seq_len, decode_slots=args.decode_slots,
                  decode_cache_len=args.decode_cache_len, device_memory_gb=args.device_memory_gb,
                  skip_decode=args.skip_decode, config_name=args.config, compile=not args.lower_only,
                  page_size=args.page_size)
    print(format_table(result) if result["compiled"] else format_lowered(result))
    if args.json:
        print(json.dumps(result))
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="per-device memory / FLOPs of the train and decode steps at full size "
                                    "(compiled on fake devices, no weights allocated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_cli)
    return p


# ---------------------------------------------------------------------------
# Measured peak of a real step (to check the plan's figure on a small config)
# ---------------------------------------------------------------------------


def measure_train_step(model_config, learner_config, rows: int, row_len: int, seed: int = 0) -> dict[str, Any]:
    """Run the real Learner's step once (compiled ahead, so the timing holds no compile) and report the
    process's peak RSS growth during that execution (run with MALLOC_MMAP_THRESHOLD_ low so freed buffers
    leave the process) next to the compiled memory analysis of the same executable."""
    import numpy as np

    from ulorl_jax.memory import PeakRSS
    from ulorl_jax.models import init_model
    from ulorl_jax.rl.learner import Learner
    from ulorl_jax.rl.packing import TrainSample

    learner = Learner(init_model(model_config, seed), dataclasses.replace(learner_config, row_len=row_len,
                                                                        micro_batch_rows=rows))
    rng = np.random.default_rng(seed)
    samples = [TrainSample(rng.integers(1, model_config.vocab_size, 4).tolist(),
                           rng.integers(1, model_config.vocab_size, row_len - 4).tolist(), float(i % 2) - 0.5,
                           float(i % 2)) for i in range(rows)]
    _, batch = learner.pack(samples)
    batch = learner.put_batch(batch)  # placed before the measured peak
    compiled = learner.lower_update(samples).compile()
    with PeakRSS() as rss:
        out = compiled(learner.params, learner.opt_state, batch)
        jax_block(out)
    return {"rss_growth_bytes": rss.growth, **compiled_memory(compiled)}


def jax_block(tree) -> None:
    import jax

    jax.block_until_ready(tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ulorl_jax.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return _cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
