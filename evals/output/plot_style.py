"""What every figure of :mod:`evals.output.plots` shares: a colour and a marker per method, small horizontal
offsets (dodge) so that methods with equal values never hide one another, the series a set of runs is drawn
as (runs whose sample counts differ are never one series), the rule that picks one full-cache run, the
"covers the context" flag and the footer naming n, dtype and hardware.
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .results import read_resolved  # noqa: E402
from .schema import read_results  # noqa: E402

METHOD_COLORS = {"full": "#333333", "streaming_llm": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#8c564b",
                 "pqcache": "#2ca02c", "omnikv": "#9467bd", "magicpig": "#e377c2", "quest": "#7f7f7f",
                 "topk": "#bcbd22", "icecache": "#d62728", "icecache_reuse": "#17becf", "arkvale": "#aec7e8",
                 "kvpress": "#98df8a"}
METHOD_MARKERS = {"full": "o", "streaming_llm": "s", "h2o": "v", "snapkv": "<", "pqcache": "D", "omnikv": "p",
                  "magicpig": "h", "quest": ">", "topk": "X", "icecache": "^", "icecache_reuse": "P",
                  "arkvale": "d", "kvpress": "8"}
SPARE_MARKERS = "*H+x12348"  # methods without a marker of their own, in order of first appearance
FULL_RULE = "most samples"  # of several full-cache runs of one configuration, the one drawn
COVERS = "covers the context"
DPI = 120
FOOTER = "footer"  # the gid of a figure's footer text


SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354",
                "#756bb1", "#636363", "#9c9ede", "#cedb9c")  # methods without a colour of their own


def method_color(cache: str) -> str:
    """A method's colour (:data:`METHOD_COLORS`); another method gets a fixed one of :data:`SPARE_COLORS`."""
    return METHOD_COLORS.get(cache) or SPARE_COLORS[zlib.crc32(str(cache).encode()) % len(SPARE_COLORS)]


def method_markers(caches) -> dict[str, str]:
    """A marker per method: its own (:data:`METHOD_MARKERS`), else a spare one no listed method uses."""
    out, spare = {}, iter(SPARE_MARKERS * 4)
    for cache in dict.fromkeys(caches):
        out[cache] = METHOD_MARKERS.get(cache) or next(spare)
    return out


def variant_text(variant) -> str:
    return "" if variant is None or pd.isna(variant) else str(variant)


def sample_count(row) -> int | None:
    """The samples behind a run's score: the summary's ``n`` (rows with a score), else ``n_samples``."""
    for key in ("n", "n_samples"):
        value = row.get(key) if hasattr(row, "get") else None
        if value is not None and not pd.isna(value):
            return int(value)
    return None


def n_text(n) -> str:
    return "n=?" if n is None or pd.isna(n) else f"n={int(n)}"


def covered_samples(row) -> int:
    """Samples of a run whose prompt fit in its budget (``budget_covers_context``): they ran as full attention."""
    value = row.get("budget_covers_context") if hasattr(row, "get") else None
    return 0 if value is None or pd.isna(value) else int(value)


def covers_note(row) -> str:
    """``covers the context`` (every sample) or ``covers the context in k/n`` ('' when the budget is below it)."""
    covered, n = covered_samples(row), sample_count(row)
    if covered == 0 or row.get("cache") == "full":
        return ""
    return COVERS if n is not None and covered >= n else f"{COVERS} in {covered}/{n if n is not None else '?'}"


def setting_parts(variant: str) -> list[str]:
    """``a=1, lengths=[256, 512]`` -> ``["a=1", "lengths=[256, 512]"]`` (commas inside values kept)."""
    return [p for p in re.split(r", (?=[\w.]+=)", variant) if p]


def without_shared(variants: list[str]) -> tuple[list[str], str]:
    """The variants with the settings every one of them shares left out, and those shared settings as text:
    labels name only what tells runs apart (the footer names the rest). Distinct variants stay distinct."""
    parts = [setting_parts(v) for v in variants]
    shared = [p for p in parts[0] if all(p in other for other in parts)] if parts else []
    return [", ".join(p for p in ps if p not in shared) for ps in parts], ", ".join(shared)


def prepared(frame: pd.DataFrame) -> pd.DataFrame:
    """Numeric budgets, a ``variant`` text column (less the settings all runs share, kept in
    ``shared_settings`` for the footer) and an ``n_drawn`` sample count per run, ordered full cache first,
    then by method, variant and budget."""
    frame = frame.assign(budget=pd.to_numeric(frame["budget"], errors="coerce"))
    variants, shared = without_shared([variant_text(v) for v in frame.get("variant", [""] * len(frame))])
    frame = frame.assign(variant=variants, shared_settings=shared,
                         n_drawn=[sample_count(row) for _, row in frame.iterrows()])
    order = sorted(range(len(frame)), key=lambda i: (frame["cache"].iat[i] != "full", frame["cache"].iat[i],
                                                     frame["variant"].iat[i], frame["budget"].fillna(-1).iat[i]))
    return frame.iloc[order]


