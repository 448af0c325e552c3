"""Figures: each plot function writes a PNG from a fixture results folder; ``python -m evals.output.plots`` writes them all."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from matplotlib import image

from evals.output import plots, results
from evals.output.summary import collect

PHASES = {"select": 0.001, "transfer": 0.002, "attention": 0.004, "update": 0.0005, "other": 0.003}
LENGTHS, DEPTHS = (512, 1024), (0.0, 0.5)


def write_run(root: Path, ev: str, cache: str, budget, score: float, metrics: dict | None = None,
              rows: list[dict] = ()) -> Path:
    """A finished run directory as evals/harness.py writes it (config, hash stamp, metrics, timing, rows)."""
    cfg = {"eval": {"name": ev}, "model": {"name": "tiny-llama"}, "cache": {"name": cache}, "budget": budget,
           "seed": 0, "results_dir": str(root)}
    run_dir = results.run_dir_for(cfg)
    run = results.RunDir(run_dir, cfg, yaml.safe_dump(cfg))
    for row in rows:
        run.append(row)
    scale = 1.0 if cache == "full" else budget / 256
    results.write_json(run_dir / "metrics.json", metrics or {"score": score, "tasks": {f"{ev}_512": score},
                                                              "n_samples": len(rows)})
    results.write_json(run_dir / "timing.json", {
        "ttft_s": 0.5, "tt2t_s": 0.6 * (1 + scale), "tpot_s": sum(PHASES.values()) * (1 + scale),
        "tpot_p50_s": 0.01, "tpot_p90_s": 0.02, "breakdown": {p: v * (1 + scale) for p, v in PHASES.items()},
        "effective_tokens_per_layer": [budget or 512] * 4, "max_resident_tokens": budget or 512,
        "peak_memory_bytes": 1 << 30})
    return run_dir


def passkey_rows(hit_depth: float) -> list[dict]:
    return [{"id": f"passkey-{n}-{d:.3f}", "task": f"passkey_{n}", "prediction": "1", "reference": "1",
             "scores": {"score": float(d == hit_depth or n == 512)}, "meta": {"length": n, "depth": d},
             "timing": None} for n in LENGTHS for d in DEPTHS]


def latency_metrics(tpot_ms: float) -> dict:
    lengths = {str(n): {"tt2t_s": n / 1000, "ttft_s": n / 1100, "tpot_s": tpot_ms * n / 512e3, "tpot_p50_s": 0.01,
                        "breakdown": {p: v * n / 512 for p, v in PHASES.items()}} for n in LENGTHS}
    return {"score": tpot_ms, "score_name": "tpot_ms", "lengths": lengths, "n_samples": len(LENGTHS)}


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    write_run(root, "passkey", "full", 64, 100.0, rows=passkey_rows(0.5))
    write_run(root, "passkey", "full", 256, 100.0, rows=passkey_rows(0.5))  # a budget sweep repeats full
    for budget, score in ((64, 50.0), (256, 75.0)):
        write_run(root, "passkey", "streaming_llm", budget, score, rows=passkey_rows(0.0))
        write_run(root, "passkey", "icecache", budget, score + 20, rows=passkey_rows(0.5))
    for cache, tpot in (("full", 20.0), ("icecache", 8.0)):
        write_run(root, "latency", cache, 64, tpot, metrics=latency_metrics(tpot))
    return root


@pytest.fixture(scope="module")
def summary(results_dir) -> pd.DataFrame:
    return collect(results_dir)


def assert_png(path: Path) -> None:
    assert path.exists() and path.suffix == ".png"
    height, width = image.imread(path).shape[:2]
    assert width > 300 and height > 200


def test_accuracy_vs_budget(summary, tmp_path):
    passkey = summary[summary["eval"] == "passkey"]
    assert_png(plots.accuracy_vs_budget(passkey, tmp_path / "acc.png", "passkey"))


def test_latency_scatter(summary, tmp_path):
    assert_png(plots.latency_scatter(summary[summary["eval"] == "passkey"], tmp_path / "scatter.png"))


def test_tpot_breakdown_has_one_bar_per_run_and_one_full(summary, tmp_path):
    passkey = summary[summary["eval"] == "passkey"]
    assert [plots.run_label(r) for _, r in plots._sorted_runs(passkey).iterrows()] == [
        "full", "icecache b64", "icecache b256", "streaming_llm b64", "streaming_llm b256"]
    assert_png(plots.tpot_breakdown(passkey, tmp_path / "breakdown.png"))


def test_decode_latency_vs_length_reads_per_length_timing(summary, tmp_path):
    table = plots.latency_by_length(summary[summary["eval"] == "latency"])
    assert sorted(table["length"].unique()) == list(LENGTHS) and len(table) == 4
    icecache = table[table["cache"] == "icecache"].sort_values("length")
    assert icecache["tpot_s"].tolist() == pytest.approx([0.008, 0.016])
    assert "breakdown/attention" in table
    assert_png(plots.decode_latency_vs_length(table, tmp_path / "latency.png"))


def test_passkey_heatmap_cells(summary, results_dir, tmp_path):
    run = summary[(summary["cache"] == "streaming_llm") & (summary["budget"] == 64)].iloc[0]
    cells = plots.passkey_cells(run["run_dir"])
    grid = cells.pivot(index="depth", columns="length", values="score")
    assert grid.loc[0.0].tolist() == [100.0, 100.0] and grid.loc[0.5].tolist() == [100.0, 0.0]
    assert_png(plots.passkey_heatmap({"streaming_llm b64": cells}, tmp_path / "heat.png"))


def test_passkey_accuracy_by_length_still_draws(tmp_path):
    frame = pd.DataFrame({"cache": ["full", "icecache"], "budget": [None, 64], "task/passkey_512": [100.0, 80.0],
                          "task/passkey_1024": [100.0, 40.0]})
    assert_png(plots.passkey_accuracy_by_length(frame, tmp_path / "demo.png"))


def test_cli_writes_summary_and_every_figure(results_dir, capsys):
    plots.main([str(results_dir)])
    names = sorted(p.name for p in (results_dir / "figures").glob("*.png"))
    assert names == ["accuracy_vs_budget_passkey_tiny-llama.png", "decode_latency_vs_length_tiny-llama.png",
                     "latency_scatter_latency_tiny-llama.png", "latency_scatter_passkey_tiny-llama.png",
                     "passkey_heatmap_tiny-llama.png", "tpot_breakdown_latency_tiny-llama.png",
                     "tpot_breakdown_passkey_tiny-llama.png"]
    assert len(pd.read_csv(results_dir / "summary.csv")) == 8
    assert "figure:" in capsys.readouterr().out
    for name in names:
        assert_png(results_dir / "figures" / name)
