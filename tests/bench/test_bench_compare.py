"""`ulorl bench compare`: one run, JAX vs PyTorch learner step and decode on the same Qwen3-MoE and tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_compare_runs_side_by_side(capsys):
    from ulorl_jax.cli import main

    rc = main(["bench", "compare", "--hidden-size", "32", "--layers", "1", "--experts", "4", "--vocab", "128",
               "--moe-intermediate-size", "16", "--samples", "2", "--seq-len", "32", "--prompt-len", "8",
               "--decode-batch", "2", "--new-tokens", "8", "--iters", "1", "--torch-compile", "off", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    L, D = r["learner_step"], r["decode"]
    for side in ("jax", "torch_eager"):
        assert L[side]["tokens_per_s"] == pytest.approx(2 * 32 / L[side]["median_s"])
        assert D[side]["tokens_per_s"] == pytest.approx(2 * 8 / D[side]["median_s"])
    assert L["ratio_jax_over_torch_eager"] == pytest.approx(L["jax"]["tokens_per_s"] / L["torch_eager"]["tokens_per_s"])
    assert D["ratio_jax_over_torch_eager"] == pytest.approx(D["jax"]["tokens_per_s"] / D["torch_eager"]["tokens_per_s"])
    assert L["torch_compile"]["status"] == "off" and "torch_compile" not in {k for k in L if "ratio" in k}
    assert L["jax"]["xla_temp_bytes"] > 0
    # Same weights, same number of identical tiny updates: the two models decode the same tokens.
    assert D["greedy_token_agreement"] == 1.0  # the README and compare.md claim 100 %
    assert r["backend"]["jax"] == "cpu"
    assert "learner step" in "\n".join(out)
    assert "forward" not in r  # only with --forward (or in the sweep)


@pytest.mark.slow
def test_sequence_length_sweep_keeps_tokens_per_step(capsys):
    """`--sweep-seq-lens`: the learner step and the forward at each row length, same tokens per step, one
    table each and JSON."""
    from ulorl_jax.cli import main

    rc = main(["bench", "compare", "--sweep-seq-lens", "32,64", "--sweep-tokens", "128", "--hidden-size", "32",
               "--layers", "1", "--experts", "4", "--vocab", "128", "--moe-intermediate-size", "16", "--prompt-len",
               "8", "--iters", "1", "--torch-compile", "off", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["bench"] == "compare-sweep" and [row["seq_len"] for row in r["rows"]] == [32, 64]
    for row in r["rows"]:
        L = row["learner_step"]
        assert row["samples"] * row["seq_len"] == 128
        assert L["jax"]["tokens_per_s"] == pytest.approx(128 / L["jax"]["median_s"])
        assert L["ratio_jax_over_torch_eager"] == pytest.approx(L["jax"]["tokens_per_s"] / L["torch_eager"]["tokens_per_s"])
        F = row["forward"]
        for side in ("jax", "torch_eager"):
            assert F[side]["tokens_per_s"] == pytest.approx(128 / F[side]["median_s"])
            assert F[side]["peak_rss_growth_bytes"] >= 0
        assert F["ratio_jax_over_torch_eager"] == pytest.approx(
            F["jax"]["tokens_per_s"] / F["torch_eager"]["tokens_per_s"])
    text = "\n".join(out)
    assert "JAX/eager" in text and "forward to logits" in text
    assert main(["bench", "compare", "--sweep-seq-lens", "30", "--sweep-tokens", "128"]) == 2  # 30 does not divide 128
