"""``page_oracle`` (baselines/page_oracle.py): IceCache's layout and M-DCI pages with each query head's exact best
pages. Checked against a brute-force reference written with explicit loops (its pages, its GQA merges), against
full attention at a covering budget, against IceCache's search at the same budget (never fewer pages, dominating
scores) and against IceCache's exhaustive search (the same pages when every scored key ranks its page)."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_SHAPES, assert_matches_full, build_tiny, replace_hook

from evals.registry import make_method
from evals.runner import generate
from icecache.kv import ModelSpec
from icecache.kv.timing import PhaseTimer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()


# ------------------------------------------------------------------ the brute-force reference
def reference_lists(q: torch.Tensor, page_positions, keys: torch.Tensor, group: int, width: int):
    """Per query head ``i`` (of KV head ``i // group``): every non-empty page of the index with its score, the
    largest fp64 ``q.k`` over the page's keys (``keys [H_kv, n, d]``: row = absolute position), the ``width``
    best pages first (ties: lower page id). Returns ``[(pages, scores)]`` per query head."""
    out = []
    for i in range(q.shape[0]):
        h = i // group
        best = {}
        for page in range(page_positions.shape[1]):
            for pos in page_positions[h, page].tolist():
                if pos >= 0:
                    score = float(torch.dot(q[i].double(), keys[h, pos].double()))
                    best[page] = max(best.get(page, float("-inf")), score)
        ranked = sorted(best, key=lambda p: (-best[p], p))[:width]
        out.append((ranked, [best[p] for p in ranked]))
    return out


def reference_merge(lists, group: int, k: int, mode: str, scaling: float) -> list[list[int]]:
    """The GQA merge written out, per KV head: ``interleaved`` reads the group's lists rank by rank and keeps the
    first ``k`` distinct pages (official ``first_k_unique``), ``union`` keeps them all; ``max`` / ``mass`` rank
    the group's distinct pages by the best scaled score any query head gave the page / by the sum over query
    heads of the page's softmax share among that head's listed pages, ties in rank-interleaved order."""
    merged = []
    for h in range(len(lists) // group):
        heads = lists[h * group:(h + 1) * group]
        met, value = [], {}
        for rank in range(max(len(pages) for pages, _ in heads)):
            for pages, scores in heads:
                if rank >= len(pages):
                    continue
                page, score = pages[rank], scaling * scores[rank]
                if mode == "mass":
                    top = max(scaling * s for s in scores)
                    total = sum(torch.exp(torch.tensor(scaling * s - top, dtype=torch.float64)) for s in scores)
                    score = float(torch.exp(torch.tensor(score - top, dtype=torch.float64)) / total)
                if page not in met:
                    met.append(page)
                    value[page] = score
                elif mode == "mass":
                    value[page] += score
                else:
                    value[page] = max(value[page], score)
        if mode in ("interleaved", "union"):
            merged.append(met if mode == "union" else met[:k])
        else:
            merged.append(sorted(met, key=lambda p: (-value[p], met.index(p)))[:k])
    return merged


class Checker:
    """A probe (the ``diagnostics=recall`` hook) that keeps every layer's whole K history as the model produced it
    and, at each decode step of an offloaded layer, recomputes the selection from the index's page membership and
    that history with :func:`reference_lists` + :func:`reference_merge`."""

    def __init__(self):
        self.keys, self.checked, self.indexed = {}, 0, set()

    def keep(self, layer, k, v):
        self.keys[layer] = k.clone() if layer not in self.keys else torch.cat([self.keys[layer], k], dim=1)

    def reset(self):
        self.keys.clear()

    def summary(self):
        return None

    def measure(self, method, st, q, selection, out):
        if selection is None:
            return
        k = method.layout()[2]
        group = st.spec.group
        width = k
        if method.gqa_merge in ("mass", "max"):
            width = max(k, method.gqa_candidates or group * k)
        lists = reference_lists(q[:, 0], st.index.page_positions(), self.keys[st.layer_idx], group, width)
        expected = reference_merge(lists, group, k, method.gqa_merge, st.spec.scaling)
        got = [[p for p in row if p >= 0] for row in selection.tolist()]
        assert got == expected, f"layer {st.layer_idx} at {st.n_seen}: {got} != {expected}"
        self.checked += 1
        self.indexed.add(st.index.n)


@pytest.mark.parametrize("gqa_merge", ["interleaved", "union", "max", "mass"])
@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda p: f"{p[0]}-kv{p[1]}-q{p[2]}")
def test_pages_equal_a_brute_force_reference_on_a_tiny_model(shape, gqa_merge):
    """Every decode step of every budgeted layer (300-token prompt, 23 decode steps, a window page inserted into
    the index on the way) selects the reference's pages per KV head, in the merge's order."""
    model = build_tiny(*shape)
    checker = Checker()
    method = make_method("page_oracle", budget=128, gqa_merge=gqa_merge, debug=True)
    generate(model, None, method, PROMPT, 24, ignore_eos=True, probe=checker)
    assert checker.checked == 2 * 23  # layers 2 and 3 at every decode step (the first token is the prefill's)
    assert len(checker.indexed) > 1  # the index grew


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda p: f"{p[0]}-kv{p[1]}-q{p[2]}")
def test_a_covering_budget_equals_full_attention(shape):
    """Prompt indexed (``always_index``), a budget of 12 retrieved pages: every page is retrieved, which is full
    attention (tokens and logits)."""
    assert_matches_full(build_tiny(*shape), "page_oracle", budget=256, prompt_len=200, new_tokens=8, debug=True,
                        always_index=True)


# ------------------------------------------------------------------ beside IceCache, on the same inputs
H_KV, H_Q, D = 2, 6, 16
SPEC = ModelSpec(n_layers=4, n_q_heads=H_Q, n_kv_heads=H_KV, head_dim=D, scaling=D ** -0.5, max_position=8192)


def drive(name: str, prompt: int = 800, steps: int = 40, seed: int = 0, **hp):
    """Layer 2 of ``name`` fed the same random post-RoPE stream for any method (seeded): returns, per decode step,
    ``(queries [H_q, d], pages [H_q, C], scores [H_q, C], exact [H_q, P], selection [H_kv, W])``, where pages and
    scores are what the method's page search handed to the merge and ``exact`` every page's exact score."""
    from baselines.page_oracle import exact_page_scores

    m = make_method(name, **hp)
    bound = m.bind(SPEC)
    gen = torch.Generator().manual_seed(seed)
    st = m.new_sequence(bound).layers[2]
    m.fill(st, torch.randn(H_KV, prompt, D, generator=gen), torch.randn(H_KV, prompt, D, generator=gen),
           torch.randn(H_Q, prompt, D, generator=gen))
    searched, search = [], m.search_pages

    def spy(st, queries, k, width):
        pages, scores = search(st, queries, k, width)
        exact = exact_page_scores(queries, st.index.page_positions(), st.store.keys(), st.store.first_pos)
        searched.append((queries, pages, scores, exact))
        return pages, scores

    replace_hook(m, "search_pages", spy)
    timer, steps_out = PhaseTimer(), []
    for _ in range(steps):
        q = torch.randn(H_Q, 1, D, generator=gen)
        m.step(st, q, torch.randn(H_KV, 1, D, generator=gen), torch.randn(H_KV, 1, D, generator=gen), timer)
        steps_out.append((*searched[-1], st.selection.clone()))
    return steps_out, m, st


def listed(row: torch.Tensor) -> int:
    return int((row >= 0).sum())


@pytest.mark.parametrize("budget", [64, 128])
def test_at_equal_budget_never_fewer_pages_and_dominating_scores(budget):
    """IceCache's default (approximate) search and the oracle on one stream: per query head the oracle lists at
    least as many pages and its ``i``-th score is at least the search's ``i``-th; every score the search reports
    is at most its page's exact best (it scored some of the page's keys); per KV head the oracle attends at least
    as many retrieved pages. The search did miss pages here (else the test would show nothing)."""
    ice, ice_method, ice_st = drive("icecache", budget=budget)
    oracle, _, _ = drive("page_oracle", budget=budget)
    assert ice_st.index.search_stats()["search_scored_fraction"] < 1.0
    missed = 0
    for (q, pages, scores, exact, sel), (q2, o_pages, o_scores, o_exact, o_sel) in zip(ice, oracle):
        assert torch.equal(q, q2) and torch.equal(exact, o_exact)  # same stream, same index
        for i in range(H_Q):
            n, n_oracle = listed(pages[i]), listed(o_pages[i])
            assert n <= n_oracle
            assert (o_scores[i, :n] >= scores[i, :n] - 1e-5).all()
            assert (scores[i, :n] <= exact[i, pages[i, :n]] + 1e-5).all()
            missed += set(pages[i, :n].tolist()) != set(o_pages[i, :n_oracle].tolist())
        for h in range(H_KV):
            assert listed(sel[h]) <= listed(o_sel[h]) == ice_method.layout()[2]
    assert missed > 0


def test_icecache_with_every_key_scored_and_ranked_selects_the_oracles_pages():
    """``min_fov`` past every node, ``prop_to_retrieve=1`` and the ``"scored"`` candidate rule: IceCache's search
    scores every key and every scored key ranks its page, so each query head's pages are the oracle's, in the
    same order, with the same scores (to fp32 summation order), and so are the merged selections."""
    exhaustive = dict(min_fov=1 << 20, prop_to_retrieve=1.0, candidate_rule="scored")
    ice, _, ice_st = drive("icecache", budget=128, **exhaustive)
    oracle, _, _ = drive("page_oracle", budget=128)
    assert ice_st.index.search_stats()["search_scored_fraction_min"] == 1.0
    for (_, pages, scores, _, sel), (_, o_pages, o_scores, _, o_sel) in zip(ice, oracle):
        assert torch.equal(pages, o_pages) and torch.equal(sel, o_sel)
        torch.testing.assert_close(scores, o_scores, atol=1e-5, rtol=1e-6)


def test_under_the_official_candidate_rule_the_exhaustive_search_misses_pages_for_a_known_reason():
    """``min_fov`` past every node and ``prop_to_retrieve=1`` (the exhaustive runs of docs/results.md)
    with the official candidate rule (``add_to_list``): every key is scored, but at level 0 only the ``K`` best
    children of each expanded level-1 node rank their pages. Every page it reports has its exact score, and each
    page of the oracle's list it lacks is one none of whose keys is among its level-1 node's ``K`` best children
    (those lie in fewer than ``K`` other pages)."""
    exhaustive = dict(min_fov=1 << 20, prop_to_retrieve=1.0)
    ice, method, st = drive("icecache", budget=128, **exhaustive)
    oracle, _, _ = drive("page_oracle", budget=128)
    index, keys, k = st.index, st.store.keys(), method.layout()[2]
    explained = 0
    for (q, pages, scores, exact, _), (_, o_pages, _, _, _) in zip(ice, oracle):
        for i in range(H_Q):
            n = listed(pages[i])
            torch.testing.assert_close(scores[i, :n], exact[i, pages[i, :n]], atol=1e-5, rtol=1e-6)
            h = i // SPEC.group
            for page in set(o_pages[i].tolist()) - set(pages[i].tolist()) - {-1}:
                node = int(index.page_node[h, page])
                assert node > 0 and index.level[node - 1] == 1  # a level-0 page under a level-1 node
                children = [(float(q[i] @ keys[h, pos - st.store.first_pos]), p)
                            for p in range(index.n_pages) if index.page_node[h, p] == node
                            for pos in index.page_positions()[h, p].tolist() if pos >= 0]
                top = [p for _, p in sorted(children, reverse=True)[:k]]
                assert page not in top and len(set(top)) < k
                explained += 1
    assert explained > 0
