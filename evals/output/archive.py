"""Copies finished run directories into a folder meant to be committed: ``python -m evals.output.archive SRC DST``.

Every complete run directory under ``SRC`` (one with ``metrics.json``) is copied to the same relative path under
``DST`` with its ``config.yaml``, ``config_hash``, ``resolved.json``, ``metrics.json``, ``timing.json`` and
``recall.json``; its ``predictions.jsonl`` keeps every field of every row but the per-sample ``timing`` block
(the run-level ``timing.json`` keeps the timing summary, to which the archive adds the summed request time,
``requests_s``, where the run's code did not record it), which is most of the file's size. The archived
folder reads like any results folder: ``python -m evals.output.summary DST`` and
``python -m evals.output.tables DST`` give the same scores and intervals as on ``SRC``.

``--partial`` also copies the run directories still in progress (no ``metrics.json``: a long run stopped with its
machine), with their rows whole, timing included, so copying such a directory back under a results folder and
rerunning the same command resumes it from the committed rows (``cp -r DST/<eval>/<model>/<run> results/...``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .results import load_predictions, write_json
from .timing import requests_seconds

KEPT_FILES = ("config.yaml", "config_hash", "resolved.json", "metrics.json", "timing.json", "recall.json")
DROPPED_ROW_FIELDS = ("timing",)


def archive_run(run_dir: Path, target: Path, dropped: tuple[str, ...] = DROPPED_ROW_FIELDS) -> None:
    """Copies one run directory (see the module docstring) to ``target``, its rows without the ``dropped`` fields."""
    target.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, target / name)
    rows = load_predictions(run_dir / "predictions.jsonl")
    add_requests_time(target / "timing.json", rows)
    with open(target / "predictions.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k not in dropped}) + "\n")


def add_requests_time(timing_file: Path, rows: list[dict]) -> None:
    """Writes ``requests_s`` (:func:`evals.output.timing.requests_seconds` of the rows' per-sample timing) into a
    ``timing.json`` that lacks it, for runs written before it was recorded; rows without timing leave it as is."""
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else None
    timings = [r["timing"] for r in rows if r.get("timing")]
    if timing is None or timing.get("requests_s") is not None or len(timings) < len(rows):
        return
    timing["requests_s"] = requests_seconds(timings)
    write_json(timing_file, timing)


def archive(source: Path, destination: Path, partial: bool = False) -> list[Path]:
    """Archives every complete run directory under ``source`` (and, with ``partial``, every one in progress, rows
    whole); returns the directories written."""
    written = []
    for stamp in sorted(source.rglob("config_hash")):
        run_dir = stamp.parent
        complete = (run_dir / "metrics.json").exists()
        if not (complete or partial and (run_dir / "predictions.jsonl").exists()):
            continue
        target = destination / run_dir.relative_to(source)
        if not complete:
            (target / "metrics.json").unlink(missing_ok=True)
        archive_run(run_dir, target, DROPPED_ROW_FIELDS if complete else ())
        written.append(target)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--partial", action="store_true",
                        help="also copy runs in progress (rows whole, so a copy back resumes them)")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"error: {args.source} is not a folder of run directories", file=sys.stderr)
        sys.exit(2)
    written = archive(args.source, args.destination, args.partial)
    print(f"{len(written)} run directories archived under {args.destination}")


if __name__ == "__main__":
    main()
