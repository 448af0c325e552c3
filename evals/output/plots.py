"""Figures from a results folder (matplotlib, headless): ``python -m evals.output.plots results``.

Writes ``summary.csv`` first (evals/output/summary.py) and draws from it; the per-length latency curves read the
latency runs' ``metrics.json`` and the passkey heat maps the passkey runs' ``predictions.jsonl``. PNGs go to
``<results_dir>/figures/``, one set per (eval, model):

* ``accuracy_vs_budget_<eval>_<model>.png`` score vs KV budget per method, full cache dashed
* ``latency_scatter_<eval>_<model>.png``    TT2T vs TPOT per run, annotated with its score
* ``tpot_breakdown_<eval>_<model>.png``     TPOT split into select/transfer/attention/update/other
* ``decode_latency_vs_length_<model>.png``  TPOT vs context length (latency suite)
* ``passkey_heatmap_<model>.png``           passkey accuracy over length x depth per run (evals/output/passkey_plots.py)
* ``recall_vs_layer_<eval>_<model>.png``     attention-mass recall per layer (runs with ``diagnostics=recall``)
* ``recall_vs_accuracy_<eval>_<model>.png``  score vs pooled attention-mass recall across a sweep

Each method keeps one colour and one marker everywhere (evals/output/plot_style.py), and the series of a line
figure sit a little apart on the x axis, so that equal values of two methods never hide one another. Every
legend entry states its n (samples per run), and every figure ends in a footer with the runs' dtype and
hardware (their ``resolved.json`` provenance, else ``timing.json``; ``mixed (...)`` where runs differ). Runs
that differ in any setting (the summary's ``variant``) or in their number of samples are separate series:
a figure never merges or drops a budgeted run. Of several full-cache runs of one configuration (a budget
sweep repeats it) the one with the most samples is drawn, and its legend entry says so. A run whose budget
covered the prompt (``budget_covers_context``) ran as full attention: its point is hollow and annotated
"covers the context", never an ordinary budget point.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .passkey_plots import passkey_accuracy_by_length, passkey_cells, passkey_heatmap  # noqa: E402,F401
from .plot_style import (COVERS, FULL_RULE, METHOD_COLORS, add_footer, choose_full, covers_note, dodge_factors,  # noqa: E402,F401
                         legend_outside, method_color, method_markers, n_text, prepared, save, series,
                         series_label, variant_text)
from .schema import read_recall, read_results  # noqa: E402
from .summary import write_summary  # noqa: E402

PHASE_COLORS = {"select": "#4c72b0", "transfer": "#dd8452", "attention": "#55a868", "update": "#c44e52",
                "other": "#8c8c8c"}
NOT_ACCURACY = ("latency",)  # suites whose score is not a quality metric
LINE_STYLES = ["-", ":", "-.", (0, (5, 1))]  # one per variant of a method
MAX_COLUMN_BARS = 24  # more runs than this: the breakdown's bars lie horizontally


def run_label(row) -> str:
    label = "full" if row["cache"] == "full" else f"{row['cache']} b{_budget_text(row['budget'])}"
    variant = variant_text(row.get("variant") if hasattr(row, "get") else None)
    return f"{label} [{variant}]" if variant else label


def unique_labels(frame: pd.DataFrame, with_n: bool = True) -> list[str]:
    """:func:`run_label` (and, ``with_n``, the run's n) per row; labels that still collide get their run
    directory's name appended."""
    labels = [f"{run_label(row)} ({n_text(row.get('n_drawn'))})" if with_n else run_label(row)
              for _, row in frame.iterrows()]
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


def _finish(fig, ax, frame: pd.DataFrame, xlabel: str, ylabel: str, title: str, note: str = ""):
    """Axis labels, title, light grid, the legend outside the axes and the footer; returns the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    add_footer(fig, frame, note)
    return fig


def _sorted_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs ordered full cache first, then by method, variant and budget, with ``n_drawn``; of several
    full-cache runs of one configuration, the one with the most samples (plot_style.choose_full)."""
    return choose_full(prepared(frame))[0]


def labelled_runs(frame: pd.DataFrame, with_n: bool = True) -> tuple[pd.DataFrame, list[str]]:
    """:func:`_sorted_runs` and a label per run (:func:`unique_labels`) that says when its budget covered the
    prompt and, for a full cache chosen among several runs, by which rule."""
    frame, chosen = choose_full(prepared(frame))
    labels = []
    for label, (i, row) in zip(unique_labels(frame, with_n), frame.iterrows()):
        notes = [covers_note(row)] + ([f"{FULL_RULE} of {chosen[i]} runs"] if chosen.get(i, 1) > 1 else [])
        labels.append(" ".join([label, *(f"[{n}]" for n in notes if n)]))
    return frame, labels


def _variant_styles(frame: pd.DataFrame) -> dict[str, object]:
    """A line style per variant (the plain run: solid)."""
    return {v: LINE_STYLES[i % len(LINE_STYLES)] for i, v in enumerate(sorted(set(frame["variant"])))}


def _points(ax, key: tuple, runs: pd.DataFrame, xs, ys, marker: str, label: str, line=None, ci=False) -> None:
    """One series: a line (``line``: its style; None: points only), filled markers, hollow ones annotated
    "covers the context" where the budget covered the prompt, and (``ci``: ``ys`` are the scores) the
    bootstrap interval where known."""
    color = method_color(key[0])
    xs, ys = list(xs), list(ys)
    notes = [covers_note(row) for _, row in runs.iterrows()]
    if line is not None:
        ax.plot(xs, ys, ls=line, color=color, lw=1.2, zorder=2)
    ax.plot([], [], marker=marker, color=color, ls=line or "none", label=label)
    for x, y, note in zip(xs, ys, notes):
        ax.plot([x], [y], marker=marker, ls="none", ms=7, color=color, mec=color, zorder=3,
                mfc="white" if note else color, mew=1.5 if note else 1.0)
        if note:
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=6, color=color)
    if ci and {"score_ci_low", "score_ci_high"} <= set(runs) and runs["score_ci_low"].notna().any():
        low = [max(0.0, y - lo) for y, lo in zip(ys, runs["score_ci_low"].astype(float))]
        high = [max(0.0, hi - y) for y, hi in zip(ys, runs["score_ci_high"].astype(float))]
        ax.errorbar(xs, ys, yerr=[low, high], ls="none", color=color, alpha=0.4, capsize=2, zorder=1)


