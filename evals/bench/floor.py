"""The floor of a decode benchmark cell (:mod:`evals.bench.decode`): the TPOT a method would have if selecting,
moving and updating its keys cost nothing and it attended exactly its budget.

``floor_s`` of (method, length) is the sum of three parts, each in seconds per output token:

* ``other``: the full cache's ``other`` phase at the same length (MLPs, projections, LM head, the step's
  Python; the cost every method pays whatever its cache does);
* ``dense_attention``: the full cache's ``attention`` phase at the same length x ``n_dense_layers / n_layers``,
  the share of full attention spent in the layers the method attends densely;
* ``budgeted_attention``: ``exact_attention_s x (n_layers - n_dense_layers)``, where ``exact_attention_s``
  is measured in the cell's own process (:func:`exact_attention_seconds`): the harness's exact attention
  kernel (:func:`icecache.kv.attention.attend`) of one decode query over ``budget`` keys with the model's
  query/KV head counts, head dim, dtype and device, the median over :data:`REPEATS` repetitions of the mean
  of :data:`CALLS` calls.

``n_dense_layers`` is read from the method bound to the model, the layers it declares unbudgeted
(:meth:`icecache.kv.KVMethod.is_budgeted` false: IceCache's and Quest's first ``n_dense_layers``, OmniKV's dense
and filter layers, MagicPIG's ``dense_layers``; every layer of the full cache, so full's floor is its own
``other + attention``); every row records the count it used.
``tpot_over_floor`` is the cell's median TPOT over its floor. A cell without a full-cache row at its length, or
measured before these fields were recorded, has no floor (``None``).
"""
from __future__ import annotations

import statistics
import time

import torch

from icecache.kv import ModelSpec
from icecache.kv.attention import attend
from icecache.kv.compat import model_spec

REPEATS, CALLS, WARMUP_CALLS = 15, 20, 3
FLOOR_KEYS = ("floor_s", "tpot_over_floor", "floor_parts_s")  # written by :func:`annotate`, never measured


def attention_shape(spec, budget: int) -> dict:
    """The tensors of one budgeted layer's decode attention: ``q [n_q_heads, 1, head_dim]`` over ``k, v
    [n_kv_heads, budget, head_dim]``, in the model's dtype on its device (``spec``: its
    :class:`icecache.kv.ModelSpec`)."""
    return {"n_q_heads": spec.n_q_heads, "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim, "keys": budget,
            "dtype": str(spec.dtype), "device": str(spec.device)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exact_attention_seconds(spec, budget: int, repeats: int = REPEATS, calls: int = CALLS) -> float:
    """Seconds of one exact decode attention over ``budget`` keys in one layer (:func:`attention_shape`): the
    median over ``repeats`` repetitions of the mean of ``calls`` calls, after :data:`WARMUP_CALLS` untimed ones."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(spec.n_q_heads, 1, spec.head_dim, generator=gen).to(spec.device, spec.dtype)
    k, v = (torch.randn(spec.n_kv_heads, budget, spec.head_dim, generator=gen).to(spec.device, spec.dtype)
            for _ in range(2))
    device = torch.device(spec.device)
    with torch.inference_mode():
        for _ in range(WARMUP_CALLS):
            attend(q, k, v, spec.scaling)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                attend(q, k, v, spec.scaling)
            _synchronize(device)
            times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def dense_layers(method, spec: ModelSpec) -> int:
    """How many layers of a model of ``spec`` ``method`` attends densely (:meth:`~icecache.kv.KVMethod.is_budgeted`
    false for the layers of a sequence bound to that model)."""
    sequence = method.new_sequence(method.bind(spec))
    try:
        return sum(not method.is_budgeted(st) for st in sequence.layers)
    finally:
        sequence.close()


def floor_inputs(model, method, budget: int) -> dict:
    """What a cell records for its floor, measured in its own process after its timed generation: the model's
    layer count, the method's dense layers (:func:`dense_layers`) and one budgeted layer's exact attention time
    (:func:`exact_attention_seconds`) with the shape it was timed at."""
    spec = model_spec(model)
    return {"n_layers": spec.n_layers, "n_dense_layers": dense_layers(method, spec),
            "exact_attention_s": exact_attention_seconds(spec, budget),
            "exact_attention_shape": attention_shape(spec, budget)}


def floor_parts(row: dict, full_row: dict) -> dict | None:
    """The three parts of ``row``'s floor (module docstring), seconds per output token, from the full cache's
    row at the same length; None when either row lacks what they need."""
    if any(key not in row for key in ("n_layers", "n_dense_layers", "exact_attention_s")):
        return None
    phases = full_row.get("breakdown") or {}
    if "other" not in phases or "attention" not in phases:
        return None
    n_layers, n_dense = row["n_layers"], row["n_dense_layers"]
    return {"other": phases["other"], "dense_attention": phases["attention"] * n_dense / n_layers,
            "budgeted_attention": row["exact_attention_s"] * (n_layers - n_dense)}


def annotate(results: dict, tpot_key: str) -> None:
    """Adds ``floor_s``, ``floor_parts_s`` and ``tpot_over_floor`` (``row[tpot_key] / floor_s``) to every measured
    cell of ``results`` (``{method: {length: row}}``), in place; None where the floor is unknown."""
    full = results.get("full", {})
    for method, rows in results.items():
        if method in ("environment", "summary"):
            continue
        for length, row in rows.items():
            if "error" in row:
                continue
            full_row = full.get(length)
            parts = floor_parts(row, full_row) if full_row and "error" not in full_row else None
            floor = sum(parts.values()) if parts else None
            tpot = row.get(tpot_key)
            row.update(floor_s=floor, floor_parts_s=parts,
                       tpot_over_floor=tpot / floor if floor and tpot is not None else None)


def without_floor(row: dict) -> dict:
    """``row`` less the fields :func:`annotate` derives (a repeat keeps what was measured, not a floor computed
    from other cells at the time)."""
    return {k: v for k, v in row.items() if k not in FLOOR_KEYS}
