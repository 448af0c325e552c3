"""Tests of the M-DCI index (icecache/dci; the authors' M-DCI)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icecache.dci import DCIConfig, MDCIIndex, merge_gqa
from icecache.dci.levels import assign_levels, level_sizes
from dci_reference import (
    key_key_distance,
    key_projection,
    query_projection,
    search_pages,
    transform_keys,
    transform_queries,
)

D = 32


def _keys(heads: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = 0.5 + torch.rand(heads, n, 1, generator=gen)  # varied norms exercise the lift
    return torch.randn(heads, n, D, generator=gen) * scale


def check_invariants(index: MDCIIndex) -> None:
    """Every token in exactly one page per head, pages within capacity, siblings only, maps agree."""
    s = index.cfg.page_size
    table, valid = index.page_table.numpy(), index.page_valid.numpy()
    ids = index.token_ids.numpy()
    tok_page = index.token_page.numpy()
    for h in range(index.heads):
        assert (valid[h] <= s).all() and (valid[h] >= 0).all()
        used = np.arange(s)[None, :] < valid[h][:, None]
        assert (table[h][used] >= 0).all() and (table[h][~used] == -1).all()
        assert sorted(table[h][used].tolist()) == sorted(ids.tolist())
        n_h = int(index.n_pages_h[h])
        assert (valid[h, :n_h] >= 1).all() and (valid[h, n_h:] == 0).all()
        # token -> page map agrees with the table
        slots = index.tok_slot[h, : index.n]
        assert (table[h, tok_page[h], slots] == ids).all()
        # tokens of a page share one parent, and the page belongs to that parent
        parents = index.parent[h, : index.n]
        assert (index.page_node[h, tok_page[h]] == parents).all()
        # each node's page chain holds exactly its children, sorted by projection
        for node in np.unique(parents):
            pg, chain = index.node_first[h, node], []
            for _ in range(index.node_npages[h, node]):
                chain.extend(index.page_proj[h, pg, : valid[h, pg]].tolist())
                pg = index.page_next[h, pg]
            assert pg == -1
            assert len(chain) == int((parents == node).sum())
            assert chain == sorted(chain)


def test_deterministic_levels_match_reference_rule():
    assert level_sizes(assign_levels(36000, DCIConfig())) == [35553, 356, 72, 15, 4]
    assert level_sizes(assign_levels(128000, DCIConfig())) == [126416, 1265, 254, 51, 11, 3]


def test_transform_ranking_equals_inner_product_ranking():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 500, D, generator=gen, dtype=torch.float64) * torch.rand(2, 500, 1, generator=gen)
    q = torch.randn(2, D, generator=gen, dtype=torch.float64)
    m2 = (keys * keys).sum(-1).max(-1).values
    tk = transform_keys(keys, m2).double()
    tq = transform_queries(q).double()
    dist = ((tk - tq[:, None, :]) ** 2).sum(-1)
    ip = torch.einsum("hnd,hd->hn", keys, q)
    assert torch.equal(dist.argsort(-1), (-ip).argsort(-1))
    # the key-key distance is half the squared transformed distance
    dd = key_key_distance(keys[:, :5], keys[:, 5:9], m2)
    ref = ((tk[:, :5, None] - tk[:, None, 5:9]) ** 2).sum(-1) / 2
    assert torch.allclose(dd.double(), ref, atol=1e-3)


@pytest.mark.parametrize("promotion", ["deterministic", "random"])
def test_invariants_after_build_and_inserts(promotion):
    cfg = DCIConfig(promotion=promotion, ratio_1=0.05)
    keys = _keys(3, 1500)
    index = MDCIIndex.build(keys.bfloat16(), torch.arange(100, 1600), cfg)
    check_invariants(index)
    assert len(index.level_sizes) >= 2
    for step in range(40):
        grow = 1.0 + 0.02 * step  # growing norms force lazy M corrections
        new = _keys(3, 16, seed=10 + step) * grow
        index.insert(new, torch.arange(1600 + 16 * step, 1616 + 16 * step))
    check_invariants(index)
    assert index.n == 1500 + 640


def test_parents_are_nearest_upper_points_under_D():
    keys = _keys(2, 2500)
    index = MDCIIndex.build(keys, torch.arange(2500), DCIConfig(ratio_1=0.05))
    m2 = index.max_sq_norm
    level = index.level[: index.n]
    for t in range(index.top_level):
        pts, ups = np.flatnonzero(level == t), np.flatnonzero(level == t + 1)
        dist = key_key_distance(keys[:, pts], keys[:, ups], m2)
        chosen = index.token_parent[:, pts]
        best = dist.min(-1).values
        got = dist.gather(-1, torch.from_numpy(np.searchsorted(ups, chosen.numpy()))[..., None])[..., 0]
        assert torch.allclose(got, best, atol=1e-4)


def _parent_distance(index: MDCIIndex, keys: torch.Tensor) -> torch.Tensor:
    """``D`` between every level-0 token and its parent, ``[H, n0]``."""
    level = index.level[: index.n]
    pts = np.flatnonzero(level == 0)
    parents = index.token_parent[:, pts]  # local ids
    m2 = index.max_sq_norm
    d = [key_key_distance(keys[h:h + 1, pts], keys[h:h + 1, parents[h]], m2[h:h + 1])[0].diagonal()
         for h in range(keys.shape[0])]
    return torch.stack(d)


def test_anchor_shortcut_is_close_to_exact_parents():
    keys = _keys(2, 6000)
    cfg = DCIConfig(exact_parent_threshold=1000)
    fast = MDCIIndex.build(keys, torch.arange(6000), cfg)
    exact = MDCIIndex.build(keys, torch.arange(6000), DCIConfig(exact_parent_threshold=1000, use_anchors=False))
    check_invariants(fast)
    agree = (fast.token_parent == exact.token_parent).float().mean()
    assert agree > 0.8
    # a wrong parent is accepted only when it is nearly as close as the true one
    ratio = _parent_distance(fast, keys) / _parent_distance(exact, keys)
    assert (ratio >= 1 - 1e-4).all() and ratio.mean() < 1.02


def test_anchor_shortcut_with_complete_candidates_is_exact():
    # ~15 upper points, dense anchors and a window over all of them: the anchors have every upper
    # point as a parent, so the candidates are complete and the result is exact (no threshold test)
    keys = _keys(2, 3000)
    cfg = DCIConfig(exact_parent_threshold=1000, ratio_1=0.005, anchor_interval=2, anchor_window=10000)
    fast = MDCIIndex.build(keys, torch.arange(3000), cfg)
    exact = MDCIIndex.build(keys, torch.arange(3000), DCIConfig(exact_parent_threshold=1000, ratio_1=0.005,
                                                                use_anchors=False))
    level0 = np.flatnonzero(exact.level[:3000] == 0)
    anchor_parents = exact.token_parent[:, level0[::2]]
    assert all(len(set(p.tolist())) == exact.level_sizes[1] for p in anchor_parents)  # premise
    assert torch.equal(fast.token_parent, exact.token_parent)


def _visited_run(proj: np.ndarray, qp: float, prop: float, chunk: int, need: int) -> tuple[int, int]:
    """Reference of the C code's visiting order in one node (``dci_next_closest_proj`` chunks)."""
    c = len(proj)
    left = int(np.searchsorted(proj, qp, side="left")) - 1
    right, scored, want = left + 1, 0, max(int(np.ceil(prop * c - 1e-9)), 1)
    while left >= 0 or right < c:
        if left < 0 or (right < c and proj[right] - qp < qp - proj[left]):
            from_right = True
        else:
            from_right = False
        for _ in range(chunk):
            if left < 0 and right >= c:
                break
            if (from_right and right < c) or left < 0:
                right += 1
            else:
                left -= 1
            scored += 1
        if scored >= want and scored >= need:
            break
    return left + 1, right


