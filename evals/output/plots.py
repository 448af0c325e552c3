"""Figures from a results folder (matplotlib, headless): ``python -m evals.output.plots results``.

Writes ``summary.csv`` first (evals/output/summary.py) and draws from it; the per-length latency curves read the
latency runs' ``metrics.json`` and the passkey heat maps the passkey runs' ``predictions.jsonl``. PNGs go to
``<results_dir>/figures/``, one set per (eval, model):

* ``accuracy_vs_budget_<eval>_<model>.png`` score vs KV budget per method, full cache dashed
* ``latency_scatter_<eval>_<model>.png``    TT2T vs TPOT per run, annotated with its score
* ``tpot_breakdown_<eval>_<model>.png``     TPOT split into select/transfer/attention/update/other
* ``decode_latency_vs_length_<model>.png``  TPOT vs context length (latency suite)
* ``passkey_heatmap_<model>.png``           passkey accuracy over length x depth, one panel per run
* ``recall_vs_layer_<eval>_<model>.png``     attention-mass recall per layer (runs with ``diagnostics=recall``)
* ``recall_vs_accuracy_<eval>_<model>.png``  score vs pooled attention-mass recall across a sweep

Each method keeps one colour everywhere (:data:`METHOD_COLORS`). Runs that differ in any other setting
(the summary's ``variant``, e.g. ``question_via_decode=true``) are drawn as separate lines, points, bars
and panels, labelled with that variant (and, if two runs still share a label, their directory): a figure
never merges or drops a run. Heat-map cells show the number of samples behind each accuracy.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .results import load_predictions  # noqa: E402
from .schema import read_recall, read_results  # noqa: E402
from .summary import write_summary  # noqa: E402

METHOD_COLORS = {"full": "#333333", "streaming_llm": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#8c564b",
                 "pqcache": "#2ca02c", "omnikv": "#9467bd", "magicpig": "#e377c2", "quest": "#7f7f7f",
                 "topk": "#bcbd22", "icecache": "#d62728", "icecache_reuse": "#17becf", "arkvale": "#aec7e8",
                 "kvpress": "#98df8a"}
PHASE_COLORS = {"select": "#4c72b0", "transfer": "#dd8452", "attention": "#55a868", "update": "#c44e52",
                "other": "#8c8c8c"}
NOT_ACCURACY = ("latency",)  # suites whose score is not a quality metric


def method_color(cache: str) -> str:
    return METHOD_COLORS.get(cache, "#000000")


def run_label(row) -> str:
    label = "full" if row["cache"] == "full" else f"{row['cache']} b{_budget_text(row['budget'])}"
    variant = _variant(row)
    return f"{label} [{variant}]" if variant else label


def _variant(row) -> str:
    variant = row.get("variant") if hasattr(row, "get") else None
    return "" if variant is None or pd.isna(variant) else str(variant)


def unique_labels(frame: pd.DataFrame) -> list[str]:
    """:func:`run_label` per row; labels that still collide get their run directory's name appended."""
    labels = [run_label(row) for _, row in frame.iterrows()]
    dirs = frame["run_dir"].tolist() if "run_dir" in frame else [str(i) for i in range(len(frame))]
    return [f"{lab} ({Path(str(d)).parent.parent.parent.name}/{Path(str(d)).name})" if labels.count(lab) > 1 else lab
            for lab, d in zip(labels, dirs)]


def _budget_text(budget) -> str:
    return "none" if pd.isna(budget) else f"{float(budget):g}"


