"""First contact with a GPU: one prepared script that validates and measures the GPU path (issue 22).

On the device machine (one H200, its own Python 3.12 / jax with the CUDA plugin / torch, no registry),
from the checkout's root, in one call with room for a rerun (the suite keeps itself under --budget-s,
default 450 s: under 8 minutes; the outer `timeout` only guards against a hang of the runner itself):

    PYTHONUNBUFFERED=1 timeout 540 python3 benchmarks/gpu_suite.py --out $OUT

i.e. the device tool's run(command=<that line>, timeout_s=570, carry=[".whl"] if wheels are carried).
The tool returns at most 8 files from $OUT, at most 2 folders down: the suite writes 6, flat. A rerun
of what broke, after fixing it on CPU, fits the rest of a 15-minute window, e.g.
`python3 benchmarks/gpu_suite.py --out $OUT --parts a,c --budget-s 200`. Before spending device time,
on any CPU:

    python benchmarks/gpu_suite.py --dry-run --out /tmp/gpu_dry   # tiny shapes, interpret mode, 2 parts at
                                                                   # a time: ~1 min idle, ~2.5 on a busy VM

Nothing needs installing: the suite runs from the checkout (it maps `ulorl_jax.kernels` to
kernels/pallas itself). Pure-Python wheels the machine lacks (env.json's `missing`, with the pip
download command to fetch them; on the 2026-11 image: omegaconf, math-verify, tensorboardX; part c
needs omegaconf) travel in `.whl/` of the working tree (README of the device tool): the suite installs
every wheel found there (or in --wheels DIR) into a temporary folder first.

Parts, each in its own subprocess with its own timeout (one that fails, hangs or crashes is recorded
with its error and traceback tail, and the next part runs):
  env  versions (python, jax, jaxlib, jax CUDA plugin, flax, optax, orbax, transformers, torch, ...),
       nvidia-smi, the JAX backend and devices, and the pyproject dependencies that do not import
       -> env.json
  a    kernel tests compiled for the GPU (Triton, not interpret mode; the tests pick interpret mode
       only when jax's backend is cpu, and this part sets JAX_PLATFORMS=cuda) against their
       references, forward and backward: tests/kernel_tests/test_kernels_{attention,decode,gmm}.py
       -> kernels_junit.xml
  b    the kernel table of benchmarks/attention.py: flash attention vs cuDNN / XLA / torch SDPA at
       4k-64k, decode attention GB/s vs HBM peak, grouped matmul vs ragged_dot and dense
       -> attention.md
  c    learner step and engine on a random-weight Qwen3-0.6B shape (28 layers, bf16 compute, f32
       master weights as the shipped configs; --model 1.7b for Qwen3-1.7B): train step tokens/s and
       MFU on 2 x 8192 = 16k tokens, engine decode tokens/s (16 slots, 4096-token prompts, 512 new
       tokens); peak memory from the compiled `memory_analysis()` and the allocator
       (`memory_stats()["peak_bytes_in_use"]`), each against `ulorl plan`'s prediction for the same
       config (XLA's CPU compiler, run in parallel on the CPU)
  d    `ulorl bench compare --device cuda` (the torch side on CUDA, eager and torch.compile; a
       checkout whose bench compare has no --device records the part as skipped)
  e    `ulorl bench segments` (segment rollout speedup, real engine + learner) on the GPU
Everything lands in --out: env.json, summary.json (every part: status ok / failed / skipped,
seconds, results, error and traceback tail), summary.md, kernels_junit.xml, attention.md, log.txt
(every part's full output). summary.md is written in the form of benchmarks/results/gpu.md
(machine, date, command, versions, then one section per part): copy it there after a GPU run;
`--render DIR` rewrites DIR/summary.md from DIR/summary.json. Exit status: 0 when no part failed
(skipped parts allowed), 1 when one failed, 2 when no GPU was found outside --dry-run (every part
skipped, nothing measured).

Figures that land in benchmarks/results/gpu.md: kernel tests passed / failed compiled on the GPU;
attention fwd and fwd+bwd TFLOP/s (ours, cuDNN, XLA, torch SDPA) per length, decode GB/s and fraction
of the 4.8 TB/s HBM peak, grouped-matmul TFLOP/s; learner tokens/s, step ms, MFU (model FLOPs of
fwd + bwd against the H200's 989 TFLOP/s dense bf16; also against the 790 measured on this
workplace's H200s), compiled peak vs allocator peak vs `ulorl plan` (GB); engine decode tokens/s,
prefill s, allocator peak vs plan; segment-rollout speedups per K.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
PARTS = ("a", "b", "c", "d", "e")
TITLES = {
    "a": "kernel tests compiled for the GPU (fwd + bwd vs references)",
    "b": "kernel table (benchmarks/attention.py)",
    "c": "learner step + engine on a Qwen3 with random weights vs `ulorl plan`",
    "d": "`ulorl bench compare` with torch on CUDA",
    "e": "`ulorl bench segments`",
}
# Seconds each part may take at most on the GPU, and the least it is given if the suite runs late.
NOMINAL_S = {"a": 150, "b": 120, "c": 200, "d": 150, "e": 100}
MIN_S = {"a": 45, "b": 45, "c": 60, "d": 30, "e": 30}
ENV_TIMEOUT_S = 60
H200_BF16_DENSE_TFLOPS = 989.4  # vendor datasheet, dense (H200.md)
H200_BF16_MEASURED_TFLOPS = 790.0  # 8192^3 bf16 matmul via torch on this workplace's H200s (KINDS.md)
H200_HBM_GBS = 4800.0
# test_context_parallel.py: on one GPU, each context shard's attention (queries at their positions against the
# whole row) compiled there; its multi-device tests skip (one GPU: the context=1 path is the learner's usual one)
KERNEL_TESTS = ("tests/kernel_tests/test_kernels_attention.py", "tests/kernel_tests/test_kernels_decode.py",
                "tests/kernel_tests/test_kernels_gmm.py", "tests/rl/test_context_parallel.py")
# Dry run: one real kernel check per file (fwd + bwd where the test has it), interpret mode.
DRY_KERNEL_TESTS = ("tests/kernel_tests/test_kernels_attention.py::test_f32_gqa_ratios[8-False]",
                    "tests/kernel_tests/test_kernels_decode.py::test_ragged_cache_and_zero_length",
                    "tests/kernel_tests/test_kernels_gmm.py::test_f32_forward_and_grads[tile_aligned]")

# pyproject distribution name -> import name (where they differ)
IMPORT_NAMES = {"orbax-checkpoint": "orbax.checkpoint", "pyyaml": "yaml", "math-verify": "math_verify",
                "pytest-xdist": "xdist",
                "ml_dtypes": "ml_dtypes", "tensorboardx": "tensorboardX"}
# What a missing pure-Python dependency needs beside itself (read off the wheels' METADATA; numpy,
# sympy, protobuf, packaging and PyYAML are on the device image).
KNOWN_REQUIRES = {"omegaconf": ["PyYAML (omegaconf 2.4 vendors antlr4; 2.3 needs antlr4-python3-runtime==4.9.*)"],
                  "math-verify": ["latex2sympy2_extended==1.11.0", "antlr4-python3-runtime>=4.9.3,<=4.13.2",
                                  "sympy"],
                  "tensorboardx": ["numpy", "packaging", "protobuf>=3.20"]}
VERSION_DISTS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                 "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "torch", "triton", "numpy",
                 "ml_dtypes", "omegaconf", "pytest", "hypothesis", "safetensors", "math-verify", "tensorboardX")

MODELS = {  # Qwen3 shapes (HF config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B)
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "dry": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16),
}
C_GPU = dict(rows=2, row_len=8192, logprob_chunk=2048, warmup=1, iters=3, slots=16, prompt_len=4096, new_tokens=512,
             steps_per_call=32, vocab=151936)
C_DRY = dict(rows=2, row_len=64, logprob_chunk=32, warmup=0, iters=1, slots=2, prompt_len=16, new_tokens=4,
             steps_per_call=4, vocab=256)


# ---------------------------------------------------------------------------
# Running the project from the checkout without installing it
# ---------------------------------------------------------------------------


class _CheckoutFinder:
    """`ulorl_jax.kernels` -> kernels/pallas and `ulorl_jax.configs` -> configs, as pyproject's package-dir
    maps them, for a checkout that is not pip-installed (the device machine)."""

    MAP = {"ulorl_jax.kernels": ROOT / "kernels" / "pallas", "ulorl_jax.configs": ROOT / "configs"}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        folder = cls.MAP.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _bootstrap_imports() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        found = importlib.util.find_spec("ulorl_jax.kernels") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        sys.meta_path.insert(0, _CheckoutFinder)


def _installed() -> bool:
    """Whether this interpreter imports `ulorl_jax.kernels` as an installed package (pip install -e .)."""
    try:
        return importlib.util.find_spec("ulorl_jax.kernels") is not None
    except ModuleNotFoundError:
        return False


def make_shim(folder: Path) -> Path:
    """A folder for the front of PYTHONPATH holding `ulorl_jax/` as the installed package lays it out:
    links to every entry of the checkout's ulorl_jax/, plus kernels -> kernels/pallas and configs ->
    configs. Every process then imports the checkout, pytest-xdist workers and grandchildren included."""
    pkg = folder / "ulorl_jax"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "ulorl_jax").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, target in _CheckoutFinder.MAP.items():
        (pkg / name.split(".")[-1]).symlink_to(target)
    return folder


def _exec(argv: list[str]) -> int:
    """`gpu_suite.py --_exec TARGET ARGS...`: run `ulorl ARGS`, a script (.py) or a module (`pytest`)
    with the checkout importable, as its own __main__."""
    import runpy

    target, args = argv[0], argv[1:]
    _bootstrap_imports()
    if target == "ulorl":
        sys.argv = ["ulorl", *args]
        from ulorl_jax.cli import main

        return int(main(args) or 0)
    sys.argv = [target, *args]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


def _exec_cmd(target: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--_exec", target, *map(str, args)]


# ---------------------------------------------------------------------------
# Workers (run in subprocesses): env probe, part c's learner and engine
# ---------------------------------------------------------------------------


def _dist_version(name: str):
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _pyproject_deps() -> dict[str, list[str]]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return {"dependencies": list(project.get("dependencies", [])),
            "test": list(project.get("optional-dependencies", {}).get("test", []))}


def _req_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()


def _version_warnings(deps: dict, versions: dict) -> list[str]:
    """jax / jaxlib / CUDA plugin versions that disagree, and present packages below pyproject's pins."""
    warnings = []
    jax_v = versions.get("jax")
    for d in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        if jax_v and versions.get(d) and versions[d].split("+")[0] != jax_v.split("+")[0]:
            warnings.append(f"{d} {versions[d]} != jax {jax_v} (jax, jaxlib and the CUDA plugin must match)")
    if jax_v and not any(d.startswith("jax-cuda") for d in versions):
        warnings.append("no jax CUDA plugin (jax-cuda12-plugin / jax-cuda13-plugin) installed: jax sees no GPU")
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return warnings
    for req in deps.get("dependencies", []) + deps.get("test", []):
        try:
            r = Requirement(req)
        except Exception:  # noqa: BLE001
            continue
        have = _dist_version(r.name)
        if have and r.specifier and not r.specifier.contains(have.split("+")[0], prereleases=True):
            warnings.append(f"{r.name} {have} does not satisfy pyproject's {req}")
    return warnings