@pytest.mark.parametrize("chunk,prop", [(128, 0.8), (1, 0.8), (128, 0.3), (50, 0.5)])
def test_single_node_search_visits_chunks_around_the_query(chunk, prop):
    # one level (no promotion below 1000 tokens): the root's 600 children are one node
    n = 600
    keys = _keys(1, n, seed=4)
    cfg = DCIConfig(ratio_1=0.001, prop_to_retrieve=prop, visit_chunk=chunk)
    index = MDCIIndex.build(keys, torch.arange(n), cfg)
    assert index.level_sizes == [n]
    chain, pg = [], index.node_first[0, 0]
    while pg >= 0:
        chain.append(pg)
        pg = index.page_next[0, pg]
    proj = np.concatenate([index.page_proj[0, p, : index.page_valid_np[0, p]] for p in chain])
    tokens = np.concatenate([index.page_abs[0, p, : index.page_valid_np[0, p]] for p in chain])
    ref = key_projection(keys[0, tokens], torch.from_numpy(index.u), index.max_sq_norm[0])
    assert np.allclose(proj, ref.numpy(), atol=1e-4)  # p(k), sorted along the chain
    pages = np.concatenate([np.full(index.page_valid_np[0, p], p) for p in chain])
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        q = torch.randn(1, D, generator=gen)
        qp = float(query_projection(q[0], torch.from_numpy(index.u)))
        lo, hi = _visited_run(proj, qp, prop, chunk, need=4)
        score = (keys[0, tokens[lo:hi]] @ q[0]).numpy()
        best = {}
        for p, s_ in zip(pages[lo:hi], score):
            best[p] = max(best.get(p, -np.inf), s_)
        expect = sorted(best, key=lambda p: -best[p])[:4]
        assert index.search(q, 4)[0].tolist() == expect
    if chunk == 128 and prop == 0.8:
        assert hi - lo == 512  # ceil(0.8 * 600) = 480 -> four chunks of 128


