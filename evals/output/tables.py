"""Markdown tables of a results folder, one per experiment cell: ``python -m evals.output.tables DIR``.

Reads every run directory under ``DIR`` through :func:`evals.output.summary.collect` (so the scores, the 95%
bootstrap intervals and the paired differences to the full cache are the summary's) and prints, for each
cell -- the runs of one eval and model sharing every setting but the method and the budget (``eval.lengths``,
``seed``...) -- one table: a row per method (its name and any ``cache.*`` setting that differs), a column per
budget, each entry ``score [low, high]`` with the difference to full and its interval below it in
parentheses. Below it, each run's agreement with the full cache's output on the same samples where a full cache
run pairs (:mod:`evals.output.agreement`: answer match in %, mean tokens to divergence, ROUGE-L x 100, each with
its 95% bootstrap interval; the full cache's own row gives its mean output length). Then the samples each run
missed (ids and their score), IceCache's search
statistics where a run records them (``stat/search_scored_fraction``: the mean fraction of the indexed keys
a search scored; ``stat/search_nodes_expanded``), and the ``diagnostics=recall`` attention-mass recall on the
common layer set where the runs were probed. With ``--limited`` the runs made with ``limit=N`` are tabulated too,
a cell per limit, and a longer limited run also stands in each shorter limit's cell on its first samples (marked
``(first N of M)``), so that every method of a suite is compared on the same samples there. Nothing is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd

from ..registry import method_class
from .results import load_predictions
from .summary import collect, read_config, settings

DIFF_SIGNIFICANT = "*"  # marks a difference to full whose interval excludes 0
TITLE_SETTINGS = ("lengths", "depths", "num_samples", "tasks")  # eval settings named in a cell's title
CELL_IGNORED = ("diagnostics.name", "diagnostics.every")  # a probe reads only; it does not split a cell


def _fmt(x, digits: int = 0) -> str:
    return "-" if x is None or pd.isna(x) else f"{x:.{digits}f}"


def _setting(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def budget_text(value) -> str:
    """A budget as the tables print it: ``64`` for 64 tokens, ``0.1`` for 10% of each prompt."""
    return _setting(float(value))


def method_label(row: pd.Series) -> str:
    """The method's name and every ``cache.*`` setting of its run that differs from the method's default
    (e.g. ``topk[n_dense_layers=2]``), read from the run's ``config.yaml``. A suite's official setting of the
    method (``official_source``, conf/suite_cache/) counts as its default there: PQCache's 32 sinks on LongBench
    read as ``pqcache``, a value the user set in its place does not."""
    cfg = read_config(Path(row["run_dir"])) or {}
    options = {k: v for k, v in (cfg.get("cache") or {}).items() if k != "name"}
    defaults = method_defaults(str(row["cache"]))
    defaults.update({k: entry["value"] for k, entry in (cfg.get("official_source") or {}).items()
                     if isinstance(entry, dict) and "value" in entry})
    extra = [f"{k}={_setting(v)}" for k, v in sorted(options.items()) if k in defaults and defaults[k] != v]
    return f"{row['cache']}[{', '.join(extra)}]" if extra else str(row["cache"])


def method_defaults(name: str) -> dict:
    """The default of each init field of a registered method's class ({} for a name the registry lacks)."""
    try:
        cls = method_class(name)
    except Exception:  # a run of a method since removed or renamed: label it by its name alone
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.default is not dataclasses.MISSING}


def score_entry(row: pd.Series) -> str:
    """``score [low, high]`` and, for a method other than full, ``(diff [low, high])``."""
    text = f"{_fmt(row['score'])} [{_fmt(row.get('score_ci_low'))}, {_fmt(row.get('score_ci_high'))}]"
    if row["cache"] != "full" and not pd.isna(row.get("diff_to_full")):
        low, high = row.get("diff_ci_low"), row.get("diff_ci_high")
        mark = DIFF_SIGNIFICANT if not (pd.isna(low) or pd.isna(high)) and (low > 0 or high < 0) else ""
        text += f" ({row['diff_to_full']:+.0f} [{_fmt(low)}, {_fmt(high)}]{mark})"
    return text


