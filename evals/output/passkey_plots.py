"""Passkey figures: accuracy over context length x needle depth per run (:func:`passkey_heatmap`), and the
grouped bars of ``make demo`` (:func:`passkey_accuracy_by_length`).

The heat map stays readable at any number of runs: up to :data:`MAX_PANELS` runs it is a grid of small
panels, at most :data:`MAX_COLUMNS` across (so its width is fixed); beyond that it becomes one matrix with a
row per run and a column per context length (accuracy averaged over depths, with its sample count).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .plot_style import add_footer, covers_note, method_color, save, sample_count  # noqa: E402
from .results import load_predictions  # noqa: E402

MAX_COLUMNS, MAX_PANELS = 4, 24
PANEL_IN = (2.9, 2.5)  # width, height of one panel (inches)
CELL_FONT, LABEL_FONT = 7, 8


def passkey_cells(run_dir: Path) -> pd.DataFrame:
    """Mean passkey accuracy (%) and sample count ``n`` per (length, depth) of one run, from its predictions,
    with the ``run_dir`` they came from (the heat map's footer reads its environment)."""
    rows = [{"length": r["meta"]["length"], "depth": r["meta"]["depth"], "score": 100 * r["scores"]["score"]}
            for r in load_predictions(Path(run_dir) / "predictions.jsonl")]
    return pd.DataFrame(rows).groupby(["length", "depth"], as_index=False).agg(
        score=("score", "mean"), n=("score", "size")).assign(run_dir=str(run_dir))


def _wrapped(label: str, width: int = 34) -> str:
    return "\n".join(textwrap.wrap(label, width)) or label


def _panel(ax, label: str, cells: pd.DataFrame):
    """One run's length x depth grid; each cell its accuracy, and its n where cells differ in n (else the
    title says the n every cell shares)."""
    grid = cells.pivot(index="depth", columns="length", values="score").sort_index()
    counts = cells.pivot(index="depth", columns="length", values="n").reindex_like(grid)
    image = ax.imshow(grid.to_numpy(), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns], fontsize=LABEL_FONT - 1)
    ax.set_yticks(range(grid.shape[0]), [f"{d:.0%}" for d in grid.index], fontsize=LABEL_FONT - 1)
    shared = {int(v) for v in counts.stack()}
    per_cell = len(shared) > 1
    for (i, j), v in pd.DataFrame(grid.to_numpy()).stack().items():
        n_cell = f"\nn={int(counts.iat[i, j])}" if per_cell else ""
        ax.text(j, i, f"{v:.0f}{n_cell}", ha="center", va="center", fontsize=CELL_FONT)
    n_note = "" if per_cell else f" (n={shared.pop()} per cell)" if shared else ""
    ax.set_title(_wrapped(label + n_note), fontsize=LABEL_FONT)
    return image