def test_small_nodes_are_scored_in_full_by_default():
    # every node has <= 128 children: with the default chunk the result is the exact best pages of
    # the expanded nodes, even with a small prop_to_retrieve; with visit_chunk=1 it is not
    n = 100
    keys = _keys(1, n, seed=6)
    full = MDCIIndex.build(keys, torch.arange(n), DCIConfig(prop_to_retrieve=0.2))
    assert full.level_sizes == [n]
    q = torch.randn(20, D, generator=torch.Generator().manual_seed(7))
    top = (q @ keys[0].T).argmax(-1)
    one = MDCIIndex.build(keys, torch.arange(n), DCIConfig(prop_to_retrieve=0.2, visit_chunk=1))
    hits_full = hits_one = 0
    for i in range(20):
        page = full.search(q[i:i + 1], 1)[0, 0]
        hits_full += int(top[i]) in full.page_table[0, page].tolist()
        page = one.search(q[i:i + 1], 1)[0, 0]
        hits_one += int(top[i]) in one.page_table[0, page].tolist()
    assert hits_full == 20 and hits_one < 20


def test_planted_clusters_are_retrieved():
    gen = torch.Generator().manual_seed(3)
    n_clusters, per = 8, 250
    centers = torch.linalg.qr(torch.randn(D, n_clusters, generator=gen))[0].T * 5  # orthogonal, equal norms
    label = torch.arange(n_clusters).repeat_interleave(per)
    label = label[torch.randperm(len(label), generator=gen)]
    keys = centers[label] + 0.3 * torch.randn(len(label), D, generator=gen)
    # every child of an expanded node scored: with 5 top-level nodes the default 80% rule may drop a
    # whole cluster's subtree (a property of the algorithm, measured by the recall benchmark)
    cfg = DCIConfig(ratio_1=0.05, prop_to_retrieve=1.0)
    index = MDCIIndex.build(keys[None], torch.arange(len(label)), cfg)
    for c in range(n_clusters):
        pages = index.search(centers[c][None], k_pages=4)[0]
        assert (pages >= 0).all()
        tokens = index.page_token_ids(torch.zeros_like(pages), pages)
        tokens = tokens[tokens >= 0]
        assert (label[tokens] == c).float().mean() > 0.95


