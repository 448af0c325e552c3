"""Bootstrap intervals and the pairing of a run with its full-cache run, shared by the summary
(:mod:`evals.output.summary`) and the agreement with the full cache (:mod:`evals.output.agreement`), and the
views of a longer limited run on a shorter limit's samples (:func:`first_n_views`), which pair there."""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np

DRAWS, SEED, LEVEL = 2000, 0, 0.95  # bootstrap resamples, their seed, the confidence level
# settings that do not change which samples a run answers nor the answers: a full cache run is paired across them
# (a limited run pairs with the full cache run that shares most of its samples, limited or not)
PAIRING_IGNORED = ("prefill_cache", "prefill_cache_max_gb", "diagnostics", "limit")


def resample_means(groups: Sequence[np.ndarray], draws: int, rng: np.random.Generator) -> list[np.ndarray]:
    """For each group (``[n_g, ...]`` rows), the means of ``draws`` resamples of its rows with replacement:
    ``[draws, ...]``. The groups draw from ``rng`` in order, each as ``rng.integers(0, n_g, (draws, n_g))``; a
    paired resample stacks both members of a pair in one row, so one draw picks the same samples for both."""
    return [g[rng.integers(0, len(g), (draws, len(g)))].mean(1) for g in groups]


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap statistics (numpy's linear interpolation)."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _pairing_key(row: dict, flat: dict) -> tuple:
    kept = {k: v for k, v in flat.items()
            if not k.startswith("cache.") and k.split(".", 1)[0] not in PAIRING_IGNORED}
    return row["eval"], row["model"], json.dumps(kept, sort_keys=True, default=str)


def full_reference(i: int, rows: list[dict], flat: list[dict], loaded: dict[int, list[dict]]) -> int | None:
    """The full cache run paired with run ``i`` among the runs ``loaded`` (index -> rows), as the module docstring
    says (itself for a full cache run), or None."""
    if rows[i]["cache"] == "full":
        return i
    key, ids = _pairing_key(rows[i], flat[i]), {r["id"] for r in loaded[i]}
    candidates = [j for j in loaded if rows[j]["cache"] == "full" and _pairing_key(rows[j], flat[j]) == key]
    same = lambda j: (sum(r["id"] in ids for r in loaded[j]), rows[j]["budget"] == rows[i]["budget"], -j)  # noqa: E731
    return max(candidates, key=same) if candidates else None


def _experiment_key(row: dict, flat: dict, *, with_method: bool) -> tuple:
    """What a limited run shares with the runs of other limits of its experiment: eval, model and every setting but
    ``limit`` (and, unless ``with_method``, but the method and budget)."""
    kept = {k: v for k, v in flat.items() if k != "limit" and (with_method or not k.startswith("cache."))}
    method = (row["cache"], json.dumps(row["budget"], default=str)) if with_method else ()
    return row["eval"], row["model"], json.dumps(kept, sort_keys=True, default=str), *method


def first_n_views(rows: list[dict], flat: list[dict]) -> list[tuple[dict, dict]]:
    """``(row, settings)`` of a view of each finished limited run on each smaller ``limit`` another run of its
    experiment was made with: its first N samples (a run with ``limit`` answers the suite's first ``limit``
    samples in order, so these are the samples the runs of limit N answered), as a run of ``limit=N`` that
    ``first_n`` = N marks and ``first_of`` names the samples it ran. A table of limit N then holds every method
    on the same samples, the full cache's among them. A view's score, intervals and agreement are recomputed
    from those rows (:func:`evals.output.summary.add_intervals`); its task scores are left out, and its timings stay the whole run's.
    No view is made where a run of that method, budget and limit exists."""
    finished = [i for i, r in enumerate(rows) if str(r.get("status", "")).startswith("partial") and r.get("limit")]
    limits: dict[tuple, set[int]] = {}
    for i in finished:
        limits.setdefault(_experiment_key(rows[i], flat[i], with_method=False), set()).add(int(rows[i]["limit"]))
    present = {(*_experiment_key(rows[i], flat[i], with_method=True), int(rows[i]["limit"])) for i in finished}
    views = []
    for i in finished:
        row, n_run = rows[i], int(rows[i]["n_samples"] or 0)
        for n in sorted(limits[_experiment_key(row, flat[i], with_method=False)]):
            if n >= n_run or (*_experiment_key(row, flat[i], with_method=True), n) in present:
                continue
            view = {k: (None if k.startswith("task/") else v) for k, v in row.items()}
            view.update(limit=n, n_samples=n, status=f"partial (limit={n})", score=None, first_n=n, first_of=n_run,
                        variant=row.get("variant", "").replace(f"limit={row['limit']}", f"limit={n}"))
            views.append((view, {**flat[i], "limit": n}))
    return views
