"""Segment-rollout arithmetic without a model: the long-tailed length workload,
Algorithm 1's pools simulated on lengths alone, the ideal speedup, and a GPU cost model.

- `LengthDistribution`: the output lengths a benchmark forces (a length
  oracle), drawn per sample uid so every run sees the same workload.
- `simulate_pools`: ULORL.md §1 / Algorithm 1 on lengths only: per RL step,
  which samples decode how many tokens from where, and which end.
- `ideal_seconds_per_update`: the critical path of each step (the longest
  decode in it), i.e. what perfect slot use gives when any number of samples
  decode concurrently at no extra cost and learning is free. The ideal speedup
  of K segments is its ratio to K = 1.
- `project`: a roofline cost model of one RL step of Qwen3-30B-A3B on H200s
  (decode iterations bounded by HBM bandwidth or FLOPs, re-prefill and the
  learner bounded by FLOPs at a stated MFU). Every assumption is a field of
  `GpuAssumptions` and is printed with the projection.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import numpy as np

from ulorl_jax.models.shape import ModelShape

# ---------------------------------------------------------------------------
# Workload: long-tailed output lengths
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Total response length at which a sample ends (as if it emitted EOS).

    With probability `body`: uniform in [1, global_max_len / 2]; with
    probability `truncated`: global_max_len + 1 (never ends: truncated at the
    global max, reward 0); otherwise the tail, uniform in (global_max_len / 2,
    global_max_len]. Deterministic per (seed, uid).
    """

    global_max_len: int
    body: float = 0.8
    truncated: float = 0.05
    seed: int = 0

    def __post_init__(self):
        if self.global_max_len < 2:
            raise ValueError(f"LengthDistribution.global_max_len={self.global_max_len} must be >= 2")
        if not (0.0 <= self.body and 0.0 <= self.truncated and self.body + self.truncated <= 1.0):
            raise ValueError(f"LengthDistribution: body={self.body}, truncated={self.truncated} must be "
                             "probabilities with body + truncated <= 1")

    def describe(self) -> str:
        g, half = self.global_max_len, self.global_max_len // 2
        tail = 1.0 - self.body - self.truncated
        return (f"{self.body:.0%} uniform in [1, {half}], {tail:.0%} uniform in ({half}, {g}], "
                f"{self.truncated:.0%} run to the global max {g} (truncated)")

    def length(self, uid: int) -> int:
        rng = random.Random(f"{self.seed}:{int(uid)}")  # str seeds hash with SHA-512: stable across runs
        u, v = rng.random(), rng.random()
        half = self.global_max_len // 2
        if u < self.body:
            return 1 + int(v * half)  # [1, half]
        if u < self.body + self.truncated:
            return self.global_max_len + 1
        return half + 1 + int(v * (self.global_max_len - half))  # (half, global]

    def __call__(self, uid: int) -> int:
        return self.length(uid)

    def scaled(self, global_max_len: int) -> "LengthDistribution":
        return dataclasses.replace(self, global_max_len=global_max_len)


# ---------------------------------------------------------------------------
# Algorithm 1 on lengths only
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class StepTrace:
    """One simulated RL step. Arrays are per sample of the step's batch."""

    start: np.ndarray  # [N] response tokens already decoded before this step
    decoded: np.ndarray  # [N] tokens decoded this step (>= 1)
    groups_completed: int  # groups whose n samples had all ended by the end of this step
    ended: int
    truncated: int

    @property
    def critical_path(self) -> int:
        return int(self.decoded.max()) if self.decoded.size else 0