def test_large_k_returns_all_pages():
    index = MDCIIndex.build(_keys(2, 1200), torch.arange(1200), DCIConfig(ratio_1=0.05, prop_to_retrieve=1.0))
    q = torch.randn(4, D)
    k = index.n_pages + 5
    res = index.search(q, k_pages=k)
    for qh in range(4):
        h = qh // 2
        got = res[qh][res[qh] >= 0]
        assert len(set(got.tolist())) == len(got)
        assert sorted(got.tolist()) == list(range(int(index.n_pages_h[h])))


def test_search_orders_pages_by_best_token():
    index = MDCIIndex.build(_keys(1, 900), torch.arange(900), DCIConfig(ratio_1=0.05, prop_to_retrieve=1.0))
    q = torch.randn(1, D)
    pages = index.search(q, k_pages=index.n_pages)[0]
    keys = _keys(1, 900)[0]
    tokens = index.page_token_ids(torch.zeros_like(pages), pages)
    best = [(keys[t[t >= 0]] @ q[0]).max().item() for t in tokens]
    assert best == sorted(best, reverse=True)
    # with K >= n_pages and every child scored, the first page holds the exact top token
    assert (keys @ q[0]).argmax().item() in tokens[0].tolist()


def _merge_reference(pages, group, k, union):
    out = []
    for h in range(len(pages) // group):
        seen = []
        for rank in range(len(pages[0])):
            for g in range(group):
                p = pages[h * group + g][rank]
                if p >= 0 and p not in seen and (union or len(seen) < k):
                    seen.append(p)
        width = group * len(pages[0]) if union else k
        out.append(seen + [-1] * (width - len(seen)))
    return out


@pytest.mark.parametrize("union", [False, True])
def test_merge_gqa_matches_reference(union):
    gen = torch.Generator().manual_seed(5)
    for group, heads, k in [(3, 3, 6), (1, 2, 4), (4, 1, 5)]:
        pages = torch.randint(-1, 10, (group * heads, k), generator=gen)
        got = merge_gqa(pages, group, k, mode="union" if union else "interleaved")
        assert got.tolist() == _merge_reference(pages.tolist(), group, k, union)


def test_insert_flags_exactly_the_changed_pages():
    index = MDCIIndex.build(_keys(2, 1000), torch.arange(1000), DCIConfig(ratio_1=0.05))
    for step in range(30):
        before_tab = index.page_table.clone()
        before_valid = index.page_valid.clone()
        new = _keys(2, 16, seed=100 + step) * (1.0 + 0.05 * (step % 3 == 0))
        flags = index.insert(new, torch.arange(1000 + 16 * step, 1016 + 16 * step))
        after_tab, after_valid = index.page_table, index.page_valid
        grown = after_tab.shape[1] - before_tab.shape[1]
        before_tab = torch.cat([before_tab, torch.full((2, grown, 16), -1)], 1)
        before_valid = torch.cat([before_valid, torch.zeros(2, grown, dtype=torch.long)], 1)
        diff = (before_tab != after_tab).any(-1) | (before_valid != after_valid)
        assert torch.equal(flags, diff)
    check_invariants(index)


def test_page_token_ids_and_valid_counts():
    index = MDCIIndex.build(_keys(3, 700), torch.arange(50, 750), DCIConfig(ratio_1=0.05))
    heads = torch.tensor([[0], [2]])
    pages = torch.tensor([[0, 3, -1], [1, -1, 2]])
    tok = index.page_token_ids(heads, pages)
    assert tok.shape == (2, 3, 16)
    assert (tok[0, 2] == -1).all() and (tok[1, 1] == -1).all()
    assert torch.equal(tok[1, 2], index.page_table[2, 2])
    counts = index.page_valid_counts(heads, pages)
    assert counts[0, 2] == 0 and counts[1, 2] == index.page_valid[2, 2]
    assert torch.equal((tok >= 0).sum(-1), counts)


def test_determinism_with_seed():
    keys, q = _keys(3, 2000), torch.randn(9, D)
    a = MDCIIndex.build(keys, torch.arange(2000), DCIConfig(seed=7, promotion="random"))
    b = MDCIIndex.build(keys, torch.arange(2000), DCIConfig(seed=7, promotion="random"))
    c = MDCIIndex.build(keys, torch.arange(2000), DCIConfig(seed=8, promotion="random"))
    assert torch.equal(a.page_table, b.page_table)
    assert torch.equal(a.search(q, 12), b.search(q, 12))
    assert not torch.equal(a.page_table, c.page_table) if a.page_table.shape == c.page_table.shape else True


def test_single_level_tree_and_small_inputs():
    index = MDCIIndex.build(_keys(1, 40), torch.arange(40))
    assert index.level_sizes == [40]
    index.insert(_keys(1, 16, seed=9), torch.arange(40, 56))
    check_invariants(index)
    res = index.search(torch.randn(2, D), k_pages=10)
    assert ((res >= 0).sum(1) == index.n_pages).all()


def _group_merge_reference(pages, scores, group, k, mode, scaling):
    """Direct reference of the score merges: per query head the softmax over its listed pages (mass) or
    the scaled score itself (max), summed / maxed per page over the group, k best, ties by first
    appearance in rank-interleaved order."""
    out = []
    for h in range(len(pages) // group):
        agg, order = {}, []
        for g in range(group):
            row = [(p, s) for p, s in zip(pages[h * group + g], scores[h * group + g]) if p >= 0]
            if not row:
                continue
            top = max(s for _, s in row) * scaling
            denom = sum(math.exp(s * scaling - top) for _, s in row)
            for p, s in row:
                v = math.exp(s * scaling - top) / denom if mode == "mass" else s * scaling
                agg[p] = agg.get(p, 0.0) + v if mode == "mass" else max(agg.get(p, -math.inf), v)
        for rank in range(len(pages[0])):
            for g in range(group):
                p = pages[h * group + g][rank]
                if p >= 0 and p not in order:
                    order.append(p)
        ranked = sorted(order, key=lambda p: (-agg[p], order.index(p)))[:k]
        out.append(ranked + [-1] * (k - len(ranked)))
    return out


@pytest.mark.parametrize("mode", ["mass", "max"])
def test_group_merges_match_reference(mode):
    gen = torch.Generator().manual_seed(7)
    for group, heads, width, k in [(3, 3, 3, 1), (3, 2, 6, 2), (1, 2, 4, 4), (4, 1, 5, 3), (7, 2, 7, 1)]:
        pages = torch.stack([torch.randperm(12, generator=gen)[:width] for _ in range(group * heads)])
        pages[torch.rand(pages.shape, generator=gen) < 0.2] = -1  # -1 padding anywhere in a row
        scores = torch.randn(pages.shape, generator=gen).where(pages >= 0, torch.tensor(-math.inf))
        got = merge_gqa(pages, group, k, mode, scores, scaling=0.5)
        assert got.tolist() == _group_merge_reference(pages.tolist(), scores.tolist(), group, k, mode, 0.5)


def test_group_merge_at_one_page_serves_the_group_not_the_first_head():
    """K = 1, group 3: heads 1 and 2 agree on page 7 (each with most of their mass), head 0 prefers page 3
    by a small margin. interleaved takes head 0's top page; both group merges take 7."""
    pages = torch.tensor([[3, 7], [7, 1], [7, 2]])
    scores = torch.tensor([[2.0, 1.9], [5.0, 0.0], [6.0, 1.0]])
    assert merge_gqa(pages, 3, 1, "interleaved").tolist() == [[3]]
    assert merge_gqa(pages, 3, 1, "mass", scores).tolist() == [[7]]
    assert merge_gqa(pages, 3, 1, "max", scores).tolist() == [[7]]


def test_group_merge_ties_and_padding():
    pages = torch.tensor([[4, -1], [5, -1]])
    scores = torch.tensor([[1.0, -math.inf], [1.0, -math.inf]])
    # equal mass: the page met first in rank-interleaved order wins; an all-padding group stays padded
    assert merge_gqa(pages, 2, 2, "mass", scores).tolist() == [[4, 5]]
    assert merge_gqa(pages, 2, 1, "max", scores).tolist() == [[4]]
    empty = torch.full((2, 2), -1)
    assert merge_gqa(empty, 2, 1, "mass", torch.full((2, 2), -math.inf)).tolist() == [[-1]]
    with pytest.raises(ValueError, match="needs scores"):
        merge_gqa(pages, 2, 1, "mass")


def test_search_scored_extends_search_and_reports_exact_best_scores():
    keys = _keys(2, 900)
    index = MDCIIndex.build(keys, torch.arange(900), DCIConfig(ratio_1=0.05))
    q = torch.randn(6, keys.shape[-1], generator=torch.Generator().manual_seed(3))
    pages, scores = index.search_scored(q, 2, 6)
    assert torch.equal(pages[:, :2], index.search(q, 2))
    table = index.page_table
    for qh in range(6):
        h = qh // 3
        for p, s in zip(pages[qh].tolist(), scores[qh].tolist()):
            if p < 0:
                assert s == -math.inf
                continue
            tokens = table[h, p][table[h, p] >= 0]
            assert s == pytest.approx(float((keys[h, tokens] @ q[qh]).max()), rel=1e-4, abs=1e-4)
        assert scores[qh].tolist() == sorted(scores[qh].tolist(), reverse=True)


def _dot_in_the_written_order(q, key):
    """The order :func:`icecache.dci.intrinsics.dot_key` promises, in numpy fp32 (one rounding per multiply and
    per add): 8 lanes accumulating 8-element chunks, halves added down to one lane, then the tail in turn."""
    full = q.shape[0] // 8
    lanes = np.zeros(8, dtype=np.float32)
    for c in range(full):
        lanes = lanes + q[8 * c: 8 * c + 8] * key[8 * c: 8 * c + 8]
    while lanes.shape[0] > 1:
        half = lanes.shape[0] // 2
        lanes = lanes[:half] + lanes[half:]
    total = lanes[0]
    for j in range(8 * full, q.shape[0]):
        total = np.float32(total + q[j] * key[j])
    return total


@pytest.mark.parametrize("d", [64, 30, 5])
@pytest.mark.parametrize("storage", ["fp32", "bf16"])
def test_every_score_is_the_dot_product_in_one_written_order(d, storage):
    """Scores must not depend on how the compiler vectorised the loop that computed them (on some CPUs the
    group's level-0 pass and a single query's search scored one key an ulp apart): ``dot_key`` equals, bit
    for bit, the dot product summed in its documented order, for fp32 keys and bf16 keys (stored as bits),
    and so do the side-by-side forms: three queries with one key (``dot_key3``) and one query with four keys
    (``dot_keys4``)."""
    from numba import njit

    from icecache.dci.intrinsics import dot_key, dot_key3, dot_keys4

    score = njit(lambda q, keys, i: dot_key(q, keys[i]))
    three = njit(lambda q, keys, i: dot_key3(q[0], q[1], q[2], keys[i]))
    four = njit(lambda q, keys, i: dot_keys4(q, keys[i], keys[i + 1], keys[i + 2], keys[i + 3]))
    rng = np.random.default_rng(d)
    q = rng.standard_normal(d).astype(np.float32) * 3
    keys = torch.from_numpy(rng.standard_normal((50, d)).astype(np.float32) * 3)
    if storage == "bf16":
        keys = keys.to(torch.bfloat16)
        stored = keys.view(torch.int16).numpy().view(np.uint16)
    else:
        stored = keys.numpy()
    as_f32 = keys.float().numpy()
    for i in range(50):
        assert score(q, stored, i) == _dot_in_the_written_order(q, as_f32[i])
    for i in range(0, 48, 4):
        assert four(q, stored, i) == tuple(_dot_in_the_written_order(q, as_f32[i + j]) for j in range(4))
    qs = np.stack([q, -q / 3, q[::-1].copy()])
    for i in range(50):
        assert three(qs, stored, i) == tuple(_dot_in_the_written_order(qs[g], as_f32[i]) for g in range(3))


@pytest.mark.parametrize("group, chunk", [(3, 128), (7, 128), (3, 4)])
def test_group_search_equals_one_search_per_query_head(group, chunk):
    """The query heads of a KV head search together (level 0 read once per group): every head's pages
    and scores must equal its own search, here one search per query head (a group of one). ``chunk=4``
    makes large nodes visit partial runs of children (the C code's chunked walk)."""
    heads = 2
    keys = _keys(heads, 1500, seed=5)
    index = MDCIIndex.build(keys, torch.arange(1500), DCIConfig(ratio_1=0.02, visit_chunk=chunk))
    index.insert(_keys(heads, 40, seed=6), torch.arange(1500, 1540))
    q = torch.randn(heads * group, D, generator=torch.Generator().manual_seed(7))
    pages, scores = index.search_scored(q, 3, 8)
    for r in range(group):
        rows = torch.arange(heads) * group + r  # query head r of every KV head: one per head, a group of 1
        own_pages, own_scores = index.search_scored(q[rows], 3, 8)
        assert torch.equal(pages[rows], own_pages)
        assert torch.equal(scores[rows], own_scores)


@pytest.mark.parametrize("rule", ["scored", "official"])
def test_search_is_the_same_whatever_the_threads_share_of_query_heads(monkeypatch, rule):
    """Each thread searches an equal share of the query heads, cut inside a KV head's group when the heads do
    not divide evenly (3 KV heads x 3 on 2 threads: 5 + 4): pages and scores must not depend on the cut."""
    import numba

    keys = _keys(3, 1200, seed=8)
    index = MDCIIndex.build(keys, torch.arange(1200), DCIConfig(ratio_1=0.03, candidate_rule=rule))
    q = torch.randn(9, D, generator=torch.Generator().manual_seed(9))
    results = []
    for threads in (1, 2, 4, 9, 20):
        monkeypatch.setattr(numba, "get_num_threads", lambda t=threads: t)
        results.append(index.search_scored(q, 3, 8))
    for pages, scores in results[1:]:
        assert torch.equal(pages, results[0][0]) and torch.equal(scores, results[0][1])


@pytest.mark.parametrize("rule", ["scored", "official"])
@pytest.mark.parametrize("ratio_1, k_pages", [(0.02, 3), (0.05, 1), (0.1, 6)])
def test_search_equals_the_tree_reference_under_both_candidate_rules(rule, ratio_1, k_pages):
    """Every child of an expanded node scored (prop 1): the kernel's ranked pages equal a plain search over
    the tree (tests/dci_reference.py), for this project's candidate rule and the C code's, at a result width
    of ``K`` and of 10 (the C rule's level 0 skips the children below the result's floor, which depends on
    the width: ``_level0.rank_top_children``)."""
    heads, n = 2, 1500
    keys = _keys(heads, n, seed=11)
    index = MDCIIndex.build(keys, torch.arange(n), DCIConfig(ratio_1=ratio_1, prop_to_retrieve=1.0,
                                                             candidate_rule=rule))
    q = torch.randn(6, D, generator=torch.Generator().manual_seed(12))
    fov = index.cfg.fov(n)
    for width in (k_pages, 10):
        pages = index.search_scored(q, k_pages, width)[0]
        for qh in range(6):
            ref = search_pages(index, keys, q[qh], qh // 3, k_pages, fov, rule)[:width]
            assert pages[qh, : len(ref)].tolist() == ref
            assert (pages[qh, len(ref):] == -1).all()


def test_official_candidate_rule_ranks_fewer_pages_and_changes_some_results():
    """The C rule's candidates are a subset of the default's: each page's score under it is at most the
    default's and fewer pages are ranked; on keys with a planted cluster the query points at (its high
    scorers crowd a few level-1 nodes, more than ``K`` children each) some top-K results differ."""
    gen = torch.Generator().manual_seed(15)
    keys = _keys(1, 2000, seed=13)
    center = torch.randn(D, generator=gen)
    center = center / center.norm() * 4
    keys[0, :300] = center + 0.5 * torch.randn(300, D, generator=gen)
    scored = MDCIIndex.build(keys, torch.arange(2000), DCIConfig(ratio_1=0.02))
    official = MDCIIndex.build(keys, torch.arange(2000), DCIConfig(ratio_1=0.02, candidate_rule="official"))
    q = center[None] + 0.5 * torch.randn(64, D, generator=gen)
    differ = 0
    for k in (2, 12):
        p_s, s_s = scored.search_scored(q, k, scored.n_pages)
        p_o, s_o = official.search_scored(q, k, scored.n_pages)
        assert ((p_o >= 0).sum(1) < (p_s >= 0).sum(1)).all()
        for qh in range(64):
            default = dict(zip(p_s[qh].tolist(), s_s[qh].tolist()))
            assert all(s <= default[p] for p, s in zip(p_o[qh].tolist(), s_o[qh].tolist()) if p >= 0)
        differ += int((p_s[:, :k].sort(1)[0] != p_o[:, :k].sort(1)[0]).any(1).sum())
    assert differ > 0


def test_candidate_rule_is_validated():
    with pytest.raises(ValueError, match="candidate_rule"):
        DCIConfig(candidate_rule="C")


def test_bf16_keys_are_stored_in_bf16_with_every_result_unchanged():
    """``key_storage="auto"`` keeps bf16 keys as their bf16 bits (half the bytes of the fp32 copy): the stored
    keys read back are exactly the bf16 keys of the page table's tokens, and builds, inserts (splits and the
    norm correction included), changed-page flags and scored searches equal those of an fp32 copy."""
    heads, n = 2, 1200
    keys = _keys(heads, n + 96, seed=21)
    keys[:, n + 48:] *= 3  # larger norms: M grows, nodes are re-projected (``_reproject``)
    keys = keys.to(torch.bfloat16)
    built = {ks: MDCIIndex.build(keys[:, :n], torch.arange(n), DCIConfig(ratio_1=0.02, key_storage=ks))
             for ks in ("auto", "float32")}
    bf16, fp32 = built["auto"], built["float32"]
    assert bf16.page_keys.dtype == np.uint16 and bf16.page_keys.nbytes * 2 == fp32.page_keys.nbytes
    for a in range(n, n + 96, 16):
        ids = torch.arange(a, a + 16)
        assert torch.equal(bf16.insert(keys[:, a:a + 16], ids), fp32.insert(keys[:, a:a + 16], ids))
    assert torch.equal(bf16.page_table, fp32.page_table)
    q = torch.randn(6, D, generator=torch.Generator().manual_seed(22))
    for got, want in zip(bf16.search_scored(q, 3, 12), fp32.search_scored(q, 3, 12)):
        assert torch.equal(got, want)
    table, valid = bf16.page_table, bf16.page_valid
    for h in range(heads):
        for p in range(bf16.n_pages):
            m = int(valid[h, p])
            stored = torch.from_numpy(bf16.page_keys[h, p, :m].astype(np.int32) << 16).view(torch.float32)
            assert torch.equal(stored, keys[h, table[h, p, :m]].float())
    assert MDCIIndex.build(keys[:, :n].float(), torch.arange(n), DCIConfig()).page_keys.dtype == np.float32
    with pytest.raises(ValueError, match="key_storage"):
        DCIConfig(key_storage="bf16")


@pytest.mark.parametrize("k", [1, 3, 12])
def test_keep_best_is_the_prefix_of_a_stable_descending_sort(k):
    """The C rule's per-node top-K (``_level0.keep_best``) equals ``np.argsort(-s, kind="mergesort")[:K]``, ties
    (many here: scores rounded to a few values) kept in offering order."""
    from icecache.dci._level0 import keep_best

    rng = np.random.default_rng(k)
    for n in (0, 1, k, 40):
        scores = np.round(rng.normal(size=n), 1).astype(np.float32)
        buf_s, buf_p, kept = np.empty(k, np.float32), np.empty(k, np.int64), 0
        for i in range(n):
            kept = keep_best(scores[i], i, kept, k, buf_s, buf_p)
        order = np.argsort(-scores, kind="mergesort")[:k]
        assert buf_p[:kept].tolist() == order.tolist()
        assert buf_s[:kept].tolist() == scores[order].tolist()