def misses(run_dir: str | Path, first_n: int | None = None) -> str:
    """The samples of a run (of its first ``first_n``) that did not score 1: their ids (with the score where it is
    partial), or ``all N``."""
    rows = load_predictions(Path(run_dir) / "predictions.jsonl")[:first_n]
    missed = [r for r in rows if r["scores"]["score"] < 1]
    if missed and len(missed) == len(rows) and all(r["scores"]["score"] == 0 for r in missed):
        return f"all {len(rows)}"
    return ", ".join(r["id"] + (f" ({r['scores']['score']:.2f})" if r["scores"]["score"] > 0 else "")
                     for r in missed)


def cells(frame: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """The frame split by every non-method, non-budget setting (``eval``, ``model``, ``eval.*``, ``seed``...)."""
    limit = ["limit"] if "limit" in frame and frame["limit"].notna().any() else []  # limited runs: a cell per limit
    keys = ["eval", "model", "seed", *limit,
            *sorted(c for c in frame if c.startswith("eval.") and frame[c].notna().any())]
    keys = [k for k in keys if k in frame and k not in CELL_IGNORED]
    out = []
    columns = [frame[k].map(lambda v: "" if pd.isna(v) else str(v)) if k == "limit" else frame[k].astype(str)
               for k in keys]
    for values, group in frame.groupby(columns, sort=True):
        out.append(({k: v for k, v in zip(keys, values) if k != "limit" or v}, group))
    return out


def with_labels(group: pd.DataFrame) -> pd.DataFrame:
    """``group`` with a ``method`` column (:func:`method_label`)."""
    return group.assign(method=group.apply(method_label, axis=1))


def cell_table(group: pd.DataFrame) -> str:
    """One markdown table: a row per method, a column per budget."""
    budgets = sorted(group["budget"].dropna().unique())
    order = sorted(group["method"].unique(), key=lambda m: (m != "full", m))
    lines = ["| method | " + " | ".join(f"budget {budget_text(b)}" for b in budgets) + " |",
             "| --- |" + " --- |" * len(budgets)]
    for method in order:
        rows = group[group["method"] == method]
        entries = []
        for b in budgets:
            at = rows[rows["budget"] == b]
            if len(at):
                entries.append(score_entry(at.iloc[0]))
            elif method == "full" and len(rows):  # the full cache ignores the budget: one run stands for all
                entries.append(score_entry(rows.iloc[0]) + f" (run at {budget_text(rows.iloc[0]['budget'])})")
            else:
                entries.append("")
        lines.append(f"| {method} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def miss_list(group: pd.DataFrame) -> str:
    lines = []
    for _, row in group.sort_values(["method", "budget"]).iterrows():
        missed = misses(row["run_dir"], first_n(row))
        if missed:
            lines.append(f"- {row['method']} at {budget_text(row['budget'])} ({row['run_dir'].rsplit('/', 1)[-1]}"
                         f"{view_text(row)}): {missed}")
    return "\n".join(lines) or "- none"


def stat_table(group: pd.DataFrame, columns: dict[str, str], digits: int = 3) -> str | None:
    """``columns`` (frame column -> heading) per method and budget, or None where no run has them."""
    present = {c: h for c, h in columns.items() if c in group and group[c].notna().any()}
    if not present:
        return None
    rows = group[group[list(present)].notna().any(axis=1)].sort_values(["method", "budget"])
    lines = ["| method | budget | " + " | ".join(present.values()) + " |", "| --- | --- |" + " --- |" * len(present)]
    for _, row in rows.iterrows():
        lines.append(f"| {row['method']} | {budget_text(row['budget'])} | "
                     + " | ".join(_fmt(row[c], 0 if c in COUNT_COLUMNS else digits) for c in present) + " |")
    return "\n".join(lines)


AGREEMENT_HEADINGS = {"answer_match": ("answer match (%)", 0), "tokens_to_divergence": ("tokens to divergence", 1),
                      "rouge_l": ("ROUGE-L", 0)}  # summary column -> (heading, digits)
AGREEMENT_TITLE = ("Agreement with the full cache's output (same samples; answer match: % of final answers equal to "
                   "full's; tokens to divergence: mean generated tokens identical to full's before the first that "
                   "differs, full's own row = its mean output length; ROUGE-L: 100 x F1 against full's text; "
                   "95% intervals; - = not defined):")


def agreement_table(group: pd.DataFrame) -> str | None:
    """A row per run paired with a full cache run: its score, then each agreement mean ``mean [low, high]``
    (:data:`AGREEMENT_HEADINGS`) and the paired samples; None where no run of the cell is paired."""
    if "n_agreement" not in group or not group["n_agreement"].notna().any():
        return None
    rows = group[group["n_agreement"].notna()]
    rows = rows.assign(_full=rows["method"] != "full").sort_values(["_full", "method", "budget"])
    lines = ["| method | budget | score | " + " | ".join(h for h, _ in AGREEMENT_HEADINGS.values()) + " | n |",
             "| --- | --- | --- |" + " --- |" * len(AGREEMENT_HEADINGS) + " --- |"]
    for _, row in rows.iterrows():
        entries = ["-" if pd.isna(row.get(c)) else
                   f"{_fmt(row[c], d)} [{_fmt(row.get(c + '_ci_low'), d)}, {_fmt(row.get(c + '_ci_high'), d)}]"
                   for c, (_, d) in AGREEMENT_HEADINGS.items()]
        lines.append(f"| {row['method']} | {budget_text(row['budget'])} | {_fmt(row.get('score'))} | " + " | ".join(entries)
                     + f" | {int(row['n_agreement'])} |")
    return "\n".join(lines)


def short_commits(value) -> list[str]:
    """The commits of a run's ``commit`` entry (several for a run resumed across commits), each as its first
    7 characters, ``-dirty`` kept."""
    commits = "" if value is None or pd.isna(value) else str(value)
    return [c[:7] + ("-dirty" if c.endswith("-dirty") else "") for c in commits.replace(",", " ").split()]


def first_n(row: pd.Series) -> int | None:
    """The samples a view of a longer run holds (:func:`evals.output.pairing.first_n_views`), None for a run."""
    value = row.get("first_n")
    return None if value is None or pd.isna(value) else int(value)


def view_text(row: pd.Series) -> str:
    """`` (first N of M)`` for a view of a longer run, empty for a run."""
    return "" if first_n(row) is None else f" (first {first_n(row)} of {int(row['first_of'])})"


def run_at_commit(row: pd.Series) -> str:
    """``<run directory> @ <commit>`` of a run (its ``config.yaml`` holds the resolved configuration); the
    commits of a run resumed across commits joined by ``+``; a view of a longer run says which samples it holds."""
    return f"`{Path(row['run_dir']).name}`{view_text(row)} @ {'+'.join(short_commits(row.get('commit'))) or '-'}"


TASK_TITLE = ("Per task (the papers' Table 2 layout: each task's score, Avg. = the suite's score, their mean over "
              "tasks; attended = past tokens attended per head at a decode step, its median over the layers, which "
              "is a budgeted layer's where most layers are budgeted; min = the run's generation time in minutes, its "
              "samples' requests summed (`requests_s`: prefill and decode, without model loading and scoring); the "
              "run directory holds the run's resolved configuration, `config.yaml`):")


def task_table(group: pd.DataFrame) -> str | None:
    """A row per run: its score on each task of the suite (``task/<name>``; no column for a suite of one task), the
    average, the median layer's attended tokens (``effective_tokens_median``), the generation time in minutes where
    runs recorded it (``requests_s``; ``-`` for a view of a longer run's first samples) and the run directory;
    None when there is neither more than one task nor an attended count."""
    tasks = sorted(c for c in group if c.startswith("task/") and group[c].notna().any())
    attended = "effective_tokens_median" in group and group["effective_tokens_median"].notna().any()
    if len(tasks) < 2:
        if not attended:
            return None
        tasks = []
    rows = group.assign(_full=group["method"] != "full").sort_values(["_full", "method", "budget"])
    minutes = "requests_s" in group and group["requests_s"].notna().any()
    names = [t.split("/", 1)[1] for t in tasks] + ["Avg.", "attended", *(["min"] if minutes else []),
                                                   "run directory @ commit"]
    lines = ["| method | budget | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for _, row in rows.iterrows():
        cells = [_fmt(row[t], 1) for t in tasks] + [_fmt(row["score"], 1), _fmt(row.get("effective_tokens_median"))]
        if minutes:
            seconds = row.get("requests_s")
            cells.append("-" if first_n(row) is not None or seconds is None or pd.isna(seconds) else _fmt(seconds / 60, 1))
        cells.append(run_at_commit(row))
        lines.append(f"| {row['method']} | {budget_text(row['budget'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SEARCH_COLUMNS = {"stat/search_scored_fraction": "scored fraction (mean)",
                  "stat/search_scored_fraction_max": "max", "stat/search_nodes_expanded": "nodes expanded"}
RECALL_COLUMNS = {"recall_common_mean": "recall (common layers)", "recall_mean": "recall (own layers)",
                  "needle_share_mean": "needle share"}
COUNT_COLUMNS = ("stat/search_nodes_expanded",)


def render(results_dir: str | Path, draws: int = 2000, limited: bool = False) -> str:
    """The tables of every complete run under ``results_dir``; ``limited`` adds the finished runs of a ``limit``
    (the first ``limit`` samples of a suite, ``partial (limit=N)`` in the summary), each in a cell of its limit,
    and to the cell of each smaller limit the view of its first samples (:func:`evals.output.pairing.first_n_views`),
    so that every method of a suite stands on the same samples there."""
    frame = collect(results_dir, draws, views=limited)
    if frame.empty:
        return f"no run directories under {results_dir}"
    frame = frame[(frame["status"] == "complete") | (limited & frame["status"].str.startswith("partial"))]
    parts = []
    for key, group in cells(frame):
        group = with_labels(group)
        common = {k: v for k, v in settings(read_config(Path(group["run_dir"].iloc[0]))).items()
                  if k.startswith("eval.") and k not in key and k.split(".", 1)[1] in TITLE_SETTINGS}
        title = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in {**key, **common}.items())
        commits = ", ".join(sorted({c for value in group["commit"] for c in short_commits(value)}))
        n = group["n"] if "n" in group else group["n_samples"]  # without intervals (draws=0) no pairing counted n
        parts += [f"### {title}", f"n = {int(n.max())} samples per run; commit {commits}", "",
                  cell_table(group), ""]
        per_task = task_table(group)
        if per_task:
            parts += [TASK_TITLE, "", per_task, ""]
        agreement = agreement_table(group)
        if agreement:
            parts += [AGREEMENT_TITLE, "", agreement, ""]
        parts += ["Misses:", miss_list(group)]
        for heading, columns in (("IceCache search", SEARCH_COLUMNS), ("Attention-mass recall", RECALL_COLUMNS)):
            table = stat_table(group, columns)
            if table:
                parts += ["", f"{heading}:", "", table]
        parts.append("")
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir")
    parser.add_argument("--draws", type=int, default=2000, help="bootstrap resamples per interval")
    parser.add_argument("--limited", action="store_true", help="also tabulate finished runs made with limit=N")
    args = parser.parse_args(argv)
    if not Path(args.results_dir).is_dir():
        print(f"error: {args.results_dir} is not a folder of run directories", file=sys.stderr)
        sys.exit(2)
    print(render(args.results_dir, args.draws, args.limited))


if __name__ == "__main__":
    main()