def worker_env(_: dict) -> dict:
    """Versions, the backend, and which pyproject dependencies do not import."""
    out = {"python": sys.version.split()[0], "python_executable": sys.executable, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_count": os.cpu_count(), "versions": {}}
    for d in VERSION_DISTS:
        v = _dist_version(d)
        if v is not None:
            out["versions"][d] = v
    plugins = {d: v for d, v in out["versions"].items() if d.startswith("jax-cuda")}
    out["jax_cuda_plugin"] = plugins or None
    missing, present = [], {}
    deps = _pyproject_deps()
    for group, reqs in deps.items():
        for req in reqs:
            name = _req_name(req)
            mod = IMPORT_NAMES.get(name.lower(), name.replace("-", "_"))
            try:
                importlib.import_module(mod)
                present[name] = _dist_version(name)
            except Exception as err:  # noqa: BLE001  (any import failure means: carry it)
                missing.append({"requirement": req, "group": group, "import": mod,
                                "error": f"{type(err).__name__}: {err}"[:200],
                                "also_needs": KNOWN_REQUIRES.get(name.lower(), [])})
    out["pyproject"] = deps
    out["present"] = present
    out["missing"] = missing
    out["version_warnings"] = _version_warnings(deps, out["versions"])
    if missing:
        names = " ".join(shlex.quote(m["requirement"]) for m in missing if m["group"] == "dependencies")
        out["carry_hint"] = (
            "here (a machine with pip and a registry), in the repo root: echo /.whl/ >> .git/info/exclude; "
            "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "
            f"{names} <and each 'also_needs' that is missing>; then name .whl in the device call's carry")
    try:
        import jax

        out["jax_backend"] = jax.default_backend()
        out["devices"] = [f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()]
        stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
        out["device_memory_limit_bytes"] = (stats or {}).get("bytes_limit")
    except Exception as err:  # noqa: BLE001
        out["jax_backend"] = None
        out["jax_error"] = f"{type(err).__name__}: {err}"[:500]
    try:
        import torch

        out["torch_cuda"] = bool(torch.cuda.is_available())
        out["torch_cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            out["torch_device"] = torch.cuda.get_device_name(0)
    except Exception as err:  # noqa: BLE001
        out["torch_error"] = f"{type(err).__name__}: {err}"[:300]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                                     "power.limit,temperature.gpu", "--format=csv"], capture_output=True,
                               text=True, timeout=20)
            full = subprocess.run([smi], capture_output=True, text=True, timeout=20)
            out["nvidia_smi_query"] = q.stdout.strip()
            out["nvidia_smi"] = full.stdout.strip()
        except Exception as err:  # noqa: BLE001
            out["nvidia_smi"] = f"failed: {err}"
    else:
        out["nvidia_smi"] = None
    return out


def _yaml_scalar(v) -> str:
    if isinstance(v, float):
        return f"{v:.6e}"  # 1.000000e-06: a YAML 1.1 float (json's 1e-06 would load as a string)
    return json.dumps(v)


def _c_spec(model: str, sizes: dict, attention: str) -> dict:
    """Part c's config: the model architecture and the runtime / learner choices (YAML and direct)."""
    arch = {"model_type": "qwen3", "vocab_size": sizes["vocab"], **MODELS[model], "rms_norm_eps": 1.0e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": max(40960, sizes["row_len"], sizes["prompt_len"] + sizes["new_tokens"]),
            "tie_word_embeddings": True}
    return {"model": model, "arch": arch, "dtype": "bfloat16", "param_dtype": "float32", "attention_impl": attention,
            "rows": sizes["rows"], "row_len": sizes["row_len"], "logprob_chunk": sizes["logprob_chunk"],
            "prompt_len": sizes["prompt_len"], "new_tokens": sizes["new_tokens"]}


