"""ArkVale's components (baselines/arkvale.py): the page digest and its bound, the recall/evict bookkeeping,
the budget mapping. Equality with full attention under a covering budget is tests/test_contract.py's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from baselines.arkvale import ArkVale, page_digests, page_scores
from icecache.kv import BudgetError, LayerState
from icecache.kv.base import ModelSpec
from icecache.kv.timing import PhaseTimer


def spec(h_kv=2, h_q=4, d=8):
    return ModelSpec(n_layers=1, n_q_heads=h_q, n_kv_heads=h_kv, head_dim=d, scaling=d ** -0.5, max_position=4096)


def true_page_max(q: torch.Tensor, k: torch.Tensor, ps: int) -> torch.Tensor:
    """``[H_q, P]``: max over each page's keys of ``q_h . k`` (query head ``h`` reads KV head ``h // G``), direct."""
    group = q.shape[0] // k.shape[0]
    n_pages = k.shape[1] // ps
    out = torch.empty(q.shape[0], n_pages)
    for h in range(q.shape[0]):
        for p in range(n_pages):
            out[h, p] = max(float(q[h] @ k[h // group, j]) for j in range(p * ps, (p + 1) * ps))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_bounding_box_digest_bounds_every_page(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 40, 8, generator=g) * 3 + torch.randn(2, 1, 8, generator=g)
    q = torch.randn(4, 8, generator=g) * 2
    centre, radius = page_digests(k, 8, "cuboid_max")
    assert centre.shape == (2, 5, 8)
    exact = true_page_max(q, k, 8)
    for h in range(4):  # one query head at a time: the bound of that head
        bound = page_scores(q[h: h + 1], centre[h // 2: h // 2 + 1], radius[h // 2: h // 2 + 1])
        assert (bound >= exact[h] - 1e-5).all()
    # the score the method uses is the mean over the heads of those bounds (official estimate_scores)
    assert (page_scores(q, centre, radius) >= exact.mean(0) - 1e-5).all()


def test_official_digest_is_the_mean_deviation_box_and_not_a_bound():
    """``cuboid_mean`` is the official ``_summarize_keys`` (layout ``[bsz, pages, page_size, H, d]``), whose box
    is tighter than the keys' range: on random keys some page's score is below its true max. ``cuboid_center``
    is the paper's third radius (Section 5.2); both lie within the bounding box's."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 64, 8, generator=g)
    keys = k.permute(1, 0, 2).reshape(1, 8, 8, 2, 8)  # official layout
    maxs, mins = keys.max(dim=2).values, keys.min(dim=2).values
    centers = (maxs + mins) / 2
    dists = (centers.reshape(1, 8, 1, 2, 8) - keys).abs().mean(dim=2)
    centre, radius = page_digests(k, 8, "cuboid_mean")
    torch.testing.assert_close(centre, centers[0].permute(1, 0, 2))
    torch.testing.assert_close(radius, dists[0].permute(1, 0, 2))
    q = torch.randn(4, 8, generator=g)
    exact = true_page_max(q, k, 8)
    bound = torch.stack([page_scores(q[h: h + 1], centre[h // 2: h // 2 + 1], radius[h // 2: h // 2 + 1])
                         for h in range(4)])
    assert (bound < exact - 1e-3).any()
    _, r_center = page_digests(k, 8, "cuboid_center")
    _, r_max = page_digests(k, 8, "cuboid_max")
    dev = (centers.reshape(1, 8, 1, 2, 8) - keys).abs()  # the paper's r_center = (min |c - k| + r_max) / 2
    torch.testing.assert_close(r_center, ((dev.amin(2) + dev.amax(2)) / 2)[0].permute(1, 0, 2))
    assert (radius <= r_max + 1e-6).all() and (r_center <= r_max + 1e-6).all()


def build(budget=32, page_size=4, prompt=48, seed=0, **hp):
    """An ArkVale layer after a prefill of ``prompt`` random keys; returns (method, state, k, v)."""
    method = ArkVale(budget=budget, page_size=page_size, **hp)
    bound = method.bind(spec())
    st = method.new_sequence(bound).layers[0]
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, prompt, 8, generator=g), torch.randn(2, prompt, 8, generator=g)
    method.fill(st, k, v, torch.randn(4, prompt, 8, generator=g))
    return method, st, k, v


def check_slots(method, st, k, v):
    """Every used slot holds its page's true K/V; the page table is a bijection; at most page_budget slots."""
    ps = method.page_size
    assert st.used_slots <= method.page_budget
    assert st.k.shape[1] <= method.budget
    for slot in range(st.used_slots):
        page = st.slot_page[slot]
        assert st.page_slot[page] == slot
        rows = slice(page * ps, min(k.shape[1], (page + 1) * ps))
        n = rows.stop - rows.start
        torch.testing.assert_close(st.kbuf[:, slot * ps: slot * ps + n], k[:, rows])
        torch.testing.assert_close(st.vbuf[:, slot * ps: slot * ps + n], v[:, rows])
    assert (st.page_slot >= 0).sum() == st.used_slots


def test_prefill_keeps_sinks_top_pages_and_window():
    method, st, k, v = build()  # 12 pages, 8 slots: 2 sinks, 4 by score, 2 window
    assert list(st.slot_page[:2]) == [0, 1] and list(st.slot_page[-2:]) == [10, 11]
    assert len(set(st.slot_page[2:6])) == 4 and all(2 <= p < 10 for p in st.slot_page[2:6])
    check_slots(method, st, k, v)
    assert st.centre.shape[1] == 11  # the last page gets its digest when the next one starts


def test_selected_page_is_recalled_into_the_lowest_scored_resident_slot():
    method, st, k, v = build()
    missing = next(p for p in range(2, 10) if st.page_slot[p] < 0)
    q = torch.zeros(4, 1, 8)
    q[:, 0] = st.centre[:, missing].repeat_interleave(2, 0) * 100  # scores `missing` far above the rest
    before = st.slot_page.copy()
    assert list(before[6:]) == [10, 11]  # the window pages
    new_k, new_v = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    # token 48 starts page 12: the window rotates, page 10 leaves slot 6 for the host
    method.step(st, q, new_k, new_v, PhaseTimer())
    k, v = torch.cat([k, new_k], 1), torch.cat([v, new_v], 1)
    assert st.page_slot[10] < 0 and st.slot_page[6] == 11 and st.slot_page[7] == 12 and st.evictions == 1
    scores = page_scores(q[:, 0], st.centre, st.radius)  # the step's digests: recalling a page changes none
    selected = method.select(st, q)  # the step's selection (select only reads the digests)
    assert len(selected) == method.topk_of(8) == 1 and selected[0] == missing
    victim_slot = 2 + int(np.argmin(scores[before[2:6]].numpy()))
    assert st.slot_page[victim_slot] == missing and st.page_slot[before[victim_slot]] == -1
    kept = [s for s in range(6) if s != victim_slot]  # sinks and scored slots other than the victim's: unchanged
    assert st.slot_page[kept].tolist() == before[kept].tolist()
    assert st.recalls == 1 and st.bytes_moved == 2 * 2 * 4 * 8 * 4
    check_slots(method, st, k, v)
    method.fetch(st, method.select(st, q))  # selected and resident now: nothing moves
    assert st.recalls == 1


@pytest.mark.parametrize("prompt", [48, 21])  # over the budget from the prefill, or only after 27 decode steps
def test_decode_bookkeeping_holds_over_many_steps(prompt):
    method, st, k, v = build(budget=48, page_topks=5, prompt=prompt)  # 12 slots, top 5 - 2 - 1 = 2 per step
    g = torch.Generator().manual_seed(1)
    timer = PhaseTimer()
    for _ in range(88 - prompt):
        new_k, new_v = torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)
        q = torch.randn(4, 1, 8, generator=g)
        method.step(st, q, new_k, new_v, timer)
        k, v = torch.cat([k, new_k], 1), torch.cat([v, new_v], 1)
        selected = method.select(st, q)  # the step's selection (select only reads the digests)
        # what the step attended is st.k (ArkVale fetches the used slots as they are)
        if st.n_seen <= 48:  # the context fits: every token attended, in order, no selection
            assert selected is None and torch.equal(st.k, k)
            continue
        assert (st.page_slot[selected] >= 0).all()  # every selected page is resident after the step
        assert st.k.shape[1] == 11 * 4 + (st.n_seen - 1) % 4 + 1  # the attended rows: every resident one
        check_slots(method, st, k, v)
    assert st.recalls > 0 and st.evictions == 10


def test_budget_mapping_and_nearest_valid_budget():
    method = ArkVale(budget=256)
    assert method.page_budget == 8 and method.topk_of(8) == 1  # 8 // 2 - 2 - (2 - 1)
    with pytest.raises(BudgetError, match=r"nearest valid budgets: 288 or 320"):
        ArkVale(budget=300)
    with pytest.raises(BudgetError, match=r"nearest valid budgets: 256$"):
        ArkVale(budget=128)  # 4 pages leave no scored page after 2 sink and 2 window pages
    assert ArkVale(budget=128, page_size=16).page_budget == 8
    with pytest.raises(BudgetError, match=r"nearest valid budgets: 160$"):
        ArkVale(budget=96, page_topks=4)  # page_topks must stay below the pages: 5 pages of 32 at least


@pytest.mark.parametrize("budget,page_size", [(64, 8), (128, 16), (256, 32)])
def test_the_scripts_page_topks_is_the_papers_cap_at_small_budgets(budget, page_size):
    """The LongBench and passkey scripts pass page_topks=32 for 128-page budgets (benchmark/longbench_pred.py
    line 38, passkey_pred.py line 139); below 33 pages the official InferState would refuse it (it asserts
    page_topks < page_budgets), and it is read as the paper's cap C of k = min(C, c/2) / p (Section 5.1):
    page_budgets // 2 = 4 of 8 pages, as the default. Where the official code accepts it, it is used as is."""
    longbench = ArkVale(budget=budget, page_size=page_size, page_topks=32, n_sink_pages=1, n_dense_layers=2)
    assert longbench.page_budget == 8 and longbench.topk_of(8) == 4 - 1 - 1
    passkey = ArkVale(budget=budget, page_size=page_size, page_topks=32, n_dense_layers=2)
    assert passkey.topk_of(8) == ArkVale(budget=budget, page_size=page_size).topk_of(8) == 4 - 2 - 1
    assert ArkVale(budget=40 * 32, page_topks=32).topk_of(40) == 32 - 2 - 1  # 40 pages: the official value
    assert ArkVale(budget=128 * 32, page_topks=32).topk_of(128) == 32 - 2 - 1  # the scripts' own 128 pages


def test_a_fractional_budget_resolves_to_whole_pages(tmp_path):
    """GSM8K's ``budget=0.1`` of a 3,418-token prompt: 341 tokens, read as 10 whole 32-token pages (320) for
    ArkVale and as 336 (a multiple of 16, PQCache's rounding) for a method without fixed pages; a prompt whose
    fraction leaves too few pages is refused with the reason."""
    from evals import harness

    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "arkvale"}, "eval": {"name": "passkey", "lengths": [160], "depths": 1},
           "budget": 0.1, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "debug": False, "progress": False}
    plan = harness.plan(cfg)
    assert plan.method(3418).budget == 320 and plan.method(3418).page_budget == 10
    assert harness.plan(dict(cfg, cache={"name": "arkvale", "page_size": 8})).method(3418).budget == 336
    assert harness.plan(dict(cfg, cache={"name": "pqcache"})).method(3418).budget == 336
    with pytest.raises(BudgetError, match="not a valid page budget"):
        plan.method(2000)  # 200 tokens: 6 pages, fewer than the 8 that leave one scored page


def test_dense_layers_keep_everything():
    method = ArkVale(budget=32, page_size=4, n_dense_layers=1)
    dense, budgeted = method.new_sequence(method.bind(dataclasses.replace(spec(), n_layers=2))).layers
    assert type(dense) is LayerState and not method.is_budgeted(dense) and method.is_budgeted(budgeted)