def _covers_legend(ax, frame: pd.DataFrame) -> None:
    if any(covers_note(row) for _, row in frame.iterrows()):
        ax.plot([], [], marker="o", ls="none", mfc="white", mec="black", label=f"hollow: budget {COVERS}")


def draw_accuracy_vs_budget(frame: pd.DataFrame, title: str = ""):
    """Headline score vs KV budget (log2 axis): one line per method, variant and n, side by side (dodged);
    each full cache as a dashed line; 95% bootstrap intervals as error bars."""
    frame, chosen = choose_full(prepared(frame))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    markers, styles = method_markers(frame["cache"]), _variant_styles(frame)
    lines = series(frame)
    budgeted = [(key, runs) for key, runs in lines if key[0] != "full"]
    for key, runs in lines:
        if key[0] == "full":
            ax.axhline(runs["score"].mean(), ls="--", color=method_color("full"),
                       label=series_label(key, chosen.get(runs.index[0], 1)))
    for (key, runs), factor in zip(budgeted, dodge_factors(len(budgeted))):
        _points(ax, key, runs, runs["budget"] * factor, runs["score"], markers[key[0]], series_label(key),
                line=styles[key[1]], ci=True)
    _covers_legend(ax, frame)
    _log2_ticks(ax, frame.loc[frame["cache"] != "full", "budget"])
    ax.set_ylim(-3, 103)
    return _finish(fig, ax, frame, "KV budget (past tokens per head per layer)", "score (0-100)",
                   title or "Score vs KV budget", "methods dodged sideways at each budget; bars: 95% bootstrap")


