"""`ulorl bench segments`: the per-K ledger (every sample trained exactly once), the pool simulation
against the real rollout, the ideal speedup and the cost-model projection."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from ulorl_jax.bench import segment_cost as sc
from ulorl_jax.bench import segments


def _args(**kw) -> argparse.Namespace:
    ns = segments.add_arguments(argparse.ArgumentParser()).parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_length_distribution_matches_its_description():
    d = sc.LengthDistribution(64, body=0.8, truncated=0.05, seed=3)
    x = np.asarray([d(u) for u in range(4000)])
    assert x.min() >= 1 and x.max() == 65
    assert abs(np.mean(x <= 32) - 0.8) < 0.03
    assert abs(np.mean(x == 65) - 0.05) < 0.015
    assert abs(np.mean((x > 32) & (x <= 64)) - 0.15) < 0.03
    assert [d(u) for u in range(20)] == [d(u) for u in range(20)]  # deterministic per uid
    with pytest.raises(ValueError, match="body"):
        sc.LengthDistribution(64, body=0.9, truncated=0.2)


def test_simulated_pools_conserve_samples_and_tokens():
    d = sc.LengthDistribution(32, seed=1)
    for k in (1, 2, 4):
        tr = sc.simulate_pools(d, global_max_len=32, num_segments=k, prompts_per_step=3, samples_per_prompt=2,
                               steps=30)
        assert all(t.decoded.max() <= 32 // k and t.decoded.min() >= 1 for t in tr)
        assert all((t.start + t.decoded <= 32).all() for t in tr)
        # Every sample ends after exactly ceil(min(len, 32) / seg) steps: count them in the traces.
        ended = sum(t.ended for t in tr)
        groups = sum(t.groups_completed for t in tr)
        assert ended <= 30 * 6 and groups <= 30 * 3 and ended >= 6 * (30 - k)
    ideal = sc.ideal_speedups(d, [1, 2, 4], prompts_per_step=3, samples_per_prompt=2, steps=60)
    assert ideal[1]["ideal_speedup"] == 1.0
    assert 1.0 < ideal[2]["ideal_speedup"] < ideal[4]["ideal_speedup"] <= 4.0


@pytest.mark.slow
def test_measured_run_trains_every_sample_exactly_once():
    """Short real run (engine + learner) for K = 1 and 4: ledger exact, lengths as the oracle says,
    in-flight counts as the simulation predicts, at most K policy versions per sample."""
    a = _args(segments="1,4", global_max_len=16, prompts_per_step=2, n=2, prompt_len=4, steps=3, steps_per_call=4,
              hidden_size=32, layers=1, vocab=32)
    s = segments.settings(a)
    ks, engine, learner = segments.build(s)
    dist = sc.LengthDistribution(16, seed=0)
    for k in ks:
        r = segments.run_one(engine, learner, k, s, dist)
        lg = r["ledger"]
        assert lg["created"] == (k + 1 + 3) * 4  # every step adds 2 prompts x 2 samples
        assert lg["trained"] == lg["created"]
        assert lg["duplicates"] == 0 and lg["lost"] == 0 and lg["unknown"] == 0 and lg["wrong_length"] == 0
        st = r["staleness"]
        # A sample spans at most K steps; a step may run more than one update when groups complete in bursts.
        assert 0 <= st["max_version_spread"] <= learner.step
        assert st["mean_versions_per_sample"] <= k
        if k == 1:
            assert st["mean_versions_per_sample"] == 1.0 and st["max_version_spread"] == 0
        sim = sc.simulate_pools(dist, global_max_len=16, num_segments=k, prompts_per_step=2, samples_per_prompt=2,
                                steps=k + 1 + 3)
        timed = sim[k + 1:]
        if r["steps_excluded_compiling"] == 0:
            assert r["mean_in_flight"] == pytest.approx(np.mean([t.decoded.size for t in timed]))
    assert engine.compile_count() < 20  # one engine serves all K


@pytest.mark.slow
def test_json_shape_and_cli_table(capsys):
    from ulorl_jax.cli import main

    rc = main(["bench", "segments", "--segments", "1,2", "--global-max-len", "8", "--prompts-per-step", "1",
               "--n", "2", "--prompt-len", "4", "--steps", "2", "--layers", "1", "--vocab", "32", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert set(r["segments"]) == {"1", "2"}
    assert r["segments"]["1"]["speedup"] == 1.0
    for v in r["segments"].values():
        assert {"seconds_per_update", "speedup", "ideal_speedup", "rollout_s_per_update", "learn_s_per_update",
                "slot_occupancy", "staleness", "ledger", "host_s_per_update", "pct_of_ideal",
                "prefill_calls_per_step", "prefill_rows_per_step"} <= set(v)
        # batched prefill: a step's samples take a call per length bucket, not one per sample
        assert 1 <= v["prefill_calls_per_step"] <= 2
    assert "MEASURED on CPU" in "\n".join(out)


def test_projection_prints_assumptions_and_paper_anchor(capsys):
    from ulorl_jax.cli import main

    rc = main(["bench", "segments", "--model-scale", "qwen3-30b-a3b", "--gpus", "64", "--segments", "1,2,4",
               "--projection-max-len", "8192", "--projection-prompts", "16", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r["mode"] == "projection" and r["assumptions"]
    assert r["segments"]["1"]["speedup"] == 1.0
    assert r["segments"]["2"]["paper_speedup"] == pytest.approx(1240 / 774)
    assert "PROJECTION" in out[0]


def test_model_shape_counts_qwen3_30b_a3b():
    total, active = sc.QWEN3_30B_A3B.params()
    assert 30.0e9 < total < 31.0e9  # "30B"
    assert 3.0e9 < active < 3.6e9  # "A3B"
    assert sc.QWEN3_30B_A3B.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2


def test_bad_segments_named():
    with pytest.raises(ValueError, match="--segments"):
        segments.parse_segments("1,3", 16)
    with pytest.raises(ValueError, match="--segments"):
        segments.parse_segments("a", 16)


def test_compile_counter_counts_every_new_compile_and_no_cached_call():
    """The bench leaves out a step during which anything compiled; the counter must see a helper's new
    shape (no executable cache of the engine or learner shows it) and stay still on a cached call."""
    import jax
    import jax.numpy as jnp

    from ulorl_jax.bench import harness

    f = jax.jit(lambda x: jnp.sin(x) * 3.0)
    x5, x7, x9 = (np.ones(n, np.float32) for n in (5, 7, 9))  # host arrays: no compile of their own
    with harness.CompileCounter() as compiles:
        f(x5).block_until_ready()
        first = compiles.count
        f(x5).block_until_ready()  # cached
        cached = compiles.count
        f(x7).block_until_ready()  # a new shape
        assert (first, cached, compiles.count) == (1, 1, 2)
    f(x9).block_until_ready()  # closed: no longer listening
    assert compiles.count == 2
