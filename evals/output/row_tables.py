"""The committed benchmark rows as tables: what ``python -m evals.bench.ablation --table`` prints, and the
markdown of docs/results.md's benchmark sections (:mod:`evals.output.results_page`).

- Ablation-format JSON lines (``python -m evals.bench.ablation --out``: one row per configuration and sample):
  :func:`read_rows`, :func:`table`, :func:`ratio_to_full` and :func:`misses` are what ``evals.bench.ablation
  --table FILE ... [--ci] [--misses] [--alias ...]`` prints; :func:`ablation_markdown` writes the same numbers as
  one markdown table (a column per task, the suite's mean over tasks, the samples, the most past tokens attended
  per head, the live probe's columns where the rows have them, the ratio to full with its 95% paired interval) and
  the samples each configuration missed.
- A decode-benchmark JSON (``python -m evals.bench.decode --out``): :func:`decode_markdown`, one row per method and
  context length (the cell's medians over its repeats, its floor and its ratios to full) and each method's TPOT
  growth between the shortest and the longest context it ran.
- A search-bound JSON (``python -m evals.bench.search_bound --out``): :func:`search_bound_markdown`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from icecache.kv.timing import PHASES

from .pairing import percentile_interval, resample_means

BREAKDOWN = (*PHASES, "other")  # a decode cell's phases, ms per output token
TPOT = "tpot_p50_s"  # the decode benchmark's TPOT: the median per-token interval


def parse_aliases(specs: list[str]) -> list[tuple[str, str, str]]:
    """``[FILE:]OLD=NEW`` -> ``(file name or "", old label, new label)`` (:func:`read_rows`)."""
    out = []
    for spec in specs:
        label, sep, new = spec.rpartition("=")
        file, colon, old = label.partition(":")
        if not (colon and file.endswith(".jsonl")):  # no FILE: part
            file, old = "", label
        if not sep or not old or not new:
            raise SystemExit(f"--alias {spec!r}: expected [FILE:]OLD=NEW")
        out.append((file, old, new))
    return out


def read_rows(*paths: Path, aliases: list[tuple[str, str, str]] = ()) -> pd.DataFrame:
    """The rows of several ``--out`` files (runs of one grid split over processes, or of several seeds), a row
    measured twice counted once. ``aliases`` ``(file, old, new)`` rename a configuration in the files whose name
    is ``file`` (every file when ``""``), so that one configuration labelled differently in two files pools, or
    two configurations that share a label in two files (``icecache[default]`` before and after a default
    changed) stay apart."""
    frames = []
    for path in map(Path, paths):
        frame = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
        frame["config"] = frame["config"].replace({old: new for file, old, new in aliases if file in ("", path.name)})
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    rows = rows.drop_duplicates(subset=["config", "budget", "suite", "id"])
    rows["suite_name"] = rows["suite"].str.split("/").str[0]
    rows["budget"] = rows["budget"].fillna(0).astype(int)
    return rows


def ratio_to_full(rows: pd.DataFrame, draws: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per suite, configuration and budget: the score (mean over tasks of each task's mean, 0-100) on the samples
    that full also answered, full's score on the same samples, their ratio, and its 95% paired bootstrap interval
    (``draws`` resamples of the samples within each task, the same draw for both: the spread a sample of this size
    leaves on the ratio). The resampling and the percentile interval are the summary's
    (:func:`evals.output.pairing.resample_means`, :func:`evals.output.pairing.percentile_interval`); one generator
    seeded ``seed`` serves every cell in turn."""
    rng = np.random.default_rng(seed)
    full = rows[rows["config"] == "full"].set_index(["suite", "id"])["score"]
    out = []
    for (suite, config, budget), cell in rows[rows["config"] != "full"].groupby(["suite_name", "config", "budget"]):
        cell = cell[cell.set_index(["suite", "id"]).index.isin(full.index)]
        pairs = [np.stack([g["score"].to_numpy(float), full.loc[list(zip(g["suite"], g["id"]))].to_numpy(float)], 1)
                 for _, g in cell.groupby("task")]  # per task: [n, 2] (config, full)
        if not pairs:
            continue
        score, ref = np.mean([p.mean(0) for p in pairs], axis=0) * 100
        boot = np.mean(resample_means(pairs, draws, rng), axis=0)  # [draws, 2]
        ratios = boot[:, 0] / np.maximum(boot[:, 1], 1e-12)
        low, high = percentile_interval(ratios)
        out.append({"suite": suite, "config": config, "budget": budget, "n": len(cell), "score": score,
                    "full": ref, "ratio": score / ref if ref else float("nan"), "ci_low": low, "ci_high": high})
    return pd.DataFrame(out).set_index(["suite", "config", "budget"]).round(3)


