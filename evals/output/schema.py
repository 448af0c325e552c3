"""The results schema: what a run directory's ``metrics.json`` and ``timing.json`` hold, and the one reader
that the summary table, the plots, W&B and the report use (as lm-evaluation-harness'
``lm_eval/api/result_schema.py`` does for its results file).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TypedDict


class Metrics(TypedDict, total=False):
    """``metrics.json``: :meth:`evals.task.Suite.aggregate` of the rows, plus the suite's version."""

    score: float | None  # the headline, 0-100 (or the number named by score_name)
    score_name: str  # absent: "score"; the latency suite's headline is "tpot_ms"
    tasks: dict[str, float]  # per-task scores, 0-100
    n_samples: int
    version: int  # Suite.version when the run was written (absent in runs written before it existed)
    limit: int | None  # the run's limit (samples per task); None: the whole suite (absent in older runs)
    n_total: int | None  # samples of the whole suite (Suite.n_total); None: the suite cannot count them
    # suite-specific extras: groups (RULER), lengths (RULER, latency), skipped (RULER), ...


class Timing(TypedDict):
    """``timing.json``: the samples' timings pooled by :func:`evals.output.timing.pool_timing`."""

    n_samples: int
    ttft_s: float | None  # mean over samples
    tt2t_s: float | None  # mean over samples
    tpot_s: float | None  # mean per-token interval over tokens 3..N of every sample
    tpot_p50_s: float | None  # median of the same intervals
    tpot_p90_s: float | None  # 90th percentile of the same intervals
    breakdown: dict[str, float]  # seconds per output token per phase (select, transfer, attention, update, other)
    effective_tokens_per_layer: list[float | None]  # mean past tokens attended per head, per layer
    method_stats: dict[str, list[float | None]]  # per layer, mean over samples: KVMethod.layer_stats (MagicPIG's K)
    max_resident_tokens: int
    device_kv_bytes: int | None  # max over samples: K/V a GPU run holds in device memory (transit buffers included)
    transit_bytes: int | None  # the transit part of device_kv_bytes
    host_kv_bytes: int | None  # K/V in the host offload store
    index_bytes: int | None  # retrieval metadata: M-DCI arrays, PQ codebooks and codes, LSH tables, page digests
    transfer_bytes_per_token: float | None
    peak_memory_bytes: int | None
    requests_s: float | None  # sum over samples of TT2T and the later tokens' intervals: the run's generation time
    n_process_segments: int
    environment: dict  # device, dtype, library versions, machine


class Recall(TypedDict, total=False):
    """``recall.json`` (runs with ``diagnostics=recall``): :func:`icecache.kv.recall.pool_recall` of the rows."""

    n_samples: int
    every: int  # decode steps between measurements
    layers: list[int]  # every layer measured: own_layers and common_layers together
    own_layers: list[int]  # the layers the method budgets (what the plain ``<metric>_mean`` pool)
    common_layers: list[int]  # layers common_from .. L-1 (2 by default) for every method (``<metric>_common_mean``)
    recall_mean: float  # attention-mass recall, mean over every measured (sample, step, own layer, query head)
    recall_common_mean: float  # the same over the common layers: comparable between methods
    error_mean: float  # relative L2 error of the attention output against exact attention
    needle_share_mean: float  # needle tasks: share of the needle's attention on attended tokens
    needle_top_mean: float  # needle tasks: how often the most-attended needle token was attended
    per_layer: dict[str, dict[str, list]]  # metric -> mean / median / p10 / n_samples, per entry of ``layers``
    samples: dict[str, dict[str, float]]  # sample id -> its pooled means and p10s


RECALL_SCALARS = ("recall_mean", "recall_common_mean", "error_mean", "needle_share_mean", "needle_top_mean")

# the timing numbers every consumer shows next to the score
TIMING_SCALARS = ("ttft_s", "tt2t_s", "tpot_s", "tpot_p50_s", "tpot_p90_s", "peak_memory_bytes", "max_resident_tokens",
                  "device_kv_bytes", "host_kv_bytes", "index_bytes", "requests_s")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_results(run_dir: Path) -> tuple[Metrics | None, Timing | None]:
    """A run directory's metrics and timing; ``None`` for a file that is missing or unreadable (a run still
    being written)."""
    run_dir = Path(run_dir)
    return _read_json(run_dir / "metrics.json"), _read_json(run_dir / "timing.json")


