"""Index benchmark: M-DCI build / query / insert time and attention-mass recall of page selectors.

Usage::

    python -m evals.bench.index [--keys capture.pt] [--out bench_index.json]

``--keys`` takes a captured file of real post-RoPE keys and decode queries, a ``torch.save``'d dict:

- ``"keys"``: list over layers of ``[H_kv, n, d]`` (bf16) keys of the prompt,
- ``"queries"``: list over layers of ``[steps, H_q, d]`` post-RoPE decode queries,
- ``"layers"``: list of the model's layer ids of these entries (the budgeted layers),
- ``"n_layers"`` (optional): the model's depth; default ``max(layers) + 1`` (SmolLM2: layers 2..29 -> 30).

Without a file, synthetic clustered keys with temporal locality are used (and the output says so).

Times are per layer (``H_kv`` KV heads, ``H_q`` query heads, ``K = 12`` pages), measured side by side
in one process on ``torch.set_num_threads(2)``; the brute force is the exact top-``16K`` tokens of
``q.K`` in torch bf16 on the same keys. Recall (docs/benchmarks.md, "Index benchmark") is the share of the exact fp64
softmax attention of a query head that falls on the tokens it may attend to: sink pages, window
pages and the pages (or tokens) a selector retrieves for its KV head.

Two token-level baselines are measured with their own code (``baselines/``): ``pqcache`` (sinks +
recent window + PQ top-k per KV head) and ``omnikv`` (one head-shared
top-``B`` set chosen at each filter layer from that layer's attention and reused by the layers after it;
``omnikv_sparse`` is the same over the layers OmniKV actually budgets). H2O and SnapKV are
not measurable from decode-only captures (their scores need the attention of the prompt's queries),
nor is MagicPIG (a sampling estimator of the attention, not a token subset).

The output names the code and configurations measured: ``commit`` and ``dirty`` (:func:`evals.output.results.git_state`)
and ``method_configs`` (:func:`method_configs`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time

import numba
import numpy as np
import torch

from baselines.omnikv import OmniKV, select_tokens
from icecache.kv.storage import sinks_and_recent
from baselines.pqcache import PQCache
from baselines.quest import page_min_max, page_upper_bounds
from baselines.streaming_llm import StreamingLLM
from evals.output.results import git_state, method_record
from evals.registry import method_class
from icecache.dci import DCIConfig, MDCIIndex, merge_gqa
from icecache.kv import ModelSpec

PAGE = method_class("icecache").page_size  # IceCache's page size (16 tokens)
SIZES = (8192, 32768, 131072)
K_TIMING = 12


def budget_pages(budget: int) -> tuple[int, int, int]:
    """(sink pages, window pages, retrieved pages) of IceCache at ``budget`` tokens (its ``layout``), those of the
    authors' index runs (docs/benchmarks.md, "Index benchmark"): 512 -> (2, 2, 28), 64 -> (1, 2, 1)."""
    return method_class("icecache")(budget=budget).layout()


# ----------------------------------------------------------------------------- data

