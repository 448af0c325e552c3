"""Collects every run directory under a results folder into one table: ``python -m evals.output.summary results``.
:func:`print_run` is the short form of one run directory, the lines ``run.py`` prints after a run.

Writes ``summary.csv`` (and ``summary.parquet`` when pyarrow is installed) with one row per run:
eval, model, cache, budget, ``variant``, ``commit`` (the code that wrote the run's rows), headline score,
per-task scores (``task/<name>``), TTFT/TT2T/TPOT, the TPOT breakdown (``breakdown/<phase>``), peak memory,
the run directory, the agreement with the full cache's output (:mod:`evals.output.agreement`: ``answer_match``,
``tokens_to_divergence``, ``rouge_l``, their intervals, ``n_agreement``) and, for runs with ``diagnostics=recall``,
the pooled attention-mass recall (``recall_mean``, ``error_mean``, ``needle_share_mean``,
``needle_top_mean``). Runs are keyed by their
whole config: every setting that differs between runs of one (eval, model) -- or, for ``cache.*``
options, of one (eval, model, cache) -- becomes a column of its own (``eval.question_via_decode``) and
part of the run's ``variant`` text, so figures never merge two different experiments. Runs that share a
label but whose methods were built differently (``resolved.json``: a default or preset changed between the
commits that wrote them) are told apart by the resolved fields that differ (:func:`split_by_resolved`), so
two configurations are never pooled under one label. Run directories
that are still being written (no ``metrics.json`` yet) are listed with ``status=incomplete``, a run with
``limit`` that left samples of its suite out with ``status=partial (limit=N)`` (columns ``limit``, ``n_total``;
its variant names the limit, and the console's ``n`` reads ``n/n_total``); a run whose
``config.yaml`` cannot be read is skipped with a one-line warning. Suites whose score is not a quality
number (latency: ``score_name: tpot_ms``) leave ``score`` empty and fill a column of that name.

Uncertainty (:func:`add_intervals`), per complete run with a quality score, from its ``predictions.jsonl``:

- ``score_ci_low``/``score_ci_high``: a 95% percentile bootstrap interval of ``score`` over ``n`` samples.
- ``diff_to_full``/``diff_ci_low``/``diff_ci_high``: the run's score minus the full cache's score on the
  ``n_paired`` samples both answered (matched by sample id), with a 95% paired bootstrap interval (the same
  resample of sample ids for both); the full cache run is one with the same eval, model and every setting
  but ``cache.*``, the budget and :data:`~evals.output.pairing.PAIRING_IGNORED` (the one sharing most samples, then the one at
  the same budget). A full cache run is paired with itself (0, [0, 0]); without a full cache run to pair
  with, these stay empty.

A row's score is its ``scores.score`` (0-1). Each resample redraws the samples with replacement within
each stratum of the suite's own aggregate, keeping every stratum's size, and recomputes that aggregate
(:data:`AGGREGATES`), so the point estimate is the suite's score: passkey (and any suite on the default
:meth:`evals.task.Suite.aggregate`) 100 x the mean over tasks of each task's mean (stratum: task); GSM8K
100 x the mean over samples (one stratum); LongBench the mean over the English tasks present (the Chinese
ones when only those ran) of 100 x each task's mean rounded to 2 decimals (stratum: task); RULER the mean
over tasks of each task's mean over lengths of 100 x the (length, task) cell's mean rounded to 2 decimals
(stratum: length and task); LongGenBench 100 x the mean over the three kinds of pooled yes / pooled judged
checks (one stratum). Every statistic is on the 0-100 scale of ``score``. Each run's
resamples come from a generator seeded afresh (``--seed``, default 0; ``--draws`` resamples, default
2000), so an interval does not depend on which other runs the folder holds. The recomputed score equals
``metrics.json``'s (up to :data:`SCORE_TOLERANCE`: numpy's summation order may round a per-task mean the
other way); a run where it does not (written by another version of the suite's aggregate) gets no interval
and a warning.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np
import pandas as pd
import yaml

from .pairing import DRAWS, LEVEL, SEED, first_n_views, full_reference, percentile_interval, resample_means
from .results import (METHOD_TOP_LEVEL, NON_SEMANTIC, SET_ONLY, canonical, prediction_key,
                      read_resolved, run_predictions)
from .schema import (commit_text, limit_warning, read_recall, read_results, recall_columns, run_status,
                     sample_count, score_columns, timing_columns)

KEYS = ("eval", "model", "cache")  # with budget: the named axes of every figure
INTERVAL_COLUMNS = ("score_ci_low", "score_ci_high", "n", "diff_to_full", "diff_ci_low", "diff_ci_high", "n_paired")
# how far a score recomputed from the rows may be from metrics.json's: a per-task mean rounded to 2 decimals
# (LongBench, RULER) may round the other way when numpy sums in another order than the suite
SCORE_TOLERANCE = 0.01


def read_config(run_dir: Path) -> dict | None:
    """A run's ``config.yaml`` as a dict, or None (with a warning) when it is missing or malformed."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        if isinstance(cfg, dict) and all(isinstance(cfg.get(k, {}), dict) for k in KEYS):
            return cfg
        problem = "not a mapping of eval/model/cache settings"
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        problem = err.__class__.__name__
    print(f"warning: skipped {run_dir}: unreadable config.yaml ({problem})", file=sys.stderr)
    return None


