"""`ulorl bench decode`: our engine vs transformers `generate` on the same tiny model, and batched prefill
vs one request per call, in one run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_bench_decode_tiny_run(capsys):
    from ulorl_jax.cli import main

    b, p_len, n = 3, 6, 5
    rc = main(["bench", "decode", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
               "--head-dim", "16", "--intermediate-size", "64", "--vocab", "128", "--batch", str(b),
               "--prompt-len", str(p_len), "--new-tokens", str(n), "--steps-per-call", "2", "--iters", "1",
               "--threads", "1", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["generated_tokens"] == b * n
    for side in ("jax", "torch"):
        assert r[side]["tokens_per_s"] == pytest.approx(b * n / r[side]["median_s"])
    assert r["ratio_jax_over_torch"] == pytest.approx(r["torch"]["median_s"] / r["jax"]["median_s"])
    # Same weights, float32 greedy: every token equal to transformers' (the README's claim).
    assert r["greedy_token_agreement"] == 1.0
    cb = r["continuous_batching"]
    assert cb["requests"] == 2 * b and n // 4 * 2 * b <= cb["tokens"] <= n * 2 * b
    pf = r["prefill"]
    assert pf["first_tokens_equal"] and pf["group_first_tokens_equal"]
    assert pf["first_logprob_max_diff"] < 1e-5 and pf["group_first_logprob_max_diff"] < 1e-5
    for kind in ("batched", "one_per_call", "group_batched", "group_one_per_call"):
        assert pf[kind]["tokens_per_s"] == pytest.approx(b * p_len / pf[kind]["median_s"])
    assert pf["speedup_batched"] == pytest.approx(pf["one_per_call"]["median_s"] / pf["batched"]["median_s"])
    text = "\n".join(out)
    assert "greedy token agreement: 1.000" in text and "first tokens equal: True" in text


def test_bench_decode_bad_option_is_named(capsys):
    from ulorl_jax.cli import main

    assert main(["bench", "decode", "--batch", "0"]) == 2
    assert "--batch must be >= 1, got 0" in capsys.readouterr().err
