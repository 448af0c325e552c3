"""Figures: each plot function writes a PNG from a fixture results folder; ``python -m evals.output.plots`` writes them all."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from matplotlib import image

from evals.output import passkey_plots, plot_style, plots, results
from evals.output.summary import collect

PHASES = {"select": 0.001, "transfer": 0.002, "attention": 0.004, "update": 0.0005, "other": 0.003}
LENGTHS, DEPTHS = (512, 1024), (0.0, 0.5)


ENVIRONMENT = {"cpu_model": "Test CPU 9000", "device": "cpu", "dtype": "torch.bfloat16", "gpu": None}


def write_run(root: Path, ev: str, cache: str, budget, score: float, metrics: dict | None = None,
              rows: list[dict] = (), covered: int = 0, environment: dict | None = None) -> Path:
    """A finished run directory as evals/harness.py writes it (config, hash stamp, metrics, timing, rows);
    ``covered``: the samples whose prompt fit in the budget."""
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
        "peak_memory_bytes": 1 << 30, "budget_covers_context": covered,
        "environment": ENVIRONMENT if environment is None else environment})
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


# ---------------------------------------------------------------- what a reader needs to trust a figure
def legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def all_texts(fig) -> str:
    return "\n".join([t.get_text() for t in fig.texts] + [t.get_text() for ax in fig.axes for t in ax.texts])


def test_every_figure_states_n_dtype_and_hardware(summary):
    passkey = summary[summary["eval"] == "passkey"]
    for draw in (plots.draw_accuracy_vs_budget, plots.draw_latency_scatter, plots.draw_tpot_breakdown):
        fig = draw(passkey)
        footer = plot_style.footer_text(fig)
        assert "dtype bfloat16" in footer and "hardware Test CPU 9000 (cpu)" in footer, footer
        labels = legend_texts(fig) + [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert any("(n=4)" in label for label in labels), labels
    assert "(n=4" in " ".join(legend_texts(plots.draw_accuracy_vs_budget(passkey)))


def test_footer_reads_resolved_provenance_first_and_says_mixed(tmp_path):
    gpu = write_run(tmp_path, "passkey", "icecache", 64, 50.0, rows=passkey_rows(0.5),
                    environment={"device": "cuda", "dtype": "torch.float16", "gpu": "NVIDIA H100"})
    cpu = write_run(tmp_path, "passkey", "streaming_llm", 64, 50.0, rows=passkey_rows(0.5))
    results.write_json(cpu / "resolved.json", {"provenance": {"environment": {
        "device": "cpu", "dtype": "torch.float32", "cpu_model": "Other CPU", "gpu": None}}})
    footer = plot_style.provenance_footer(collect(tmp_path, draws=0))
    assert "dtype mixed (float16; float32)" in footer
    assert "hardware mixed (NVIDIA H100 (cuda); Other CPU (cpu))" in footer
    assert plot_style.provenance_footer(pd.DataFrame({"run_dir": [str(gpu)]})) == \
        "dtype float16 | hardware NVIDIA H100 (cuda)"


@pytest.fixture()
def uneven_dir(tmp_path) -> Path:
    """Two results folders: icecache b64 once on 4 samples and once on 1 (a run with limit=1); two full-cache
    runs with 4 and 2 samples; and a budget that covers every prompt."""
    write_run(tmp_path / "a", "passkey", "full", 64, 100.0, rows=passkey_rows(0.5)[:2])
    write_run(tmp_path / "b", "passkey", "full", 64, 100.0, rows=passkey_rows(0.5))
    write_run(tmp_path / "a", "passkey", "icecache", 64, 75.0, rows=passkey_rows(0.5))
    write_run(tmp_path / "b", "passkey", "icecache", 64, 100.0, rows=passkey_rows(0.5)[:1])
    write_run(tmp_path / "a", "passkey", "icecache", 2048, 100.0, rows=passkey_rows(0.5), covered=4)
    write_run(tmp_path / "a", "passkey", "streaming_llm", 64, 75.0, rows=passkey_rows(0.5))
    write_run(tmp_path / "a", "passkey", "h2o", 64, 75.0, rows=passkey_rows(0.5))
    return tmp_path


def test_runs_with_different_n_are_separate_series_and_full_is_chosen_by_rule(uneven_dir):
    fig = plots.draw_accuracy_vs_budget(collect(uneven_dir, draws=0))
    labels = legend_texts(fig)
    assert "icecache (n=4)" in labels and "icecache (n=1)" in labels
    assert "full cache (n=4; most samples of 2 runs)" in labels
    assert not any("n=2" in label for label in labels)
    ticks = [t.get_text() for t in plots.draw_tpot_breakdown(collect(uneven_dir, draws=0)).axes[0].get_xticklabels()]
    assert ticks[0] == "full (n=4) [most samples of 2 runs]"
    assert "icecache b64 (n=4)" in ticks and "icecache b64 (n=1)" in ticks


def test_covers_context_points_are_hollow_and_annotated(uneven_dir):
    fig = plots.draw_accuracy_vs_budget(collect(uneven_dir, draws=0))
    ax = fig.axes[0]
    hollow = [line for line in ax.lines if len(line.get_xdata()) == 1 and line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and 1800 < hollow[0].get_xdata()[0] < 2300  # the budget-2048 point, dodged
    assert "covers the context" in all_texts(fig)
    assert any("covers the context" in label for label in legend_texts(fig))
    assert not any(line.get_markerfacecolor() == "white" and line.get_xdata()[0] < 100 for line in ax.lines
                   if len(line.get_xdata()) == 1)
    panels = plots.passkey_panels(collect(uneven_dir, draws=0))
    assert [label for label in panels if "covers the context" in label] == ["icecache b2048 [covers the context]"]
    breakdown = plots.draw_tpot_breakdown(collect(uneven_dir, draws=0))
    assert any("covers the context" in t.get_text() for t in breakdown.axes[0].get_xticklabels())


def test_methods_have_distinct_markers_and_equal_points_sit_apart(uneven_dir):
    fig = plots.draw_accuracy_vs_budget(collect(uneven_dir, draws=0))
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    markers = {label.split(" ")[0]: h.get_marker() for h, label in zip(handles, labels)
               if not label.startswith(("full", "hollow"))}
    assert set(markers) == {"icecache", "streaming_llm", "h2o"}
    assert len(set(markers.values())) == 3
    points = [line for line in ax.lines if len(line.get_xdata()) == 1 and line.get_marker() != "None"]
    at_64 = [line.get_xdata()[0] for line in points if line.get_xdata()[0] < 100]
    assert len(at_64) == 4 and len(set(at_64)) == 4  # streaming_llm and h2o both at 75 do not coincide
    assert plot_style.method_markers(["a_new_method", "another"]) == {"a_new_method": "*", "another": "H"}


def test_passkey_heatmap_width_is_bounded_at_14_methods(summary, tmp_path):
    passkey = summary[summary["eval"] == "passkey"]
    run = passkey[(passkey["cache"] == "icecache") & (passkey["budget"] == 64)].iloc[0]
    cells = plots.passkey_cells(run["run_dir"])
    runs = {f"method_{i} b64 [a long variant label, option={i}]": cells for i in range(14)}
    fig = passkey_plots.draw_passkey_heatmap(runs)
    assert fig.get_size_inches()[0] <= 13
    assert "hardware Test CPU 9000 (cpu)" in plot_style.footer_text(fig)
    assert all("(n=1 per cell)" in ax.get_title().replace("\n", " ") for ax in fig.axes[:14])
    fonts = [t.get_fontsize() for ax in fig.axes for t in [*ax.texts, ax.title]]
    assert min(fonts) >= 7
    width = image.imread(passkey_plots.passkey_heatmap(runs, tmp_path / "heat.png")).shape[1]
    assert width <= 1700
    many = {f"run {i}": cells for i in range(40)}  # beyond a grid: one matrix, a row per run
    fig = passkey_plots.draw_passkey_heatmap(many)
    assert len(fig.axes[0].get_yticklabels()) == 40 and fig.get_size_inches()[0] <= 13


def test_breakdown_starts_at_zero_with_value_labels(summary):
    fig = plots.draw_tpot_breakdown(summary[summary["eval"] == "passkey"])
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0 and 0 in ax.get_yticks()
    assert len(ax.texts) == 5 and all(float(t.get_text()) > 0 for t in ax.texts)


def test_demo_bars_have_value_labels_from_zero_and_legend_below(tmp_path):
    frame = pd.DataFrame({"cache": ["full", "streaming_llm"], "budget": [None, 64], "n": [8, 8],
                          "task/passkey_512": [100.0, 0.0], "task/passkey_1024": [100.0, 0.0]})
    fig = passkey_plots.draw_passkey_accuracy_by_length(frame)
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["0", "0", "100", "100"]
    assert ax.get_ylim()[0] == 0
    fig.canvas.draw()
    assert ax.get_legend().get_window_extent().y1 < ax.get_window_extent().y0  # below the axes, off the bars
    assert "full, n=8" in legend_texts(fig)


def test_labels_name_only_the_settings_that_tell_runs_apart(summary):
    passkey = summary[summary["eval"] == "passkey"].copy()
    passkey["variant"] = ["depths=3, lengths=[256, 512], seed=1" if c == "icecache" and b == 256 else
                          "depths=3, lengths=[256, 512], seed=0" for c, b in zip(passkey["cache"], passkey["budget"])]
    fig = plots.draw_accuracy_vs_budget(passkey)
    assert {"icecache [seed=0] (n=4)", "icecache [seed=1] (n=4)", "streaming_llm [seed=0] (n=4)"} <= \
        set(legend_texts(fig))
    assert "all runs: depths=3, lengths=[256, 512]" in plot_style.footer_text(fig)
    heat = passkey_plots.draw_passkey_heatmap(plots.passkey_panels(passkey))
    assert "all runs: depths=3, lengths=[256, 512]" in plot_style.footer_text(heat)
    assert "icecache b256 [seed=1]" in [ax.get_title().split(" (n=")[0] for ax in heat.axes]
