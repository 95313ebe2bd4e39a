"""`ulorl bench context`: the load-balance figures and the learner comparison, the table and the JSON contract
(in-process: the test session already has 8 fake devices, tests/conftest.py)."""

from __future__ import annotations

import json

import jax
import pytest


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (fake) devices; see tests/conftest.py")
def test_bench_context_tiny_run(capsys):
    from ulorl_jax.cli import main

    rc = main(["bench", "context", "--contexts", "2,4", "--balance-len", "4096", "--time-len", "512",
               "--devices", "2", "--row-len", "256", "--rows", "2", "--iters", "1", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    for b in r["balance"]:
        assert b["pairs_max_over_mean"] == 1.0 and b["tiles_max_over_mean"] == 1.0
        assert b["contiguous_max_over_mean"] == pytest.approx((2 * b["context"] - 1) / b["context"], rel=1e-3)
        assert len(b["seconds_per_shard"]) == b["context"] and all(s > 0 for s in b["seconds_per_shard"])
    fsdp, context = r["learner"]
    assert (fsdp["mesh"], context["mesh"]) == ("fsdp", "context")
    assert fsdp["tokens_per_device_per_micro_batch"] == 2 * context["tokens_per_device_per_micro_batch"]
    assert "load balance" in out[1]
