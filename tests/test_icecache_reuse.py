"""IceCache(reuse)'s own candidates (icecache/reuse.py): the page bounds of a reusing layer's own keys over its
anchor's layout (Quest's per-page min/max), their refresh after inserts, and the method around them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_matches_full
from test_icecache_method import EXHAUSTIVE, H_KV, H_Q, Driver

from evals.registry import make_method
from icecache.reuse import PageBounds, union_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _layout(heads=2, pages=7, size=4, n=20, seed=0):
    """A random page layout of positions ``0..n-1`` per head (every position once), empty slots -1, and
    one empty page per head."""
    rng = np.random.default_rng(seed)
    page_abs = np.full((heads, pages, size), -1, dtype=np.int64)
    for h in range(heads):
        order = rng.permutation(n)
        cuts = np.sort(rng.choice(np.arange(1, n), pages - 2, replace=False))
        for p, chunk in enumerate(np.split(order, cuts)):
            page_abs[h, p, : min(len(chunk), size)] = chunk[:size]
            for t in chunk[size:]:  # overflow goes to the next empty slots of the last pages
                for q in range(pages - 2, -1, -1):
                    free = np.nonzero(page_abs[h, q] < 0)[0]
                    if free.size:
                        page_abs[h, q, free[0]] = t
                        break
    return page_abs


def _direct_bounds(page_abs, keys, first):
    heads, pages, _ = page_abs.shape
    kmin = torch.full((heads, pages, keys.shape[-1]), float("inf"))
    kmax = torch.full_like(kmin, float("-inf"))
    for h in range(heads):
        for p in range(pages):
            pos = [t for t in page_abs[h, p].tolist() if t >= 0]
            if pos:
                k = keys[h, torch.tensor(pos) - first]
                kmin[h, p], kmax[h, p] = k.min(0).values, k.max(0).values
    return kmin, kmax


def test_page_bounds_equal_a_direct_min_max_and_bound_every_score():
    first = 5
    page_abs = _layout() + first
    page_abs[page_abs < first] = -1
    keys = torch.randn(2, 20, 8, generator=torch.Generator().manual_seed(1))
    bounds = PageBounds(2, 8)
    bounds.refresh(page_abs, page_abs.shape[1], keys, first)
    kmin, kmax = _direct_bounds(page_abs, keys, first)
    valid = (page_abs >= 0).sum(-1)
    used = torch.from_numpy(valid > 0)
    assert torch.equal(bounds.kmin[used], kmin[used]) and torch.equal(bounds.kmax[used], kmax[used])
    q = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
    ub = bounds.upper_bounds(q, valid)
    for h in range(2):
        for g in range(3):
            for p in range(page_abs.shape[1]):
                pos = [t for t in page_abs[h, p].tolist() if t >= 0]
                if not pos:
                    assert ub[h, g, p] == float("-inf")
                    continue
                expected = torch.maximum(q[h, g] * kmin[h, p], q[h, g] * kmax[h, p]).sum()
                assert float(ub[h, g, p]) == pytest.approx(float(expected), rel=1e-5, abs=1e-5)
                exact = (keys[h, torch.tensor(pos) - first] @ q[h, g]).max()
                assert float(ub[h, g, p]) >= float(exact) - 1e-5  # Quest's bound is an upper bound


def test_page_bounds_recompute_exactly_the_pages_marked_stale():
    page_abs = _layout()
    keys = torch.randn(2, 20, 8, generator=torch.Generator().manual_seed(3))
    bounds = PageBounds(2, 8)
    bounds.refresh(page_abs, page_abs.shape[1], keys, 0)
    moved = keys.clone()
    moved[:, :] += 100.0  # every key changes, but only page (1, 2) is marked changed
    changed = np.zeros(page_abs.shape[:2], dtype=np.bool_)
    changed[1, 2] = True
    before = bounds.kmax.clone()
    bounds.mark_stale(changed)
    bounds.refresh(page_abs, page_abs.shape[1], moved, 0)
    fresh = _direct_bounds(page_abs, moved, 0)[1]
    assert torch.equal(bounds.kmax[1, 2], fresh[1, 2])
    keep = torch.ones(page_abs.shape[:2], dtype=torch.bool)
    keep[1, 2] = False
    keep &= torch.from_numpy((page_abs >= 0).any(-1))
    assert torch.equal(bounds.kmax[keep], before[keep])
    # pages the index grew by are computed on first use
    grown = np.concatenate([page_abs, np.full((2, 1, 4), -1)], axis=1)
    grown[0, -1, 0] = 3
    bounds.refresh(grown, grown.shape[1], moved, 0)
    assert torch.equal(bounds.kmax[0, -1], moved[0, 3])


def test_union_rows_keeps_order_and_drops_duplicates_and_padding():
    first = np.array([[3, 1, -1], [-1, -1, -1]])
    second = np.array([[1, 4], [2, 2]])
    assert union_rows(first, second).tolist() == [[3, 1, 4, -1, -1], [2, -1, -1, -1, -1]]


def test_own_candidates_need_rerank():
    with pytest.raises(ValueError, match="own_candidates"):
        make_method("icecache_reuse", budget=64, rerank=0, own_candidates=2)
    with pytest.raises(ValueError, match="own_candidates"):
        make_method("icecache_reuse", budget=64, own_candidates=-1)


def test_covering_budget_with_own_candidates_matches_full(tiny_model):
    assert_matches_full(tiny_model, "icecache_reuse", budget=256, prompt_len=200, new_tokens=8, debug=True,
                        rerank=3, own_candidates=2, **EXHAUSTIVE)


def test_reusing_layer_finds_the_page_only_its_own_keys_point_to():
    """Layer 3 reuses anchor 2. Layer 3's own key 150 is long (6x) and the query is aligned with it, so nearly
    all of layer 3's attention is on token 150 while layer 2's keys there are random: with own candidates layer
    3 attends token 150 at every step; with the anchor's candidates only, it does not (on this seed). (Quest's
    bound is loose on random keys; a long key makes its page's bound the largest.)"""
    found = {}
    for own in (0, 2):
        m = make_method("icecache_reuse", budget=128, page_size=16, rerank=2, own_candidates=own, debug=True)
        drv = Driver(m, prompt=300, seed=11)
        st = drv.states[3]
        m.await_background(st)
        drv.k[3][:, 150] *= 6
        st.store.keys()[:, 150 - st.store.first_pos] *= 6
        q = drv.k[3][torch.arange(H_Q) // (H_Q // H_KV), 150][:, None]
        hits = []
        for _ in range(20):  # crosses an eviction and its insert
            drv.step(q)
            hits.append(all(150 in m.attended_positions(drv.states[3])[h].tolist() for h in range(H_KV)))
            assert m.resident_tokens(drv.states[3]) <= m.budget
        found[own] = hits
    assert all(found[2]) and not any(found[0])


def test_rerank_variant_resolves_per_budget_and_explicit_values_win():
    for budget, own in [(64, 4), (128, 4), (248, 4), (256, 0), (512, 0)]:
        m = make_method("icecache_reuse_rerank", budget=budget)
        assert (m.rerank, m.own_candidates) == (3, own)
    official = make_method("icecache_reuse", budget=64)
    assert (official.rerank, official.own_candidates, official.page_size) == (0, 0, 16)  # the anchor's pages
    assert make_method("icecache_reuse_rerank", budget=64, own_candidates=1).own_candidates == 1
    assert make_method("icecache_reuse", budget=64, rerank=2).rerank == 2
