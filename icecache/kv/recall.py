"""Live attention-mass recall (``diagnostics=recall``): how much of the exact attention a method kept.

At every ``every``-th decode step, for each measured layer (the method's budgeted ones and the common set
below) and query head, :class:`RecallProbe` computes the exact softmax attention (fp64) of the step's query
over the whole context -- the prompt and every token decoded so far, kept aside for this diagnostic only --
and measures:

- ``recall``: the share of that attention that falls on the tokens the method attended (attention-mass
  recall: what a retrieval method's index approximates, what an eviction method's kept set preserves);
- ``error``: the relative L2 error of the method's attention output against the exact one,
  ``||o - o*|| / ||o*||``. For a sampling method (MagicPIG) this is the estimator's error; for StreamingLLM's
  re-rotated keys it includes what the re-rotation changes;
- on needle tasks (the suite names the needle text, e.g. the pass key): ``needle_share``, the share of the
  attention on the needle's tokens that falls on attended ones, and ``needle_top``, whether the needle token
  with the most attention was attended (1 or 0).

Two poolings over layers (docs/diagnostics.md): each method's *own* budgeted layers (``recall_mean``, ...: what
its own budget covers, so the population differs between methods: the top-k oracle counts layers 0-1, IceCache
exempts them, MagicPIG its dense layers, OmniKV all but its sparse ones) and the layers *common* to every
method (``recall_common_mean``, ...): layers ``common_from .. L-1`` whatever the method, ``common_from = 2``
by default (the first two layers IceCache, Quest and OmniKV keep dense; official ``n_unlimited_layers``). A
layer of the common set that the method exempts is measured too and counts what it attends there (the
whole context: recall 1), so every method is compared over the same (step, layer, head) cases.

The tokens a method attended are its :meth:`~icecache.kv.KVMethod.attended_positions` (original positions,
-1 for masked slots), read between its attention and its ``observe`` (before an eviction that follows). The
probe only reads: the K/V it keeps are its own copies and nothing of the method is written, so outputs and
predictions are unchanged (``tests/test_recall.py`` compares them with and without the probe). Its cost is
timed as the ``diagnostics`` phase and is part of the step's wall time, so a run with the probe is not a
latency measurement.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .attention import expand_heads
from .storage import append_to_buffer

METRICS = ("recall", "error", "needle_share", "needle_top")
COMMON_FROM = 2  # recall_common pools layers COMMON_FROM .. L-1 for every method (module docstring)
POOLS = (("", "own_layers"), ("_common", "common_layers"))  # metric-name suffix, the layer set it pools


def positions_mask(positions: torch.Tensor, n: int, n_q_heads: int) -> torch.Tensor:
    """``[H_q, n]`` bool, True where query head ``h`` attends position ``j``, from original positions ``[m]``
    (one set for every head) or ``[H, m]`` (``H`` in {1, H_kv, H_q}; query head ``h`` reads head
    ``h // (H_q / H)``), ``-1`` marking masked slots."""
    positions = positions.detach().long().cpu()
    positions = positions[None] if positions.dim() == 1 else positions
    if positions.numel() and int(positions.max()) >= n:
        raise ValueError(f"attended position {int(positions.max())} is beyond the {n} tokens of the context")
    mask = torch.zeros(positions.shape[0], n + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(positions >= 0, positions, n), True)
    return expand_heads(mask[:, :n], n_q_heads)


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 probabilities ``[H_q, n]`` and output ``[H_q, d]`` of one query per head ``q: [H_q, d]`` over
    ``keys, values: [H_kv, n, d]`` (query head ``h`` reads KV head ``h // group``)."""
    h_kv, n, d = keys.shape
    grouped = q.double().view(h_kv, -1, d)  # [H_kv, G, d]
    probs = (torch.matmul(grouped, keys.double().transpose(1, 2)) * scaling).softmax(-1)  # [H_kv, G, n]
    out = torch.matmul(probs, values.double())  # [H_kv, G, d]
    return probs.reshape(-1, n), out.reshape(-1, d)


def step_metrics(probs: torch.Tensor, exact_out: torch.Tensor, out: torch.Tensor, mask: torch.Tensor,
                 needle: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per query head: ``recall``, ``error`` and, when ``needle`` (prompt positions) is not empty,
    ``needle_share`` and ``needle_top`` (see the module docstring)."""
    kept = probs * mask
    err = (out.double() - exact_out).norm(dim=-1) / exact_out.norm(dim=-1).clamp(min=1e-30)
    metrics = {"recall": kept.sum(-1), "error": err}
    if needle.numel():
        on_needle = probs[:, needle]
        metrics["needle_share"] = kept[:, needle].sum(-1) / on_needle.sum(-1).clamp(min=1e-300)
        top = needle[on_needle.argmax(-1)]
        metrics["needle_top"] = mask.gather(1, top[:, None])[:, 0].double()
    return metrics


def _stats(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "median": float(np.median(values)),
            "p10": float(np.percentile(values, 10)), "n": int(values.size)}


class RecallProbe:
    """Keeps a copy of every layer's K/V and measures, per budgeted layer and per layer of the common set, the
    attention-mass recall of what the method attends (module docstring). ``every``: measure every ``every``-th
    decode step of each layer; ``needle``: prompt positions of the needle tokens (empty: no needle metrics);
    ``common_from``: the first layer of the common set (layers ``common_from .. L-1``)."""

    def __init__(self, every: int = 1, needle: list[int] | tuple[int, ...] = (), common_from: int = COMMON_FROM):
        for key, value, least in (("diagnostics.every", every, 1), ("common_from", common_from, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key} must be a whole number >= {least}, got {value!r}")
        self.every, self.common_from = every, common_from
        self.needle = torch.as_tensor(sorted(set(needle)), dtype=torch.long)
        self.reset()

    def reset(self) -> None:
        """Forgets the kept K/V and the measurements (a cache reset for a new prompt)."""
        self.buffers: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        self.views: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        self.steps: dict[int, int] = defaultdict(int)
        self.values: dict[int, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.own: set[int] = set()  # the measured layers the method budgets

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends a copy of ``k, v: [H_kv, m, d]`` to the layer's full context (before the method sees them)."""
        for name, x in (("k", k), ("v", v)):
            self.buffers[layer][name], self.views[layer][name] = append_to_buffer(
                self.buffers[layer].get(name), self.views[layer].get(name), x.detach().cpu())

    def measure(self, method, st, q: torch.Tensor, selection, out: torch.Tensor) -> None:
        """One decode step of one layer, after the method's attention (``q, out: [H_q, 1, d]``)."""
        layer = st.layer_idx
        if method.budget is None or not (method.is_budgeted(st) or layer >= self.common_from):
            return  # a method without a budget (full) is not measured
        if method.is_budgeted(st):
            self.own.add(layer)
        self.steps[layer] += 1
        if (self.steps[layer] - 1) % self.every:
            return
        keys, values = self.views[layer]["k"], self.views[layer]["v"]
        n = keys.shape[1]
        mask = positions_mask(method.attended_positions(st, selection), n, q.shape[0])
        probs, exact_out = exact_attention(q[:, 0].detach().cpu(), keys, values, st.spec.scaling)
        needle = self.needle[self.needle < n]
        for name, value in step_metrics(probs, exact_out, out[:, 0].detach().cpu(), mask, needle).items():
            self.values[layer][name].append(value.float())

    def summary(self) -> dict | None:
        """What a prediction row keeps: per metric the pooled mean (and p10) over every measured step, layer
        and query head of the method's own budgeted layers (``<metric>_mean``, ``own_layers``) and of the
        common layers (``<metric>_common_mean``, ``common_layers``), and per measured layer (``layers``, their
        union) its mean, median, p10 and number of cases. None when nothing was measured (a method without a
        budget, or no decode step)."""
        layers = sorted(self.values)
        if not layers:
            return None
        out: dict = {"every": self.every, "layers": layers, "own_layers": [i for i in layers if i in self.own],
                     "common_layers": [i for i in layers if i >= self.common_from], "common_from": self.common_from,
                     "needle_tokens": int(self.needle.numel()), "per_layer": {}}
        for name in METRICS:
            per_layer = {i: torch.cat(self.values[i][name]).numpy() for i in layers if self.values[i].get(name)}
            if not per_layer:
                continue
            for suffix, key in POOLS:
                chosen = [per_layer[i] for i in out[key] if i in per_layer]
                if chosen:
                    pooled = np.concatenate(chosen)
                    out[f"{name}{suffix}_mean"] = float(pooled.mean())
                    out[f"{name}{suffix}_p10"] = float(np.percentile(pooled, 10))
            stats = [_stats(v) for v in per_layer.values()]
            out["per_layer"][name] = {key: [s[key] for s in stats] for key in ("mean", "median", "p10", "n")}
        return out


def _row_pools(rec: dict) -> dict[str, set[int]]:
    """A row's layer set per pooling suffix (rows written before the common set: own = every layer measured)."""
    return {suffix: set(rec.get(key, rec["layers"] if key == "own_layers" else ())) for suffix, key in POOLS}


def _layer_spread(means: dict[int, list[tuple[float, int]]]) -> dict[str, list]:
    """Per layer: the case-weighted mean of the samples' means, their median and p10, and how many samples."""
    rows_of = list(means.values())
    return {"mean": [sum(m * n for m, n in ms) / sum(n for _, n in ms) if ms else None for ms in rows_of],
            "median": [float(np.median([m for m, _ in ms])) if ms else None for ms in rows_of],
            "p10": [float(np.percentile([m for m, _ in ms], 10)) if ms else None for ms in rows_of],
            "n_samples": [len(ms) for ms in rows_of]}


def pool_recall(rows: list[dict]) -> dict | None:
    """``recall.json`` of a run from its rows' ``recall`` entries: per metric, the mean over every measured
    case of the run (pooled means, weighted by each sample's cases) over the own layers (``<metric>_mean``)
    and over the common ones (``<metric>_common_mean``) and, per layer, that mean plus the median and p10
    *over samples* of each sample's mean in that layer; ``samples`` lists each sample's pooled numbers. None
    when no row has one."""
    entries = [(row["id"], row["recall"]) for row in rows if row.get("recall")]
    if not entries:
        return None
    layers = sorted({layer for _, rec in entries for layer in rec["layers"]})
    out: dict = {"n_samples": len(entries), "every": entries[0][1]["every"], "layers": layers, "per_layer": {}}
    for suffix, key in POOLS:
        out[key] = sorted(set().union(*(_row_pools(rec)[suffix] for _, rec in entries)))
    for name in METRICS:
        per_sample = [rec for _, rec in entries if name in rec["per_layer"]]
        if not per_sample:
            continue
        means: dict[int, list] = {layer: [] for layer in layers}
        sums = {suffix: [0.0, 0] for suffix, _ in POOLS}
        for rec in per_sample:
            pools, stats = _row_pools(rec), rec["per_layer"][name]
            for layer, mean, n in zip(rec["layers"], stats["mean"], stats["n"]):
                means[layer].append((mean, n))
                for suffix in (s for s, chosen in pools.items() if layer in chosen):
                    sums[suffix][0] += mean * n
                    sums[suffix][1] += n
        out.update({f"{name}{suffix}_mean": total / count for suffix, (total, count) in sums.items() if count})
        out["per_layer"][name] = _layer_spread(means)
    out["samples"] = {sid: {k: v for k, v in rec.items() if k.endswith(("_mean", "_p10"))} for sid, rec in entries}
    return out
