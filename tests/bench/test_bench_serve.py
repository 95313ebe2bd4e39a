"""`ulorl bench serve`: a real server under 1 and 4 concurrent clients, the table and the JSON contract."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_serve_tiny_run(capsys):
    from ulorl_jax.cli import main

    rc = main(["bench", "serve", "--clients", "1,4", "--requests", "8", "--max-tokens", "8", "--prompt-len", "4",
               "--slots", "4", "--repeats", "1", "--hidden-size", "32", "--layers", "1", "--vocab", "64", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert [x["clients"] for x in r["rounds"]] == [1, 4]
    for x in r["rounds"]:
        assert x["requests"] == 8 and x["tokens"] == 8 * 8  # no EOS in the bench model: every request runs out
        assert x["tokens_per_s"] == pytest.approx(x["tokens"] / x["seconds"])
        assert 0 < x["latency_p50_s"] <= x["latency_p90_s"] <= x["latency_p99_s"]
    assert r["rounds"][0]["vs_first"] == 1.0
    assert "clients" in out[1] and "tokens/s" in out[1]


def test_bench_serve_bad_options(capsys):
    from ulorl_jax.cli import main

    assert main(["bench", "serve", "--clients", "1,x"]) == 2
    assert "--clients" in capsys.readouterr().err
    assert main(["bench", "serve", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
