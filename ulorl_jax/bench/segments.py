"""Segment-rollout speedup (paper Table 1, ULORL.md §1): wall time per learner update vs num_segments.

    ulorl bench segments [--segments 1,2,4,8] [--json]
    ulorl bench segments --model-scale qwen3-30b-a3b --gpus 64 [--json]

Measured (default): the real `PolicyEngine` + `SegmentRollout` + `Learner` on
a tiny Qwen3. Every RL step adds `--prompts-per-step` prompts x `--n`
samples; a length oracle ends each sample at a length drawn from a stated
long-tailed distribution (`segment_cost.LengthDistribution`), so the
workload does not depend on what the random model emits. Complete groups
queue in order; whenever `--prompts-per-step` groups are ready the learner
trains on exactly those samples (a fixed number of trained samples per
update). After `num_segments + 1` warm-up steps (the pools fill up) the
next `--steps` steps are timed (96 by default: on a 2-core CPU seven runs then
agree within 5 % at K = 4 and 7 % at K = 8, where 24-step windows differed by
up to 12 %); a step during which anything compiled (engine or learner) is left
out and counted. Reported per K:
seconds per update (rollout + learn), speedup over K = 1, the ideal speedup
of the same lengths (critical path: `segment_cost.ideal_speedups`), the
rollout / learn split, slot occupancy, staleness (policy versions per
trained sample) and an exact ledger: after the timed steps the pools are
drained and every sample created must be trained exactly once.

One engine (slots = prompts x n x max K, so every in-flight sample gets a slot
at every K) and one learner serve all K: the same executables, no recompiles.
The K values run interleaved, one RL step of each in turn, so that on a shared
machine every K sees the same background load (each K keeps its own pools,
prompts, lengths and policy-version count, so its figures are what a K-only run
would measure).

Projected (`--model-scale`): the roofline cost model of `segment_cost.project`
for the paper's setting (128 prompts x 8, 64k, K = 1, 2, 4, 8), assumptions printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from ulorl_jax import choices
from ulorl_jax.bench import harness
from ulorl_jax.bench import segment_cost as sc


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("workload")
    g.add_argument("--segments", default="1,2,4,8", help="comma-separated num_segments values (default 1,2,4,8)")
    g.add_argument("--global-max-len", type=int, default=128, help="max response tokens (default 128)")
    g.add_argument("--prompts-per-step", type=int, default=2, help="new prompts per step = groups per update "
                                                                    "(default 2)")
    g.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size, default 4)")
    g.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    g.add_argument("--body", type=float, default=0.8, help="fraction of lengths uniform in [1, max/2] (default 0.8)")
    g.add_argument("--truncated", type=float, default=0.05,
                   help="fraction running to the global max (truncated; default 0.05); the rest: (max/2, max]")
    g.add_argument("--steps", type=int, default=96,
                   help="timed RL steps per K after warm-up (default 96, about a minute on 2 CPU cores: over "
                        "fewer steps the window's lengths, not the engine, move the ratios; see "
                        "benchmarks/results/segments.md)")
    g.add_argument("--steps-per-call", type=int, default=8, help="engine decode steps per jitted call (default 8)")
    g.add_argument("--prefill-token-budget", type=int, default=None,
                   help="engine's padded tokens per batched prefill call (default: the engine's, "
                        "PolicyEngine.prefill_many)")
    g.add_argument("--seed", type=int, default=0, help="default 0")
    g = parser.add_argument_group("tiny model (measured run)")
    g.add_argument("--hidden-size", type=int, default=32, help="default 32")
    g.add_argument("--layers", type=int, default=2, help="default 2")
    g.add_argument("--vocab", type=int, default=64, help="default 64")
    g.add_argument("--remat", choices=choices.REMAT, default="none",
                   help="learner rematerialisation (trainer.remat; default none, as configs/tiny_cpu.yaml trains a "
                        "tiny model on a CPU; full is the full-size default)")
    g.add_argument("--micro-batch-rows", type=int, default=4,
                   help="learner rows per micro-batch (learner.micro_batch_rows; default 4: an update's 8 samples "
                        "pack into 3-5 rows of prompt + global max tokens, one micro-batch for most updates)")
    g = parser.add_argument_group("projection (cost model, no measurement)")
    g.add_argument("--model-scale", choices=sorted(sc.MODEL_SCALES), default=None,
                   help="project the paper's setting for this model instead of measuring")
    g.add_argument("--gpus", type=int, default=64, help="H200s for the projection (default 64)")
    g.add_argument("--projection-max-len", type=int, default=65536, help="global max len projected (default 64k)")
    g.add_argument("--projection-prompts", type=int, default=128, help="prompts per step projected (default 128)")
    g.add_argument("--projection-n", type=int, default=8, help="samples per prompt projected (default 8)")
    g.add_argument("--projection-prompt-len", type=int, default=1024, help="prompt tokens projected (default 1024)")
    g.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def settings(args) -> dict:
    defaults = vars(add_arguments(argparse.ArgumentParser(add_help=False)).parse_args([]))
    return {k: getattr(args, k, v) for k, v in defaults.items() if k != "json"}


def parse_segments(text: str, global_max_len: int) -> list[int]:
    try:
        ks = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--segments={text!r}: expected comma-separated integers like 1,2,4,8") from None
    if not ks or ks[0] < 1:
        raise ValueError(f"--segments={text!r}: need positive integers")
    bad = [k for k in ks if global_max_len % k]
    if bad:
        raise ValueError(f"--segments {bad} do not divide --global-max-len={global_max_len}")
    return ks


# ---------------------------------------------------------------------------
# Measured run
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Ledger:
    """Which sample uids were created, and which the learner trained (in order)."""

    created: list[int] = dataclasses.field(default_factory=list)
    trained: list[int] = dataclasses.field(default_factory=list)
    wrong_length: list[int] = dataclasses.field(default_factory=list)  # trained length != oracle's

    def summary(self) -> dict:
        trained = np.asarray(self.trained, np.int64)
        uniq, counts = np.unique(trained, return_counts=True)
        return {"created": len(self.created), "trained": len(self.trained),
                "duplicates": int((counts > 1).sum()), "lost": len(set(self.created) - set(uniq.tolist())),
                "unknown": len(set(uniq.tolist()) - set(self.created)), "wrong_length": len(self.wrong_length)}


def _train_samples(groups) -> list:
    """GRPO advantages on a synthetic reward (uid parity; truncated samples get 0, ULORL.md §1)."""
    from ulorl_jax.rl.advantages import grpo_advantages
    from ulorl_jax.rl.packing import TrainSample

    rewards = np.asarray([[float(s.uid % 2 == 0 and s.finish_reason == "eos") for s in g] for g in groups],
                         np.float32)  # [groups, n]
    adv = np.asarray(grpo_advantages(rewards))
    return [TrainSample(s.prompt_ids, s.response_ids, float(adv[i, j]), float(rewards[i, j]), s.logprobs)
            for i, g in enumerate(groups) for j, s in enumerate(g)]


def run_one(engine, learner, k: int, s: dict, dist: sc.LengthDistribution, progress=None) -> dict:
    """Measure one num_segments value; the engine and learner are shared across K."""
    steps = run_steps(engine, learner, k, s, dist)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if progress:
            progress()


def run_steps(engine, learner, k: int, s: dict, dist: sc.LengthDistribution):
    """`run_one` as a generator that yields after every RL step (warm-up, timed, drain) and returns
    its result: `run` interleaves the K values step by step, so that all K see the same background
    load on a shared machine (their ratios are what the bench reports). Policy versions count this
    K's own updates (the learner is shared)."""
    import jax

    from ulorl_jax.decode.sampling import SamplingParams
    from ulorl_jax.rollout.segment import RolloutConfig, SegmentRollout
    from ulorl_jax.types import PromptItem

    cfg = RolloutConfig(global_max_len=s["global_max_len"], num_segments=k, samples_per_prompt=s["n"],
                        max_prompt_len=s["prompt_len"], sampling=SamplingParams(temperature=1.0))
    rollout = SegmentRollout(engine, cfg, length_oracle=lambda smp: dist(smp.uid), steps_per_call=s["steps_per_call"])
    ledger = Ledger()
    queue: list[list] = []  # complete groups waiting for an update, in completion order
    rng = np.random.default_rng(s["seed"])
    warmup = k + 1
    rows, next_prompt, version = [], 0, 0
    g = s["prompts_per_step"]

    xla = harness.CompileCounter()

    def compiles() -> int:  # any compile anywhere (xla); the engine's and learner's caches as a second witness
        return xla.count + engine.compile_count() + sum(learner.jit_cache_sizes().values())

    def one_step(step: int, new_prompts: int) -> dict:
        nonlocal next_prompt, version
        prompts = []
        for _ in range(new_prompts):
            prompts.append(PromptItem(next_prompt, rng.integers(1, s["vocab"], s["prompt_len"]).tolist()))
            next_prompt += 1
        before = compiles()
        t0 = time.perf_counter()
        rep = rollout.step(learner.params, prompts, policy_version=version,
                           rng=jax.random.fold_in(jax.random.PRNGKey(s["seed"]), 1000 * k + step))
        rollout_s = time.perf_counter() - t0
        for smp in rep.ended:
            want = min(dist(smp.uid), s["global_max_len"])
            if len(smp.response_ids) != want or len(smp.logprobs) != want or len(smp.policy_versions) != want:
                ledger.wrong_length.append(smp.uid)
        queue.extend(rollout.experience_pool.pop_complete_groups())
        learn_s, staleness, updated = 0.0, [], 0
        drain = new_prompts == 0
        while len(queue) >= g or (drain and queue and not rollout.unfinished_pool):
            batch, queue[:] = queue[:g], queue[g:]
            flat = [smp for grp in batch for smp in grp]
            ledger.trained.extend(smp.uid for smp in flat)
            staleness += [(max(smp.policy_versions) - min(smp.policy_versions), version - min(
                smp.policy_versions), len(set(smp.policy_versions))) for smp in flat]
            t0 = time.perf_counter()
            learner.update(_train_samples(batch))
            learn_s += time.perf_counter() - t0
            updated += 1
            version += 1
        batch_size = rep.carried + rep.finished + rep.truncated
        iterations = (rep.tokens_decoded - batch_size) / max(rep.slot_occupancy * engine.max_concurrent_decodes, 1e-9)
        return {"step": step, "rollout_s": rollout_s, "learn_s": learn_s, "updates": updated,
                "prefill_s": rep.prefill_seconds, "decode_s": rep.decode_seconds,
                "host_s": rollout_s - rep.prefill_seconds - rep.decode_seconds,
                "prefill_calls": getattr(rep, "prefill_calls", 0), "prefill_rows": getattr(rep, "prefill_rows", 0),
                "compiled": compiles() != before, "batch": batch_size, "tokens": rep.tokens_decoded,
                "slot_occupancy": rep.slot_occupancy, "iterations": iterations,
                "batch_occupancy": (rep.tokens_decoded - batch_size) / max(iterations * batch_size, 1e-9)
                if rep.slot_occupancy else 0.0, "staleness": staleness}

    with xla:
        for step in range(warmup + s["steps"]):
            for uid in range(rollout.next_uid, rollout.next_uid + g * s["n"]):
                ledger.created.append(uid)
            row = one_step(step, g)
            row["timed"] = step >= warmup
            rows.append(row)
            yield
        drain_steps = 0
        while rollout.unfinished_pool or queue or len(rollout.experience_pool):  # drain: every sample trained once
            one_step(10_000 + drain_steps, 0)
            drain_steps += 1
            yield
            if drain_steps > 4 * k + 4:
                raise RuntimeError(f"K={k}: pools did not drain in {drain_steps} steps")

    timed = [r for r in rows if r["timed"] and not r["compiled"]]
    updates = sum(r["updates"] for r in timed)
    roll, learn = sum(r["rollout_s"] for r in timed), sum(r["learn_s"] for r in timed)
    stale = [x for r in rows if r["timed"] for x in r["staleness"]]
    spread = np.asarray([x[0] for x in stale] or [0])
    lag = np.asarray([x[1] for x in stale] or [0])
    versions = np.asarray([x[2] for x in stale] or [1])
    return {
        "seconds_per_update": (roll + learn) / updates if updates else float("nan"),
        "rollout_s_per_update": roll / updates if updates else float("nan"),
        "learn_s_per_update": learn / updates if updates else float("nan"),
        "prefill_s_per_update": sum(r["prefill_s"] for r in timed) / max(updates, 1),
        "decode_s_per_update": sum(r["decode_s"] for r in timed) / max(updates, 1),
        # rollout time outside prefill and decode calls: building requests, pools, host copies
        "host_s_per_update": sum(r["host_s"] for r in timed) / max(updates, 1),
        "prefill_calls_per_step": float(np.mean([r["prefill_calls"] for r in timed])) if timed else 0.0,
        "prefill_rows_per_step": float(np.mean([r["prefill_rows"] for r in timed])) if timed else 0.0,
        "updates_timed": updates, "steps_timed": len(timed),
        "steps_excluded_compiling": sum(1 for r in rows if r["timed"] and r["compiled"]),
        "segment_len": cfg.segment_len,
        "mean_in_flight": float(np.mean([r["batch"] for r in timed])) if timed else 0.0,
        "slot_occupancy": float(np.mean([r["slot_occupancy"] for r in timed])) if timed else 0.0,
        "batch_occupancy": float(np.mean([r["batch_occupancy"] for r in timed])) if timed else 0.0,
        "decode_iterations_per_step": float(np.mean([r["iterations"] for r in timed])) if timed else 0.0,
        "staleness": {"mean_version_spread": float(spread.mean()), "max_version_spread": int(spread.max()),
                      "mean_versions_per_sample": float(versions.mean()),
                      "multi_version_fraction": float((versions > 1).mean()),
                      "mean_lag_at_update": float(lag.mean()), "max_lag_at_update": int(lag.max())},
        "ledger": ledger.summary(),
        "drain_steps": drain_steps,
    }