def settings(cfg: dict) -> dict:
    """Every setting that defines what a run computed, flattened (``eval.question_via_decode``), apart
    from the named axes (eval, model and cache names, budget)."""
    flat = {}
    for key, value in canonical(cfg).items():
        if key in NON_SEMANTIC or key == "budget" or (key in SET_ONLY and value is None):
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items() if k != "name" or key not in KEYS})
        else:
            flat[key] = value
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flat.items()}


def run_row(run_dir: Path, cfg: dict, resolved: dict | None = None) -> dict:
    metrics, timing = read_results(run_dir)
    row = {**{k: cfg.get(k, {}).get("name") for k in KEYS}, "budget": canonical(cfg.get("budget")),
           "seed": cfg.get("seed"), "limit": cfg.get("limit"), "commit": commit_text(timing, resolved),
           "run_dir": str(run_dir), "status": run_status(metrics, timing, cfg.get("limit"))}
    if row["status"] == "incomplete":
        return row
    row.update({**score_columns(metrics), "n_samples": metrics.get("n_samples"), "n_total": metrics.get("n_total")})
    row["budget_covers_context"] = timing.get("budget_covers_context")  # samples that ran as full attention
    return {**row, **timing_columns(timing), **recall_columns(read_recall(run_dir))}


def resolved_settings(resolved: dict | None) -> dict | None:
    """A run's method as constructed (``resolved.json``), flattened as ``resolved.<field>`` (its name, budget
    and debug flag left out: named axes and a non-semantic switch); None for a run that did not record it."""
    method = (resolved or {}).get("method")
    if not isinstance(method, dict):
        return None
    return {f"resolved.{k}": json.dumps(v) if isinstance(v, (list, dict)) else v
            for k, v in canonical(method).items() if k != "name" and k not in METHOD_TOP_LEVEL}


def _resolved_differences(runs: list[tuple]) -> set[str]:
    """The ``resolved.*`` keys that differ between runs of one budget among ``(budget, resolved settings)``
    pairs, and ``resolved`` when a run without a record sits beside recorded ones at one budget. Runs at
    different budgets are not compared: a preset resolves per budget (IceCache's page size)."""
    keys: set[str] = set()
    for budget in {json.dumps(b, default=str) for b, _ in runs}:
        same = [m for b, m in runs if json.dumps(b, default=str) == budget]
        known = [m for m in same if m is not None]
        keys |= _varying(known, lambda k: True)
        if known and len(known) < len(same):
            keys.add("resolved")
    return keys