def accuracy_vs_budget(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    return save(draw_accuracy_vs_budget(frame, title), out)


def draw_latency_scatter(frame: pd.DataFrame, title: str = ""):
    """TT2T (s) vs TPOT (ms), one point per run in its method's colour and marker, annotated with budget and
    score; labels alternate above and below their points, always to the right, so none leaves the axes."""
    frame, chosen = choose_full(prepared(frame))
    markers = method_markers(frame["cache"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = 0
    for key, runs in series(frame):
        _points(ax, key, runs, runs["tt2t_s"], 1000 * runs["tpot_s"], markers[key[0]],
                series_label(key, chosen.get(runs.index[0], 1)))
        for _, row in runs.iterrows():
            score = "-" if pd.isna(row.get("score")) else f"{row['score']:.1f}"
            note = f"b{_budget_text(row['budget'])}: {score}" if key[0] != "full" else score
            ax.annotate(note, (row["tt2t_s"], 1000 * row["tpot_s"]), textcoords="offset points",
                        xytext=(6, 5 if k % 2 == 0 else -12), fontsize=7, annotation_clip=False)
            k += 1
    _covers_legend(ax, frame)
    ax.margins(x=0.25, y=0.2)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    return _finish(fig, ax, frame, "time to second token, TT2T (s)", "time per output token, TPOT (ms)",
                   title or "TT2T vs TPOT (labels: budget: score)")


def latency_scatter(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    return save(draw_latency_scatter(frame, title), out)


def _stacked_bars(ax, labels: list[str], frame: pd.DataFrame, phases: list[str], horizontal: bool) -> list[float]:
    """One stacked bar per run (ms per output token in each phase), labelled with its total; returns the totals."""
    base, bars = [0.0] * len(labels), None
    for phase in phases:
        ms = (1000 * frame[f"breakdown/{phase}"].fillna(0.0)).tolist()
        draw = ax.barh if horizontal else ax.bar
        bars = draw(labels, ms, **{"left" if horizontal else "bottom": base}, color=PHASE_COLORS.get(phase),
                    label=phase)
        base = [b + m for b, m in zip(base, ms)]
    if bars is not None:
        ax.bar_label(bars, labels=[f"{b:.1f}" for b in base], fontsize=7, padding=2)
    return base


def draw_tpot_breakdown(frame: pd.DataFrame, title: str = ""):
    """Stacked bars from 0 per run, labelled with their total: milliseconds per output token in each decode
    phase; a run whose budget covered the prompt says so beside its label. Beyond :data:`MAX_COLUMN_BARS`
    runs the bars lie horizontally (one row each), so the figure's width stays fixed."""
    frame, labels = labelled_runs(frame)
    phases = [c.split("/", 1)[1] for c in frame.columns if c.startswith("breakdown/")]
    phases = [p for p in PHASE_COLORS if p in phases] + [p for p in phases if p not in PHASE_COLORS]
    horizontal = len(labels) > MAX_COLUMN_BARS
    size = (10, 1.5 + 0.26 * len(labels)) if horizontal else (max(4.0, 0.8 * len(labels) + 2), 4)
    fig, ax = plt.subplots(figsize=size)
    totals = _stacked_bars(ax, labels, frame, phases, horizontal)
    value_axis = ax.xaxis if horizontal else ax.yaxis
    (ax.set_xlim if horizontal else ax.set_ylim)(0, 1.15 * max(totals + [1e-9]))
    value_axis.set_major_locator(MaxNLocator(nbins=6, min_n_ticks=3))
    value_axis.set_label_text("time per output token (ms)")
    if horizontal:
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
    else:
        ax.tick_params(axis="x", rotation=45)
        plt.setp(ax.get_xticklabels(), ha="right", fontsize=8)
    ax.set_title(title or "TPOT breakdown per decode phase")
    legend_outside(ax)
    add_footer(fig, frame, "bar labels: total ms per token")
    return fig


def tpot_breakdown(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    return save(draw_tpot_breakdown(frame, title), out)


def recall_vs_layer(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Mean attention-mass recall per budgeted layer (``recall.json``), one panel per budget and one line per
    run with ``diagnostics=recall`` in its method's colour and marker; one legend for all panels, outside them."""
    frame = _sorted_runs(frame)
    markers = method_markers(frame["cache"])
    budgets = sorted({b for b in frame["budget"] if pd.notna(b)}) or [None]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets) + 2, 3.6), sharey=True, squeeze=False)
    handles = {}
    for _, row in frame.iterrows():
        recall = read_recall(row["run_dir"])
        if not recall or "recall" not in recall.get("per_layer", {}):
            continue
        ax = axes[0][budgets.index(row["budget"]) if row["budget"] in budgets else 0]
        label = series_label((row["cache"], row["variant"], row["n_drawn"], 0))
        (line,) = ax.plot(recall["layers"], recall["per_layer"]["recall"]["mean"], marker=markers[row["cache"]],
                          ms=3, color=method_color(row["cache"]), label=label)
        handles.setdefault(label, line)
    for ax, budget in zip(axes[0], budgets):
        ax.set_title(f"budget {_budget_text(budget)}" if budget is not None else "")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention-mass recall\n(mean over steps and heads)")
    axes[0][0].set_ylim(0, 1.02)
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title or "Attention-mass recall per layer")
    fig.tight_layout()
    add_footer(fig, frame)
    return save(fig, out)


def recall_vs_accuracy(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Score vs pooled attention-mass recall, one point per run with ``diagnostics=recall`` (a sweep over
    methods and budgets), annotated with the budget."""
    frame, chosen = choose_full(prepared(frame[frame["recall_mean"].notna()]))
    markers = method_markers(frame["cache"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, runs in series(frame):
        _points(ax, key, runs, runs["recall_mean"], runs["score"], markers[key[0]],
                series_label(key, chosen.get(runs.index[0], 1)))
        for _, row in runs.iterrows():
            if key[0] != "full":
                ax.annotate(f"b{_budget_text(row['budget'])}", (row["recall_mean"], row["score"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
    _covers_legend(ax, frame)
    ax.set_xlim(max(0.0, float(frame["recall_mean"].min()) - 0.05), 1.01)
    ax.set_ylim(-3, 103)
    return save(_finish(fig, ax, frame, "attention-mass recall (pooled mean)", "score (0-100)",
                        title or "Score vs attention-mass recall"), out)


def latency_by_length(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (latency run, context length) from the runs' ``metrics.json`` ``lengths`` entries:
    cache, budget, model, length, n_samples, tt2t_s, ttft_s, tpot_s and breakdown/<phase>."""
    rows = []
    for _, run in frame.iterrows():
        metrics, _ = read_results(Path(run["run_dir"]))
        for length, at in metrics.get("lengths", {}).items():
            rows.append({"cache": run["cache"], "budget": run["budget"], "model": run["model"], "length": int(length),
                         "variant": variant_text(run.get("variant")), "run_dir": run["run_dir"],
                         "n_samples": run.get("n_samples"), "budget_covers_context": run.get("budget_covers_context"),
                         **{k: v for k, v in at.items() if k != "breakdown"},
                         **{f"breakdown/{p}": v for p, v in at.get("breakdown", {}).items()}})
    return pd.DataFrame(rows)


def draw_decode_latency_vs_length(table: pd.DataFrame, title: str = ""):
    """TPOT (ms) vs context length (log2 axis), one line per run (method colour and marker, a line style per
    budget), dodged sideways."""
    table = prepared(table)
    fig, ax = plt.subplots(figsize=(7, 4))
    markers = method_markers(table["cache"])
    budgets = sorted({_budget_text(b) for b in table["budget"]})
    groups = list(table.groupby(["cache", "budget", "variant", "run_dir"], sort=False, dropna=False))
    for ((cache, budget, variant, _), runs), factor in zip(groups, dodge_factors(len(groups), 0.2)):
        runs = runs.sort_values("length")
        label = f"{run_label({'cache': cache, 'budget': budget, 'variant': variant})} ({n_text(runs['n_drawn'].iat[0])})"
        key = (cache, variant, None, 0)
        _points(ax, key, runs, runs["length"] * factor, 1000 * runs["tpot_s"], markers[cache], label,
                line=LINE_STYLES[budgets.index(_budget_text(budget)) % len(LINE_STYLES)])
    _covers_legend(ax, table)
    _log2_ticks(ax, table["length"])
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, table, "context length (tokens)", "decode latency per token, TPOT (ms)",
                   title or "Decode latency vs context length", "runs dodged sideways at each length")


def decode_latency_vs_length(table: pd.DataFrame, out: Path, title: str = "") -> Path:
    return save(draw_decode_latency_vs_length(table, title), out)


def passkey_panels(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The heat map's panels: label -> :func:`passkey_cells` per run (each panel states the n of its cells,
    the footer the settings all runs share); a run whose budget covered the prompt says so in its label."""
    ordered, labels = labelled_runs(runs, with_n=False)
    return {label: passkey_cells(row["run_dir"]).assign(shared_settings=row["shared_settings"])
            for label, (_, row) in zip(labels, ordered.iterrows())}


def figures(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Draws every figure the finished runs of a summary table support into ``out_dir``: complete runs and
    ``partial`` ones (a limit left samples out), the latter as series of their own labelled with their n."""
    finished = summary["status"].astype(str).str.startswith(("complete", "partial")) if len(summary) else []
    frame = summary[finished] if len(summary) else summary
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
            paths.append(passkey_heatmap(passkey_panels(runs), out / f"passkey_heatmap_{model}.png",
                                         f"Passkey accuracy by length and depth ({model})"))
    return paths


def make_all(results_dir: str | Path) -> list[Path]:
    """Writes ``<results_dir>/summary.csv`` and every figure into ``<results_dir>/figures``."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir() or not any(results_dir.rglob("config_hash")):
        raise FileNotFoundError(f"no run directories under {results_dir} (run `python run.py ...` first)")
    return figures(pd.read_csv(write_summary(results_dir)), results_dir / "figures")


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
