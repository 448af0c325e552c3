"""The search-bound benchmark (evals/bench/search_bound.py): its scan reads exactly the keys it claims, and a tiny
run reports what the search scored."""
import numpy as np
import torch

from evals.bench import search_bound


def _capture(n: int = 700, layers: int = 2, steps: int = 2) -> dict:
    gen = torch.Generator().manual_seed(3)
    keys = [torch.randn(3, n, 64, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    queries = [torch.randn(steps, 9, 64, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    return {"keys": keys, "queries": queries, "layers": list(range(2, 2 + layers))}


def _stored_rows(index, h: int, count: int) -> np.ndarray:
    """The first ``count`` stored keys of KV head ``h``, pages in storage order, as fp32."""
    rows = []
    for pg in range(index.page_valid_np.shape[1]):
        rows.extend(index.page_keys[h, pg, :index.page_valid_np[h, pg]])
    bits = np.asarray(rows[:count]).astype(np.uint32) << 16
    return bits.view(np.float32)


def test_scan_reads_the_first_stored_keys_of_each_head_for_every_query_of_its_group():
    capture = _capture()
    index = search_bound.layer_indexes(capture, budget=256)[0]
    q = capture["queries"][0][0].float()
    index.search_scored(q, 12, 12)
    counts, group_q = search_bound.scan_inputs(index, q)
    assert (counts == index.search_counts[:, 0].reshape(3, 3).max(1)).all() and (counts > 0).all()
    best = search_bound.scan_keys(index.page_keys, index.page_valid_np, counts, group_q)
    for h in range(3):
        keys = _stored_rows(index, h, counts[h])
        assert len(keys) == counts[h]
        expected = (group_q[h].astype(np.float64) @ keys.T.astype(np.float64)).max(1)
        np.testing.assert_allclose(best[h], expected, rtol=1e-5, atol=1e-4)


def test_a_tiny_run_reports_both_times_and_the_scored_keys():
    row = search_bound.measure(_capture(), budget=256, steps=2, rounds=1)
    assert row["keys_per_kv_head"] == 700 and row["layers"] == 2 and row["k_pages"] == 12
    assert 0 < row["scored_per_query_head"] <= 700 and 0 < row["scored_fraction"] <= 1
    assert row["search_ms"] > 0 and row["scan_ms"] > 0
    assert row["search_over_scan"] == row["search_ms"] / row["scan_ms"]


def test_scan_serves_groups_that_are_not_a_multiple_of_three():
    index = search_bound.layer_indexes(_capture(), budget=256)[0]
    queries = np.random.default_rng(0).standard_normal((3, 4, 64)).astype(np.float32)
    counts = np.array([1, 333, 700])
    best = search_bound.scan_keys(index.page_keys, index.page_valid_np, counts, queries)
    for h in range(3):
        expected = (queries[h].astype(np.float64) @ _stored_rows(index, h, counts[h]).T.astype(np.float64)).max(1)
        np.testing.assert_allclose(best[h], expected, rtol=1e-5, atol=1e-4)