def split_by_resolved(rows: list[dict], methods: list[dict | None]) -> None:
    """Gives runs that share a label (eval, model, cache, variant) but whose methods were built differently
    distinct variants: the differing resolved fields are appended to their ``variant`` and filled in as
    ``resolved.<field>`` columns; a run without ``resolved.json`` beside recorded runs of its budget gets
    ``resolved=unrecorded``. Labels of runs whose methods agree are left as they are."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault((row["eval"], row["model"], row["cache"], row["variant"]), []).append(i)
    for members in groups.values():
        keys = _resolved_differences([(rows[i]["budget"], methods[i]) for i in members])
        fields = sorted(keys - {"resolved"})
        for i in members:
            if methods[i] is None:
                parts = ["resolved=unrecorded"] if "resolved" in keys else []
            else:
                rows[i].update({k: methods[i].get(k) for k in fields})
                parts = [f"{k.split('.', 1)[1]}={_text(methods[i].get(k))}" for k in fields]
            rows[i]["variant"] = ", ".join(p for p in (rows[i]["variant"], *parts) if p)


def _varying(configs: list[dict], prefix_filter) -> set[str]:
    keys = {k for c in configs for k in c if prefix_filter(k)}
    return {k for k in keys if len({json.dumps(c.get(k), default=str) for c in configs}) > 1}


def differing_settings(rows: list[dict], flat: list[dict]) -> list[set[str]]:
    """For each run, the settings that differ among the runs it is compared with: non-cache settings
    within its (eval, model), ``cache.*`` options within its (eval, model, cache)."""
    out = []
    for row in rows:
        peers = [f for r, f in zip(rows, flat) if (r["eval"], r["model"]) == (row["eval"], row["model"])]
        same_cache = [f for r, f in zip(rows, flat)
                      if (r["eval"], r["model"], r["cache"]) == (row["eval"], row["model"], row["cache"])]
        out.append(_varying(peers, lambda k: not k.startswith("cache.")) |
                   _varying(same_cache, lambda k: k.startswith("cache.")))
    return out


def _text(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------- bootstrap intervals
def _round2(x: np.ndarray) -> np.ndarray:
    return np.round(x, 2)


def _mean_over_tasks(m: dict) -> np.ndarray:
    return np.mean([100 * v[..., 0] for v in m.values()], axis=0)


def _pooled(m: dict) -> np.ndarray:
    return 100 * m[None][..., 0]


def _longbench(m: dict) -> np.ndarray:
    from ..tasks.longbench import CHINESE_TASKS, ENGLISH_TASKS

    english = [t for t in ENGLISH_TASKS if t in m]
    chosen = english or [t for t in CHINESE_TASKS if t in m]
    return np.mean([_round2(100 * m[t][..., 0]) for t in chosen], axis=0)


def _ruler(m: dict) -> np.ndarray:
    tasks: dict[str, list] = {}
    for (_, task), v in m.items():
        tasks.setdefault(task, []).append(_round2(100 * v[..., 0]))
    return np.mean([np.mean(cells, axis=0) for cells in tasks.values()], axis=0)


LONGGENBENCH_KINDS = ("once", "range", "periodic")


def _longgenbench_values(row: dict) -> list[float]:
    return [float(row["scores"][f"{k}_{part}"]) for k in LONGGENBENCH_KINDS for part in ("yes", "judged")]


def _longgenbench(m: dict) -> np.ndarray:
    v = m[None]
    accuracies = [np.divide(v[..., 2 * i], v[..., 2 * i + 1], out=np.zeros_like(v[..., 2 * i]),
                            where=v[..., 2 * i + 1] > 0) for i in range(len(LONGGENBENCH_KINDS))]
    return 100 * np.mean(accuracies, axis=0)


def _score_value(row: dict) -> list[float]:
    return [float(row["scores"]["score"])]


@dataclass(frozen=True)
class Aggregate:
    """A suite's headline score as a function of per-stratum means: each row belongs to a ``stratum`` and
    contributes ``values``; ``combine`` maps ``{stratum: mean values [..., k]}`` to the score ``[...]`` (0-100).
    A bootstrap resamples rows within each stratum, so every stratum keeps its size and weight."""

    stratum: Callable[[dict], Hashable]
    values: Callable[[dict], list[float]]
    combine: Callable[[dict], np.ndarray]


TASK_MEAN = Aggregate(lambda row: row["task"], _score_value, _mean_over_tasks)
# eval name -> how its metrics.json score is computed from the rows (:class:`Aggregate`); None: not a quality
# score (no interval); a suite not listed uses the default Suite.aggregate, the mean over tasks of task means
AGGREGATES: dict[str, Aggregate | None] = {
    "passkey": TASK_MEAN,
    "gsm8k": Aggregate(lambda row: None, _score_value, _pooled),
    "longbench": Aggregate(lambda row: row["task"], _score_value, _longbench),
    "ruler": Aggregate(lambda row: (int(row["meta"]["length"]), row["task"]), _score_value, _ruler),
    "longgenbench": Aggregate(lambda row: None, _longgenbench_values, _longgenbench),
    "latency": None,
}


def _strata(rows: Sequence[Sequence[dict]], aggregate: Aggregate) -> dict:
    """``{stratum: [n_s, k * len(rows)]}``: the values of aligned row lists (one list, or a run's and full's
    rows of the same samples), side by side, grouped by the first list's strata."""
    out: dict = {}
    for aligned in zip(*rows):
        out.setdefault(aggregate.stratum(aligned[0]), []).append([x for r in aligned for x in aggregate.values(r)])
    return {key: np.asarray(v, dtype=float) for key, v in out.items()}