def _grid_figure(runs: dict[str, pd.DataFrame]):
    columns = min(len(runs), MAX_COLUMNS)
    rows = -(-len(runs) // columns)
    title_lines = max(_wrapped(label).count("\n") + 2 for label in runs)  # with the "(n=.. per cell)" note
    row_in = PANEL_IN[1] + 0.15 * title_lines
    fig, axes = plt.subplots(rows, columns, figsize=(PANEL_IN[0] * columns + 1.2, row_in * rows + 0.6),
                             squeeze=False)
    image = None
    for k, (ax, (label, cells)) in enumerate(zip(axes.flat, runs.items())):
        image = _panel(ax, label, cells)
        if k % columns == 0:
            ax.set_ylabel("needle depth", fontsize=LABEL_FONT)
        if k >= len(runs) - columns:
            ax.set_xlabel("context length (tokens)", fontsize=LABEL_FONT)
    for ax in list(axes.flat)[len(runs):]:
        ax.set_axis_off()
    fig.tight_layout(h_pad=1.2, w_pad=1.0)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy (%)", shrink=0.8)
    return fig


def _matrix_figure(runs: dict[str, pd.DataFrame]):
    """One row per run, one column per context length: accuracy averaged over depths, with its n."""
    lengths = sorted({int(x) for cells in runs.values() for x in cells["length"]})
    scores = np.full((len(runs), len(lengths)), np.nan)
    counts = np.zeros_like(scores)
    for i, cells in enumerate(runs.values()):
        for length, at in cells.groupby("length"):
            j = lengths.index(int(length))
            counts[i, j] = at["n"].sum()
            scores[i, j] = (at["score"] * at["n"]).sum() / counts[i, j]
    fig, ax = plt.subplots(figsize=(4.5 + 0.9 * len(lengths), 1.2 + 0.3 * len(runs)))
    image = ax.imshow(scores, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for (i, j), v in np.ndenumerate(scores):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.0f} (n={int(counts[i, j])})", ha="center", va="center", fontsize=CELL_FONT)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=LABEL_FONT)
    ax.set_yticks(range(len(runs)), [_wrapped(label, 70) for label in runs], fontsize=CELL_FONT)
    ax.set_xlabel("context length (tokens); accuracy averaged over needle depths")
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    return fig


def draw_passkey_heatmap(runs: dict[str, pd.DataFrame], title: str = ""):
    """The heat map figure of ``runs`` (label -> :func:`passkey_cells` frame); its footer names the dtype and
    hardware of the runs the cells came from."""
    fig = _grid_figure(runs) if len(runs) <= MAX_PANELS else _matrix_figure(runs)
    fig.suptitle(title or "Passkey accuracy by length and depth", fontsize=10,
                 y=1 + 0.2 / fig.get_size_inches()[1])  # just above the panels' own titles
    sources = pd.concat([cells.head(1) for cells in runs.values() if "run_dir" in cells and len(cells)]
                        or [pd.DataFrame(columns=["run_dir"])])
    add_footer(fig, sources, "cells: accuracy (%)")
    return fig


def passkey_heatmap(runs: dict[str, pd.DataFrame], out: Path, title: str = "") -> Path:
    """Passkey accuracy over context length (x) and needle depth (y) per run (:func:`draw_passkey_heatmap`)."""
    return save(draw_passkey_heatmap(runs, title), out)


def draw_passkey_accuracy_by_length(frame: pd.DataFrame, title: str = ""):
    """Grouped bars from 0: passkey accuracy (%) per context length, one bar per run, each labelled with its
    value (a 0 bar shows its "0"); the legend, with each run's n, sits below the axes; a run whose budget
    covered the prompt is hatched and says so."""
    tasks = sorted((c for c in frame.columns if c.startswith("task/passkey_")), key=lambda c: int(c.split("_")[-1]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(frame), 1)
    for i, (_, row) in enumerate(frame.iterrows()):
        xs = [j + i * width for j in range(len(tasks))]
        name = row["cache"] if row["cache"] == "full" else f"{row['cache']} (budget {row['budget']})"
        n, note = sample_count(row), covers_note(row)
        label = f"{name}, n={n if n is not None else '?'}" + (f" [{note}]" if note else "")
        bars = ax.bar(xs, [row[t] for t in tasks], width, label=label, color=method_color(row["cache"]),
                      edgecolor="black", linewidth=0.4, hatch="//" if note else None)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [t.split("_")[-1] + " tokens" for t in tasks])
    ax.set_ylabel("passkey accuracy (%)")
    ax.set_ylim(0, 112)
    ax.set_title(title or "Passkey retrieval per context length")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    add_footer(fig, frame, "bar labels: accuracy (%)")
    return fig


def passkey_accuracy_by_length(frame: pd.DataFrame, out: Path, title: str = "") -> Path:
    """Writes :func:`draw_passkey_accuracy_by_length` to ``out``."""
    return save(draw_passkey_accuracy_by_length(frame, title), Path(out))