def read_recall(run_dir: Path) -> Recall | None:
    """A run directory's ``recall.json``, or None (no ``diagnostics=recall``, or still being written)."""
    return _read_json(Path(run_dir) / "recall.json")


def recall_columns(recall: Recall | None) -> dict:
    """:data:`RECALL_SCALARS` of a run (empty without ``diagnostics=recall``)."""
    return {} if not recall else {key: recall.get(key) for key in RECALL_SCALARS}


def score_columns(metrics: Metrics) -> dict:
    """``score`` (None when the headline is not a quality number) or ``<score_name>``, and ``task/<name>``."""
    name = metrics.get("score_name", "score")
    out = {"score": metrics.get("score") if name == "score" else None}
    if name != "score":
        out[name] = metrics.get("score")
    out.update({f"task/{t}": v for t, v in metrics.get("tasks", {}).items()})
    return out


def timing_columns(timing: Timing) -> dict:
    """:data:`TIMING_SCALARS`, ``breakdown/<phase>``, the mean and the median layer's effective tokens (the
    median is a budgeted layer's wherever most layers are budgeted, the mean counts the dense ones too) and, per
    ``method_stats`` entry (e.g. IceCache's ``search_scored_fraction``), ``stat/<name>``: its mean over the
    layers that report it."""
    out = {key: timing.get(key) for key in TIMING_SCALARS}
    out.update({f"breakdown/{p}": v for p, v in timing.get("breakdown", {}).items()})
    out["effective_tokens_mean"] = _layer_mean(timing.get("effective_tokens_per_layer", []))
    out["effective_tokens_median"] = _layer_median(timing.get("effective_tokens_per_layer", []))
    out.update({f"stat/{name}": _layer_mean(values) for name, values in timing.get("method_stats", {}).items()})
    return out


def _layer_mean(values: list) -> float | None:
    """Mean of the per-layer values that are not None (None when no layer has one)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _layer_median(values: list) -> float | None:
    """Median of the per-layer values that are not None (None when no layer has one)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_status(metrics: Metrics | None, timing: Timing | None, limit: int | None = None) -> str:
    """``incomplete`` (no metrics or timing yet), ``complete`` (the suite's whole data set ran) or
    ``partial (limit=N)``: a limited run that left samples of the suite out (``n_samples < n_total``, or a
    total the suite cannot count). ``limit``: the config's, for runs whose metrics do not record it."""
    if metrics is None or timing is None:
        return "incomplete"
    limit = metrics.get("limit", limit)
    n, total = metrics.get("n_samples"), metrics.get("n_total")
    if limit is None or (total is not None and n is not None and n >= total):
        return "complete"
    return f"partial (limit={limit})"


def limit_warning(limit: int, n: int, n_total: int | None) -> str:
    """The line every run with ``limit`` prints (stderr) when it starts and with its results: how many of the
    suite's samples it ran, and that its scores are not those of the whole suite."""
    if n_total is not None and n >= n_total:
        return (f"WARNING: limit={limit}: all {n_total:,} samples of the suite; the run is stored apart from the "
                "run without limit")
    part = f"{n:,} samples of a larger suite" if n_total is None else f"{n:,} of {n_total:,} samples"
    return f"WARNING: limit={limit}: {part}; scores are not comparable to full runs"


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


def sample_count(n, n_total) -> str:
    """A run's samples as the summary's console shows them: ``n``, or ``n/n_total`` when a limit left some of the
    suite out; empty for a run without metrics (a missing number: None or NaN)."""
    def known(x) -> bool:
        try:
            return x is not None and bool(x == x)
        except TypeError:  # pandas' NA
            return False
    if not known(n):
        return ""
    return f"{int(n)}/{int(n_total)}" if known(n_total) and n < n_total else str(int(n))
