"""Collects every run directory under a results folder into one table: ``python -m evals.summary results``.

Writes ``summary.csv`` (and ``summary.parquet`` when pyarrow is installed) with one row per run:
eval, model, cache, budget, ``variant``, headline score, per-task scores (``task/<name>``), TTFT/TT2T/TPOT,
the TPOT breakdown (``breakdown/<phase>``), peak memory, the run directory and, for runs with
``diagnostics=recall``, the pooled attention-mass recall (``recall_mean``, ``error_mean``, ``needle_share_mean``,
``needle_top_mean``). Runs are keyed by their
whole config: every setting that differs between runs of one (eval, model) -- or, for ``cache.*``
options, of one (eval, model, cache) -- becomes a column of its own (``eval.question_via_decode``) and
part of the run's ``variant`` text, so figures never merge two different experiments. Run directories
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

from .results import NON_SEMANTIC, canonical
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


def run_row(run_dir: Path, cfg: dict) -> dict:
    row = {**{k: cfg.get(k, {}).get("name") for k in KEYS},
           "budget": canonical(cfg.get("budget")), "seed": cfg.get("seed"), "run_dir": str(run_dir)}
    metrics, timing = read_results(run_dir)
    if metrics is None or timing is None:
        return {**row, "status": "incomplete"}
    row.update({"status": "complete", **score_columns(metrics), "n_samples": metrics.get("n_samples")})
    return {**row, **timing_columns(timing), **recall_columns(read_recall(run_dir))}


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
    rows, flat = [], []
    for stamp in sorted(Path(results_dir).rglob("config_hash")):
        cfg = read_config(stamp.parent)
        if cfg is not None:
            rows.append(run_row(stamp.parent, cfg))
            flat.append(settings(cfg))
    for row, f, keys in zip(rows, flat, differing_settings(rows, flat)):
        row.update({k: f.get(k) for k in sorted(keys)})
        row["variant"] = ", ".join(f"{k.split('.', 1)[-1]}={_text(f.get(k))}" for k in sorted(keys))
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=[*KEYS, "budget", "seed", "run_dir", "status",
                                                                  "variant"])


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
    cols = [c for c in ("eval", "model", "cache", "budget", "variant", "score", "tt2t_s", "tpot_s", "status")
            if c in frame]
    print(frame[cols].to_string(index=False) if len(frame) else f"no run directories under {args.results_dir}")
    print(f"summary: {out}")


if __name__ == "__main__":
    main()
