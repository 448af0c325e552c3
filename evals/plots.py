"""Figures from run summaries (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

METHOD_COLORS = {"full": "#333333", "streaming_llm": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#8c564b",
                 "pqcache": "#2ca02c", "omnikv": "#9467bd", "magicpig": "#e377c2", "quest": "#7f7f7f",
                 "topk": "#bcbd22", "icecache": "#d62728", "icecache_reuse": "#17becf"}


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