def _split(means: dict, parts: int) -> list[dict]:
    """``{stratum: [..., k * parts]}`` -> one ``{stratum: [..., k]}`` per aligned row list."""
    return [{key: np.split(m, parts, axis=-1)[i] for key, m in means.items()} for i in range(parts)]


def bootstrap(rows: Sequence[Sequence[dict]], aggregate: Aggregate, draws: int = DRAWS,
              seed: int = SEED) -> tuple[list[float], list[np.ndarray]]:
    """The aggregate of each of the aligned row lists ``rows`` (point estimates) and its ``draws`` bootstrap
    replicates, ``[draws]`` each: the samples are resampled within each stratum, with one draw shared by the
    lists (a paired bootstrap when there are two), from ``np.random.default_rng(seed)``."""
    strata = _strata(rows, aggregate)
    keys = list(strata)
    point = {key: strata[key].mean(0) for key in keys}
    boot = dict(zip(keys, resample_means([strata[key] for key in keys], draws, np.random.default_rng(seed))))
    parts = len(rows)
    return ([float(aggregate.combine(m)) for m in _split(point, parts)],
            [aggregate.combine(m) for m in _split(boot, parts)])


def score_interval(rows: list[dict], aggregate: Aggregate, draws: int = DRAWS, seed: int = SEED,
                   level: float = LEVEL) -> dict:
    """``score`` (the suite's aggregate of ``rows``), ``score_ci_low``/``score_ci_high`` (its ``level``
    percentile bootstrap interval) and ``n``."""
    if not rows:
        return {"score": None, "score_ci_low": None, "score_ci_high": None, "n": 0}
    (point,), (boot,) = bootstrap([rows], aggregate, draws, seed)
    low, high = percentile_interval(boot, level)
    return {"score": point, "score_ci_low": low, "score_ci_high": high, "n": len(rows)}


