"""`ulorl_jax.bench.forward`: tiny dense and MoE runs, table, and the --json last line."""

import argparse
import json
import math

import pytest

from ulorl_jax.bench import forward

TINY_ARGS = ["--hidden-size", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
             "--intermediate-size", "64", "--experts", "4", "--top-k", "2", "--moe-intermediate-size", "16",
             "--vocab", "128", "--batch", "2", "--seq-len", "16", "--iters", "1", "--warmup", "0"]


def _args(*extra) -> argparse.Namespace:
    return forward.add_arguments(argparse.ArgumentParser()).parse_args(TINY_ARGS + list(extra))


_RESULTS = {}


def _run(model_type: str, layers: str) -> dict:
    """One real run per model type (each costs a few seconds of JAX compile); reused below."""
    if model_type not in _RESULTS:
        _RESULTS[model_type] = forward.run(_args("--model-type", model_type, "--layers", layers))
    return _RESULTS[model_type]


@pytest.mark.parametrize("model_type,layers", [("qwen3", "1"), ("qwen3_moe", "2")])
def test_run_reports_throughput_and_matching_logits(model_type, layers):
    result = _run(model_type, layers)
    assert result["model"]["model_type"] == model_type
    assert result["model"]["params"] == result["model"]["params_jax"] > 0
    assert result["tokens_per_step"] == 2 * 16
    for case in ("forward", "forward_backward"):
        for fw in ("jax", "torch"):
            assert result[case][fw]["tokens_per_s"] > 0
        assert math.isfinite(result[case]["ratio_jax_over_torch"]) and result[case]["ratio_jax_over_torch"] > 0
    assert result["first_call_s"]["jax_forward"] > 0
    c = result["correctness"]
    assert c["logits_max_abs_diff"] < 1e-3
    assert c["loss_abs_diff"] < 1e-4
    compared, total = map(int, c["grads_compared"].split("/"))
    assert compared == total > 0
    assert c["grads_max_abs_diff"] < 1e-4
    for key in ("cpu", "cpu_count", "jax", "torch", "jax_backend", "date"):
        assert result["machine"][key]
    table = forward.format_table(result)
    assert "forward+backward" in table and "JAX/torch" in table
    json.dumps(result)  # serialisable as is


def test_main_json_is_last_stdout_line(capsys, monkeypatch):
    seen = {}
    dense = _run("qwen3", "1")

    def fake_run(args):  # main's own job is parsing and printing; the measuring is tested above
        seen["args"] = args
        return dense

    monkeypatch.setattr(forward, "run", fake_run)
    assert forward.main(TINY_ARGS + ["--model-type", "qwen3", "--layers", "1", "--json"]) == 0
    assert seen["args"].model_type == "qwen3" and seen["args"].layers == 1 and seen["args"].json
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "forward" and result["settings"]["model_type"] == "qwen3"
    assert result["forward"]["jax"]["tokens_per_s"] > 0
    assert any("forward+backward" in line for line in lines[:-1])  # the table comes first


def test_run_accepts_a_namespace_without_bench_only_options():
    """The CLI may hand over its own namespace; missing options fall back to defaults."""
    s = forward.settings(argparse.Namespace(model_type="qwen3", json=True, func=print))
    assert s["model_type"] == "qwen3" and s["hidden_size"] == 256 and s["torch_attention"] == "sdpa"
