"""`ulorl bench learner`: a tiny real run (JAX step vs the PyTorch step), the table, and the --json last line."""

import argparse
import json

import pytest

from ulorl_jax.bench import learner as bench

TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate-size", "64", "--vocab", "64", "--samples", "4", "--seq-len", "16", "--prompt-len", "4",
        "--micro-batch-rows", "2", "--logprob-chunk", "8", "--iters", "1", "--warmup", "0",
        "--mem-lengths", "64", "--mem-attention", "both"]


@pytest.mark.slow
def test_tiny_run_table_and_json(capsys):
    assert bench.main(TINY + ["--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "learner" and result["tokens_per_step"] == 4 * 16
    for fw in ("jax", "torch"):
        assert result["train_step"][fw]["tokens_per_s"] > 0
    assert result["memory"]["jax_xla_temp_bytes"] > 0
    rows = result["memory_vs_length"]
    assert [r["seq_len"] for r in rows] == [64, 64] and all(r["temp_bytes"] > 0 for r in rows)
    assert any("JAX/torch tokens/s" in line for line in lines[:-1])


def test_bad_options_are_named():
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(TINY + ["--prompt-len", "16"])
    with pytest.raises(ValueError, match="--prompt-len must be in"):
        bench.run(args)