def _write_config(path: Path, spec: dict) -> str:
    text = "\n".join([
        f"# gpu_suite part c: random-weight Qwen3 ({spec['model']}), the learner and engine of `ulorl train`",
        "model:", "  path: null", "  arch:", *[f"    {k}: {_yaml_scalar(v)}" for k, v in spec["arch"].items()],
        f"  dtype: {spec['dtype']}", f"  param_dtype: {spec['param_dtype']}",
        f"  attention_impl: {spec['attention_impl']}",
        "mesh: {data: 1, fsdp: -1, expert: 1, tensor: 1}",
        f"data: {{train_files: [unused.jsonl], max_prompt_len: {spec['prompt_len']}}}  # never read: the suite "
        f"makes samples",
        f"rollout: {{global_max_len: {spec['new_tokens']}, num_segments: 1, n: 2}}",
        f"trainer: {{micro_batch_rows: {spec['rows']}, row_len: {spec['row_len']}, logprob_chunk: "
        f"{spec['logprob_chunk']}, scan_layers: true, remat: true, train_batch_size: 1, "
        f"ppo_mini_batch_size: {spec['rows']}}}",
        "",
    ])
    path.write_text(text)
    return text


def _configs(s: dict):
    """(ModelConfig, LearnerConfig, MeshConfig, source): from the YAML through `load_config` and
    `learner_config` as `ulorl train` / `ulorl plan` build them; if the config stack cannot import
    (omegaconf not carried), built directly from the same spec (RunConfig's defaults) so the GPU
    figures still come."""
    try:
        from ulorl_jax.config import load_config
        from ulorl_jax.rl.build import learner_config
    except ModuleNotFoundError as err:
        from ulorl_jax.models.config import ModelConfig
        from ulorl_jax.rl.learner import LearnerConfig
        from ulorl_jax.sharding import MeshConfig

        spec = s["spec"]
        mc = ModelConfig(**spec["arch"], dtype=spec["dtype"], param_dtype=spec["param_dtype"],
                         attention_impl=spec["attention_impl"])
        lc = LearnerConfig(row_len=spec["row_len"], micro_batch_rows=spec["rows"], logprob_chunk=spec["logprob_chunk"],
                           remat="full", scan_layers=True, ppo_mini_batch_size=spec["rows"], temperature=0.85)
        return mc, lc, MeshConfig(), f"built directly ({err}: carry omegaconf for the YAML path)"
    cfg = load_config(s["config"])
    return cfg.model.model_config(), learner_config(cfg), cfg.mesh.mesh_config(), "YAML via load_config"


def _allocator() -> dict:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        stats = None
    if not stats:
        return {"peak_bytes_in_use": None, "bytes_in_use": None, "bytes_limit": None}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def _analytic_train_flops(mc, rows: int, row_len: int) -> dict:
    """`ulorl plan`'s formula: forward 2 N_active per token + causal attention; model FLOPs fwd + bwd = 3x."""
    from ulorl_jax.bench.segment_cost import ModelShape

    shape = ModelShape.from_model_config("model", mc)
    total, active = shape.params()
    tokens = rows * row_len
    fwd = 2.0 * active * tokens + 2.0 * shape.layers * shape.heads * shape.head_dim * rows * row_len ** 2
    return {"params": total, "active_params": active, "fwd_flops": fwd, "model_flops": 3.0 * fwd,
            "hardware_flops_with_remat": 4.0 * fwd}


