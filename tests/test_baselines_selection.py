"""Quest and the TOP-k oracle: equality with full attention at a covering budget, Quest's page bounds and
selection against brute force, and exact top-k attention against an explicit reference."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches_full, build_tiny, generate_with

from baselines.quest import Quest, page_min_max, page_upper_bounds
from baselines.topk_oracle import TopKOracle
from evals.registry import make_method
from icecache.kv import BudgetError, ModelSpec
from icecache.kv.timing import PhaseTimer

PROMPT, NEW = 48, 8


def bind_and_prefill(method, q, k, v, layer_idx=0, scaling=0.5):
    """Binds ``method`` to a model shaped like the inputs and prefills one layer with ``n`` tokens."""
    bound = method.bind(ModelSpec(n_layers=layer_idx + 1, n_q_heads=q.shape[0], n_kv_heads=k.shape[0],
                          head_dim=q.shape[-1], scaling=scaling, max_position=4096))
    st = method.new_sequence(bound).layers[layer_idx]
    method.fill(st, k, v, q)
    return st


def decode(method, st, q, k, v):
    return method.step(st, q, k, v, PhaseTimer())


def attention_over(q_h, k_sel, v_sel, scaling):
    """Explicit softmax attention of one query ``[d]`` over ``[m, d]`` keys/values."""
    return ((k_sel @ q_h) * scaling).softmax(-1) @ v_sel


# --------------------------------------------------------------------------- both methods
@pytest.mark.parametrize("method,budget", [("quest", 64), ("topk", PROMPT + NEW - 2)])
def test_covering_budget_equals_full_attention(tiny_model, method, budget):
    assert_matches_full(tiny_model, method, budget=budget, prompt_len=PROMPT, new_tokens=NEW, debug=True)


@pytest.mark.parametrize("method,budget,hp", [("quest", 48, {"n_dense_layers": 0}), ("topk", 16, {})])
def test_small_budget_changes_the_output(method, budget, hp):
    """The equality above is not vacuous: a budget below the context changes the logits."""
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_full(build_tiny("tiny-llama", 2, 4), method, budget=budget, prompt_len=PROMPT,
                            new_tokens=NEW, **hp)


def test_invalid_budgets_are_clear_errors():
    with pytest.raises(BudgetError, match="not a multiple of page_size=16; nearest valid budgets: 48 or 64"):
        Quest(budget=50)
    with pytest.raises(BudgetError, match="not a multiple of page_size=16; nearest valid budgets: 48$"):
        make_method("quest", budget=8)
    with pytest.raises(BudgetError, match=r"below the 3 pages of 16 tokens .*nearest valid budgets: 48$"):
        Quest(budget=32)  # the official evaluation attends max(3, budget // 16) pages
    assert Quest(budget=16, force_last_page=True).top_pages == 1  # the kernels' page budget has no floor
    with pytest.raises(BudgetError, match="nearest valid budgets: 96 or 128"):
        Quest(budget=100, page_size=32)
    with pytest.raises(BudgetError, match="needs a budget"):
        Quest(budget=None)
    with pytest.raises(BudgetError, match="needs a budget"):
        TopKOracle(budget=None)
    with pytest.raises(BudgetError, match="positive"):
        TopKOracle(budget=0)
    with pytest.raises(ValueError, match="heads"):
        TopKOracle(budget=8, heads="layer")


# --------------------------------------------------------------------------- Quest
@pytest.mark.parametrize("n_kv,n_q", [(1, 4), (2, 4), (4, 4)])
def test_quest_bounds_dominate_true_page_maxima(n_kv, n_q):
    torch.manual_seed(0)
    n, d, ps = 50, 8, 16  # 4 pages, the last one holding 2 tokens
    q, k = torch.randn(n_q, d), torch.randn(n_kv, n, d)
    bounds = page_upper_bounds(q, *page_min_max(k, ps))
    dots = torch.einsum("hd,hnd->hn", q, k.repeat_interleave(n_q // n_kv, 0))
    true_max = torch.stack([dots[:, p * ps:(p + 1) * ps].amax(-1) for p in range(math.ceil(n / ps))], -1)
    assert bounds.shape == true_max.shape
    assert bool((bounds >= true_max - 1e-5).all())
    # one-token pages: the bound is exact
    torch.testing.assert_close(page_upper_bounds(q, *page_min_max(k, 1)), dots)


def brute_force_quest_pages(q, k, ps, top, force_last=False):
    """Per query head: page bounds by explicit loops, best ``top`` page ids (the last page forced with
    ``force_last``, the official kernels' rule; else a plain top-k, the official evaluation's)."""
    n_q, n_kv, n = q.shape[0], k.shape[0], k.shape[1]
    pages = []
    for h in range(n_q):
        keys = k[h // (n_q // n_kv)]
        bounds = []
        for p in range(math.ceil(n / ps)):
            lo, hi = keys[p * ps:(p + 1) * ps].amin(0), keys[p * ps:(p + 1) * ps].amax(0)
            bounds.append(sum(max(float(q[h, i] * lo[i]), float(q[h, i] * hi[i])) for i in range(q.shape[1])))
        if force_last:
            bounds[-1] = float("inf")
        pages.append(sorted(sorted(range(len(bounds)), key=lambda p: -bounds[p])[:top]))
    return pages


@pytest.mark.parametrize("force_last", [False, True])
@pytest.mark.parametrize("n_kv,n_q", [(1, 4), (2, 4), (4, 4)])
def test_quest_selection_and_attention_equal_brute_force(n_kv, n_q, force_last):
    torch.manual_seed(1)
    n_prompt, steps, d, ps, budget = 70, 12, 8, 16, 48
    q = torch.randn(n_q, n_prompt + steps, d)
    k, v = torch.randn(n_kv, n_prompt + steps, d), torch.randn(n_kv, n_prompt + steps, d)
    method = Quest(budget=budget, page_size=ps, n_dense_layers=0, force_last_page=force_last, debug=True)
    newest_left_out = 0
    st = bind_and_prefill(method, q[:, :n_prompt], k[:, :n_prompt], v[:, :n_prompt])
    g = n_q // n_kv
    for t in range(n_prompt, n_prompt + steps):  # crosses the page boundary at token 80
        out = decode(method, st, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        # metadata maintained incrementally == recomputed from scratch
        lo, hi = page_min_max(k[:, :t + 1], ps)
        assert torch.equal(st.kmin, lo) and torch.equal(st.kmax, hi)
        ref_pages = brute_force_quest_pages(q[:, t], k[:, :t + 1], ps, budget // ps, force_last)
        assert method.select(st, q[:, t:t + 1]).sort(-1).values.tolist() == ref_pages
        for h in range(n_q):
            tokens = [i for p in ref_pages[h] for i in range(p * ps, min((p + 1) * ps, t + 1))]
            assert len(tokens) - (t in tokens) <= budget  # the current token is attended only with its page
            newest_left_out += t not in tokens
            ref = attention_over(q[h, t], k[h // g, tokens], v[h // g, tokens], 0.5)
            torch.testing.assert_close(out[h, 0], ref)
    assert (newest_left_out > 0) != force_last  # random keys: the plain top-k leaves the newest page out at times


def test_quest_dense_layers_and_budget_accounting():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 100))
    _, cache = generate_with(model, ids, 6, "quest", 48, force_last_page=True, debug=True)  # debug: attended <= 48
    eff = cache.effective_tokens()
    assert eff[:2] == [102.0, 102.0]  # dense: past tokens 100..104 over 5 decode steps
    # sparse, the newest page forced: two full pages + the last page (tokens 96..t, the current one excluded)
    assert eff[2:] == [pytest.approx(32 + sum(t - 96 for t in range(100, 105)) / 5)] * 2
    assert cache.resident_tokens() == [105] * 4  # Quest keeps every key resident (no offload)
    _, cache = generate_with(model, ids, 6, "quest", 48, debug=True)  # the official plain top-3
    assert all(32 + 4 <= e <= 48 for e in cache.effective_tokens()[2:])


def test_quest_rejects_over_budget_attention():
    method = Quest(budget=48, n_dense_layers=0, debug=True)
    st = bind_and_prefill(method, torch.randn(2, 80, 4), torch.randn(2, 80, 4), torch.randn(2, 80, 4))
    st.max_attended = 49
    with pytest.raises(AssertionError, match="attended 49 past tokens"):
        method.check_resident(st)


# --------------------------------------------------------------------------- TOP-k oracle
def reference_topk(q, k, v, budget, scaling, heads, agg):
    """Explicit top-k attention of the last token: per query head (or per KV head ranked by the group's
    summed softmax / max logit), top-``budget`` past tokens + the current one."""
    n_q, n_kv, n = q.shape[0], k.shape[0], k.shape[1]
    g = n_q // n_kv
    logits = torch.einsum("hd,hnd->hn", q, k.repeat_interleave(g, 0)) * scaling
    if heads == "query":
        ranks = logits
    else:
        grouped = logits.view(n_kv, g, n)
        ranks = (grouped.softmax(-1).sum(1) if agg == "sum" else grouped.amax(1)).repeat_interleave(g, 0)
    outs, sets = [], []
    for h in range(n_q):
        chosen = sorted(range(n - 1), key=lambda j: -float(ranks[h, j]))[:budget] + [n - 1]
        sets.append(sorted(chosen))
        outs.append(attention_over(q[h], k[h // g, chosen], v[h // g, chosen], scaling))
    return torch.stack(outs), sets


@pytest.mark.parametrize("n_kv,n_q", [(1, 4), (2, 4), (4, 4)])
@pytest.mark.parametrize("heads,agg", [("query", "sum"), ("kv", "sum"), ("kv", "max")])
def test_topk_attends_exactly_the_top_k_tokens(n_kv, n_q, heads, agg):
    torch.manual_seed(2)
    n_prompt, steps, d, budget = 40, 4, 8, 10
    q = torch.randn(n_q, n_prompt + steps, d)
    k, v = torch.randn(n_kv, n_prompt + steps, d), torch.randn(n_kv, n_prompt + steps, d)
    method = TopKOracle(budget=budget, heads=heads, group_agg=agg, debug=True)
    st = bind_and_prefill(method, q[:, :n_prompt], k[:, :n_prompt], v[:, :n_prompt])
    for t in range(n_prompt, n_prompt + steps):
        out = decode(method, st, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        ref_out, ref_sets = reference_topk(q[:, t], k[:, :t + 1], v[:, :t + 1], budget, 0.5, heads, agg)
        torch.testing.assert_close(out[:, 0], ref_out)
        chosen = method.select(st, q[:, t:t + 1]).sort(-1).values
        assert chosen.shape[0] == (n_q if heads == "query" else n_kv)
        expected = ref_sets if heads == "query" else ref_sets[:: n_q // n_kv]
        assert chosen.tolist() == expected
    assert st.attended_sum / st.attended_steps == budget