def choose_full(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Of the full-cache runs of one configuration (the full cache ignores the budget, so a budget sweep
    repeats it), keeps the one with the most samples (ties: the first in order); returns the kept frame and,
    per kept full run's index, how many runs it was chosen from."""
    full = frame[frame["cache"] == "full"]
    keep, chosen_from = [], {}
    same = [c for c in ("eval", "model", "variant", "length") if c in frame]
    for _, runs in full.groupby(same, sort=False, dropna=False):
        best = runs.assign(_n=runs["n_drawn"].fillna(-1)).sort_values("_n", ascending=False, kind="stable").index[0]
        keep.append(best)
        chosen_from[best] = len(runs)
    return frame[(frame["cache"] != "full") | frame.index.isin(keep)], chosen_from


def series(frame: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    """The lines of a figure: runs of one method and variant with one sample count; a second run at a budget
    already in the line (another results folder) starts a series of its own (``#2``)."""
    out = []
    for (cache, variant, n), runs in frame.groupby(["cache", "variant", "n_drawn"], sort=False, dropna=False):
        repeat = runs.groupby("budget", dropna=False).cumcount()
        for k in sorted(set(repeat)):
            out.append(((cache, variant, None if pd.isna(n) else int(n), int(k)), runs[repeat == k]))
    return out


def series_label(key: tuple, chosen_from: int = 1) -> str:
    """``icecache [variant] (n=10)``; a full cache chosen among several runs says by which rule."""
    cache, variant, n, repeat = key
    name = "full cache" if cache == "full" else cache
    note = f"; {FULL_RULE} of {chosen_from} runs" if chosen_from > 1 else ""
    label = f"{name} [{variant}]" if variant else name
    return f"{label} ({n_text(n)}{note})" + (f" #{repeat + 1}" if repeat else "")


def dodge_factors(count: int, spread: float = 0.35) -> list[float]:
    """Multiplicative x offsets on a log2 axis for ``count`` series, centred on 1 and at most ``spread``
    octaves wide in all, so that equal points of different methods sit side by side."""
    if count <= 1:
        return [1.0] * count
    step = min(0.07, spread / (count - 1))
    return [2 ** ((i - (count - 1) / 2) * step) for i in range(count)]


def run_environment(run_dir) -> dict:
    """A run's environment: ``resolved.json``'s ``provenance.environment``, else ``timing.json``'s."""
    provenance = (read_resolved(Path(run_dir)) or {}).get("provenance")
    if isinstance(provenance, dict) and isinstance(provenance.get("environment"), dict):
        return provenance["environment"]
    _, timing = read_results(Path(run_dir))
    return (timing or {}).get("environment") or {}


def hardware_text(env: dict) -> str:
    if not env:
        return "unrecorded"
    device = str(env.get("device") or "?")
    chip = env.get("gpu") or " ".join(filter(None, (env.get("cpu_model"), env.get("cpu_signature"))))
    return f"{chip} ({device})" if chip else device


def _one_or_mixed(values: list[str]) -> str:
    distinct = sorted(set(values))
    return distinct[0] if len(distinct) == 1 else f"mixed ({'; '.join(distinct)})" if distinct else "unrecorded"


def provenance_footer(frame: pd.DataFrame) -> str:
    """``dtype bfloat16 | hardware AMD EPYC (cpu)`` over the runs of a figure; ``mixed (...)`` where they differ."""
    envs = [run_environment(d) for d in frame["run_dir"]] if "run_dir" in frame else []
    dtypes = [str(e.get("dtype") or "unrecorded").removeprefix("torch.") for e in envs]
    return f"dtype {_one_or_mixed(dtypes)} | hardware {_one_or_mixed([hardware_text(e) for e in envs])}"


def add_footer(fig, frame: pd.DataFrame, extra: str = "") -> None:
    """The footer line under a figure: what n counts, dtype and hardware, and any note of the figure."""
    shared = frame["shared_settings"].iat[0] if "shared_settings" in frame and len(frame) else ""
    parts = ["n = samples per run", provenance_footer(frame), f"all runs: {shared}" if shared else "", extra]
    fig.text(0.01, 0.0, " | ".join(p for p in parts if p), ha="left", va="top", fontsize=7, color="#444444",
             gid=FOOTER)


def footer_text(fig) -> str:
    """The footer line of a figure drawn by :func:`add_footer` ('' when it has none)."""
    return next((t.get_text() for t in fig.texts if t.get_gid() == FOOTER), "")


def _place_footer(fig) -> None:
    """Moves the footer under everything else the figure draws (outside legends, rotated labels)."""
    footer = [t for t in fig.texts if t.get_gid() == FOOTER]
    if not footer:
        return
    footer[0].set_visible(False)
    fig.set_dpi(DPI)  # text extents measured at the resolution the file is written at
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    width, height = fig.get_size_inches()
    footer[0].set_position((box.x0 / width, (box.y0 - 0.1) / height))
    footer[0].set_visible(True)


def legend_outside(ax, **kwargs) -> None:
    """The legend to the right of the axes, where it never covers a point or a bar."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def save(fig, out: Path) -> Path:
    """Saves a figure (tight bounding box: footers, outside legends and long labels are never clipped)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _place_footer(fig)
    fig.savefig(out, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return out