def simulate_pools(lengths: Callable[[int], int], *, global_max_len: int, num_segments: int,
                   prompts_per_step: int, samples_per_prompt: int, steps: int) -> list[StepTrace]:
    """Algorithm 1 with the three terminations of ULORL.md §1, on target lengths `lengths(uid)`.

    uids are assigned in order (prompt by prompt, n per prompt), as
    `SegmentRollout.new_samples` does, so a real run with the same oracle
    decodes exactly these token counts.
    """
    if global_max_len % num_segments:
        raise ValueError(f"num_segments={num_segments} does not divide global_max_len={global_max_len}")
    seg = global_max_len // num_segments
    unfinished: list[tuple[int, int, int]] = []  # (uid, group, decoded so far)
    remaining: dict[int, int] = {}  # group -> samples not yet ended
    next_uid, next_group, out = 0, 0, []
    targets: dict[int, int] = {}  # uid -> target length, drawn once
    for _ in range(steps):
        batch = list(unfinished)
        for _ in range(prompts_per_step):
            for _ in range(samples_per_prompt):
                batch.append((next_uid, next_group, 0))
                next_uid += 1
            remaining[next_group] = samples_per_prompt
            next_group += 1
        unfinished = []
        start, decoded, ended, truncated, completed = [], [], 0, 0, 0
        for uid, group, done in batch:
            target = targets[uid] if uid in targets else targets.setdefault(uid, lengths(uid))
            budget = min(seg, global_max_len - done, max(1, target - done))
            now = done + budget
            start.append(done)
            decoded.append(budget)
            if now >= target or now >= global_max_len:
                ended += 1
                truncated += now < target
                remaining[group] -= 1
                if remaining[group] == 0:
                    completed += 1
                    del remaining[group]
            else:
                unfinished.append((uid, group, now))
                continue
            targets.pop(uid, None)
        out.append(StepTrace(np.asarray(start), np.asarray(decoded), completed, ended, truncated))
    return out


def steady_state(traces: Sequence[StepTrace], num_segments: int) -> list[StepTrace]:
    """Drop the first `num_segments` steps (the pools are still filling)."""
    return list(traces[num_segments:])


def ideal_seconds_per_update(traces: Sequence[StepTrace], prompts_per_update: int, seconds_per_token: float = 1.0
                             ) -> float:
    """Σ critical paths / updates: decode time when every in-flight sample decodes concurrently for free."""
    groups = sum(t.groups_completed for t in traces)
    if groups == 0:
        raise ValueError("no group completed in the simulated steps; simulate more steps")
    return seconds_per_token * sum(t.critical_path for t in traces) / (groups / prompts_per_update)


def ideal_speedups(dist: LengthDistribution, segments: Sequence[int], *, prompts_per_step: int,
                   samples_per_prompt: int, steps: int = 200) -> dict[int, dict]:
    """Per K: ideal critical-path tokens per update and its speedup over K = 1 (or the smallest K)."""
    out = {}
    for k in segments:
        tr = steady_state(simulate_pools(dist, global_max_len=dist.global_max_len, num_segments=k,
                                         prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                                         steps=steps + k), k)
        in_flight = float(np.mean([t.decoded.size for t in tr]))
        used = sum(int(t.decoded.sum()) for t in tr)
        slot_steps = sum(t.critical_path * t.decoded.size for t in tr)
        out[k] = {"critical_tokens_per_update": ideal_seconds_per_update(tr, prompts_per_step),
                  "mean_in_flight": in_flight, "ideal_batch_occupancy": used / max(slot_steps, 1)}
    base = out[min(segments)]["critical_tokens_per_update"]
    for k in out:
        out[k]["ideal_speedup"] = base / out[k]["critical_tokens_per_update"]
    return out


# ---------------------------------------------------------------------------
# GPU cost model (projection for the paper's setting)
# ---------------------------------------------------------------------------


QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                           vocab=151936, experts=128, top_k=8, expert_mlp=768, dense_mlp=6144)
MODEL_SCALES = {"qwen3-30b-a3b": QWEN3_30B_A3B}


@dataclasses.dataclass(frozen=True)
class GpuAssumptions:
    peak_flops: float = 989e12  # H200 dense bf16 FLOP/s
    hbm_bytes_per_s: float = 4.8e12  # H200 HBM3e
    hbm_efficiency: float = 0.6  # achieved fraction of HBM bandwidth in decode
    decode_mfu: float = 0.5  # achieved fraction of peak when decode is compute bound
    prefill_mfu: float = 0.4
    learner_mfu: float = 0.35
    decode_tp: int = 1  # GPUs per decode replica (30B-A3B bf16 = 61 GB fits one 141 GB H200)
    iteration_overhead_s: float = 2e-4  # launch / sampling / scheduling per decode iteration
    weight_bytes: int = 2  # bf16 weights for decode
    kv_bytes: int = 2  # bf16 KV cache
    remat_factor: float = 4.0  # learner FLOPs / forward FLOPs (fwd + bwd 2x + remat recompute)

    def lines(self) -> list[str]:
        return [f"  {f.name} = {getattr(self, f.name):g}" for f in dataclasses.fields(self)]


