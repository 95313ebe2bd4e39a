"""`ulorl plot`: charts from metrics.jsonl, skipped (never crashing) when metrics are missing."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from ulorl_jax.config import config_to_yaml, load_config
from ulorl_jax.plot import add_parser, group_curves, plot_compare, plot_run, run_sigma

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = {"reward.png", "entropy.png", "response_length.png", "pools.png"}


def _write_run(run_dir, records, sigma=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if sigma is not None:
        (run_dir / "config.yaml").write_text(config_to_yaml(load_config("tiny_cpu", [f"algorithm.sigma={sigma}"])))
    return run_dir


def _full_records(steps=30, seed=0, entropy_floor=0.2):
    rng = np.random.default_rng(seed)
    records = []
    for step in range(steps):
        r = {"step": step, "reward_mean": float(min(1, 0.2 + step / 40 + 0.05 * rng.standard_normal())),
             "entropy": float(entropy_floor + 0.8 * np.exp(-step / 8)), "pool_unfinished": int(rng.integers(0, 9)),
             "pool_experience": int(rng.integers(8, 40)),
             "response_lengths": rng.integers(5, 128, 16).tolist()}
        if step % 5 == 0:
            r["eval_accuracy"] = 0.1 + step / 50
        records.append(r)
    return records


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_all_charts_written_with_sigma_from_config(tmp_path):
    run = _write_run(tmp_path / "run", _full_records(), sigma=0.3)
    assert run_sigma(run) == 0.3
    written, skipped = plot_run(run)
    assert {p.name for p in written} == ALL and skipped == []
    assert all(_is_png(p) and p.parent == run / "plots" for p in written)


def test_missing_metrics_skip_their_charts_with_a_message(tmp_path):
    run = _write_run(tmp_path / "run", [{"step": s, "entropy": 1.0 / (s + 1)} for s in range(5)]
                     + [{"step": 5, "entropy": None, "reward_mean": "n/a"}])
    written, skipped = plot_run(run, out_dir=tmp_path / "charts")
    assert [p.name for p in written] == ["entropy.png"] and _is_png(tmp_path / "charts" / "entropy.png")
    text = "\n".join(skipped)
    for name in ("reward.png skipped", "response_length.png skipped", "pools.png skipped", "no σ line"):
        assert name in text


def test_empty_metrics_file_skips_everything(tmp_path):
    run = _write_run(tmp_path / "run", [])
    written, skipped = plot_run(run, sigma=0.2)
    assert written == [] and len(skipped) == 4


def test_length_curves_without_per_sample_lengths(tmp_path):
    records = [{"step": s, "response_length_mean": 10.0 + s, "response_length_max": 20 + 2 * s} for s in range(6)]
    written, _ = plot_run(_write_run(tmp_path / "run", records))
    assert [p.name for p in written] == ["response_length.png"]


def test_plot_compare_overlays_runs(tmp_path):
    a = _write_run(tmp_path / "dmmpt", _full_records(entropy_floor=0.2), sigma=0.2)
    b = _write_run(tmp_path / "none", _full_records(seed=1, entropy_floor=0.02), sigma=0.2)
    out = plot_compare([a, b], ["DMMPT", "no masking"], tmp_path / "cmp" / "entropy.png")
    assert _is_png(out)
    with pytest.raises(ValueError, match="2 run folders but 1 labels"):
        plot_compare([a, b], ["x"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="'no_such_metric'"):
        plot_compare([a, b], None, tmp_path / "x.png", metric="no_such_metric")


def test_group_curves_mean_and_range_of_trailing_means():
    # Two seeds of one setting; the second logged step 3 only, so the group covers steps 1, 2, 4.
    a = ([1, 2, 3, 4], [1.0, 3.0, 5.0, 7.0])
    b = ([1, 2, 4], [3.0, 1.0, 2.0])
    steps, mean, low, high = group_curves([a, b])
    # trailing means (window 10 covers everything): a -> 1, 2, 3, 4 at steps 1-4; b -> 3, 2, 2 at 1, 2, 4
    assert steps == [1, 2, 4]
    np.testing.assert_allclose(mean, [2.0, 2.0, 3.0])
    np.testing.assert_allclose(low, [1.0, 2.0, 2.0])
    np.testing.assert_allclose(high, [3.0, 2.0, 4.0])


def test_plot_compare_groups_runs_by_label(tmp_path):
    runs = [_write_run(tmp_path / f"{mode}{seed}", _full_records(seed=seed, entropy_floor=floor), sigma=0.2)
            for mode, floor in (("dmmpt", 0.2), ("none", 0.02)) for seed in range(3)]
    out = plot_compare(runs, ["dmmpt"] * 3 + ["none"] * 3, tmp_path / "seeds.png")
    assert _is_png(out)


def test_sigma_lines_mark_the_target_and_its_band():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ulorl_jax.plot import _sigma_lines

    fig, ax = plt.subplots()
    _sigma_lines(ax, 0.2, "σ = 0.2")
    heights = sorted(line.get_ydata()[0] for line in ax.get_lines())
    np.testing.assert_allclose(heights, [0.1, 0.2, 0.4])
    assert [t.get_text() for t in ax.legend().get_texts()] == ["σ = 0.2", "0.5σ and 2σ"]
    plt.close(fig)


def test_cli_subcommand(tmp_path, capsys):
    run = _write_run(tmp_path / "run", _full_records(8))
    other = _write_run(tmp_path / "other", _full_records(8, seed=2))
    parser = argparse.ArgumentParser(prog="ulorl")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(run), "--sigma", "0.25"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 4 and "no σ line" not in out
    args = parser.parse_args(["plot", str(run), "--compare", str(other), "--labels", "a", "b"])
    assert args.func(args) == 0
    assert _is_png(run / "plots" / "compare_entropy.png")


def test_ulorl_plot_entry_point(tmp_path, capsys):
    from ulorl_jax.cli import main

    run = _write_run(tmp_path / "run", [{"step": 0, "entropy": 0.5}], sigma=0.2)
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out
    assert "entropy.png" in out and "reward.png skipped" in out
    assert main(["plot", str(tmp_path / "missing")]) == 2  # shown plainly, not a traceback
    assert "metrics.jsonl" in capsys.readouterr().err