def _log2_ticks(ax, values) -> None:
    """A log2 x axis labelled with the values themselves (budgets, lengths) instead of powers of two."""
    ticks = sorted({float(v) for v in values if pd.notna(v)})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def _finish_line_plot(fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Axis labels, title, light grid and legend shared by the line and scatter figures, then save."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # long titles and rotated labels are never clipped
    plt.close(fig)
    return out


def _sorted_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs ordered full cache first, then by method and budget. The full cache ignores the budget, so
    of several full-cache runs (a sweep over budgets) only the first is kept."""
    frame = frame.assign(budget=pd.to_numeric(frame["budget"], errors="coerce"))
    if "variant" not in frame:
        frame = frame.assign(variant="")
    frame = frame.assign(variant=[_variant({"variant": v}) for v in frame["variant"]])
    frame = frame.sort_values(["cache", "variant", "budget"], key=lambda c: c.map(lambda x: (x != "full", x))
                              if c.name == "cache" else c)
    same = [c for c in ("eval", "model", "cache", "variant", "length") if c in frame]
    return frame[~((frame["cache"] == "full") & frame.duplicated(same))]


def _line_label(cache: str, variant: str) -> str:
    return f"{cache} [{variant}]" if variant else cache


def accuracy_vs_budget(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Headline score vs KV budget (log2 axis), one line per method; the full cache as a dashed line."""
    frame = _sorted_runs(frame)
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = _variant_styles(frame)
    for (cache, variant), runs in frame.groupby(["cache", "variant"], sort=False):
        if cache == "full":
            ax.axhline(runs["score"].mean(), ls="--", color=method_color(cache),
                       label=_line_label("full cache", variant))
        else:
            ax.plot(runs["budget"], runs["score"], marker=styles[variant][0], ls=styles[variant][1],
                    color=method_color(cache), label=_line_label(cache, variant))
    _log2_ticks(ax, frame.loc[frame["cache"] != "full", "budget"])
    ax.set_ylim(-3, 103)
    return _finish_line_plot(fig, ax, out, "KV budget (past tokens per head per layer)",
                             "score (0-100)",
                             title or "Score vs KV budget")


def _variant_styles(frame: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """A marker and line style per variant (the plain run: circles, solid lines)."""
    variants = sorted(set(frame["variant"]))
    markers, lines = "osD^v<>px*", ["-", ":", "-.", (0, (5, 1))]
    return {v: (markers[i % len(markers)], lines[i % len(lines)]) for i, v in enumerate(variants)}


def latency_scatter(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """TT2T (s) vs TPOT (ms), one point per run in its method's colour (a marker per variant), annotated
    with budget and score; labels alternate around their points so neighbours do not overlap."""
    frame = _sorted_runs(frame)
    styles = _variant_styles(frame)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    n = 0
    for (cache, variant), runs in frame.groupby(["cache", "variant"], sort=False):
        ax.scatter(runs["tt2t_s"], 1000 * runs["tpot_s"], color=method_color(cache), marker=styles[variant][0],
                   label=_line_label(cache, variant), s=40)
        for _, row in runs.iterrows():
            score = "-" if pd.isna(row.get("score")) else f"{row['score']:.1f}"
            note = f"b{_budget_text(row['budget'])}: {score}" if cache != "full" else score
            offset = [(5, 5), (5, -11), (-40, 5), (-40, -11)][n % 4]
            ax.annotate(note, (row["tt2t_s"], 1000 * row["tpot_s"]), textcoords="offset points", xytext=offset,
                        fontsize=7)
            n += 1
    ax.margins(0.2)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    return _finish_line_plot(fig, ax, out, "time to second token, TT2T (s)",
                             "time per output token, TPOT (ms)",
                             title or "TT2T vs TPOT (labels: budget: score)")


def tpot_breakdown(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Stacked bars per run: milliseconds per output token in each decode phase."""
    frame = _sorted_runs(frame)
    phases = [c.split("/", 1)[1] for c in frame.columns if c.startswith("breakdown/")]
    phases = [p for p in PHASE_COLORS if p in phases] + [p for p in phases if p not in PHASE_COLORS]
    labels = unique_labels(frame)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(labels) + 2), 4))
    bottom = [0.0] * len(labels)
    for phase in phases:
        ms = (1000 * frame[f"breakdown/{phase}"].fillna(0.0)).tolist()
        ax.bar(labels, ms, bottom=bottom, color=PHASE_COLORS.get(phase), label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(title or "TPOT breakdown per decode phase")
    ax.tick_params(axis="x", rotation=45)
    plt.setp(ax.get_xticklabels(), ha="right")
    ax.legend(fontsize=8)
    return _save(fig, out)


def recall_vs_layer(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Mean attention-mass recall per budgeted layer (``recall.json``), one panel per budget and one line per
    run with ``diagnostics=recall`` in its method's colour; one legend for all panels, outside them."""
    frame = _sorted_runs(frame)
    budgets = sorted({b for b in frame["budget"] if pd.notna(b)}) or [None]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets) + 2, 3.6), sharey=True, squeeze=False)
    handles = {}
    for _, row in frame.iterrows():
        recall = read_recall(row["run_dir"])
        if not recall or "recall" not in recall.get("per_layer", {}):
            continue
        ax = axes[0][budgets.index(row["budget"]) if row["budget"] in budgets else 0]
        label = _line_label(row["cache"], _variant(row))
        (line,) = ax.plot(recall["layers"], recall["per_layer"]["recall"]["mean"], marker="o", ms=3,
                          color=method_color(row["cache"]), label=label)
        handles.setdefault(label, line)
    for ax, budget in zip(axes[0], budgets):
        ax.set_title(f"budget {_budget_text(budget)}" if budget is not None else "")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention-mass recall\n(mean over steps and heads)")
    axes[0][0].set_ylim(0, 1.02)
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title or "Attention-mass recall per layer")
    return _save(fig, out)


