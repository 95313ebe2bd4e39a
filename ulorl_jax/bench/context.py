"""Context parallelism (`mesh.context`): load balance of the causal layout, and the learner step with a
row split over `context` against the same devices splitting rows over `fsdp`.

Load balance, three ways, for each context size:
- causal (query, key) pairs per shard of one `--balance-len` row (default 131,072: a 128k row), with the
  load-balanced layout and with contiguous pieces (`context_layout.causal_pairs`);
- blockwise attention's computed tiles per shard at that length (tiles past a query tile are skipped);
- measured: each shard's own attention (its two chunks' queries against the whole row, forward +
  backward, `blockwise`), run one shard at a time on one device at `--time-len` tokens, median time.
The busiest shard over the mean is the figure that matters (1.00 = perfect).

Learner: `Learner.update` on `--devices` devices, mesh fsdp=N (whole rows per device) against context=N
(each row split over the N devices), the same samples (rows of `--row-len` tokens, one sample each), a tiny
random Qwen3: median step time and XLA's compiled temporaries per device.

    ulorl bench context [--devices 4] [--row-len 4096] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ulorl_jax.bench import harness


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--contexts", default="2,4,8", help="context sizes for the balance table (default 2,4,8)")
    parser.add_argument("--balance-len", type=int, default=131072, help="row length counted (default 131072)")
    parser.add_argument("--time-len", type=int, default=8192,
                        help="row length of the measured per-shard attention (default 8192)")
    parser.add_argument("--devices", type=int, default=4, help="devices of the learner comparison (default 4)")
    parser.add_argument("--row-len", type=int, default=4096, help="learner row length (default 4096)")
    parser.add_argument("--rows", type=int, default=4, help="learner rows (samples) per step (default 4)")
    parser.add_argument("--iters", type=int, default=3, help="timed repetitions, median (default 3)")
    parser.add_argument("--skip-learner", action="store_true", help="the balance table only")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def _median_s(fn, iters: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shard_attention_times(row_len: int, context: int, iters: int, heads: int = 8, kv_heads: int = 2,
                          head_dim: int = 64) -> list[float]:
    """Median seconds of each context shard's attention (forward + backward, blockwise) on one device."""
    import jax
    import jax.numpy as jnp

    from ulorl_jax.models.attention import AttentionMask
    from ulorl_jax.models.blockwise_attention import blockwise_attention
    from ulorl_jax.models.context_layout import shard_positions

    keys = jax.random.split(jax.random.key(0), 3)
    local = row_len // context
    q = jax.random.normal(keys[0], (1, local, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, row_len, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, row_len, kv_heads, head_dim), jnp.float32)
    ids = jnp.ones((1, row_len), jnp.int32)

    @jax.jit
    def step(q, k, v, positions):
        def loss(q, k, v):
            mask = AttentionMask(ids[:, :local], ids, positions[None], is_self_attention=False)
            return jnp.sum(blockwise_attention(q, k, v, mask))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out = []
    for shard in range(context):
        positions = shard_positions(shard, row_len, context)
        out.append(_median_s(lambda: jax.block_until_ready(step(q, k, v, positions)), iters))  # noqa: B023
    return out


def balance(args) -> list[dict]:
    from ulorl_jax.models.blockwise_attention import BLOCK_K, BLOCK_Q
    from ulorl_jax.models.context_layout import causal_pairs, causal_tiles

    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        pairs, contiguous = causal_pairs(args.balance_len, context), causal_pairs(args.balance_len, context, False)
        tiles = causal_tiles(args.balance_len, context, BLOCK_Q, BLOCK_K)
        times = shard_attention_times(args.time_len, context, args.iters)
        rows.append({
            "context": context,
            "pairs_per_shard": pairs.tolist(), "pairs_max_over_mean": float(pairs.max() / pairs.mean()),
            "contiguous_max_over_mean": float(contiguous.max() / contiguous.mean()),
            "tiles_per_shard": tiles.tolist(), "tiles_max_over_mean": float(tiles.max() / tiles.mean()),
            "time_len": args.time_len, "seconds_per_shard": times,
            "time_max_over_mean": max(times) / statistics.mean(times),
        })
    return rows


