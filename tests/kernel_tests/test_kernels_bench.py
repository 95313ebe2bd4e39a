"""`ulorl bench attention`: a tiny run through the CLI, table, markdown and the --json last line."""

import argparse
import json

import pytest

from ulorl_jax import cli
from ulorl_jax.bench import attention

TINY = ["--seq-lens", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--decode-batch", "2",
        "--decode-len", "64", "--gmm-tokens", "16", "--experts", "4", "--top-k", "2", "--hidden", "32",
        "--expert-width", "32", "--iters", "1", "--warmup", "0"]


@pytest.mark.slow
def test_cli_tiny_run_times_every_path(capsys, tmp_path):
    md = tmp_path / "attention.md"
    # --time-interpreted runs the Pallas timing code too (figures meaningless on CPU).
    assert cli.main(["bench", "attention", *TINY, "--time-interpreted", "--markdown", str(md), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "attention" and result["settings"]["seq_lens"] == [32]
    row = result["attention"][0]
    for impl in ("pallas", "xla", "torch_sdpa"):
        for case in ("fwd", "fwd_bwd"):
            assert row[impl][case]["tflops"] > 0, (impl, case, row[impl])
    check = result["attention"][-1]
    assert check["max_abs_diff"] < 1e-4
    for impl in ("pallas", "xla"):
        assert result["decode"][impl]["gbs"] > 0
    for impl in ("pallas", "ragged_dot", "dense"):
        assert result["gmm"][impl]["fwd_bwd"]["tflops"] > 0
    text = md.read_text()
    assert "machine:" in text and "date:" in text and "command:" in text and "Grouped matmul" in text
    assert any("Attention TFLOP/s" in line for line in lines[:-1])


def test_cpu_defaults_skip_interpreted_timings_and_bad_skip_is_an_error(capsys):
    with pytest.raises(ValueError, match="--skip"):
        attention.run(attention.add_arguments(argparse.ArgumentParser()).parse_args(["--skip", "nope"]))
    assert cli.main(["bench", "attention", *TINY, "--skip", "decode,gmm,torch"]) == 0
    out = capsys.readouterr().out
    assert "pallas: interpret mode on CPU: not timed" in out and "Decode" not in out