def recall_vs_accuracy(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Score vs pooled attention-mass recall, one point per run with ``diagnostics=recall`` (a sweep over
    methods and budgets), annotated with the budget."""
    frame = _sorted_runs(frame[frame["recall_mean"].notna()])
    styles = _variant_styles(frame)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (cache, variant), runs in frame.groupby(["cache", "variant"], sort=False):
        ax.scatter(runs["recall_mean"], runs["score"], color=method_color(cache), marker=styles[variant][0],
                   label=_line_label(cache, variant), s=40)
        for _, row in runs.iterrows():
            if cache != "full":
                ax.annotate(f"b{_budget_text(row['budget'])}", (row["recall_mean"], row["score"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlim(max(0.0, float(frame["recall_mean"].min()) - 0.05), 1.01)
    ax.set_ylim(-3, 103)
    return _finish_line_plot(fig, ax, out, "attention-mass recall (pooled mean)", "score (0-100)",
                             title or "Score vs attention-mass recall")


def latency_by_length(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (latency run, context length) from the runs' ``metrics.json`` ``lengths`` entries:
    cache, budget, model, length, tt2t_s, ttft_s, tpot_s and breakdown/<phase>."""
    rows = []
    for _, run in frame.iterrows():
        metrics, _ = read_results(Path(run["run_dir"]))
        for length, at in metrics.get("lengths", {}).items():
            rows.append({"cache": run["cache"], "budget": run["budget"], "model": run["model"], "length": int(length),
                         "variant": _variant(run), "run_dir": run["run_dir"],
                         **{k: v for k, v in at.items() if k != "breakdown"},
                         **{f"breakdown/{p}": v for p, v in at.get("breakdown", {}).items()}})
    return pd.DataFrame(rows)


def decode_latency_vs_length(table: pd.DataFrame, out: Path, title: str = "") -> Path:
    """TPOT (ms) vs context length (log2 axis), one line per run (method colour, marker per budget)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osD^v<>px*"
    budgets = sorted({_budget_text(b) for b in table["budget"]})
    groups = _sorted_runs(table).groupby(["cache", "budget", "variant", "run_dir"], sort=False, dropna=False)
    for (cache, budget, variant, _), runs in groups:
        runs = runs.sort_values("length")
        label = run_label({"cache": cache, "budget": budget, "variant": variant})
        ax.plot(runs["length"], 1000 * runs["tpot_s"], color=method_color(cache), label=label,
                marker=markers[budgets.index(_budget_text(budget)) % len(markers)])
    _log2_ticks(ax, table["length"])
    ax.set_ylim(bottom=0)
    return _finish_line_plot(fig, ax, out, "context length (tokens)",
                             "decode latency per token, TPOT (ms)",
                             title or "Decode latency vs context length")


def passkey_cells(run_dir: Path) -> pd.DataFrame:
    """Mean passkey accuracy (%) and sample count ``n`` per (length, depth) of one run, from its predictions."""
    rows = [{"length": r["meta"]["length"], "depth": r["meta"]["depth"], "score": 100 * r["scores"]["score"]}
            for r in load_predictions(Path(run_dir) / "predictions.jsonl")]
    return pd.DataFrame(rows).groupby(["length", "depth"], as_index=False).agg(
        score=("score", "mean"), n=("score", "size"))


def passkey_heatmap(runs: dict[str, pd.DataFrame], out: Path, title: str = "") -> Path:
    """Passkey accuracy over context length (x) and needle depth (y), one panel per run
    (``runs``: label -> :func:`passkey_cells` frame)."""
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(1.2 + 3.0 * n, 3.6), squeeze=False)
    fig.subplots_adjust(wspace=0.45)  # room for each panel's own depth labels
    image = None
    for ax, (label, cells) in zip(axes[0], runs.items()):  # each panel its own depth axis (no sharey)
        grid = cells.pivot(index="depth", columns="length", values="score").sort_index()
        counts = cells.pivot(index="depth", columns="length", values="n").reindex_like(grid) \
            if "n" in cells else None
        image = ax.imshow(grid.to_numpy(), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
        ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns], rotation=45)
        ax.set_yticks(range(grid.shape[0]), [f"{d:.0%}" for d in grid.index])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(label, fontsize=9)
        for (i, j), v in pd.DataFrame(grid.to_numpy()).stack().items():
            n_cell = "" if counts is None else f"\nn={int(counts.iat[i, j])}"
            ax.text(j, i, f"{v:.0f}{n_cell}", ha="center", va="center", fontsize=6)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy (%)")
    fig.suptitle(title or "Passkey accuracy by length and depth")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def figures(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Draws every figure the complete runs of a summary table support into ``out_dir``."""
    frame = summary[summary["status"] == "complete"] if len(summary) else summary
    paths, out = [], Path(out_dir)
    for (ev, model), runs in frame.groupby(["eval", "model"]):
        tag = f"{ev}_{model}"
        if ev not in NOT_ACCURACY and (runs["cache"] != "full").any():
            paths.append(accuracy_vs_budget(runs, out / f"accuracy_vs_budget_{tag}.png",
                                            f"{ev}: score vs KV budget ({model})"))
        paths.append(latency_scatter(runs, out / f"latency_scatter_{tag}.png",
                                     f"{ev}: TT2T vs TPOT, labels budget: score ({model})"))
        paths.append(tpot_breakdown(runs, out / f"tpot_breakdown_{tag}.png", f"{ev}: TPOT breakdown ({model})"))
        if "recall_mean" in runs and runs["recall_mean"].notna().any():
            paths.append(recall_vs_layer(runs[runs["recall_mean"].notna()], out / f"recall_vs_layer_{tag}.png",
                                         f"{ev}: attention-mass recall per layer ({model})"))
            if ev not in NOT_ACCURACY:
                paths.append(recall_vs_accuracy(runs, out / f"recall_vs_accuracy_{tag}.png",
                                                f"{ev}: score vs attention-mass recall ({model})"))
        if ev == "latency":
            paths.append(decode_latency_vs_length(latency_by_length(runs), out / f"decode_latency_vs_length_{model}.png",
                                                  f"Decode latency vs context length ({model})"))
        if ev == "passkey":
            ordered = _sorted_runs(runs)
            cells = {label: passkey_cells(row["run_dir"])
                     for label, (_, row) in zip(unique_labels(ordered), ordered.iterrows())}
            paths.append(passkey_heatmap(cells, out / f"passkey_heatmap_{model}.png",
                                         f"Passkey accuracy by length and depth ({model})"))
    return paths


def make_all(results_dir: str | Path) -> list[Path]:
    """Writes ``<results_dir>/summary.csv`` and every figure into ``<results_dir>/figures``."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir() or not any(results_dir.rglob("config_hash")):
        raise FileNotFoundError(f"no run directories under {results_dir} (run `python run.py ...` first)")
    return figures(pd.read_csv(write_summary(results_dir)), results_dir / "figures")


def passkey_accuracy_by_length(frame: pd.DataFrame, out: Path) -> Path:
    """Grouped bars: passkey accuracy (%) per context length, one bar per method."""
    tasks = sorted((c for c in frame.columns if c.startswith("task/passkey_")), key=lambda c: int(c.split("_")[-1]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(frame), 1)
    for i, (_, row) in enumerate(frame.iterrows()):
        xs = [j + i * width for j in range(len(tasks))]
        label = row["cache"] if row["cache"] == "full" else f"{row['cache']} (budget {row['budget']})"
        ax.bar(xs, [row[t] for t in tasks], width, label=label, color=METHOD_COLORS.get(row["cache"]))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [t.split("_")[-1] + " tokens" for t in tasks])
    ax.set_ylabel("passkey accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Passkey retrieval, SmolLM2-135M-Instruct")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Writes summary.csv and all figures of a results folder")
    parser.add_argument("results_dir", nargs="?", default="results")
    args = parser.parse_args(argv)
    try:
        paths = make_all(args.results_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for path in paths:
        print(f"figure: {path}")


if __name__ == "__main__":
    main()