def table(*paths: Path, aliases: list[tuple[str, str, str]] = ()) -> pd.DataFrame:
    """Accuracy (0-100) per configuration and budget: passkey, RULER niah (mean over tasks), and the most past
    tokens per head any budgeted layer attended on average over a step (:func:`read_rows`)."""
    rows = read_rows(*paths, aliases=aliases)
    per_task = rows.groupby(["config", "budget", "suite_name", "task"])["score"].mean().mul(100).reset_index()
    acc = per_task.groupby(["config", "budget", "suite_name"])["score"].mean().unstack("suite_name")
    acc["n"] = rows.groupby(["config", "budget"]).size()
    acc["max_attended"] = rows.groupby(["config", "budget"])["max_attended_per_head"].max()
    acc = acc.round(1)
    for name in ("recall_mean", "needle_share_mean"):  # rows measured with --probe (per suite)
        if name in rows and rows[name].notna().any():
            means = rows.groupby(["config", "budget", "suite_name"])[name].mean().unstack("suite_name")
            acc = acc.join(means.rename(columns=lambda suite: f"{suite}_{name.removesuffix('_mean')}").round(3))
    return acc.sort_index(level=["budget", "config"])


def misses(*paths: Path, aliases: list[tuple[str, str, str]] = ()) -> pd.DataFrame:
    """Every row scored below the full cache on the same sample (``full``: full's score), with its prediction and
    the commit that measured it, sorted by budget and configuration (``--misses``)."""
    rows = read_rows(*paths, aliases=aliases)
    full = rows[rows["config"] == "full"].set_index(["suite", "id"])["score"].rename("full")
    missed = rows[rows["config"] != "full"].join(full, on=["suite", "id"])
    missed = missed[missed["score"] < missed["full"]].copy()
    missed["prediction"] = missed["prediction"].map(lambda text: repr(text[:24]))
    columns = ["budget", "config", "suite", "id", "score", "full", "prediction",
               *(["commit"] if "commit" in rows else [])]
    if "commit" in rows:
        missed["commit"] = missed["commit"].str[:10]
    return missed[columns].sort_values(["budget", "config", "suite", "id"]).reset_index(drop=True)


def markdown(header: list[str], rows: list[list]) -> str:
    """A markdown table; ``None`` and NaN cells are left empty."""
    def cell(value) -> str:
        return "" if value is None or isinstance(value, float) and math.isnan(value) else str(value)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows]) + "\n"


def _num(value, digits: int = 1) -> str | None:
    return None if value is None or pd.isna(value) else f"{value:.{digits}f}"


def ablation_markdown(paths: list[Path], aliases: list[tuple[str, str, str]] = (), with_misses: bool = False,
                      draws: int = 2000) -> str:
    """One table of ablation rows (:func:`table` and :func:`ratio_to_full` side by side, with a column per task
    where a suite has several) and, with ``with_misses``, the samples each configuration scored below full."""
    rows = read_rows(*paths, aliases=aliases)
    acc, ratio = table(*paths, aliases=aliases), ratio_to_full(rows, draws)
    suites = list(dict.fromkeys(rows["suite_name"]))
    tasks = list(dict.fromkeys(rows["task"]))
    per_task = rows.groupby(["config", "budget", "task"])["score"].mean().mul(100)
    show_tasks = len(tasks) > len(suites)
    probes = [c for c in acc.columns if c.endswith(("_recall", "_needle_share"))]
    header = ["configuration", "budget", *(tasks if show_tasks else []),
              *[f"{s} (mean of tasks)" if show_tasks else s for s in suites], "n", "max attended",
              *[c.replace("_", " ") for c in probes], *[f"{s} / full [95% CI]" for s in suites]]
    body = []
    for (config, budget), r in acc.iterrows():
        cells = [f"`{config}`", budget or "-"]
        cells += [_num(per_task.get((config, budget, t))) for t in (tasks if show_tasks else [])]
        cells += [_num(r.get(s)) for s in suites] + [int(r["n"]), _num(r["max_attended"])]
        cells += [_num(r[c], 3) for c in probes]
        for s in suites:
            x = ratio.loc[(s, config, budget)] if (s, config, budget) in ratio.index else None
            cells.append(None if x is None else f"{x['ratio']:.3f} [{x['ci_low']:.3f}, {x['ci_high']:.3f}]")
        body.append(cells)
    text = markdown(header, body)
    if with_misses:
        missed = misses(*paths, aliases=aliases)
        lines = []
        for (budget, config), group in missed.groupby(["budget", "config"], sort=True):
            ids = [f"{r.suite.rpartition('/')[2]} {r.id}"
                   + ("" if r.score == 0 and r.full == 1 else f" ({r.score:g} < {r.full:g})")
                   for r in group.itertuples()]
            lines.append(f"- `{config}` at {budget} ({len(ids)}): " + ", ".join(ids))
        text += "\nSamples scored below full on the same sample (seed, id):\n\n" + ("\n".join(lines) or "none") + "\n"
    return text