def worker_learner(s: dict) -> dict:
    import statistics

    import jax
    import numpy as np

    from ulorl_jax import plan
    from ulorl_jax.models import init_model
    from ulorl_jax.rl.learner import Learner
    from ulorl_jax.rl.packing import TrainSample

    mc, lc, _, source = _configs(s)
    rows, row_len = lc.micro_batch_rows, lc.row_len
    out = {"config_source": source, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
           "rows": rows, "row_len": row_len, "tokens_per_step": rows * row_len, "attention_impl": mc.attention_impl,
           "dtype": mc.dtype, "param_dtype": mc.param_dtype, "layers": mc.num_hidden_layers}
    t0 = time.perf_counter()
    learner = Learner(init_model(mc, 0), lc)
    jax.block_until_ready(learner.params)
    out["init_s"] = time.perf_counter() - t0
    out["allocator_after_init"] = _allocator()
    rng = np.random.default_rng(0)
    prompt = 64 if row_len > 256 else 4
    samples = [TrainSample(rng.integers(1, mc.vocab_size, prompt).tolist(),
                           rng.integers(1, mc.vocab_size, row_len - prompt).tolist(), float(i % 2) - 0.5,
                           float(i % 2)) for i in range(rows)]
    t0 = time.perf_counter()
    _, batch = learner.pack(samples)
    batch = learner.put_batch(batch)
    jax.block_until_ready(batch)
    out["pack_put_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = learner.lower_update(samples).compile()
    out["compile_s"] = time.perf_counter() - t0
    out["compiled_memory"] = plan.compiled_memory(compiled)
    out["xla_flops"] = plan.compiled_flops(compiled)
    params, opt = learner.params, learner.opt_state
    times, metrics = [], None
    for _ in range(s["warmup"] + s["iters"]):
        t0 = time.perf_counter()
        params, opt, metrics = compiled(params, opt, batch)
        jax.block_until_ready((params, opt, metrics))
        times.append(time.perf_counter() - t0)
    timed = times[s["warmup"]:]
    out["step_times_s"] = times
    out["step_s"] = statistics.median(timed)
    out["tokens_per_s"] = rows * row_len / out["step_s"]
    flops = _analytic_train_flops(mc, rows, row_len)
    out.update(flops)
    out["mfu"] = flops["model_flops"] / out["step_s"] / (H200_BF16_DENSE_TFLOPS * 1e12)
    out["mfu_vs_measured_matmul"] = flops["model_flops"] / out["step_s"] / (H200_BF16_MEASURED_TFLOPS * 1e12)
    out["hfu_with_remat"] = flops["hardware_flops_with_remat"] / out["step_s"] / (H200_BF16_DENSE_TFLOPS * 1e12)
    out["achieved_tflops"] = flops["model_flops"] / out["step_s"] / 1e12
    try:
        out["loss"] = float(np.asarray(jax.device_get(metrics.get("loss", np.nan)))) if isinstance(metrics, dict) \
            else None
    except Exception:  # noqa: BLE001
        out["loss"] = None
    out["allocator"] = _allocator()
    return out


def worker_engine(s: dict) -> dict:
    import statistics

    import jax
    import numpy as np

    from ulorl_jax import plan
    from ulorl_jax.decode.engine import PolicyEngine, Request
    from ulorl_jax.decode.sampling import GREEDY
    from ulorl_jax.models import init_model
    from ulorl_jax.sharding import make_mesh

    t_start = time.monotonic()
    mc, _, mesh_config, source = _configs(s)
    slots, p_len, n_new = s["slots"], s["prompt_len"], s["new_tokens"]
    out = {"config_source": source, "backend": jax.default_backend(), "slots": slots, "prompt_len": p_len,
           "new_tokens": n_new,
           "cache_len": p_len + n_new, "steps_per_call": s["steps_per_call"]}
    t0 = time.perf_counter()
    engine = PolicyEngine(init_model(mc, 0), max_concurrent_decodes=slots, max_prefill_length=p_len,
                          max_cache_len=p_len + n_new, prefill_buckets=(p_len,), sampling=GREEDY)
    params = engine.load_params()
    jax.block_until_ready(params)
    out["init_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    requests = [Request(rng.integers(1, mc.vocab_size, p_len).tolist(), n_new, i) for i in range(slots)]
    runs = []
    for i in range(1 + s["iters"]):  # the first run compiles
        t0 = time.perf_counter()
        completions, stats = engine.run(params, requests, steps_per_call=s["steps_per_call"])
        wall = time.perf_counter() - t0
        runs.append({"wall_s": wall, "prefill_s": getattr(stats, "prefill_seconds", None),
                     "decode_s": getattr(stats, "decode_seconds", None),
                     "tokens": getattr(stats, "tokens_decoded", sum(len(c.tokens) for c in completions)),
                     "prefills": getattr(stats, "prefills", slots),
                     "slot_occupancy": getattr(stats, "slot_occupancy", None)})
    out["first_run"] = runs[0]
    timed = runs[1:]
    out["runs"] = timed
    med = statistics.median(r["wall_s"] for r in timed)
    dec = statistics.median(r["decode_s"] for r in timed if r["decode_s"] is not None)
    pre = statistics.median(r["prefill_s"] for r in timed if r["prefill_s"] is not None)
    tokens = timed[-1]["tokens"]
    out.update(wall_s=med, decode_s=dec, prefill_s=pre, tokens=tokens, tokens_per_s=tokens / med,
               decode_tokens_per_s=(tokens - timed[-1]["prefills"]) / dec if dec else None,
               prefill_tokens_per_s=slots * p_len / pre if pre else None)
    param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2  # bf16 per token
    steps = n_new - 1
    avg_ctx = p_len + n_new / 2
    if dec:
        out["decode_bytes_per_step"] = param_bytes + kv_bytes * avg_ctx * slots
        out["decode_gbs"] = out["decode_bytes_per_step"] * steps / dec / 1e9
        out["decode_frac_of_hbm_peak"] = out["decode_gbs"] / H200_HBM_GBS
    out["param_bytes"] = param_bytes
    out["allocator"] = _allocator()
    left = s.get("time_budget_s", 1e9) - (time.monotonic() - t_start)
    if left < s.get("optional_compile_s", 60):
        out["plan_decode_step_this_backend"] = {"skipped": f"{left:.0f} s left in part c"}
        return out
    try:  # the GPU compiler's figure for `ulorl plan`'s decode step (abstract: allocates nothing)
        mesh = make_mesh(mesh_config, devices=jax.devices()[:1])
        t0 = time.perf_counter()
        out["plan_decode_step_this_backend"] = plan.compile_decode_step(mc, mesh, slots, p_len + n_new)
        out["plan_decode_step_this_backend"]["seconds"] = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001
        out["plan_decode_step_this_backend"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    return out


WORKERS = {"env": worker_env, "learner": worker_learner, "engine": worker_engine}


def _worker(argv: list[str]) -> int:
    """`gpu_suite.py --_worker NAME SETTINGS_JSON`: one JSON line (prefixed) on stdout."""
    _bootstrap_imports()
    name, settings = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    if settings.get("inject_failure"):
        raise RuntimeError(f"injected failure in worker {name} (--inject-failure)")
    result = WORKERS[name](settings)
    print("GPU_SUITE_RESULT " + json.dumps(result, default=str), flush=True)
    return 0


# ---------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------


class Suite:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="ulorl-gpu-suite-"))
        self.log = self.out / "log.txt"
        self.log.write_text("")
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.dry = args.dry_run
        self.platform = "cpu" if self.dry else None  # set by the env probe
        self.site = None
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        self.shim = None if _installed() else str(make_shim(self.tmp / "shim"))
        self.jobs = max(1, args.jobs) if self.dry else 1
        self.env = None
        self.live: set = set()  # child processes (each its own session: killed by group on timeout or SIGTERM)
        self.lock = threading.Lock()
        self.summary = {
            "suite": "gpu_suite", "dry_run": self.dry,
            "command": " ".join([os.path.basename(sys.executable),
                                 os.path.relpath(SCRIPT) if Path.cwd() in SCRIPT.parents else str(SCRIPT),
                                 *map(shlex.quote, args.argv)]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "budget_s": args.budget_s, "out": str(self.out),
            "parts": {}, "env": None,
        }

    # -- process plumbing -------------------------------------------------------------

    def child_env(self, jax_platform: str | None = None, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        paths = ([self.shim] if self.shim else []) + [str(ROOT)] + ([self.site] if self.site else []) + \
            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        if self.dry:  # figures mean nothing in a dry run: compile fast (about a third less CPU time)
            fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {fast}".strip()
        platform_ = jax_platform or self.platform
        if platform_:
            env["JAX_PLATFORMS"] = platform_
        env.update(extra or {})
        return env

    def run(self, label: str, cmd: list[str], timeout: float, env: dict, background: bool = False):
        """Run cmd in its own process group; returns a dict (rc, stdout, stderr, seconds, timed_out)."""
        stdout_f = open(self.tmp / f"{label}.out", "w+")
        stderr_f = open(self.tmp / f"{label}.err", "w+")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout_f, stderr=stderr_f, start_new_session=True)
        self.live.add(proc)
        handle = {"label": label, "cmd": cmd, "proc": proc, "t0": t0, "timeout": timeout,
                  "files": (stdout_f, stderr_f)}
        return handle if background else self.wait(handle)

    def wait(self, h: dict) -> dict:
        proc = h["proc"]
        remaining = max(1.0, h["timeout"] - (time.monotonic() - h["t0"]))
        timed_out = False
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(proc)
        self.live.discard(proc)
        seconds = time.monotonic() - h["t0"]
        texts = []
        for f in h["files"]:
            f.flush()
            f.seek(0)
            texts.append(f.read())
            f.close()
        out, err = texts
        with self.lock, open(self.log, "a") as log:
            log.write(f"\n===== {h['label']}: {' '.join(map(shlex.quote, h['cmd']))}\n"
                      f"===== rc {proc.returncode}, {seconds:.1f} s{', TIMED OUT' if timed_out else ''}\n")
            log.write("----- stdout\n" + out + ("\n" if out and not out.endswith("\n") else ""))
            log.write("----- stderr\n" + err + ("\n" if err and not err.endswith("\n") else ""))
        return {"rc": proc.returncode, "stdout": out, "stderr": err, "seconds": seconds, "timed_out": timed_out,
                "timeout": h["timeout"]}

    @staticmethod
    def _kill(proc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def part_timeout(self, part: str, later: list[str]) -> float:
        if self.dry:
            return float(self.args.dry_part_timeout_s)
        left = self.time_left()
        reserve = sum(MIN_S[p] for p in later)
        return max(10.0, min(NOMINAL_S[part], max(MIN_S[part], left - reserve), left))

    # -- results ----------------------------------------------------------------------

    @staticmethod
    def json_result(res: dict, marker: str | None = None):
        """The last JSON object line of stdout (bench --json), or the GPU_SUITE_RESULT line."""
        for line in reversed(res["stdout"].splitlines()):
            line = line.strip()
            if marker:
                if line.startswith(marker):
                    return json.loads(line[len(marker):])
                continue
            if line.startswith("{") and line.endswith("}"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return None

    @staticmethod
    def failure(res: dict, what: str) -> dict:
        text = (res["stderr"] or "") + "\n" + (res["stdout"] or "")
        lines = [x for x in text.splitlines() if x.strip()]
        if res["timed_out"]:
            error = f"{what}: timed out after {res['timeout']:.0f} s (killed)"
        else:
            errs = [x for x in lines if re.match(r"^([\w.]+(Error|Exception|Exit)|error:|ulorl .*: error:|"
                                                  r"FAILED |E  )", x.strip())]
            error = f"{what}: exit status {res['rc']}: " + (errs[-1].strip() if errs else (lines[-1] if lines else ""))
        tb_start = max((i for i, x in enumerate(lines) if x.startswith("Traceback")), default=None)
        tail = lines[tb_start:] if tb_start is not None else lines
        return {"error": error[:2000], "traceback_tail": "\n".join(tail[-40:])[-6000:]}

    @staticmethod
    def table_text(res: dict) -> str:
        """A bench's human table: stdout without its JSON line."""
        return "\n".join(x for x in res["stdout"].splitlines()
                         if not (x.strip().startswith("{") and x.strip().endswith("}")) and
                         not x.startswith("GPU_SUITE_RESULT")).strip()

    def record(self, part: str, rec: dict) -> None:
        with self.lock:
            self.summary["parts"][part] = rec
            self.save()

    def save(self) -> None:
        self.summary["elapsed_s"] = time.monotonic() - self.start
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        (self.out / "summary.md").write_text(render_markdown(self.summary))

    # -- env ------------------------------------------------------------------------------

    def install_wheels(self) -> dict | None:
        folder = Path(self.args.wheels) if self.args.wheels else ROOT / ".whl"
        wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
        if not wheels:
            return None
        site = self.tmp / "site"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        res = self.run("wheels", cmd, 120, self.child_env())
        info = {"folder": str(folder), "wheels": [w.name for w in wheels], "rc": res["rc"]}
        if res["rc"] == 0:
            self.site = str(site)
        else:
            info.update(self.failure(res, "pip install of carried wheels"))
        return info

    def probe_env(self) -> dict:
        settings = {"inject_failure": "env" in self.args.inject_failure}
        # The probe itself asks jax which backend it finds: no JAX_PLATFORMS unless a dry run.
        env = self.child_env(jax_platform="cpu" if self.dry else None)
        res = self.run("env", [sys.executable, str(SCRIPT), "--_worker", "env", json.dumps(settings)],
                       ENV_TIMEOUT_S, env)
        data = self.json_result(res, "GPU_SUITE_RESULT ")
        if data is None:
            data = {"error": self.failure(res, "env probe")}
        data["seconds"] = res["seconds"]
        data["wheels_installed"] = self.summary.get("wheels")
        (self.out / "env.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        return data

    # -- parts ----------------------------------------------------------------------------

    def part_a(self, timeout: float) -> dict:
        junit = self.out / "kernels_junit.xml"
        cmd = _exec_cmd("pytest", "-v", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        "-o", "junit_family=xunit1",
                        *(DRY_KERNEL_TESTS if self.dry else [x for x in self.args.kernel_tests.split(",") if x]))
        cmd += shlex.split(self.args.pytest_args)
        xdist = not self.dry and "pytest-xdist" in (self.env or {}).get("present", {})
        if xdist:  # Triton compiles on 4 host cores at once; the workers share the GPU (no preallocation)
            cmd += ["-n", str(self.args.kernel_test_workers)]
        res = self.run("a_kernel_tests", cmd, timeout, self.child_env(extra={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        rec = {"mode": "interpret (CPU)" if self.platform == "cpu" else "compiled (Pallas Triton on the GPU)",
               "xdist_workers": self.args.kernel_test_workers if xdist else 0,
               "jax_platforms": self.platform, "junit": junit.name if junit.exists() else None}
        rec.update(parse_junit(junit) if junit.exists() else parse_pytest_lines(res["stdout"]))
        tail = [x for x in res["stdout"].splitlines() if x.strip()]
        rec["pytest_summary"] = tail[-1] if tail else ""
        return self.finish(rec, res, "pytest (kernel tests)", ok=res["rc"] == 0)

    def part_b(self, timeout: float) -> dict:
        md = self.out / "attention.md"
        if self.dry:
            shapes = ["--seq-lens", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--decode-batch", "2",
                      "--decode-len", "128", "--gmm-tokens", "32", "--experts", "4", "--top-k", "2", "--hidden", "32",
                      "--expert-width", "32", "--iters", "1", "--warmup", "0", "--time-interpreted"]
        else:
            shapes = shlex.split(self.args.attention_args)
        cmd = _exec_cmd("benchmarks/attention.py", *shapes, "--markdown", str(md), "--json")
        res = self.run("b_attention", cmd, timeout,
                       self.child_env(extra={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))  # torch shares the GPU
        data = self.json_result(res)
        rec = {"markdown": md.name if md.exists() else None, "table": self.table_text(res)}
        if data:
            rec["result"] = data
            rec["case_errors"] = _case_errors(data)
        return self.finish(rec, res, "benchmarks/attention.py", ok=res["rc"] == 0 and data is not None)

    def part_c(self, timeout: float) -> dict:
        t_end = time.monotonic() + timeout
        sizes = C_DRY if self.dry else C_GPU
        model = "dry" if self.dry else self.args.model
        cfg_path = self.tmp / "part_c.yaml"
        # Dry run: XLA attention (the interpreted Pallas kernel makes `ulorl plan`'s CPU compile ~30 s longer)
        spec = _c_spec(model, sizes, "xla" if self.dry else self.args.attention)
        yaml_text = _write_config(cfg_path, spec)
        rec = {"model": model, "config_yaml": yaml_text, "sizes": sizes, "steps": {}}
        inject = "c" in self.args.inject_failure
        # `ulorl plan` on the CPU (the prediction), in parallel with the GPU runs.
        plan_cmd = _exec_cmd("ulorl", "plan", "--config", cfg_path, "--devices", "1", "--seq-len", sizes["row_len"],
                             "--decode-slots", sizes["slots"],
                             "--decode-cache-len", sizes["prompt_len"] + sizes["new_tokens"], "--json")
        plan_h = self.run("c_plan_cpu", plan_cmd, timeout, self.child_env(jax_platform="cpu"), background=True)
        results = {}
        for name in ("learner", "engine"):
            left = t_end - time.monotonic()
            if name == "learner":  # leave the engine its share even if the learner hangs
                left = min(left, 0.6 * timeout)
            if left < 5:
                results[name] = {"status": "skipped", "reason": "part c's time ran out"}
                continue
            settings = {**sizes, "config": str(cfg_path), "spec": spec, "time_budget_s": left,
                        "optional_compile_s": 5 if self.dry else 60, "inject_failure": inject and name == "learner"}
            res = self.run(f"c_{name}", [sys.executable, str(SCRIPT), "--_worker", name, json.dumps(settings)],
                           left, self.child_env())
            data = self.json_result(res, "GPU_SUITE_RESULT ")
            results[name] = {"status": "ok", "seconds": res["seconds"], **data} if (res["rc"] == 0 and data) else \
                {"status": "failed", "seconds": res["seconds"], **self.failure(res, f"part c {name}")}
        pres = self.wait(plan_h)
        pdata = self.json_result(pres)
        results["plan_cpu"] = {"status": "ok", "seconds": pres["seconds"], **pdata} if (pres["rc"] == 0 and pdata) \
            else {"status": "failed", "seconds": pres["seconds"], **self.failure(pres, "ulorl plan (CPU)")}
        rec["steps"] = results
        rec["comparison"] = compare_c(results)
        failed = [k for k, v in results.items() if v.get("status") != "ok"]
        rec["status"] = "failed" if failed else "ok"
        if failed:
            rec["error"] = "; ".join(results[k].get("error", f"{k}: {results[k].get('reason', '')}") for k in failed)
            rec["traceback_tail"] = "\n\n".join(f"[{k}]\n{results[k].get('traceback_tail', '')}" for k in failed)
        return rec

    def part_d(self, timeout: float) -> dict:
        help_res = self.run("d_compare_help", _exec_cmd("ulorl", "bench", "compare", "--help"), 60, self.child_env())
        has_device = "--device" in help_res["stdout"]
        rec = {"compare_has_device_option": has_device}
        if self.dry:
            args = ["--hidden-size", "32", "--layers", "1", "--experts", "4", "--top-k", "2",
                    "--moe-intermediate-size", "16", "--vocab", "64", "--samples", "2", "--seq-len", "32",
                    "--prompt-len", "8", "--decode-batch", "2", "--new-tokens", "4", "--iters", "1",
                    "--torch-compile", "off"] + (["--device", "cpu"] if has_device else [])
        elif not has_device:
            rec.update(status="skipped", reason="needs --device cuda in `ulorl bench compare` (its torch side stays "
                                                "on the CPU: compare.py puts the transformers model on 'cpu')")
            return rec
        else:
            args = ["--device", "cuda", *shlex.split(self.args.compare_args)]
        res = self.run("d_compare", _exec_cmd("ulorl", "bench", "compare", *args, "--json"), timeout,
                       self.child_env(extra={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
        data = self.json_result(res)
        rec.update(table=self.table_text(res), result=data)
        return self.finish(rec, res, "ulorl bench compare", ok=res["rc"] == 0 and data is not None)

    def part_e(self, timeout: float) -> dict:
        if self.dry:
            args = ["--segments", "2", "--steps", "1", "--global-max-len", "8", "--prompts-per-step", "1", "--n", "2",
                    "--steps-per-call", "4", "--hidden-size", "16", "--layers", "1", "--vocab", "32"]
        else:
            args = shlex.split(self.args.segments_args)
        res = self.run("e_segments", _exec_cmd("ulorl", "bench", "segments", *args, "--json"), timeout,
                       self.child_env())
        data = self.json_result(res)
        rec = {"table": self.table_text(res), "result": data}
        return self.finish(rec, res, "ulorl bench segments", ok=res["rc"] == 0 and data is not None)

    def finish(self, rec: dict, res: dict, what: str, ok: bool) -> dict:
        rec["rc"] = res["rc"]
        if ok:
            rec["status"] = "ok"
        else:
            rec["status"] = "failed"
            rec.update(self.failure(res, what))
            if res["rc"] == 0:
                rec["error"] = f"{what}: exit status 0 but no JSON result on stdout"
        return rec

    def injected(self, part: str, timeout: float) -> dict:
        code = f"raise RuntimeError('injected failure in part {part} (--inject-failure)')"
        res = self.run(f"{part}_injected", [sys.executable, "-c", code], timeout, self.child_env())
        return self.finish({}, res, f"part {part}", ok=False)

    # -- main -----------------------------------------------------------------------------

    def run_part(self, part: str, later: list[str], backend, env: dict) -> None:
        timeout = self.part_timeout(part, later)
        t0 = time.monotonic()
        if not self.dry and backend != "gpu":
            why = f" ({env['jax_error']})" if env.get("jax_error") else ""
            rec = {"status": "skipped", "reason": f"no GPU: jax's backend is {backend!r}{why}; use --dry-run on a CPU"}
        elif self.time_left() < 10 and not self.dry:
            rec = {"status": "skipped", "reason": f"the suite's budget ({self.args.budget_s} s) is spent"}
        elif part in self.args.inject_failure and part != "c":
            rec = self.injected(part, timeout)
        else:
            try:
                rec = getattr(self, f"part_{part}")(timeout)
            except Exception as err:  # noqa: BLE001  (the runner itself: record and go on)
                rec = {"status": "failed", "error": f"suite error in part {part}: {type(err).__name__}: {err}",
                       "traceback_tail": traceback.format_exc()[-4000:]}
        rec["seconds"] = time.monotonic() - t0
        rec["timeout_s"] = timeout
        rec["title"] = TITLES[part]
        self.record(part, rec)
        print(f"[gpu_suite] part {part} ({TITLES[part]}): {rec['status']} in {rec['seconds']:.1f} s"
              + (f" -- {rec.get('error') or rec.get('reason')}" if rec["status"] != "ok" else ""), flush=True)

    def _on_signal(self, signum, frame) -> None:
        """`timeout` (or Ctrl-C) stopping the suite: end every child's process group (they run in their own
        sessions, which the device machine would let outlive the call), keep the summary, exit."""
        for proc in list(self.live):
            self._kill(proc)
        self.summary["interrupted"] = f"signal {signum} after {time.monotonic() - self.start:.0f} s"
        try:
            self.save()
            shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            os._exit(128 + signum)

    def main(self) -> int:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        self.summary["wheels"] = self.install_wheels()
        env = self.env = self.probe_env()
        self.summary["env"] = {k: env.get(k) for k in ("python", "versions", "jax_cuda_plugin", "jax_backend",
                                                       "devices", "torch_cuda", "torch_cuda_version", "torch_device",
                                                       "nvidia_smi_query", "device_memory_limit_bytes",
                                                       "missing", "carry_hint", "version_warnings", "jax_error",
                                                       "error", "seconds")}
        backend = env.get("jax_backend")
        if not self.dry:
            self.platform = "cuda" if backend == "gpu" else None
        self.save()
        parts = [p for p in PARTS if p in self.args.parts]
        if self.jobs > 1:  # dry run only: independent parts side by side (the GPU run is sequential)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                for future in [pool.submit(self.run_part, part, [], backend, env) for part in parts]:
                    future.result()
            self.summary["parts"] = {p: self.summary["parts"][p] for p in parts}
        else:
            for i, part in enumerate(parts):
                self.run_part(part, parts[i + 1:], backend, env)
        self.save()
        shutil.rmtree(self.tmp, ignore_errors=True)
        statuses = {p: r["status"] for p, r in self.summary["parts"].items()}
        print(f"[gpu_suite] done in {time.monotonic() - self.start:.0f} s: {statuses}; wrote {self.out}/summary.md")
        if not self.dry and backend != "gpu":
            return 2  # nothing measured
        return 1 if any(s == "failed" for s in statuses.values()) else 0


def _case_errors(result: dict) -> list[str]:
    """Cases inside the attention table that failed (recorded by the bench, not fatal)."""
    errs = []

    def walk(x, path):
        if isinstance(x, dict):
            if "error" in x and isinstance(x["error"], str):
                errs.append(f"{path}: {x['error']}")
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk({k: result.get(k) for k in ("attention", "decode", "gmm")}, "")
    return errs


def parse_junit(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        return {"junit_error": str(err)}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                failed.append({"test": name, "kind": tag, "message": (el.get("message") or "")[:300]})
        if case.find("skipped") is not None:
            skipped.append({"test": name, "message": (case.find("skipped").get("message") or "")[:200]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed_tests": failed, "skipped_tests": skipped}


def parse_pytest_lines(stdout: str) -> dict:
    """Counts from `pytest -v` lines when no junit file was written (the run was killed at its timeout)."""
    plain = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", stdout, flags=re.MULTILINE)
    xdist = re.findall(r"\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)", stdout)  # [gw0] [ 5%] PASSED t
    results = plain + [(t, k) for k, t in xdist]
    if not results:
        return {}
    kinds = [k for _, k in results]
    return {"tests": len(results), "passed": kinds.count("PASSED") + kinds.count("XPASS"),
            "failures": kinds.count("FAILED"), "errors": kinds.count("ERROR"),
            "skipped": kinds.count("SKIPPED") + kinds.count("XFAIL"),
            "failed_tests": [{"test": t, "kind": k.lower(), "message": ""} for t, k in results
                             if k in ("FAILED", "ERROR")],
            "skipped_tests": [], "partial": "no junit file (killed?): counted from pytest -v output"}


def compare_c(steps: dict) -> dict:
    """Measured vs `ulorl plan` (CPU compiler) for the learner and decode steps, in GB and ratios."""
    out = {}
    gb = lambda x: None if x is None else x / 1e9  # noqa: E731
    plan = steps.get("plan_cpu", {})
    lrn, eng = steps.get("learner", {}), steps.get("engine", {})
    pt, pd = plan.get("train", {}), plan.get("decode", {})
    if lrn.get("status") == "ok":
        alloc = lrn.get("allocator", {}).get("peak_bytes_in_use")
        out["train"] = {"plan_cpu_peak_gb": gb(pt.get("peak_bytes")),
                        "compiled_peak_gb": gb(lrn["compiled_memory"]["peak_bytes"]),
                        "compiled_temp_gb": gb(lrn["compiled_memory"]["temp_bytes"]),
                        "allocator_peak_gb": gb(alloc)}
    if eng.get("status") == "ok":
        gpu_plan = eng.get("plan_decode_step_this_backend", {})
        out["decode"] = {"plan_cpu_peak_gb": gb(pd.get("peak_bytes")),
                         "compiled_peak_gb": gb(gpu_plan.get("peak_bytes")),
                         "allocator_peak_gb": gb(eng.get("allocator", {}).get("peak_bytes_in_use"))}
    for d in out.values():
        p = d.get("plan_cpu_peak_gb")
        for k in ("compiled_peak_gb", "allocator_peak_gb"):
            if p and d.get(k):
                d[k.replace("_gb", "_over_plan")] = d[k] / p
    return out


# ---------------------------------------------------------------------------
# summary.md (the form of benchmarks/results/gpu.md)
# ---------------------------------------------------------------------------


def _f(x, fmt="{:.3g}", none="-"):
    if x is None:
        return none
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def render_markdown(s: dict) -> str:
    env = s.get("env") or {}
    v = env.get("versions") or {}
    devices = env.get("devices") or []
    kind = "dry run (CPU, tiny shapes, interpret mode: the figures mean nothing)" if s.get("dry_run") else "GPU run"
    lines = [f"# GPU suite: {kind}", "",
             f"- machine: {', '.join(devices) or '?'}" + (f"; host {s.get('host')}" if s.get("host") else ""),
             f"- date: {s.get('date')}",
             f"- command: `{s.get('command')}` (budget {s.get('budget_s')} s; took "
             f"{_f(s.get('elapsed_s'), '{:.0f}')} s)",
             f"- versions: python {env.get('python')}, " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"- torch sees CUDA: {env.get('torch_cuda')} {env.get('torch_device') or ''} (torch built for CUDA "
             f"{env.get('torch_cuda_version')}); JAX's memory limit on device 0: "
             f"{_f((env.get('device_memory_limit_bytes') or 0) / 2**30 or None, '{:.1f} GiB')}"]
    if env.get("nvidia_smi_query"):
        lines += ["- nvidia-smi: `" + " / ".join(env["nvidia_smi_query"].splitlines()) + "`"]
    missing = env.get("missing") or []
    if missing:
        lines.append("- missing wheels (pyproject dependencies that do not import): " + ", ".join(
            f"`{m['requirement']}`" + (" (test extra)" if m.get("group") == "test" else "")
            + (f" (+ {', '.join(m['also_needs'])})" if m.get("also_needs") else "")
            for m in missing))
    else:
        lines.append("- missing wheels: none")
    for w in env.get("version_warnings") or []:
        lines.append(f"- version warning: {w}")
    if s.get("wheels"):
        lines.append(f"- carried wheels installed: {', '.join(s['wheels'].get('wheels', []))} "
                     f"(rc {s['wheels'].get('rc')})")
    if env.get("jax_error") or env.get("error"):
        lines.append(f"- env probe error: {env.get('jax_error') or env.get('error')}")
    if s.get("interrupted"):
        lines.append(f"- **interrupted**: {s['interrupted']} (parts below are those that finished)")
    lines += ["", "| part | what | status | seconds | figures |", "|---|---|---|---|---|"]
    parts = s.get("parts", {})
    for p in PARTS:
        r = parts.get(p)
        if r is None:
            continue
        lines.append(f"| {p} | {TITLES[p]} | {r['status']} | {_f(r.get('seconds'), '{:.0f}')} | {_headline(p, r)} |")
    for p in PARTS:
        r = parts.get(p)
        if r is None:
            continue
        lines += ["", f"## {p}. {TITLES[p]}", ""]
        lines += _section(p, r)
        if r["status"] == "failed":
            lines += ["", f"**failed**: {r.get('error', '')}", "", "```", r.get("traceback_tail", "")[-3000:], "```"]
        elif r["status"] == "skipped":
            lines += [f"skipped: {r.get('reason', '')}"]
    return "\n".join(lines) + "\n"


def _headline(p: str, r: dict) -> str:
    try:
        if p == "a" and "tests" in r:
            return f"{r['passed']} passed, {r['failures'] + r['errors']} failed, {r['skipped']} skipped ({r['mode']})"
        if p == "b" and r.get("result"):
            att = [x for x in r["result"].get("attention", []) if "seq_len" in x]
            if att:
                last = att[-1]
                pal = (last.get("pallas") or {}).get("fwd_bwd", {}).get("tflops")
                cud = (last.get("cudnn") or {}).get("fwd_bwd", {}).get("tflops")
                return f"T={last['seq_len']} fwd+bwd TFLOP/s: pallas {_f(pal)}, cudnn {_f(cud)}"
        if p == "c":
            lrn = r.get("steps", {}).get("learner", {})
            eng = r.get("steps", {}).get("engine", {})
            bits = []
            if lrn.get("status") == "ok":
                bits.append(f"learner {_f(lrn['tokens_per_s'], '{:,.0f}')} tok/s, MFU {_f(lrn['mfu'], '{:.1%}')}")
            if eng.get("status") == "ok":
                bits.append(f"engine decode {_f(eng.get('decode_tokens_per_s'), '{:,.0f}')} tok/s")
            return "; ".join(bits)
        if p == "d" and r.get("result"):
            ls = r["result"].get("learner_step", {})
            return f"learner JAX/torch eager {_f(ls.get('ratio_jax_over_torch_eager'), '{:.2f}')}x"
        if p == "e" and r.get("result"):
            segs = r["result"].get("segments") or {}
            return "speedup " + ", ".join(f"K={k}: {_f(x.get('speedup'), '{:.2f}')}x" for k, x in segs.items())
    except Exception:  # noqa: BLE001  (a headline is best effort)
        return ""
    return ""


def _section(p: str, r: dict) -> list[str]:
    out = []
    if p == "a":
        if "tests" in r:
            out.append(f"{r['tests']} tests, mode {r['mode']}: {r['passed']} passed, {r['failures']} failed, "
                       f"{r['errors']} errors, {r['skipped']} skipped (`{r.get('pytest_summary', '')}`); junit: "
                       f"{r.get('junit')}")
            for f in r.get("failed_tests", []):
                out.append(f"- FAILED `{f['test']}`: {f['message'][:200]}")
            for f in r.get("skipped_tests", [])[:20]:
                out.append(f"- skipped `{f['test']}`: {f['message'][:120]}")
    elif p in ("b", "d", "e"):
        if r.get("table"):
            out += ["```", r["table"][-6000:], "```"]
        for e in r.get("case_errors", []) or []:
            out.append(f"- case error: {e}")
    elif p == "c":
        st = r.get("steps", {})
        lrn, eng, pl = st.get("learner", {}), st.get("engine", {}), st.get("plan_cpu", {})
        out.append(f"Model: Qwen3 shape `{r.get('model')}`, random weights, bf16 compute, f32 master weights, "
                   f"scanned layers, remat; sizes {json.dumps(r.get('sizes'))}")
        if lrn.get("status") == "ok":
            out += ["", "| learner step | value |", "|---|---|",
                    f"| tokens / step | {lrn['rows']} x {lrn['row_len']} = {lrn['tokens_per_step']:,} |",
                    f"| params | {_f(lrn['params'] / 1e9, '{:.3f}')} B |",
                    f"| step (median of {len(lrn['step_times_s']) - r['sizes']['warmup']}) | "
                    f"{_f(lrn['step_s'] * 1e3, '{:.1f}')} ms |",
                    f"| tokens/s | {_f(lrn['tokens_per_s'], '{:,.0f}')} |",
                    f"| model TFLOP/s (fwd+bwd, 3x fwd) | {_f(lrn['achieved_tflops'], '{:.1f}')} |",
                    f"| MFU vs {H200_BF16_DENSE_TFLOPS:.0f} (datasheet) / {H200_BF16_MEASURED_TFLOPS:.0f} (measured "
                    f"matmul) | {_f(lrn['mfu'], '{:.1%}')} / {_f(lrn['mfu_vs_measured_matmul'], '{:.1%}')} |",
                    f"| HFU incl. remat recompute | {_f(lrn['hfu_with_remat'], '{:.1%}')} |",
                    f"| compile | {_f(lrn['compile_s'], '{:.1f}')} s |",
                    f"| attention | {lrn['attention_impl']} |"]
        if eng.get("status") == "ok":
            out += ["", "| engine | value |", "|---|---|",
                    f"| slots x (prompt + new) | {eng['slots']} x ({eng['prompt_len']} + {eng['new_tokens']}) |",
                    f"| decode tokens/s | {_f(eng.get('decode_tokens_per_s'), '{:,.0f}')} |",
                    f"| decode GB/s (params + KV per step) | {_f(eng.get('decode_gbs'), '{:,.0f}')} = "
                    f"{_f(eng.get('decode_frac_of_hbm_peak'), '{:.0%}')} of {H200_HBM_GBS:.0f} |",
                    f"| prefill | {_f(eng.get('prefill_s'), '{:.2f}')} s = "
                    f"{_f(eng.get('prefill_tokens_per_s'), '{:,.0f}')} tok/s |",
                    f"| end to end | {_f(eng.get('wall_s'), '{:.2f}')} s, {_f(eng.get('tokens_per_s'), '{:,.0f}')} "
                    f"tok/s; first run (compiles) {_f(eng.get('first_run', {}).get('wall_s'), '{:.1f}')} s |"]
        if pl.get("status") == "ok":
            out += ["", f"`ulorl plan --devices 1` on the CPU ({_f(pl.get('seconds'), '{:.0f}')} s): train "
                        f"{_f(pl.get('train', {}).get('peak_bytes', 0) / 1e9)} GB (micro-batch "
                        f"{pl.get('train', {}).get('micro_batch_rows')} x {pl.get('train', {}).get('row_len')}), "
                        f"decode {_f((pl.get('decode') or {}).get('peak_bytes', 0) / 1e9)} GB "
                        f"({(pl.get('decode') or {}).get('slots')} slots x "
                        f"{(pl.get('decode') or {}).get('cache_len')})"]
        cmp_ = r.get("comparison") or {}
        if cmp_:
            out += ["", "| memory, GB | `ulorl plan` (CPU compiler) | compiled `memory_analysis` (this backend) | "
                        "allocator peak | compiled / plan | allocator / plan |", "|---|---|---|---|---|---|"]
            for step, d in cmp_.items():
                out.append(f"| {step} | {_f(d.get('plan_cpu_peak_gb'))} | {_f(d.get('compiled_peak_gb'))} | "
                           f"{_f(d.get('allocator_peak_gb'))} | {_f(d.get('compiled_peak_over_plan'), '{:.2f}')} | "
                           f"{_f(d.get('allocator_peak_over_plan'), '{:.2f}')} |")
            out.append("")
            out.append("(allocator peak: `peak_bytes_in_use` of the process, weights + optimizer + batch included; "
                       "the engine's also holds the KV cache and the prefill)")
        for k, v in st.items():
            if v.get("status") != "ok":
                out.append(f"- {k}: {v.get('status')}: {v.get('error') or v.get('reason')}")
    return out


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu_suite.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "gpu_run"),
                   help="output folder (default: $OUT if set, else benchmarks/results/gpu_run)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run (default a,b,c,d,e)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, interpret mode: the same code paths and files in about a minute")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="the whole suite's wall-clock budget; part timeouts shrink to fit it (default 450)")
    p.add_argument("--model", choices=["0.6b", "1.7b"], default="0.6b", help="part c's Qwen3 shape (default 0.6b)")
    p.add_argument("--attention", choices=["pallas", "cudnn", "xla"], default="pallas",
                   help="part c's attention_impl (default pallas: our flash kernel, O(T) memory)")
    p.add_argument("--attention-args", default="--seq-lens 4096,16384,65536 --iters 5 --warmup 1",
                   help="part b's options of benchmarks/attention.py (default '%(default)s'; write "
                        "--attention-args='...' since the value starts with --)")
    p.add_argument("--segments-args", default="--segments 1,2,4,8 --steps 4",
                   help="part e's `ulorl bench segments` options (default '%(default)s'; write --segments-args='...')")
    p.add_argument("--compare-args", default="--torch-compile all",
                   help="part d's `ulorl bench compare` options besides --device cuda (default '%(default)s'; "
                        "torch.compile of the MoE model graph-breaks in transformers' grouped_mm and takes "
                        "minutes: --compare-args='--torch-compile learner' in a short window)")
    p.add_argument("--wheels", default=None,
                   help="folder of carried wheels to install first (default .whl/ in the checkout, if present)")
    p.add_argument("--render", metavar="DIR", help="only rewrite DIR/summary.md from DIR/summary.json")
    p.add_argument("--kernel-tests", default=",".join(KERNEL_TESTS),
                   help="part a: comma-separated test files or node ids (default %(default)s)")
    p.add_argument("--pytest-args", default="",
                   help="part a: extra pytest options, e.g. --pytest-args='-k gmm' for a rerun (default none)")
    p.add_argument("--kernel-test-workers", type=int, default=4,
                   help="part a: pytest-xdist workers on the GPU when xdist is installed (default 4)")
    p.add_argument("--jobs", type=int, default=2,
                   help="dry run only: parts run side by side (default 2; a GPU run is always sequential)")
    p.add_argument("--dry-part-timeout-s", type=float, default=300.0, help=argparse.SUPPRESS)
    # tests only: comma-separated parts (or env) that fail on purpose; in c, its learner sub-step fails
    p.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--_exec":
        return _exec(argv[1:])
    if argv and argv[0] == "--_worker":
        return _worker(argv[1:])
    args = build_parser().parse_args(argv)
    if args.render:
        folder = Path(args.render)
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.md").write_text(render_markdown(summary))
        print(f"wrote {folder / 'summary.md'}")
        return 0
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.inject_failure = {x.strip() for x in args.inject_failure.split(",") if x.strip()}
    bad = sorted(set(args.parts) - set(PARTS))
    if bad:
        build_parser().error(f"--parts: unknown {bad}; parts are {','.join(PARTS)}")
    args.argv = argv
    return Suite(args).main()


if __name__ == "__main__":
    sys.exit(main())
