"""How much of the M-DCI index a search scores: the per-query-head counts of ``_search.search`` (keys whose ``q.k``
it computed, nodes it expanded), their running summary ``MDCIIndex.search_stats`` and IceCache's ``layer_stats``
(``timing.json`` ``method_stats``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evals.harness import run_eval
from evals.registry import make_cache
from helpers import build_tiny
from icecache.dci import DCIConfig, MDCIIndex

D = 32
STATS = {"search_calls", "search_indexed_keys", "search_scored_keys", "search_scored_fraction",
         "search_scored_fraction_min", "search_scored_fraction_max", "search_nodes_expanded"}


def _keys(heads: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, D, generator=gen) * (0.5 + torch.rand(heads, n, 1, generator=gen))


def reference_counts(index: MDCIIndex, keys: torch.Tensor, q: torch.Tensor, head: int, k_pages: int,
                     fov: int) -> tuple[int, int]:
    """(keys scored, nodes expanded) of one query's search when every child of an expanded node is scored
    (``prop_to_retrieve = 1``), from the tree alone (each token's level, parent and page) and fp64 scores, as in
    ``dci_reference.search_pages``: every child of a kept node is scored; per upper level the children found
    are ranked and at least ``min(fov, found)`` of them kept, more until ``k_pages`` level-0 pages are below
    them; the virtual root and every kept node are expanded."""
    level = index.level[: index.n]
    parent = (index.token_parent[head] + 1).tolist()  # node ids: 0 = virtual root, i + 1 = token i
    page = index.token_page[head].tolist()
    score = (keys[head].double() @ q.double()).tolist()
    children: dict[int, list[int]] = {}
    for t in range(index.n):
        children.setdefault(parent[t], []).append(t)
    memo: dict[int, int] = {}

    def pages_below(node: int) -> int:
        if node not in memo:
            kids = children.get(node, [])
            memo[node] = (len({page[t] for t in kids}) if kids and level[kids[0]] == 0
                          else sum(pages_below(t + 1) for t in kids))
        return memo[node]

    kept, scored, nodes = [0], 0, 0
    for _ in range(int(level.max())):
        nodes += len(kept)
        found = sorted((t for node in kept for t in children.get(node, [])), key=lambda t: -score[t])
        scored += len(found)
        n_kept = min(fov, len(found))
        while sum(pages_below(t + 1) for t in found[:n_kept]) < k_pages and n_kept < len(found):
            n_kept += 1
        kept = [t + 1 for t in found[:n_kept]]
    return scored + sum(len(children.get(node, [])) for node in kept), nodes + len(kept)


@pytest.mark.parametrize("rule", ["scored", "official"])
@pytest.mark.parametrize("n, ratio_1, min_fov, k_pages", [(1500, 0.02, 5, 3), (4000, 0.01, 8, 2),
                                                          (4000, 0.05, 3, 12)])
def test_counts_equal_a_reference_walk_of_the_tree(rule, n, ratio_1, min_fov, k_pages):
    """prop 1: each query head's keys scored and nodes expanded equal a plain walk of the tree, for both
    candidate rules (the rule changes which scored keys rank pages, not which are scored)."""
    heads, group = 2, 3
    keys = _keys(heads, n, seed=n + min_fov)
    index = MDCIIndex.build(keys, torch.arange(n), DCIConfig(ratio_1=ratio_1, min_fov=min_fov, prop_to_retrieve=1.0,
                                                             candidate_rule=rule))
    assert len(index.level_sizes) >= 3  # premise: levels to descend
    q = torch.randn(heads * group, D, generator=torch.Generator().manual_seed(1))
    index.search(q, k_pages)
    expect = [reference_counts(index, keys, q[qh], qh // group, k_pages, index.cfg.fov(n))
              for qh in range(heads * group)]
    assert index.search_counts.tolist() == [list(e) for e in expect]
    assert (index.search_counts[:, 0] < n).all()  # premise: not a brute force


def test_a_field_of_view_over_every_node_scores_every_key():
    """min_fov larger than any level and prop 1: every key is scored once (fraction 1.0) and the virtual root
    and every upper-level token are expanded, also after inserts (the fraction is of the keys at that search)."""
    n = 3000
    index = MDCIIndex.build(_keys(3, n, seed=2), torch.arange(n), DCIConfig(min_fov=10**9, prop_to_retrieve=1.0))
    q = torch.randn(9, D, generator=torch.Generator().manual_seed(3))
    index.search(q, 4)
    assert index.search_counts.tolist() == [[n, 1 + index.n_upper]] * 9
    index.insert(_keys(3, 40, seed=4), torch.arange(n, n + 40))
    index.search(q, 4)
    assert index.search_counts.tolist() == [[n + 40, 1 + index.n_upper]] * 9
    stats = index.search_stats()
    assert stats["search_scored_fraction"] == stats["search_scored_fraction_min"] == 1.0
    assert stats["search_scored_fraction_max"] == 1.0 and stats["search_calls"] == 2
    assert stats["search_indexed_keys"] == n + 20 and stats["search_scored_keys"] == n + 20


@pytest.mark.parametrize("chunk, prop, scored", [(128, 0.8, 512), (1, 0.8, 480), (50, 0.3, 200), (128, 1.0, 600)])
def test_one_large_node_scores_the_chunks_of_its_walk(chunk, prop, scored):
    """One level of 600 keys (the root's children): a query scores the chunks of ``visit_chunk`` children around
    ``p(q)`` until ``ceil(prop * 600)`` are reached: 4 x 128 = 512 at 0.8, exactly 480 with chunks of 1, 4 x 50 =
    200 at 0.3, all 600 at 1.0; one node (the root) is expanded."""
    n = 600
    index = MDCIIndex.build(_keys(1, n, seed=4), torch.arange(n),
                            DCIConfig(ratio_1=0.001, prop_to_retrieve=prop, visit_chunk=chunk))
    assert index.level_sizes == [n]
    index.search(torch.randn(5, D, generator=torch.Generator().manual_seed(5)), 4)
    assert index.search_counts.tolist() == [[scored, 1]] * 5
    assert index.search_stats()["search_scored_fraction"] == pytest.approx(scored / n)


def test_counts_of_a_group_search_equal_one_search_per_query_head():
    """The query heads of a KV head search together (level 0 in one pass); each one's counts are its own."""
    n = 4000
    index = MDCIIndex.build(_keys(3, n, seed=6), torch.arange(n), DCIConfig(min_fov=6))
    q = torch.randn(9, D, generator=torch.Generator().manual_seed(7))
    index.search(q, 4)
    together = index.search_counts.copy()
    alone = {}
    for r in range(3):  # one query head of each KV head at a time
        rows = [r, r + 3, r + 6]
        index.search(q[rows], 4)
        alone.update(zip(rows, index.search_counts.tolist()))
    assert together.tolist() == [alone[qh] for qh in range(9)]
    assert len(set(together[:, 0].tolist())) > 1  # premise: the heads differ


def test_search_stats_summarise_every_search():
    """``search_stats``: means over searches of the per-query-head means, extremes over searches and heads,
    each fraction against the keys in the index at its search."""
    n = 2500
    index = MDCIIndex.build(_keys(2, n, seed=8), torch.arange(n), DCIConfig(min_fov=4))
    assert index.search_stats() == {}
    gen = torch.Generator().manual_seed(9)
    counts, sizes = [], []
    for step in range(5):
        index.search(torch.randn(4, D, generator=gen), 3)
        counts.append(index.search_counts.copy())
        sizes.append(index.n)
        index.insert(_keys(2, 16, seed=20 + step), torch.arange(index.n, index.n + 16))
    frac = [c[:, 0] / s for c, s in zip(counts, sizes)]
    assert index.search_stats() == pytest.approx({
        "search_calls": 5, "search_indexed_keys": np.mean(sizes),
        "search_scored_keys": np.mean([c[:, 0].mean() for c in counts]),
        "search_scored_fraction": np.mean([f.mean() for f in frac]),
        "search_scored_fraction_min": min(f.min() for f in frac),
        "search_scored_fraction_max": max(f.max() for f in frac),
        "search_nodes_expanded": np.mean([c[:, 1].mean() for c in counts])})


@pytest.mark.parametrize("method, searched", [("icecache", (2, 3, 4, 5)), ("icecache_tuned", (2, 3, 4, 5)),
                                              ("icecache_reuse", (2, 5))])
def test_icecache_layers_report_their_searches(one_thread, method, searched):
    """Every budgeted layer with an index reports its searches in ``method_stats``: one per decode step; the
    dense layers 0-1 and IceCache(reuse)'s reusing layers 3-4 (no index, no search) report none."""
    model = build_tiny(n_layers=6)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    cache = make_cache(method, model, budget=64)
    new_tokens = 6
    try:
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       past_key_values=cache)
    finally:
        cache.close()
    stats = cache.method_stats()
    assert set(stats) == STATS
    for layer in range(6):
        values = {name: stats[name][layer] for name in STATS}
        if layer not in searched:
            assert set(values.values()) == {None}, layer
            continue
        assert values["search_calls"] == new_tokens - 1
        assert 0 < values["search_scored_fraction_min"] <= values["search_scored_fraction"]
        assert values["search_scored_fraction"] <= values["search_scored_fraction_max"] <= 1.0
        assert values["search_scored_keys"] == pytest.approx(values["search_scored_fraction"]
                                                             * values["search_indexed_keys"], rel=0.05)
        assert values["search_nodes_expanded"] >= 1
        assert 300 - 64 <= values["search_indexed_keys"] <= 300 + new_tokens


def test_timing_json_records_icecache_search_stats(tmp_path):
    """The per-layer search summary reaches ``timing.json`` (means over the samples)."""
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "icecache"}, "eval": {"name": "passkey", "lengths": [200], "depths": 2,
                                                   "question_via_decode": True, "max_new_tokens": 3},
           "budget": 64, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"),
           "data_dir": None, "device": "cpu", "debug": True, "progress": False}
    stats = json.loads((run_eval(cfg) / "timing.json").read_text())["method_stats"]
    assert set(stats) == STATS
    assert stats["search_calls"][:2] == [None, None]
    assert all(0 < f <= 1 for f in stats["search_scored_fraction"][2:])
