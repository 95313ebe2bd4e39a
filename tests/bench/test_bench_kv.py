"""`ulorl bench kv`: the dense and the paged cache on one workload and one KV memory budget."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_bench_kv_tiny_run(capsys, preemption):
    from ulorl_jax.cli import main

    # One decode step per call: admission keeps back one page per sample in flight, so samples outgrow the pool.
    rc = main(["bench", "kv", "--requests", "16", "--global-max-len", "48", "--dense-slots", "2",
               "--paged-slots", "8", "--page-size", "4", "--hidden-size", "32", "--layers", "1", "--vocab", "64",
               "--steps-per-call", "1", "--repeats", "1", "--preemption", preemption, "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["greedy_equal"] is True
    # One KV memory budget: 2 slots x (8 + 48) positions = 28 pages of 4.
    assert r["dense"]["kv_positions"] == r["paged"]["kv_positions"] == 112
    for side in ("dense", "paged"):
        x = r[side]
        assert {"in_flight", "seconds"} <= set(x)
        assert x["tokens_per_s"] == pytest.approx(x["tokens"] / x["seconds"])
        assert 0 < x["in_flight"] <= x["slots"]
        assert x["decode_s"] > 0 and x["prefill_s"] > 0 and x["host_s"] >= 0
        assert x["decode_s"] + x["prefill_s"] + x["swap_s"] <= x["times_s"][-1]
        assert x["ms_per_decode_step"] > 0
    assert r["dense"]["tokens"] == r["paged"]["tokens"]
    assert r["paged"]["peak_pages"] <= 28
    assert r["settings"]["preemption"] == preemption
    assert r["paged"]["preemptions"] > 0  # the workload outgrows the pool: the chosen preemption runs
    assert (r["paged"]["swap_s"] > 0) == (preemption == "swap") and r["dense"]["swap_s"] == 0
    assert r["in_flight_ratio"] == pytest.approx(r["paged"]["in_flight"] / r["dense"]["in_flight"])
    assert r["speedup"] == pytest.approx(r["dense"]["seconds"] / r["paged"]["seconds"])
    assert "greedy tokens equal: True" in "\n".join(out)


def test_bench_kv_bad_option_is_named(capsys):
    from ulorl_jax.cli import main

    assert main(["bench", "kv", "--page-size", "0"]) == 2
    assert "--page-size must be a positive integer, got 0" in capsys.readouterr().err
