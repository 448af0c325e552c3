"""Human-readable output of a run directory."""
from __future__ import annotations

from pathlib import Path

from .schema import read_results


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
