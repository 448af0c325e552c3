"""The M-DCI search beside the cost of only reading the keys it scores: a lower reference for the decode
step's ``select`` phase on this CPU.

Usage::

    python -m evals.bench.search_bound --keys keys16k.pt [--keys keys32k.pt ...] [--steps 8] [--rounds 3]
        [--threads 2] [--out bench_search_bound.json]

``--keys``: captured post-RoPE keys and decode queries (:mod:`evals.bench.capture`). For every captured file, an
index per budgeted layer is built over its keys exactly as IceCache builds it (``IceCache(budget).dci_config``), and
two things are timed, layers in turn as in a decode step (layer 2, 3, ..., the last, then the next step), so a layer's
keys have left the caches by the time it is searched again:

- ``search``: :meth:`~icecache.dci.MDCIIndex.search_scored` of one step's query heads for ``K`` pages (the
  official search; ``K`` = the retrieved pages of ``--budget``);
- ``scan``: a plain pass over as many keys as that search scored, read in storage order from the same page
  storage, every key read once for three query heads of its KV head (all of them on SmolLM2, :func:`scan_keys`).
  Per KV head it reads the largest count of its query heads (:attr:`~icecache.dci.MDCIIndex.search_counts`), so
  it reads no more than the search must: the union of the query heads' keys is at least that large.

``scan`` keeps the search's arithmetic (:func:`~icecache.dci.intrinsics.dot_key3`) and drops everything else: the
tree, the scattered page order and the ranking. No search that scores the same keys, i.e. no search with the
official selection, reads them faster than a contiguous pass, so ``scan`` is the lower reference for ``search``
on this CPU; their ratio is how much of ``search`` is structure rather than reading. Both run with ``--threads``
numba threads over the same heads. Rounds alternate the two; the row keeps the median of each.

The JSON names the commit, the CPU (:func:`icecache.hardware.cpu_signature`) and, per file, the keys per KV head,
the keys scored per query head (mean and fraction) and both medians in ms per layer and step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from evals.output.results import git_state
from evals.registry import method_class
from icecache.dci import MDCIIndex
from icecache.dci.intrinsics import EXACT, dot_key, dot_key3
from icecache.hardware import cpu_signature


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _scan_head(page_keys, page_valid, h, count, qs, best, g):
    """Best ``q.k`` of the queries ``qs[g : g + 3]`` (fewer at the group's end) over the first ``count`` stored
    keys of KV head ``h`` into ``best[h, g : g + 3]``: three queries share each key read
    (:func:`~icecache.dci.intrinsics.dot_key3`, as the search scores a KV head's query heads together)."""
    t0 = t1 = t2 = np.float32(-np.inf)
    three = g + 3 <= qs.shape[0]
    left = count
    for pg in range(page_valid.shape[0]):
        take = min(page_valid[pg], left)
        for s in range(take):
            key = page_keys[h, pg, s]
            if three:
                d0, d1, d2 = dot_key3(qs[g], qs[g + 1], qs[g + 2], key)
                t0, t1, t2 = max(t0, d0), max(t1, d1), max(t2, d2)
            else:
                t0 = max(t0, dot_key(qs[g], key))
        left -= take
        if left == 0:
            break
    best[h, g] = t0
    if three:
        best[h, g + 1], best[h, g + 2] = t1, t2


@njit(cache=True, nogil=True, fastmath=EXACT, parallel=True)
def scan_keys(page_keys, page_valid, counts, queries):
    """Best ``q.k`` per query over the first ``counts[h]`` stored keys of KV head ``h``, pages in storage order
    (``page_keys [H, P, S, d]``, ``page_valid [H, P]``), for the ``G`` queries ``queries [H, G, d]`` (fp32) of
    each head, three per key read: ``[H, G]``."""
    heads, group = queries.shape[0], queries.shape[1]
    best = np.full((heads, group), -np.inf, dtype=np.float32)
    for h in prange(heads):
        g = 0
        while g < group:
            _scan_head(page_keys, page_valid[h], h, counts[h], queries[h], best, g)
            g += 3 if g + 3 <= group else 1
    return best


def layer_indexes(capture: dict, budget: int) -> list[MDCIIndex]:
    """One index per captured layer, built as IceCache builds it at ``budget``."""
    cfg = method_class("icecache")(budget=budget).dci_config(0)
    return [MDCIIndex.build(k.to(torch.bfloat16), torch.arange(k.shape[1]), cfg) for k in capture["keys"]]


def scan_inputs(index: MDCIIndex, queries: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(keys to read per KV head = the most any of its query heads scored, queries ``[H, G, d]`` fp32) of the
    search just run on ``index``."""
    counts = index.search_counts[:, 0].reshape(index.heads, -1).max(1).astype(np.int64)
    group = queries.shape[0] // index.heads
    return counts, np.ascontiguousarray(queries.float().reshape(index.heads, group, -1).numpy())


def measure(capture: dict, budget: int, steps: int, rounds: int) -> dict:
    """Medians over ``rounds`` of the search and the scan, ms per layer and step, and what the search scored."""
    k_pages = method_class("icecache")(budget=budget).layout()[2]
    indexes = layer_indexes(capture, budget)
    queries = [q.float() for q in capture["queries"]]
    inputs, scored = [], []
    for index, q in zip(indexes, queries):
        index.search_scored(q[0], k_pages, k_pages)
        scored.append(index.search_counts[:, 0].mean())
        inputs.append(scan_inputs(index, q[0]))

    def search():
        for s in range(steps):
            for index, q in zip(indexes, queries):
                index.search_scored(q[s % len(q)], k_pages, k_pages)

    def scan():
        for s in range(steps):
            for index, (counts, q) in zip(indexes, inputs):
                scan_keys(index.page_keys, index.page_valid_np, counts, q)

    search(), scan()  # kernels loaded, caches in their steady state
    times = {"search": [], "scan": []}
    for _ in range(rounds):
        for name, fn in (("search", search), ("scan", scan)):
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / (steps * len(indexes)) * 1e3)
    n = indexes[0].n
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"keys_per_kv_head": n, "layers": len(indexes), "k_pages": k_pages,
            "scored_per_query_head": float(np.mean(scored)), "scored_fraction": float(np.mean(scored)) / n,
            "search_ms": med["search"], "scan_ms": med["scan"], "search_over_scan": med["search"] / med["scan"],
            "rounds_ms": times}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", nargs="+", required=True, help="files written by evals.bench.capture")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_search_bound.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    rows = {}
    for path in args.keys:
        row = measure(torch.load(path), args.budget, args.steps, args.rounds)
        rows[path] = row
        print(f"{path}: {row['keys_per_kv_head']} keys per KV head, scored per query head "
              f"{row['scored_per_query_head']:.0f} ({100 * row['scored_fraction']:.1f}%); ms per layer and step: "
              f"search {row['search_ms']:.3f}, scan of as many keys {row['scan_ms']:.3f} "
              f"(search / scan {row['search_over_scan']:.2f})", flush=True)
    out = {"rows": rows, "budget": args.budget, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
           "cpu": cpu_signature(), **git_state()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
