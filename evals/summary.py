"""Collects every run directory under a results folder into one table: ``python -m evals.summary results``.

Writes ``summary.csv`` (and ``summary.parquet`` when pyarrow is installed) with one row per run:
eval, model, cache, budget, headline score, per-task scores (``task/<name>``), TTFT/TT2T/TPOT, the
TPOT breakdown (``breakdown/<phase>``), peak memory, and the run directory. Run directories that are
still being written (no ``metrics.json`` yet, or unreadable JSON) are listed with ``status=incomplete``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import yaml


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_row(run_dir: Path) -> dict:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    row = {"eval": cfg.get("eval", {}).get("name"), "model": cfg.get("model", {}).get("name"),
           "cache": cfg.get("cache", {}).get("name"), "budget": cfg.get("budget"), "seed": cfg.get("seed"),
           "run_dir": str(run_dir)}
    metrics, timing = _read_json(run_dir / "metrics.json"), _read_json(run_dir / "timing.json")
    if metrics is None or timing is None:
        return {**row, "status": "incomplete"}
    row.update(status="complete", score=metrics.get("score"), n_samples=metrics.get("n_samples"))
    row.update({f"task/{t}": v for t, v in metrics.get("tasks", {}).items()})
    for key in ("ttft_s", "tt2t_s", "tpot_s", "tpot_p50_s", "tpot_p90_s", "peak_memory_bytes", "max_resident_tokens"):
        row[key] = timing.get(key)
    row.update({f"breakdown/{p}": v for p, v in timing.get("breakdown", {}).items()})
    effective = [v for v in timing.get("effective_tokens_per_layer", []) if v is not None]
    row["effective_tokens_mean"] = sum(effective) / len(effective) if effective else None
    return row


def collect(results_dir: str | Path) -> pd.DataFrame:
    runs = sorted(p.parent for p in Path(results_dir).rglob("config.yaml") if (p.parent / "config_hash").exists())
    return pd.DataFrame([run_row(r) for r in runs])


def write_summary(results_dir: str | Path) -> Path:
    frame = collect(results_dir)
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
    out = write_summary(args.results_dir)
    frame = pd.read_csv(out)
    cols = [c for c in ("eval", "model", "cache", "budget", "score", "tt2t_s", "tpot_s", "status") if c in frame]
    print(frame[cols].to_string(index=False) if len(frame) else "no run directories found")
    print(f"summary: {out}")


if __name__ == "__main__":
    main()