def context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def decode_markdown(data: dict) -> str:
    """One row per method and context length of a decode-benchmark JSON (medians over a cell's repeats, ms per
    output token by phase), then each method's TPOT growth from its shortest to its longest context."""
    cells = {m: {int(n): r for n, r in rows.items() if "error" not in r} for m, rows in data.items()
             if m not in ("environment", "summary", "configurations")}
    failed = [f"{m} at {n}" for m, rows in data.items() if m not in ("environment", "summary", "configurations")
              for n, r in rows.items() if "error" in r]
    full = cells.get("full", {})
    header = ["method", "context", "TT2T s", "TPOT ms", *BREAKDOWN, "floor ms", "TPOT / floor", "TPOT / full",
              "TT2T / full", "device KV MiB", "peak RSS GiB", "repeats"]
    body = []
    for n in sorted({n for rows in cells.values() for n in rows}):
        for method, rows in cells.items():
            if (r := rows.get(n)) is None:
                continue
            ref = full.get(n)
            live = r.get("prefill", "live") == "live"  # a replayed prefill's TT2T leaves out the forward pass
            body.append([method, context(n), _num(r["tt2t_s"]) if live else None, _num(1000 * r[TPOT]),
                         *[_num(1000 * r["breakdown"].get(p, 0.0)) for p in BREAKDOWN],
                         _num(1000 * r["floor_s"]) if r.get("floor_s") else None, _num(r.get("tpot_over_floor"), 2),
                         _num(r[TPOT] / ref[TPOT], 2) if ref else None,
                         _num(r["tt2t_s"] / ref["tt2t_s"], 2) if ref and live else None,
                         _num(r["device_kv_bytes"] / 2**20) if r.get("device_kv_bytes") else None,
                         _num(r["peak_rss_bytes"] / 2**30, 2) if r.get("peak_rss_bytes") else None,
                         len(r.get("runs", [r]))])
    text = markdown(header, body)
    growth = []
    for method, rows in cells.items():
        if len(rows) < 2:
            continue
        a, b = rows[min(rows)], rows[max(rows)]
        growth.append([method, f"{context(min(rows))} -> {context(max(rows))}", _num(1000 * a[TPOT]),
                       _num(1000 * b[TPOT]), f"{1000 * (b[TPOT] - a[TPOT]):+.1f}", _num(b[TPOT] / a[TPOT], 2),
                       *[f"{1000 * (b['breakdown'].get(p, 0.0) - a['breakdown'].get(p, 0.0)):+.1f}"
                         for p in BREAKDOWN]])
    if growth:
        text += ("\nTPOT growth with the context (ms per output token; phases as above):\n\n" +
                 markdown(["method", "context", "TPOT from", "TPOT to", "growth", "growth x", *BREAKDOWN], growth))
    if len((data.get("configurations") or {}).get("row_sets", {})) > 1:
        text += ("\nTPOT / full by row set (`default`: each method's official setting; `dense=N`: every method with "
                 "exactly its first N layers dense):\n\n" + row_sets_markdown(data))
    if failed:
        text += "\nFailed cells: " + ", ".join(failed) + ".\n"
    return text


def dense_layers(cells: dict) -> str:
    """The dense-layer counts (``n_dense_layers``) of one label's measured cells, ``/``-joined ("" where none)."""
    counts = {r.get("n_dense_layers") for r in cells.values() if "error" not in r} - {None}
    return "/".join(map(str, sorted(counts)))


def row_sets_markdown(data: dict) -> str:
    """The equal-dense row sets of a decode-benchmark JSON (``--equal-dense``) as one row per method and set: its
    label, its dense layers (the rows' ``n_dense_layers``) and its median TPOT over full's at each length
    (``configurations.tpot_over_full``); a method already on a set's terms shows its default row there, and one
    that cannot be put on them says why."""
    configurations = data["configurations"]
    ratios = configurations["tpot_over_full"]
    lengths = sorted({int(L) for table in ratios.values() for cells in table.values() for L in cells})
    body = []
    for base in [b for b in configurations["row_sets"]["default"]["cells"] if b != "full"]:
        for name, row_set in configurations["row_sets"].items():
            label = row_set["cells"].get(base)
            if label is None:
                why = row_set.get("not_equalised", {}).get(base, "not measured")
                body.append([base, name, f"cannot be put on these terms: {why}", None, *[None] * len(lengths)])
                continue
            shown = label + (" (its default row)" if name != "default" and label == base else "")
            body.append([base, name, f"`{shown}`", dense_layers(data.get(label, {})) or None,
                         *[_num(ratios[name].get(base, {}).get(str(L)), 2) for L in lengths]])
    return markdown(["method", "row set", "row", "dense layers", *[context(L) for L in lengths]], body)


def search_bound_markdown(data: dict) -> str:
    """One row per capture of a search-bound JSON: the official search against a scan of as many keys as it
    scored (medians over the rounds, ms per layer and decode step)."""
    body = [[name, f"{r['keys_per_kv_head']:,}", f"{r['scored_per_query_head']:,.0f} ({r['scored_fraction']:.1%})",
             _num(r["search_ms"], 3), _num(r["scan_ms"], 3), _num(r["search_over_scan"]),
             _num(r["scan_ms"] * r["layers"])] for name, r in data["rows"].items()]
    return markdown(["capture", "keys per KV head", "keys scored per query head", "search ms", "scan ms",
                     "search / scan", "scan x budgeted layers, ms per token"], body)
