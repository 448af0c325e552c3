"""Collects every run directory under a results folder into one table: ``python -m evals.summary results``.

Writes ``summary.csv`` (and ``summary.parquet`` when pyarrow is installed) with one row per run:
eval, model, cache, budget, ``variant``, ``commit`` (the code that wrote the run's rows), headline score,
per-task scores (``task/<name>``), TTFT/TT2T/TPOT, the TPOT breakdown (``breakdown/<phase>``), peak memory,
the run directory and, for runs with
``diagnostics=recall``, the pooled attention-mass recall (``recall_mean``, ``error_mean``, ``needle_share_mean``,
``needle_top_mean``). Runs are keyed by their
whole config: every setting that differs between runs of one (eval, model) -- or, for ``cache.*``
options, of one (eval, model, cache) -- becomes a column of its own (``eval.question_via_decode``) and
part of the run's ``variant`` text, so figures never merge two different experiments. Runs that share a
label but whose methods were built differently (``resolved.json``: a default or preset changed between the
commits that wrote them) are told apart by the resolved fields that differ (:func:`split_by_resolved`), so
two configurations are never pooled under one label. Run directories
that are still being written (no ``metrics.json`` yet) are listed with ``status=incomplete``; a run whose
``config.yaml`` cannot be read is skipped with a one-line warning. Suites whose score is not a quality
number (latency: ``score_name: tpot_ms``) leave ``score`` empty and fill a column of that name.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml

from .results import METHOD_TOP_LEVEL, NON_SEMANTIC, canonical, read_resolved
from .schema import read_recall, read_results, recall_columns, score_columns, timing_columns

KEYS = ("eval", "model", "cache")  # with budget: the named axes of every figure


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
        if key in NON_SEMANTIC or key == "budget":
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items() if k != "name" or key not in KEYS})
        else:
            flat[key] = value
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flat.items()}


def run_row(run_dir: Path, cfg: dict, resolved: dict | None = None) -> dict:
    metrics, timing = read_results(run_dir)
    row = {**{k: cfg.get(k, {}).get("name") for k in KEYS}, "budget": canonical(cfg.get("budget")),
           "seed": cfg.get("seed"), "commit": commit_text(timing, resolved), "run_dir": str(run_dir)}
    if metrics is None or timing is None:
        return {**row, "status": "incomplete"}
    row.update({"status": "complete", **score_columns(metrics), "n_samples": metrics.get("n_samples")})
    return {**row, **timing_columns(timing), **recall_columns(read_recall(run_dir))}


def commit_text(timing: dict | None, resolved: dict | None) -> str | None:
    """The commit(s) whose code wrote a run's rows (``timing.json``'s ``commits``; before metrics exist the
    ``resolved.json`` provenance), 12 hex digits each, ``-dirty`` when tracked files were modified; None for
    a run written before commits were recorded."""
    versions = (timing or {}).get("commits")
    if not versions and isinstance((resolved or {}).get("provenance"), dict):
        prov = resolved["provenance"]
        versions = [f"{prov.get('commit', 'unknown')}{'-dirty' if prov.get('dirty') is True else ''}"]
    if not versions:
        return None
    return " ".join(sha[:12] + sep + rest for sha, sep, rest in (v.partition("-") for v in versions))


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


def collect(results_dir: str | Path) -> pd.DataFrame:
    """One row per run directory under ``results_dir`` (empty frame when there is none)."""
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
        row["variant"] = ", ".join(f"{k.split('.', 1)[-1]}={_text(f.get(k))}" for k in sorted(keys))
    split_by_resolved(rows, methods)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=[*KEYS, "budget", "seed", "commit", "run_dir",
                                                                  "status", "variant"])


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results")
    args = parser.parse_args(argv)
    if not Path(args.results_dir).is_dir():
        print(f"error: {args.results_dir} is not a folder of run directories", file=sys.stderr)
        sys.exit(2)
    frame = collect(args.results_dir)
    out = write_summary(args.results_dir, frame)
    cols = [c for c in ("eval", "model", "cache", "budget", "variant", "score", "tt2t_s", "tpot_s", "commit",
                        "status")
            if c in frame]
    print(frame[cols].to_string(index=False) if len(frame) else f"no run directories under {args.results_dir}")
    print(f"summary: {out}")


if __name__ == "__main__":
    main()
