"""Timing of a run: the per-sample timings of ``predictions.jsonl`` pooled into ``timing.json``
(:class:`evals.output.schema.Timing`), where the run executed, and which code it ran (:func:`provenance`).

TPOT is one statistic everywhere: ``tpot_s`` is the *mean* per-token interval over tokens 3..N (PQCache's
definition, :mod:`evals.runner`), ``tpot_p50_s`` the median and ``tpot_p90_s`` the 90th percentile
(:func:`tpot_stats`, used by timing.json, the latency suite and the decode benchmark alike).
"""
from __future__ import annotations

import os
import platform
import resource
import statistics

import torch

from icecache.hardware import cpu_info, cpu_signature
from icecache.kv.base import MEMORY_KEYS

from .. import threads
from ..models import dtype_record, resolve_dtype
from .results import git_state
from .schema import Timing


def tpot_stats(intervals: list[float]) -> dict:
    """``{"tpot_s": mean, "tpot_p50_s": median, "tpot_p90_s": 90th percentile}`` of per-token intervals
    (None where there are too few)."""
    return {"tpot_s": statistics.fmean(intervals) if intervals else None,
            "tpot_p50_s": statistics.median(intervals) if intervals else None,
            "tpot_p90_s": statistics.quantiles(intervals, n=10)[-1] if len(intervals) >= 2 else None}


def requests_seconds(timings: list[dict]) -> float | None:
    """The summed time of the samples' requests (each one's TT2T, or its TTFT when it stopped after one token,
    plus its later tokens' intervals): the run's generation time, without model loading and scoring; None
    without per-sample timings."""
    if not timings:
        return None
    return sum((t.get("tt2t_s") or t.get("ttft_s") or 0.0) + sum(t.get("intervals_s") or []) for t in timings)


def pool_timing(rows: list[dict], cfg: dict) -> Timing:
    """``timing.json`` from the rows' per-sample timings: TT2T/TTFT means, TPOT over all tokens >= 3 of all
    samples (:func:`tpot_stats`), breakdown per output token. Peak memory is the maximum over every process
    that wrote rows (each row records its process's peak); the KV memory by place (``device_kv_bytes``,
    ``transit_bytes``, ``host_kv_bytes``, ``index_bytes``: :meth:`icecache.kv.KVCache.memory_bytes`) the maximum
    over samples."""
    timings = [r["timing"] for r in rows if r.get("timing")]
    intervals = [x for t in timings for x in t["intervals_s"]]
    n_tok = len(intervals)
    breakdown: dict[str, float] = {}
    for t in timings:
        for phase, sec in t["breakdown_s"].items():
            breakdown[phase] = breakdown.get(phase, 0.0) + sec
    layers = [t["effective_tokens"] for t in timings if t.get("effective_tokens")]
    effective = [statistics.fmean(v) if (v := [per[i] for per in layers if per[i] is not None]) else None
                 for i in range(len(layers[0]))] if layers else []
    stats = [t["method_stats"] for t in timings if t.get("method_stats")]
    names = sorted({name for per in stats for name in per})
    method_stats = {name: [_mean_or_none([per[name][i] for per in stats if name in per])
                           for i in range(max(len(per[name]) for per in stats if name in per))] for name in names}
    tt2t = [t["tt2t_s"] for t in timings if t["tt2t_s"] is not None]
    segments: dict[str, int] = {}
    for t in timings:
        if t.get("peak_memory_bytes"):
            key = t.get("segment")
            segments[key] = max(segments.get(key, 0), t["peak_memory_bytes"])
    return {
        "n_samples": len(timings),
        "ttft_s": statistics.fmean([t["ttft_s"] for t in timings]) if timings else None,
        "tt2t_s": statistics.fmean(tt2t) if tt2t else None,
        **tpot_stats(intervals),
        "breakdown": {k: v / n_tok for k, v in breakdown.items()} if n_tok else {},
        "effective_tokens_per_layer": effective,
        "method_stats": method_stats,
        "max_resident_tokens": max((t.get("max_resident_tokens", 0) for t in timings), default=0),
        **{key: max((t[key] for t in timings if t.get(key) is not None), default=None) for key in MEMORY_KEYS},
        "transfer_bytes_per_token": sum(t.get("transfer_bytes", 0) for t in timings) / n_tok if n_tok else None,
        "peak_memory_bytes": max(segments.values()) if segments else peak_memory_bytes(),
        "requests_s": requests_seconds(timings),
        "n_process_segments": len(segments),
        "commits": code_versions(timings),
        "environment": run_environment(cfg),
    }


def code_versions(timings: list[dict]) -> list[str]:
    """The commits whose code wrote the rows (``<sha>``, ``<sha>-dirty`` when tracked files were modified),
    sorted: one entry unless a run was resumed by other code. Rows written before commits were recorded
    count as ``unknown``."""
    return sorted({t.get("commit", "unknown") + ("-dirty" if t.get("dirty") is True else "") for t in timings})


def provenance(environment: dict | None = None) -> dict:
    """Which code ran where: ``commit`` and ``dirty`` of this repository (:func:`evals.output.results.git_state`;
    ``"unknown"`` outside a git checkout) and ``environment``, the record ``timing.json`` keeps (library
    versions, CPU model, threads, device and dtype: :func:`run_environment` or :func:`environment`; default:
    the machine and libraries alone)."""
    return {**git_state(), "environment": machine() if environment is None else environment}


def _mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def peak_memory_bytes() -> int:
    """CUDA max allocated when on a GPU, else the process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def environment(model) -> dict:
    """Where a loaded model runs: its device and dtype, library versions and the machine."""
    param = next(model.parameters())
    return {**machine(), "device": str(param.device), "dtype": str(param.dtype),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def machine() -> dict:
    """Library versions and the machine: threads, torch, transformers, python, CPU (model name from
    ``/proc/cpuinfo``, else the platform's; its family and model), CPU count, the OpenMP wait rule and the choice behind it."""
    import transformers
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.uname().machine, "cpu_model": cpu_info()[0],
            "cpu_signature": cpu_signature(), "cpu_count": os.cpu_count(), "omp_wait": omp_wait_record(), "thread_choice": threads.record()}


def omp_wait_record() -> str:
    """How this process's idle OpenMP threads wait (read by libgomp at start-up): ``spin N`` when
    ``GOMP_SPINCOUNT`` sets it, else ``OMP_WAIT_POLICY`` lower-cased, or ``default`` (libgomp's ~300k-iteration
    spin, then sleep). Passive waiting costs every parallel op a thread wake-up (docs/benchmarks.md, "Threads and
    OpenMP waiting"). ``thread_choice`` beside it records why (:func:`evals.threads.record`: threads and waiting
    chosen at start-up, by what, and the load seen)."""
    return threads.environment_wait(os.environ)


def run_environment(cfg: dict) -> dict:
    """Where the run executed: the resolved device (``device=auto`` recorded as cpu or cuda) and dtype,
    library versions and the machine."""
    device, dtype = cfg["device"], cfg["model"].get("dtype", "auto")
    return {**machine(), "device": device, **dtype_record(dtype, device),  # the rule behind model.dtype=auto
            "dtype": str(resolve_dtype(dtype, device)),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}