def synthetic(n: int = 8192, heads: int = 3, q_heads: int = 9, dim: int = 64, steps: int = 16,
              seed: int = 0) -> dict:
    """Clustered keys with temporal locality: runs of tokens about one of 64 topics per head, a shared
    key bias (as in real post-RoPE keys), and queries that attend to a few topics."""
    gen = torch.Generator().manual_seed(seed)
    topics = torch.randn(heads, 64, dim, generator=gen)
    bias = 2.0 * torch.randn(heads, 1, dim, generator=gen)
    run = torch.randint(8, 128, (n,), generator=gen).cumsum(0)
    topic_of = torch.randint(0, 64, (int((run < n).sum()) + 1,), generator=gen)
    seg = torch.searchsorted(run, torch.arange(n), right=True)
    keys = bias + topics[:, topic_of[seg]] + 0.7 * torch.randn(heads, n, dim, generator=gen)
    group = q_heads // heads
    pick = torch.randint(0, 64, (steps, q_heads, 2), generator=gen)
    q = torch.stack([topics[h // group][pick[:, h]].sum(1) for h in range(q_heads)], 1)
    q = 1.5 * q + 0.5 * torch.randn(steps, q_heads, dim, generator=gen)
    return {"keys": [keys.bfloat16()], "queries": [q.bfloat16()], "layers": [0], "synthetic": True}


def load(path: str | None) -> dict:
    if path is None:
        return synthetic()
    data = torch.load(path, map_location="cpu")
    data["synthetic"] = False
    return data


def tile(keys: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """Repeat ``keys [H, n0, d]`` to ``n`` tokens per head and perturb (noise 5% of the key std)."""
    gen = torch.Generator().manual_seed(seed)
    reps = math.ceil(n / keys.shape[1])
    out = keys.float().repeat(1, reps, 1)[:, :n]
    out = out + 0.05 * keys.float().std() * torch.randn(out.shape, generator=gen)
    return out.bfloat16()


# ----------------------------------------------------------------------------- timing

def _paired_median_ms(fns: dict, repeats: int) -> dict:
    """Median wall and CPU (all threads of the process) times of several functions, timed in
    alternation so that each sees the same machine load: ``{name: (wall_ms, cpu_ms)}``.

    On a shared machine the wall time of a call includes the time other processes hold the cores;
    the CPU time does not (it counts the work of the call, on every thread, spin-waits included).
    """
    for fn in fns.values():
        fn()
    times = {name: ([], []) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name][0].append(time.perf_counter() - start)
            times[name][1].append(time.process_time() - cpu)
    return {name: (float(np.median(w)) * 1e3, float(np.median(c)) * 1e3) for name, (w, c) in times.items()}


def brute_force(keys: torch.Tensor, queries: torch.Tensor, k_tokens: int) -> torch.Tensor:
    """Exact top-``k_tokens`` of ``q.k`` per query head in the keys' dtype (GQA: q-head i -> KV head
    i // r)."""
    heads = keys.shape[0]
    q = queries.to(keys.dtype).view(heads, -1, queries.shape[-1])
    return torch.bmm(q, keys.transpose(1, 2)).topk(k_tokens, dim=-1).indices


def time_sizes(keys: torch.Tensor, queries: torch.Tensor, sizes, cfg: DCIConfig,
               repeats: int = 200) -> dict:
    """Build / query / insert time of the index and brute-force query time at each size (medians).

    Query and brute force (bf16, as the authors' reference, and fp32) are timed in alternation, so
    their ratio holds under a varying machine load.
    """
    out = {}
    for n in sizes:
        big = tile(keys, n)
        ids = torch.arange(n)
        big32 = big.float().contiguous()
        q = [queries[s] for s in range(len(queries))]
        step = iter(range(10**9))
        build = _paired_median_ms({
            "build": lambda: MDCIIndex.build(big, ids, cfg),
            "brute_bf16": lambda: brute_force(big, q[next(step) % len(q)], PAGE * K_TIMING),
            "brute_fp32": lambda: brute_force(big32, q[next(step) % len(q)], PAGE * K_TIMING),
        }, 7 if n <= 32768 else 3)
        index = MDCIIndex.build(big, ids, cfg)
        new = [tile(keys, 16, seed=s + 1) for s in range(8)]
        count = iter(range(10**9))

        def insert():
            c = next(count)
            index.insert(new[c % len(new)], torch.arange(n + 16 * c, n + 16 * c + 16))

        times = _paired_median_ms({
            "query": lambda: index.search(q[next(step) % len(q)], K_TIMING),
            "brute_bf16": lambda: brute_force(big, q[next(step) % len(q)], PAGE * K_TIMING),
            "brute_fp32": lambda: brute_force(big32, q[next(step) % len(q)], PAGE * K_TIMING),
        }, repeats)
        times["insert"] = _paired_median_ms({"insert": insert}, 100)["insert"]
        times["build"] = build["build"]
        brute = min(times["brute_bf16"][0], times["brute_fp32"][0])
        brute_cpu = min(times["brute_bf16"][1], times["brute_fp32"][1])
        row = {name: {"wall_ms": w, "cpu_ms": c} for name, (w, c) in times.items()}
        # the schema of the performance issue (wall-clock medians), beside the detailed rows above
        row["icecache"] = {f"{name}_ms": times[name][0] for name in ("build", "query", "insert")}
        row["brute_force"] = {"query_ms": brute}
        row["query_over_brute_wall"] = times["query"][0] / brute
        row["query_over_brute_cpu"] = times["query"][1] / brute_cpu
        row["build_over_brute_wall"] = times["build"][0] / min(build["brute_bf16"][0], build["brute_fp32"][0])
        out[str(n)] = row
        print(f"  {n:>7} keys/head, wall (cpu) ms: build {times['build'][0]:8.2f} ({times['build'][1]:8.2f}) | "
              f"query {times['query'][0]:6.3f} ({times['query'][1]:6.3f}) | brute bf16 "
              f"{times['brute_bf16'][0]:6.3f} ({times['brute_bf16'][1]:6.3f}) fp32 {times['brute_fp32'][0]:6.3f} "
              f"({times['brute_fp32'][1]:6.3f}) | query/brute {row['query_over_brute_wall']:.2f} "
              f"({row['query_over_brute_cpu']:.2f}) | insert 16 {times['insert'][0]:6.3f} "
              f"({times['insert'][1]:6.3f})", flush=True)
    return out


# ----------------------------------------------------------------------------- recall

def _order_pages(n_tokens: int, start: int, stop: int) -> torch.Tensor:
    """Token-order pages over ``[start, stop)``: ``[n_pages, PAGE]`` token ids, -1 padded."""
    ids = torch.arange(start, stop)
    pad = (-len(ids)) % PAGE
    return torch.cat([ids, torch.full((pad,), -1)]).view(-1, PAGE)


def _mask_from_pages(n: int, heads: int, pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[H_kv, n]`` bool mask of the tokens in ``pages [H_kv, K]`` (ids into ``table [H, P, S]``)."""
    mask = torch.zeros(heads, n, dtype=torch.bool)
    for h in range(heads):
        sel = pages[h][pages[h] >= 0]
        tok = table[h][sel].flatten() if table.dim() == 3 else table[sel].flatten()
        mask[h, tok[tok >= 0]] = True
    return mask


def _page_mass_topk(mass: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """Per KV head, the ``k`` pages of ``table`` (``[P, S]`` shared or ``[H, P, S]``) of largest mass."""
    if table.dim() == 2:
        table = table.expand(mass.shape[0], -1, -1)
    gathered = torch.gather(mass, 1, table.clamp_min(0).flatten(1)).view(table.shape)
    page_mass = torch.where(table >= 0, gathered, 0.0).sum(-1)
    return page_mass.topk(min(k, table.shape[1]), -1).indices


def selector_masks(keys: torch.Tensor, q: torch.Tensor, probs: torch.Tensor, indexes: dict,
                   n_s: int, n_w: int, k: int) -> dict:
    """Attended-token masks ``[H_kv, n]`` of every selector at one decode step.

    ``indexes`` maps a selector name to an :class:`MDCIIndex` over the tokens between the sink and
    the window (searched per query head, then GQA-merged, as IceCache does).
    """
    heads, n, _ = keys.shape
    group = q.shape[0] // heads
    lo, hi = n_s * PAGE, n - n_w * PAGE
    base = torch.zeros(heads, n, dtype=torch.bool)
    base[:, :lo] = True
    base[:, hi:] = True
    masks = {}
    mass = probs.view(heads, group, n).sum(1)  # attention of the group, per KV head
    for name, index in indexes.items():
        pages = merge_gqa(index.search(q, k, n_seq=n), group, k)
        masks[name] = base | _mask_from_pages(n, heads, pages, index.page_table)
    first = next(iter(indexes.values()))
    leaves = _page_mass_topk(mass, first.page_table, k)
    masks["oracle_dci_leaves"] = base | _mask_from_pages(n, heads, leaves, first.page_table)

    order = _order_pages(n, lo, hi)  # [P, S]
    masks["oracle_pages"] = base | _mask_from_pages(n, heads, _page_mass_topk(mass, order, k), order)

    mid = mass[:, lo:hi].topk(min(k * PAGE, hi - lo)).indices + lo
    tok_mask = torch.zeros(heads, n, dtype=torch.bool)
    tok_mask.scatter_(1, mid, True)
    masks["oracle_tokens"] = base | tok_mask

    # Quest's own page bounds (baselines/quest.py) over the token-order pages between sink and window, per
    # query head, then GQA-merged to K pages per KV head as IceCache merges
    kmin, kmax = page_min_max(keys[:, lo:hi], PAGE)
    bounds = page_upper_bounds(q, kmin, kmax)  # [H_q, P]
    quest = merge_gqa(bounds.topk(min(k, len(order)), -1).indices, group, k)
    masks["quest"] = base | _mask_from_pages(n, heads, quest, order)

    streaming = StreamingLLM(budget=(n_s + n_w + k) * PAGE)  # its own sinks + recent window
    stream = torch.zeros(heads, n, dtype=torch.bool)
    stream[:, sinks_and_recent(n, streaming.n_sink, streaming.budget - streaming.n_sink)] = True
    masks["streaming_llm"] = stream
    return masks


def variants(index: MDCIIndex) -> dict:
    """The default index, the plain visiting rule (``visit_chunk=1``: exactly ``ceil(0.8 c)``
    children per expanded node) and the C code's candidate rule (``candidate_rule="official"``) over the
    same tree."""
    return {"icecache": index, "icecache_chunk1": _with(index, visit_chunk=1),
            "icecache_c_rule": _with(index, candidate_rule="official")}


def _with(index: MDCIIndex, **cfg) -> MDCIIndex:
    """The same tree searched with other query-time settings."""
    other = copy.copy(index)
    other.cfg = dataclasses.replace(index.cfg, **cfg)
    return other


def model_spec(data: dict) -> ModelSpec:
    """The :class:`ModelSpec` the baselines are bound to (scaling ``d**-0.5``, as SmolLM2)."""
    heads, _, dim = data["keys"][0].shape
    return ModelSpec(n_layers=int(data.get("n_layers") or max(data["layers"]) + 1),
                     n_q_heads=data["queries"][0].shape[1], n_kv_heads=heads, head_dim=dim,
                     scaling=dim ** -0.5, max_position=0)


def pqcache_masks(keys: torch.Tensor, queries: torch.Tensor, layer: int, budget: int,
                  spec: ModelSpec, **options) -> list[torch.Tensor]:
    """PQCache's attended tokens ``[H_kv, n]`` at each step.

    Runs :class:`baselines.pqcache.PQCache` itself: its prefill end (k-means codebooks of every KV
    head on the non-sink prompt keys, seeded per layer) and its decode selection (softmax of the PQ
    logits per query head, summed over the GQA group, top-k per KV head). Attended: ``n_sink`` (2)
    sinks + ``recent = (B - n_sink) // 2`` newest prompt tokens + top-k ``B - n_sink - recent`` of the tokens
    between them (the captured prompt stands for the context; generated tokens are not captured).
    ``options``: other :class:`PQCache` hyperparameters (defaults: the baseline's).
    """
    method = PQCache(budget=budget, **options)
    seq = method.new_sequence(method.bind(spec))
    st = seq.layers[layer]
    method.fill(st, keys, keys)  # keeps sinks + recent window in st.pos, trains the codebooks
    method.await_background(st)
    seq.close()
    resident = torch.zeros(keys.shape[:2], dtype=torch.bool)
    resident[:, st.pos] = True
    return [resident.scatter(1, method.select(st, q[:, None]), True) for q in queries]


def omnikv_selections(data: dict, budget: int, spec: ModelSpec) -> dict:
    """OmniKV's selection per captured layer: ``{layer id:
    (role, sets)}`` with ``sets`` a list over steps of the ``budget`` prompt positions shared by all
    heads, or ``None`` (everything) for the dense layers before the first filter layer.

    Filter layers and roles are :class:`baselines.omnikv.OmniKV`'s (official ``2, 8, 18`` of 32
    layers scaled to the depth: SmolLM2's 30 -> ``2, 8, 17``; one dense "wait" layer after each).
    At filter layer ``f``, ``select_tokens`` takes the top-``B`` of the max over all query heads of
    ``f``'s logits (selector ``last``); every later layer up to the next filter layer uses that set.
    Unlike the method, which attends everything at filter and wait layers, the set is also applied
    there (role ``filter``/``wait``), so ``omnikv`` measures the selection at every budgeted layer;
    layers whose filter layer was not captured are left out.
    """
    method = OmniKV(budget=budget)
    roles = method.bind(spec).roles
    chosen = {layer: [select_tokens(q[:, None], keys, spec.scaling, budget, method.selector) for q in queries]
              for layer, keys, queries in zip(data["layers"], data["keys"], data["queries"])
              if roles[layer][0] == "filter"}
    out = {}
    for layer in data["layers"]:
        role, f = roles[layer]
        if role == "dense" or f in chosen:
            out[layer] = (role, None if role == "dense" else chosen[f])
    return out


def recall(data: dict, budgets, cfg: DCIConfig) -> dict:
    """Attention-mass recall per budget and selector over every layer, step and query head."""
    values: dict[int, dict[str, list]] = {b: {} for b in budgets}
    spec = model_spec(data)
    omni = {b: omnikv_selections(data, b, spec) for b in budgets}
    for layer, keys, queries in zip(data["layers"], data["keys"], data["queries"]):
        heads, n, dim = keys.shape
        k64 = keys.double()
        built = {}
        for b in budgets:
            n_s, n_w, k = budget_pages(b)
            lo, hi = n_s * PAGE, n - n_w * PAGE
            if (lo, hi) not in built:
                built[lo, hi] = variants(MDCIIndex.build(keys[:, lo:hi], torch.arange(lo, hi), cfg))
            pq = pqcache_masks(keys, queries, layer, b, spec)
            role, omni_sets = omni[b].get(layer, (None, None))
            for step, q in enumerate(queries):
                group = q.shape[0] // heads
                logits = torch.einsum("hrd,hnd->hrn", q.double().view(heads, group, dim), k64)
                probs = (logits / math.sqrt(dim)).softmax(-1).reshape(heads * group, n)
                masks = selector_masks(keys, q, probs, built[lo, hi], n_s, n_w, k)
                masks["pqcache"] = pq[step]
                if role is not None:  # dense layers attend everything
                    omni_mask = torch.ones(heads, n, dtype=torch.bool) if omni_sets is None else \
                        torch.zeros(heads, n, dtype=torch.bool).index_fill_(1, omni_sets[step], True)
                    masks["omnikv"] = omni_mask
                    if role == "sparse":
                        masks["omnikv_sparse"] = omni_mask
                for name, mask in masks.items():
                    per_q = (probs * mask.repeat_interleave(group, 0)).sum(-1)
                    values[b].setdefault(name, []).extend(per_q.tolist())
    return {str(b): {name: {"p50": float(np.percentile(v, 50)), "p10": float(np.percentile(v, 10)),
                            "mean": float(np.mean(v))} for name, v in per.items()}
            for b, per in values.items()}


# ----------------------------------------------------------------------------- main

def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"threads": torch.get_num_threads(), "numba_threads": numba.get_num_threads(),
            "torch": torch.__version__, "load_avg": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "dtype": "bfloat16 keys, fp32 index",
            "cpu": cpu, "python": platform.python_version()}


def method_configs(budgets, cfg: DCIConfig) -> dict:
    """The configurations behind the numbers: the M-DCI index's ``DCIConfig`` (the selector variants change
    only what :func:`variants` names) and, per budget, the resolved fields of the baselines run with their own
    code (:func:`evals.output.results.method_record`)."""
    return {"dci": dataclasses.asdict(cfg),
            **{str(b): {"pqcache": method_record(PQCache(budget=b)), "omnikv": method_record(OmniKV(budget=b)),
                        "streaming_llm": method_record(StreamingLLM(budget=sum(budget_pages(b)) * PAGE))}
               for b in budgets}}


def _ensure_passive_omp(argv) -> None:
    """Re-run under ``OMP_WAIT_POLICY=PASSIVE`` unless set: torch and numba each keep an OpenMP pool
    whose idle threads spin, and on a shared machine the spinning pools starve each other. The policy is
    read when OpenMP starts, i.e. before torch is imported, hence the re-exec."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "evals.bench.index", *argv])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    _ensure_passive_omp(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default=None, help="captured .pt file (see module docstring)")
    parser.add_argument("--out", default="bench_index.json")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--budgets", default="64,128,256,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer", type=int, default=0, help="entry of the file used for timing")
    parser.add_argument("--repeats", type=int, default=200, help="timed query calls per size")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    data = load(args.keys)
    cfg = DCIConfig()
    src = "SYNTHETIC clustered keys (no --keys file given)" if data["synthetic"] else f"captured keys {args.keys}"
    keys0, queries0 = data["keys"][args.layer], data["queries"][args.layer]
    print(f"M-DCI index benchmark on {src}: {len(data['keys'])} layer(s), "
          f"H_kv={keys0.shape[0]}, H_q={queries0.shape[1]}, d={keys0.shape[2]}, n={keys0.shape[1]}")
    sizes = {}
    if args.sizes:  # --sizes '' skips the timing
        print(f"timing per layer (K={K_TIMING} pages), {args.threads} threads:")
        sizes = time_sizes(keys0, queries0, [int(s) for s in args.sizes.split(",")], cfg, args.repeats)
    budgets = [int(b) for b in args.budgets.split(",")]
    rec = recall(data, budgets, cfg)
    names = list(next(iter(rec.values())).keys())
    print("recall: median / p10 (mean) by budget:")
    print(f"  {'selector':<18}" + "".join(f"{b:>22}" for b in budgets))
    for name in names:
        print(f"  {name:<18}" + "".join(
            f"{rec[str(b)][name]['p50']:>9.3f} / {rec[str(b)][name]['p10']:.3f} ({rec[str(b)][name]['mean']:.3f})"
            for b in budgets))
    result = {"source": src, "sizes": sizes, "recall": rec, "machine": machine(), **git_state(),
              "method_configs": method_configs(budgets, cfg)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