def build(s: dict):
    """The tiny model, one engine for all K, one learner."""
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.rl.learner import Learner, LearnerConfig

    ks = parse_segments(s["segments"], s["global_max_len"])
    heads = max(1, s["hidden_size"] // 16)
    model = init_model(tiny_config("qwen3", vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                                   intermediate_size=2 * s["hidden_size"], num_hidden_layers=s["layers"],
                                   num_attention_heads=heads, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=max(2048, s["prompt_len"] + s["global_max_len"])),
                       seed=s["seed"])
    p, gmax = s["prompt_len"], s["global_max_len"]
    slots = s["prompts_per_step"] * s["n"] * max(ks)
    budget = {"prefill_token_budget": s["prefill_token_budget"]} if s.get("prefill_token_budget") else {}
    engine = PolicyEngine(model, max_concurrent_decodes=slots, max_prefill_length=p + gmax, max_cache_len=p + gmax,
                          prefill_fanout=s["n"], **budget)
    learner = Learner(model, LearnerConfig(row_len=p + gmax, micro_batch_rows=s["micro_batch_rows"],
                                           logprob_chunk=p + gmax,
                                           mask_mode="dmmpt", lr=1e-4, remat=s["remat"]))
    return ks, engine, learner


def run(args) -> dict:
    s = settings(args)
    for name in ("global_max_len", "prompts_per_step", "n", "prompt_len", "steps", "steps_per_call",
                 "hidden_size", "layers", "vocab", "micro_batch_rows", "gpus", "projection_max_len",
                 "projection_prompts", "projection_n", "projection_prompt_len"):
        if not isinstance(s[name], int) or s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {s[name]!r}")
    if s["prefill_token_budget"] is not None and (not isinstance(s["prefill_token_budget"], int)
                                                  or s["prefill_token_budget"] < 1):
        raise ValueError(f"--prefill-token-budget must be a positive integer, got {s['prefill_token_budget']!r}")
    dist = sc.LengthDistribution(s["global_max_len"], body=s["body"], truncated=s["truncated"], seed=s["seed"])
    if s["model_scale"]:
        return projection(s, dist)

    from rich.progress import Progress

    load_before = harness.loadavg()
    ks, engine, learner = build(s)
    ideal = sc.ideal_speedups(dist, ks, prompts_per_step=s["prompts_per_step"], samples_per_prompt=s["n"])
    out = {}
    cpu_before = harness.cpu_sample()
    with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(f"num_segments {','.join(map(str, ks))}, interleaved",
                            total=sum(k + 1 + s["steps"] for k in ks))
        running = {k: run_steps(engine, learner, k, s, dist) for k in ks}
        while running:  # one RL step of each K in turn: every K sees the same background load
            for k, steps in list(running.items()):
                try:
                    next(steps)
                    bar.advance(task)
                except StopIteration as done:
                    out[k] = done.value
                    del running[k]
    background = harness.background_load(cpu_before, harness.cpu_sample())
    base = out[ks[0]]["seconds_per_update"]
    for k in ks:
        out[k]["speedup"] = base / out[k]["seconds_per_update"]
        out[k]["ideal_speedup"] = ideal[k]["ideal_speedup"]
        out[k]["pct_of_ideal"] = 100.0 * out[k]["speedup"] / ideal[k]["ideal_speedup"]
        out[k]["ideal_batch_occupancy"] = ideal[k]["ideal_batch_occupancy"]
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    return {"bench": "segments", "mode": "measured", "settings": s, "length_distribution": dist.describe(),
            "engine_slots": engine.max_concurrent_decodes,
            "prefill_token_budget": getattr(engine, "prefill_token_budget", None),
            "segments": {str(k): out[k] for k in ks},
            "machine": machine}


def projection(s: dict, dist: sc.LengthDistribution) -> dict:
    ks = parse_segments(s["segments"], s["projection_max_len"])
    model = sc.MODEL_SCALES[s["model_scale"]]
    gpu = sc.GpuAssumptions()
    pdist = dist.scaled(s["projection_max_len"])
    res = sc.project(model, gpu, pdist, ks, gpus=s["gpus"], prompts_per_step=s["projection_prompts"],
                     samples_per_prompt=s["projection_n"], prompt_len=s["projection_prompt_len"])
    ideal = sc.ideal_speedups(pdist, ks, prompts_per_step=s["projection_prompts"], samples_per_prompt=s["projection_n"],
                              steps=40)
    total, active = model.params()
    for k in ks:
        res[k]["ideal_speedup"] = ideal[k]["ideal_speedup"]
        if k in sc.PAPER_TABLE_1:
            res[k]["paper_seconds_per_step"] = sc.PAPER_TABLE_1[k]
            res[k]["paper_speedup"] = sc.PAPER_TABLE_1[1] / sc.PAPER_TABLE_1[k]
    assumptions = [f"model {model.name}: {total / 1e9:.1f}B params, {active / 1e9:.2f}B active per token, "
                   f"KV {model.kv_bytes_per_token(gpu.kv_bytes) / 1024:.0f} KiB/token",
                   f"{s['gpus']} H200s; decode replicas of {gpu.decode_tp} GPU(s), samples split evenly",
                   f"{s['projection_prompts']} prompts x {s['projection_n']} per step, prompt "
                   f"{s['projection_prompt_len']} tokens, global max {s['projection_max_len']}",
                   f"lengths: {pdist.describe()}",
                   "decode iteration = max(weights touched + KV read over HBM, FLOPs at decode_mfu) + overhead",
                   "continued samples re-prefilled (FLOPs at prefill_mfu); learner = remat_factor x forward FLOPs "
                   "(incl. causal attention) of every trained sample at learner_mfu; one update per step",
                   "not modelled: weight sync, reward scoring, KV-cache capacity limits, stragglers"]
    return {"bench": "segments", "mode": "projection", "settings": s, "assumptions": assumptions,
            "gpu_assumptions": dataclasses.asdict(gpu), "segments": {str(k): res[k] for k in ks}}


def format_table(r: dict) -> str:
    s = r["settings"]
    if r["mode"] == "projection":
        lines = [f"ulorl bench segments --model-scale {s['model_scale']} --gpus {s['gpus']}: COST-MODEL PROJECTION "
                 "(not a measurement)", "assumptions:"] + [f"  {a}" for a in r["assumptions"]] + [
            "  " + ", ".join(f"{k}={v:g}" for k, v in r["gpu_assumptions"].items()), "",
            f"{'K':>3}{'s/update':>10}{'speedup':>9}{'ideal':>7}{'decode s':>10}{'prefill s':>10}{'learn s':>9}"
            f"{'in flight':>10}{'paper s':>9}{'paper x':>8}"]
        for k, v in r["segments"].items():
            paper = (f"{v['paper_seconds_per_step']:>9.0f}{v['paper_speedup']:>8.2f}" if "paper_speedup" in v
                     else f"{'-':>9}{'-':>8}")
            lines.append(f"{k:>3}{v['seconds_per_update']:>10.0f}{v['speedup']:>9.2f}{v['ideal_speedup']:>7.2f}"
                         f"{v['decode_s']:>10.0f}{v['prefill_s']:>10.0f}{v['learn_s']:>9.0f}"
                         f"{v['mean_in_flight']:>10.0f}{paper}")
        lines.append("paper: Table 1, Qwen3-30B-A3B at 64k (GPU count not stated in the paper)")
        return "\n".join(lines)
    mc = r["machine"]
    lines = [
        f"ulorl bench segments (MEASURED on CPU: {mc['cpu']}, {mc['cpus_usable']} usable CPUs; {mc['date']})",
        f"tiny qwen3 hidden {s['hidden_size']}, {s['layers']} layers, vocab {s['vocab']}; {s['prompts_per_step']} "
        f"prompts x {s['n']} per step, prompt {s['prompt_len']}, global max {s['global_max_len']}; engine "
        f"{r['engine_slots']} slots, {s['steps_per_call']} steps/call, prefill budget "
        f"{r.get('prefill_token_budget', '-')} tokens/call; learner remat {s.get('remat', 'full')}, "
        f"{s.get('micro_batch_rows', 1)} rows per micro-batch",
        f"lengths: {r['length_distribution']}",
        "",
        f"{'K':>3}{'seg':>5}{'s/update':>10}{'speedup':>9}{'ideal':>7}{'% ideal':>8}{'rollout s':>10}{'prefill':>8}"
        f"{'decode':>8}{'host':>7}{'learn s':>9}{'pf calls':>9}"
        f"{'slots':>7}{'batch occ':>10}{'in flight':>10}{'versions':>9}{'spread max':>11}{'ledger':>12}",
    ]
    for k, v in r["segments"].items():
        st, lg = v["staleness"], v["ledger"]
        ok = "ok" if not (lg["duplicates"] or lg["lost"] or lg["unknown"] or lg["wrong_length"]) else "BAD"
        lines.append(f"{k:>3}{v['segment_len']:>5}{v['seconds_per_update']:>10.3f}{v['speedup']:>9.2f}"
                     f"{v['ideal_speedup']:>7.2f}{v['pct_of_ideal']:>7.0f}%{v['rollout_s_per_update']:>10.3f}"
                     f"{v['prefill_s_per_update']:>8.3f}{v['decode_s_per_update']:>8.3f}{v['host_s_per_update']:>7.3f}"
                     f"{v['learn_s_per_update']:>9.3f}{v['prefill_calls_per_step']:>9.1f}"
                     f"{v['slot_occupancy']:>7.2f}{v['batch_occupancy']:>10.2f}{v['mean_in_flight']:>10.1f}"
                     f"{st['mean_versions_per_sample']:>9.2f}{st['max_version_spread']:>11d}"
                     f"{lg['trained']:>6d}/{lg['created']:<4d}{ok}")
    lines += ["s/update: (rollout + learn) wall time of compile-free timed steps / updates in them; ideal: "
              "critical-path speedup of the same lengths (batch free, learning free); % ideal: speedup / ideal",
              "prefill / decode: seconds in the engine's prefill / decode calls; host: the rest of the rollout "
              "(requests, pools, host copies); pf calls: batched prefill calls per step",
              "slots: fraction of engine slots generating; batch occ: fraction of the step's samples generating per "
              "decode iteration; versions: policy versions per trained sample; ledger: trained / created "
              "(each exactly once)"]
    lines += [line for line in (harness.cpu_load_line(mc),) if line]
    return "\n".join(lines)


def _cli(args) -> int:
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "segments", "segment-rollout speedup per num_segments (paper "
                                    "Table 1); --model-scale for a GPU cost-model projection", __doc__,
                                    add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.segments", __doc__, add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
