"""The PQCache and OmniKV selectors of the recall benchmark (evals/bench/index.py), on small synthetic captures."""

import math

import pytest
import torch

from baselines.pqcache import PQCache
from evals.bench import index as bench
from icecache.dci import DCIConfig

N, STEPS = 1024, 4
LAYERS = [1, 2, 3, 4]  # of a 30-layer model: 1 dense, 2 filter (filters 2, 8, 17), 3 wait, 4 sparse


@pytest.fixture(scope="module")
def data():
    parts = [bench.synthetic(n=N, steps=STEPS, seed=i) for i in range(len(LAYERS))]
    return {"keys": [p["keys"][0] for p in parts], "queries": [p["queries"][0] for p in parts],
            "layers": LAYERS, "n_layers": 30, "synthetic": True}


def attention(keys, q):
    """Exact fp64 attention ``[H_q, n]`` of ``q [H_q, d]`` over ``keys [H_kv, n, d]``."""
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [H_q, n, d]
    return (torch.einsum("hd,hnd->hn", q.double(), k) / math.sqrt(keys.shape[-1])).softmax(-1)


def recall_of(mask, keys, q):
    group = q.shape[0] // keys.shape[0]
    return (attention(keys, q) * mask.repeat_interleave(group, 0)).sum(-1)


@pytest.mark.parametrize("budget", [64, 256])
def test_budget_respected(data, budget):
    spec = bench.model_spec(data)
    keys, queries = data["keys"][0], data["queries"][0]
    sinks = PQCache.n_sink  # the class default (2)
    for mask in bench.pqcache_masks(keys, queries, 0, budget, spec):
        assert (mask.sum(-1) == budget).all()  # sinks + (B - sinks)//2 recent + top-k, per KV head
        assert mask[:, :sinks].all() and mask[:, N - (budget - sinks) // 2:].all()
    omni = bench.omnikv_selections(data, budget, spec)
    assert omni[1] == ("dense", None) and [role for role, _ in omni.values()] == ["dense", "filter", "wait", "sparse"]
    for layer in (2, 3, 4):
        assert all(len(s) == budget == len(set(s.tolist())) for s in omni[layer][1])


def test_full_budget_recall_is_one(data):
    spec = bench.model_spec(data)
    omni = bench.omnikv_selections(data, N, spec)
    for layer, keys, queries in zip(data["layers"], data["keys"], data["queries"]):
        pq = bench.pqcache_masks(keys, queries, layer, N, spec)
        _, sets = omni[layer]
        for step, q in enumerate(queries):
            assert pq[step].all()
            omni_mask = torch.ones(keys.shape[:2], dtype=torch.bool)
            if sets is not None:
                omni_mask = torch.zeros_like(omni_mask).index_fill_(1, sets[step], True)
            for mask in (pq[step], omni_mask):
                assert torch.allclose(recall_of(mask, keys, q), torch.ones(q.shape[0], dtype=torch.float64))


def test_omnikv_matches_direct_topk(data):
    """At a filter layer the set is the top-B of the max over all query heads of the logits (selector
    ``last``), and the next layers reuse it."""
    budget = 64
    omni = bench.omnikv_selections(data, budget, bench.model_spec(data))
    keys, queries = data["keys"][1], data["queries"][1]  # layer 2: a filter layer
    group = queries.shape[1] // keys.shape[0]
    for step, q in enumerate(queries):
        logits = torch.einsum("hd,hnd->hn", q.float(), keys.float().repeat_interleave(group, 0))
        direct = logits.max(0).values.topk(budget).indices
        assert set(omni[2][1][step].tolist()) == set(direct.tolist())
        assert omni[3][1][step] is omni[2][1][step] and omni[4][1][step] is omni[2][1][step]


def test_pqcache_with_exact_codes_matches_direct_topk(data):
    """With a centroid per key (PQ scores = exact scores), the retrieved tokens are the top-k of the
    softmax per query head summed over the GQA group, among the tokens between sinks and window."""
    budget = 128
    keys, queries = data["keys"][0], data["queries"][0]
    masks = bench.pqcache_masks(keys, queries, 0, budget, bench.model_spec(data), n_bits=10)
    sinks = PQCache.n_sink
    recent = (budget - sinks) // 2
    lo, hi, k = sinks, N - recent, budget - sinks - recent
    for step, q in enumerate(queries):
        group_mass = attention(keys[:, lo:hi], q).view(keys.shape[0], -1, hi - lo).sum(1)
        direct = group_mass.topk(k).indices + lo
        expected = torch.zeros(keys.shape[:2], dtype=torch.bool).scatter(1, direct, True)
        expected[:, :lo] = expected[:, hi:] = True
        assert torch.equal(masks[step], expected)


def test_recall_reports_new_selectors(data):
    rec = bench.recall(data, [64], DCIConfig())["64"]
    for name in ("pqcache", "omnikv", "omnikv_sparse"):
        assert 0.0 < rec[name]["p10"] <= rec[name]["p50"] <= 1.0 + 1e-9


def test_timing_rows_carry_the_issue_schema():
    """``bench_index.json`` sizes rows hold ``icecache: {build_ms, query_ms, insert_ms}`` and
    ``brute_force: {query_ms}`` (the performance issue's schema) next to the wall/CPU details."""
    small = bench.synthetic(n=512, steps=2)
    row = bench.time_sizes(small["keys"][0], small["queries"][0], [512], DCIConfig(), repeats=2)["512"]
    assert set(row["icecache"]) == {"build_ms", "query_ms", "insert_ms"}
    assert row["icecache"]["query_ms"] == row["query"]["wall_ms"] > 0
    assert row["brute_force"]["query_ms"] == min(row["brute_bf16"]["wall_ms"], row["brute_fp32"]["wall_ms"])
