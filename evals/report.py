"""Human-readable output of a run directory."""
from __future__ import annotations

import json
from pathlib import Path


def print_run(run_dir: Path) -> None:
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    timing = json.loads((Path(run_dir) / "timing.json").read_text())
    ms = lambda s: "-" if s is None else f"{1000 * s:.1f} ms"  # noqa: E731
    score = metrics.get("score")
    print(f"{metrics.get('score_name', 'score')} {'-' if score is None else f'{score:.1f}'} "
          f"({metrics.get('n_samples', '?')} samples)  " +
          "  ".join(f"{t} {v:.1f}" for t, v in metrics.get("tasks", {}).items()))
    print(f"TTFT {ms(timing['ttft_s'])}  TT2T {ms(timing['tt2t_s'])}  TPOT {ms(timing['tpot_s'])} "
          f"(p50 {ms(timing['tpot_p50_s'])}, p90 {ms(timing['tpot_p90_s'])})  " +
          "  ".join(f"{k} {ms(v)}" for k, v in timing.get("breakdown", {}).items()))