def paired_difference(rows: list[dict], full_rows: list[dict], aggregate: Aggregate, draws: int = DRAWS,
                      seed: int = SEED, level: float = LEVEL) -> dict:
    """The aggregate of ``rows`` minus that of ``full_rows`` on the samples both hold (matched by ``id``):
    ``diff_to_full``, its ``level`` paired bootstrap interval ``diff_ci_low``/``diff_ci_high`` and ``n_paired``."""
    by_id = {r["id"]: r for r in full_rows}
    common = [r for r in rows if r["id"] in by_id]
    if not common:
        return {"diff_to_full": None, "diff_ci_low": None, "diff_ci_high": None, "n_paired": 0}
    (own, full), (own_boot, full_boot) = bootstrap([common, [by_id[r["id"]] for r in common]], aggregate, draws, seed)
    low, high = percentile_interval(own_boot - full_boot, level)
    return {"diff_to_full": own - full, "diff_ci_low": low, "diff_ci_high": high, "n_paired": len(common)}


def add_intervals(rows: list[dict], flat: list[dict], draws: int = DRAWS, seed: int = SEED,
                  cache: dict | None = None) -> None:
    """Fills :data:`INTERVAL_COLUMNS` of every finished run whose eval has a quality score (the module
    docstring says what each is), reading each run's ``predictions.jsonl`` (into ``cache``, a dict by run directory
    shared with :func:`evals.output.agreement.add_agreement`); the others keep them empty."""
    loaded: dict[int, list[dict]] = {}
    cache = {} if cache is None else cache
    for i, row in enumerate(rows):
        aggregate = AGGREGATES.get(row["eval"], TASK_MEAN)
        if row.get("status", "incomplete") == "incomplete" or aggregate is None or (
                row.get("score") is None and row.get("first_n") is None):
            continue
        preds = cache[prediction_key(row)] = run_predictions(row)
        try:
            interval = score_interval(preds, aggregate, draws, seed)
        except (KeyError, TypeError, ValueError) as err:
            print(f"warning: {row['run_dir']}: no interval (a row without {err})", file=sys.stderr)
            continue
        if row.get("first_n") is not None and interval["score"] is not None:  # a view: its score is its rows'
            row["score"] = interval["score"]
        if interval["score"] is None or abs(interval["score"] - row["score"]) > SCORE_TOLERANCE:
            print(f"warning: {row['run_dir']}: score recomputed from predictions.jsonl ({interval['score']}) differs "
                  f"from metrics.json ({row['score']}): no interval", file=sys.stderr)
            continue
        loaded[i] = preds
        row.update({k: v for k, v in interval.items() if k != "score"})
    for i, preds in loaded.items():
        if (ref := full_reference(i, rows, flat, loaded)) is not None:
            rows[i].update(paired_difference(preds, loaded[ref], AGGREGATES.get(rows[i]["eval"], TASK_MEAN), draws,
                                             seed))



def collect(results_dir: str | Path, draws: int = DRAWS, seed: int = SEED,
            views: bool = False) -> pd.DataFrame:
    """One row per run directory under ``results_dir`` (empty frame when there is none), with the bootstrap
    intervals of :func:`add_intervals` and the agreement with the full cache (``draws`` resamples seeded ``seed``;
    ``draws=0``: neither, no ``predictions.jsonl`` is read). ``views`` adds the rows of
    :func:`evals.output.pairing.first_n_views` (with ``draws > 0`` only: a view's score is recomputed from its rows)."""
    rows, flat, methods = [], [], []
    for stamp in sorted(Path(results_dir).rglob("config_hash")):
        cfg = read_config(stamp.parent)
        if cfg is not None:
            resolved = read_resolved(stamp.parent)
            rows.append(run_row(stamp.parent, cfg, resolved))
            flat.append(settings(cfg))
            methods.append(resolved_settings(resolved))
    for row, f, keys in zip(rows, flat, differing_settings(rows, flat)):
        row.update({k: f.get(k) for k in sorted(keys)})
        row["variant"] = ", ".join(f"{k.split('.', 1)[-1]}={_text(f.get(k))}" for k in sorted(keys)
                                   if k not in SET_ONLY or f.get(k) is not None)  # a whole run: no "limit=null"
    split_by_resolved(rows, methods)
    from .agreement import AGREEMENT_COLUMNS, add_agreement  # (it builds on this module)
    if views and draws > 0:
        made = first_n_views(rows, flat)
        rows, flat = rows + [v for v, _ in made], flat + [f for _, f in made]
    if draws > 0:
        cache: dict = {}  # each predictions.jsonl read once
        add_intervals(rows, flat, draws, seed, cache)
        add_agreement(rows, flat, draws, seed, cache)
    if rows:
        frame = pd.DataFrame(rows)
        for count in ("n", "n_paired", "n_agreement", "limit", "n_total"):  # counts stay integers beside runs without
            if count in frame:
                frame[count] = frame[count].astype("Int64")
        if "score" in frame:  # the intervals, then the agreement with full, beside the score they qualify
            beside = [c for c in (*INTERVAL_COLUMNS, *AGREEMENT_COLUMNS) if c in frame]
            rest = [c for c in frame if c not in beside]
            at = rest.index("score") + 1
            frame = frame[rest[:at] + beside + rest[at:]]
        return frame
    return pd.DataFrame(columns=[*KEYS, "budget", "seed", "commit", "run_dir", "status", "variant"])


