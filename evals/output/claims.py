"""The IceCache paper's claims beside this harness's committed rows: ``python -m evals.output.claims``.

Each claim compares two configurations of one suite (Mao et al., ICLR 2026: the LongBench table of the project
page, Llama-3.1-8B-Instruct and Mistral-7B-Instruct-v0.2, and the GSM8K "10% budget" sentence of the abstract).
Here both configurations are read from the committed run directories under ``reference_results/paper/<suite>``:
their scores, and the difference between them with its 95% paired bootstrap interval over the samples both ran
(the summary's :func:`~evals.output.summary.paired_difference`, resampled within each task). "Resolved" says
whether that interval excludes 0; the sign of the difference is compared with the paper's. A claim whose rows
are not committed yet says which run is missing.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from .pairing import DRAWS
from .results import load_predictions
from .summary import AGGREGATES, collect, paired_difference
from .tables import method_label

ROOT = Path(__file__).resolve().parents[2]
FOLDER = Path("reference_results") / "paper"


@dataclass(frozen=True)
class Claim:
    text: str
    suite: str
    ours: tuple[str, float, int | None]  # (cache, budget, limit) of the first configuration
    other: tuple[str, float, int | None]  # ... and of the one it is compared with
    paper: str  # the paper's numbers, first vs other


CLAIMS = (
    Claim("IceCache at 64 tokens matches or beats PQCache at 256 on LongBench", "longbench",
          ("icecache", 64, None), ("pqcache", 256, None),
          "Avg. 47.8 vs 47.3 (Llama-3.1-8B); 39.0 vs 37.4 (Mistral-7B)"),
    Claim("IceCache at 256 tokens keeps about 99% of the full cache on LongBench", "longbench",
          ("icecache", 256, None), ("full", 256, None),
          "Avg. 49.0 vs 49.5 (Llama-3.1-8B, 99.0%); 41.7 vs 42.2 (Mistral-7B, 98.8%)"),
    Claim("IceCache at 64 tokens keeps about 97% of the full cache on LongBench", "longbench",
          ("icecache", 64, None), ("full", 64, None),
          "Avg. 47.8 vs 49.5 (Llama-3.1-8B, 96.6%); 39.0 vs 42.2 (Mistral-7B, 92.4%)"),
    Claim("IceCache(reuse) stays close to IceCache on LongBench (256 tokens)", "longbench",
          ("icecache_reuse", 256, None), ("icecache", 256, None),
          "about 97% vs 99% of the full cache (read off the latency figure; no table row)"),
    Claim("On GSM8K-CoT at a 10% budget IceCache beats PQCache", "gsm8k",
          ("icecache", 0.1, 50), ("pqcache", 0.1, 50), "47.3 vs about 46.1 (+1.2 points; model not stated)"),
)


def find_run(frame, cache: str, budget: float, limit: int | None):
    """The finished run of ``cache`` at ``budget`` (the full cache: at any budget) and ``limit`` in a summary frame
    whose label is the bare method name (its official configuration), or None."""
    same_budget = (frame["budget"].astype(float) == float(budget)) | (cache == "full")
    rows = frame[(frame["cache"] == cache) & same_budget & (frame["status"] != "incomplete")]
    rows = rows[rows["limit"].isna()] if limit is None else rows[rows["limit"] == limit]
    rows = rows[[method_label(row) == cache for _, row in rows.iterrows()]]
    return None if rows.empty else rows.iloc[0]


def _label(cache: str, budget: float, limit: int | None) -> str:
    return f"{cache} at {budget:g}" + (f" (first {limit})" if limit else "")


def claim_row(claim: Claim, root: Path, draws: int) -> str:
    folder = root / FOLDER / claim.suite
    frame = collect(folder, draws=0) if folder.is_dir() else None
    runs = [None if frame is None or frame.empty else find_run(frame, *config) for config in (claim.ours, claim.other)]
    missing = [_label(*config) for config, run in zip((claim.ours, claim.other), runs) if run is None]
    if missing:
        return f"| {claim.text} | {claim.paper} | missing rows: {', '.join(missing)} | - | - |"
    rows = [load_predictions(Path(run["run_dir"]) / "predictions.jsonl") for run in runs]
    diff = paired_difference(rows[0], rows[1], AGGREGATES[claim.suite], draws)
    scores = f"{runs[0]['score']:.1f} vs {runs[1]['score']:.1f}"
    interval = f"{diff['diff_to_full']:+.1f} [{diff['diff_ci_low']:+.1f}, {diff['diff_ci_high']:+.1f}]"
    resolved = "yes" if diff["diff_ci_low"] > 0 or diff["diff_ci_high"] < 0 else "no"
    return f"| {claim.text} | {claim.paper} | {scores} (n = {diff['n_paired']}) | {interval} | {resolved} |"


def render(root: Path = ROOT, draws: int = DRAWS) -> str:
    head = ["| claim | paper | here | difference [95% paired interval] | resolved by the interval |",
            "| --- | --- | --- | --- | --- |"]
    return "\n".join(head + [claim_row(claim, root, draws) for claim in CLAIMS]) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the folder holding reference_results/")
    args = parser.parse_args(argv)
    sys.stdout.write(render(args.root))


if __name__ == "__main__":
    main()