def learner_comparison(args) -> list[dict]:
    import jax
    import numpy as np

    from ulorl_jax.models.config import tiny_config
    from ulorl_jax.models.qwen3 import init_model
    from ulorl_jax.plan import compiled_memory
    from ulorl_jax.rl.learner import Learner, LearnerConfig, TrainSample
    from ulorl_jax.sharding import MeshConfig, make_mesh

    n = args.devices
    cfg = tiny_config("qwen3", vocab_size=2048, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    samples = [TrainSample(rng.integers(1, 2048, 32).tolist(), rng.integers(1, 2048, args.row_len - 32).tolist(),
                           advantage=float(i % 2) - 0.5, reward=float(i % 2)) for i in range(args.rows)]
    out = []
    for name, mesh_cfg, rows in (("fsdp", MeshConfig(fsdp=n), n), ("context", MeshConfig(fsdp=1, context=n), 1)):
        conf = LearnerConfig(lr=1e-6, row_len=args.row_len, micro_batch_rows=rows, logprob_chunk=512,
                             remat="full", scan_layers=False)
        learner = Learner(model, conf, make_mesh(mesh_cfg, jax.devices()[:n]))
        memory = compiled_memory(learner.lower_update(samples).compile())
        seconds = _median_s(lambda: learner.update(samples), args.iters)  # noqa: B023
        out.append({"mesh": name, "devices": n, "micro_batch_rows": rows,
                    "tokens_per_device_per_micro_batch": rows * args.row_len // n,
                    "step_s": seconds, "temp_bytes_per_device": memory["temp_bytes"],
                    "peak_bytes_per_device": memory["peak_bytes"]})
    return out


def run(args) -> dict:
    from ulorl_jax.plan import ensure_devices

    ensure_devices(max(args.devices, 1), "ulorl bench context")
    result = {"machine": harness.machine_info(), "balance_len": args.balance_len, "balance": balance(args)}
    if not args.skip_learner:
        result["learner"] = learner_comparison(args)
    return result


def format_table(r: dict) -> str:
    lines = [f"context parallelism on {r['machine']['cpu']} ({r['machine']['jax_backend']}), {r['machine']['date']}",
             f"load balance of one causal {r['balance_len']}-token row (busiest shard / mean; 1.00 = even):",
             "context  pairs  contiguous  blockwise tiles  measured fwd+bwd (len)  seconds per shard"]
    for b in r["balance"]:
        secs = " ".join(f"{s:.3f}" for s in b["seconds_per_shard"])
        lines.append(f"{b['context']:>7}  {b['pairs_max_over_mean']:.3f}  {b['contiguous_max_over_mean']:>10.3f}  "
                     f"{b['tiles_max_over_mean']:>15.3f}  {b['time_max_over_mean']:>14.3f} ({b['time_len']})  {secs}")
    if "learner" in r:
        lines.append("learner update, same devices and samples:")
        lines.append("mesh      devices  tokens/device/micro-batch  step s  temp MB/device  peak MB/device")
        for x in r["learner"]:
            lines.append(f"{x['mesh']:<9} {x['devices']:>7}  {x['tokens_per_device_per_micro_batch']:>25}  "
                         f"{x['step_s']:>6.3f}  {x['temp_bytes_per_device'] / 2**20:>14.1f}  "
                         f"{x['peak_bytes_per_device'] / 2**20:>14.1f}")
    return "\n".join(lines)


def _cli(args) -> int:
    r = run(args)
    return harness.print_result(r, format_table(r), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "context", "context parallelism: per-shard causal load "
                                    "balance, and a row split over context vs rows over fsdp", __doc__,
                                    add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.context", __doc__, add_arguments, _cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())