def write_summary(results_dir: str | Path, frame: pd.DataFrame | None = None) -> Path:
    """Writes ``summary.csv`` (and ``.parquet``) of ``frame`` (default: :func:`collect`)."""
    frame = collect(results_dir) if frame is None else frame
    out = Path(results_dir) / "summary.csv"
    frame.to_csv(out, index=False)
    try:
        frame.to_parquet(out.with_suffix(".parquet"), index=False)
    except ImportError:
        pass
    return out


def print_run(run_dir: Path) -> None:
    metrics, timing = read_results(run_dir)
    ms = lambda s: "-" if s is None else f"{1000 * s:.1f} ms"  # noqa: E731
    score = metrics.get("score")
    print(f"{metrics.get('score_name', 'score')} {'-' if score is None else f'{score:.1f}'} "
          f"({metrics.get('n_samples', '?')} samples)  " +
          "  ".join(f"{t} {v:.1f}" for t, v in metrics.get("tasks", {}).items()))
    print(f"TTFT {ms(timing['ttft_s'])}  TT2T {ms(timing['tt2t_s'])}  TPOT {ms(timing['tpot_s'])} "
          f"(p50 {ms(timing['tpot_p50_s'])}, p90 {ms(timing['tpot_p90_s'])})  " +
          "  ".join(f"{k} {ms(v)}" for k, v in timing.get("breakdown", {}).items()))
    if metrics.get("limit") is not None:
        print(limit_warning(metrics["limit"], metrics.get("n_samples", 0), metrics.get("n_total")), file=sys.stderr)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results")
    parser.add_argument("--draws", type=int, default=DRAWS, help="bootstrap resamples per interval (0: none)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of every run's bootstrap resamples")
    args = parser.parse_args(argv)
    if not Path(args.results_dir).is_dir():
        print(f"error: {args.results_dir} is not a folder of run directories", file=sys.stderr)
        sys.exit(2)
    from .agreement import AGREEMENT_MEANS
    frame = collect(args.results_dir, args.draws, args.seed)
    out = write_summary(args.results_dir, frame)
    cols = [c for c in ("eval", "model", "cache", "budget", "variant", "score", *INTERVAL_COLUMNS, *AGREEMENT_MEANS,
                        "tt2t_s", "tpot_s", "commit", "status")
            if c in frame or c == "n"]
    missing = pd.Series([None] * len(frame), index=frame.index, dtype=object)
    counts = [sample_count(n, t) for n, t in zip(frame.get("n_samples", missing), frame.get("n_total", missing))]
    shown = frame.assign(n=counts)[cols].round({**{c: 1 for c in AGREEMENT_MEANS}, **{c: 2 for c in (  # (CSV: all)
        "score", "score_ci_low", "score_ci_high", "diff_to_full", "diff_ci_low", "diff_ci_high")}})
    print(shown.to_string(index=False) if len(frame) else f"no run directories under {args.results_dir}")
    print(f"summary: {out}")


if __name__ == "__main__":
    main()