def _decode_seconds(model: ModelShape, gpu: GpuAssumptions, replicas: int, start: np.ndarray,
                    decoded: np.ndarray, prompt_len: int) -> float:
    """Σ over decode iterations t of max(memory time, compute time) per replica (samples split evenly)."""
    total, active = model.params()
    crit = int(decoded.max())
    counts = np.bincount(decoded, minlength=crit + 1).astype(np.float64)
    alive = counts[::-1].cumsum()[::-1]  # alive[m] = #{decoded >= m}
    a = alive[1:crit + 1]  # samples decoding at iteration t = 0..crit-1 (decoded > t)
    ctx0 = np.bincount(decoded, weights=start + prompt_len, minlength=crit + 1)
    c = ctx0[::-1].cumsum()[::-1][1:crit + 1]  # Σ starting context of those samples
    t = np.arange(crit, dtype=np.float64)
    kv_tokens = c + t * a  # Σ context of the samples decoding at t
    per_rep = np.maximum(a / replicas, 1e-9)
    # Expert weights touched: each token picks top_k of E experts per layer.
    if model.experts:
        frac = 1.0 - (1.0 - model.top_k / model.experts) ** np.maximum(per_rep, 1.0)
        expert_params = total - active + model.layers * model.top_k * 3 * model.hidden * model.expert_mlp
        touched = (active - model.layers * model.top_k * 3 * model.hidden * model.expert_mlp) + frac * expert_params
    else:
        touched = np.full_like(a, total)
    mem = (touched * gpu.weight_bytes / gpu.decode_tp + kv_tokens / replicas * model.kv_bytes_per_token(
        gpu.kv_bytes) / gpu.decode_tp) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)
    flops = (2.0 * active * per_rep + model.attention_flops(kv_tokens / replicas)) / gpu.decode_tp
    comp = flops / (gpu.peak_flops * gpu.decode_mfu)
    return float(np.sum(np.maximum(mem, comp)) + crit * gpu.iteration_overhead_s)


def _forward_flops(model: ModelShape, lengths: np.ndarray) -> float:
    """Forward FLOPs of full sequences (causal attention: s^2 / 2 query-key pairs each)."""
    _, active = model.params()
    lengths = lengths.astype(np.float64)
    return float(2.0 * active * lengths.sum() + 2.0 * model.layers * model.heads * model.head_dim * np.sum(lengths ** 2))


def project(model: ModelShape, gpu: GpuAssumptions, dist: LengthDistribution, segments: Sequence[int], *,
            gpus: int, prompts_per_step: int, samples_per_prompt: int, prompt_len: int, steps: int = 24) -> dict:
    """Modelled seconds per RL step (= per update: one update per step, §4) for each K."""
    if gpus < gpu.decode_tp or gpus % gpu.decode_tp:
        raise ValueError(f"--gpus={gpus} must be a multiple of decode_tp={gpu.decode_tp}")
    replicas = gpus // gpu.decode_tp
    final = np.minimum([dist(u) for u in range(4096)], dist.global_max_len)
    mean_fwd = _forward_flops(model, final + prompt_len) / final.size  # forward FLOPs of one trained sample
    out = {}
    for k in segments:
        tr = steady_state(simulate_pools(dist, global_max_len=dist.global_max_len, num_segments=k,
                                         prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                                         steps=steps + k), k)
        decode = prefill = 0.0
        for t in tr:
            decode += _decode_seconds(model, gpu, replicas, t.start, t.decoded, prompt_len)
            # Continued samples are re-prefilled: prompt + earlier segments (new ones: the prompt).
            prefill += _forward_flops(model, t.start + prompt_len) / (gpus * gpu.peak_flops * gpu.prefill_mfu)
        # The learner trains every sample once: prompts_per_step groups per update, lengths from `dist`.
        learn = len(tr) * prompts_per_step * samples_per_prompt * mean_fwd * gpu.remat_factor / (
            gpus * gpu.peak_flops * gpu.learner_mfu)
        groups = sum(t.groups_completed for t in tr)
        updates = groups / prompts_per_step
        total = decode + prefill + learn
        out[k] = {"seconds_per_update": total / updates, "decode_s": decode / updates, "prefill_s": prefill / updates,
                  "learn_s": learn / updates, "mean_in_flight": float(np.mean([t.decoded.size for t in tr]))}
    base = out[min(segments)]["seconds_per_update"]
    for k in out:
        out[k]["speedup"] = base / out[k]["seconds_per_update"]
    return out


PAPER_TABLE_1 = {1: 1240.0, 2: 774.0, 4: 601.0}  # Qwen3-30B-A3B, 64k output, s/step (ULORL.md §1)

