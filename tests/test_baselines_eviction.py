"""H2O and SnapKV: equality with full attention at a covering budget, chunked prefill statistics against
eager references, per-head budgets, and the tokens kept on hand-made inputs."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_full, build_tiny, generate_with

from baselines.h2o import H2O, aggregate_group, attention_with_column_sums
from baselines.snapkv import SnapKV, pool_votes, window_votes
from evals.registry import make_method
from icecache.kv import BudgetError, ModelSpec
from icecache.kv.timing import PhaseTimer

PROMPT, NEW = 48, 8
COVERING = PROMPT + NEW - 2  # past tokens at the last decode step: exactly the whole context


def prefill(method, q, k, v):
    """Binds ``method`` to a one-layer model shaped like the inputs (scaling 1) and prefills it."""
    bound = method.bind(ModelSpec(n_layers=1, n_q_heads=q.shape[0], n_kv_heads=k.shape[0], head_dim=q.shape[-1],
                          scaling=1.0, max_position=4096))
    st = method.new_sequence(bound).layers[0]
    out = method.fill(st, k, v, q)
    return st, out


def decode(method, st, q, k, v):
    return method.step(st, q, k, v, PhaseTimer())


def eager_attention(q, k, v, scaling=1.0):
    """Reference softmax attention of one query per head ``[H_q, d]`` over ``[H_q, m, d]``."""
    probs = (torch.einsum("hd,hmd->hm", q, k) * scaling).softmax(-1)
    return torch.einsum("hm,hmd->hd", probs, v), probs


# --------------------------------------------------------------------------- both methods
@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_covering_budget_equals_full_attention(tiny_model, method):
    cache = assert_matches_full(tiny_model, method, budget=COVERING, prompt_len=PROMPT, new_tokens=NEW, debug=True)
    assert cache.effective_tokens()[-1] == pytest.approx((PROMPT + PROMPT + NEW - 2) / 2)


@pytest.mark.parametrize("method,budget", [("h2o", 16), ("snapkv", 40)])
def test_small_budget_changes_the_output(method, budget):
    """The equality above is not vacuous: a budget below the context changes the logits."""
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_full(build_tiny("tiny-llama", 2, 4), method, budget=budget, prompt_len=PROMPT,
                            new_tokens=NEW)


@pytest.mark.parametrize("method,budget,hp", [("h2o", 12, {}), ("h2o", 13, {"group_agg": "max"}),
                                              ("snapkv_pinned", 20, {"window_size": 8})])
def test_resident_never_exceeds_budget(tiny_model, method, budget, hp):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 60))
    _, cache = generate_with(tiny_model, ids, 6, method, budget, debug=True, **hp)  # debug asserts each step
    assert cache.resident_tokens() == [budget] * tiny_model.config.num_hidden_layers
    assert cache.effective_tokens() == [budget] * tiny_model.config.num_hidden_layers


def test_invalid_budgets_are_clear_errors():
    with pytest.raises(BudgetError, match="needs a budget"):
        H2O(budget=None)
    with pytest.raises(BudgetError, match="positive"):
        H2O(budget=-4)
    with pytest.raises(ValueError, match="heavy_ratio"):
        H2O(budget=64, heavy_ratio=1.0)
    with pytest.raises(BudgetError, match="must exceed window_size=32"):
        SnapKV(budget=32)
    with pytest.raises(BudgetError, match="needs a budget"):
        make_method("snapkv")
    with pytest.raises(ValueError, match="decode_policy"):
        SnapKV(budget=64, decode_policy="keep")
    with pytest.raises(ValueError, match="selection"):
        SnapKV(budget=64, selection="per_group")
    with pytest.raises(BudgetError, match="no room for generated"):
        SnapKV(budget=33, decode_policy="pinned")  # window 32 + 1 voted token leaves no slot for generated tokens
    SnapKV(budget=33, decode_policy="sliding")


# --------------------------------------------------------------------------- H2O
@pytest.mark.parametrize("n_kv,n_q,chunk", [(1, 4, 5), (2, 4, 7), (4, 4, 64)])
def test_h2o_chunked_attention_and_column_sums_equal_eager_softmax(n_kv, n_q, chunk):
    torch.manual_seed(0)
    n, d = 23, 8
    q, k, v = torch.randn(n_q, n, d), torch.randn(n_kv, n, d), torch.randn(n_kv, n, d)
    logits = torch.einsum("hid,hjd->hij", q, k.repeat_interleave(n_q // n_kv, 0)) * 0.3
    probs = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    out, sums = attention_with_column_sums(q, k, v, 0.3, chunk)
    torch.testing.assert_close(sums, probs.sum(1))
    torch.testing.assert_close(out, probs @ v.repeat_interleave(n_q // n_kv, 0))


def test_h2o_column_sums_in_bf16_follow_the_fp32_softmax():
    """bf16 inputs (the official eager path: q.k and a.v in the model dtype, softmax in fp32): the output stays
    bf16 and both it and the fp32 column sums are within bf16 rounding of the fp32 computation."""
    torch.manual_seed(1)
    n, d = 40, 16
    q, k, v = (torch.randn(h, n, d).bfloat16() for h in (4, 2, 2))
    want_out, want_sums = attention_with_column_sums(q.float(), k.float(), v.float(), 0.25, 7)
    out, sums = attention_with_column_sums(q, k, v, 0.25, 7)
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    torch.testing.assert_close(sums, want_sums, atol=0.05, rtol=0.02)
    torch.testing.assert_close(out.float(), want_out, atol=0.05, rtol=0.02)


def planted_inputs(n_q: int, n: int, head0_tokens: list[int], head1_tokens: list[int]):
    """Two KV heads, d = 4: head 0's keys are 10*e0 at ``head0_tokens``, head 1's 10*e1 at ``head1_tokens``;
    the first half of the query heads query e0, the second half e1; random values."""
    d = 4
    k = torch.zeros(2, n, d)
    k[0, head0_tokens, 0] = 10.0
    k[1, head1_tokens, 1] = 10.0
    q = torch.zeros(n_q, n, d)
    q[: n_q // 2, :, 0] = 1.0
    q[n_q // 2:, :, 1] = 1.0
    return q, k, torch.randn(2, n, d)


def heavy_hitter_inputs(n_q: int):
    """8 tokens: KV head 0's heavy hitters are tokens {1, 3}, KV head 1's are {2, 4}."""
    return planted_inputs(n_q, 8, [1, 3], [2, 4])


@pytest.mark.parametrize("n_q", [2, 4])
def test_h2o_keeps_heavy_hitters_and_recent_tokens(n_q):
    q, k, v = heavy_hitter_inputs(n_q)
    method = H2O(budget=4, debug=True)  # 2 heavy + 2 recent
    st, _ = prefill(method, q, k, v)
    assert st.pos.tolist() == [[1, 3, 6, 7], [2, 4, 6, 7]]
    assert method.resident_tokens(st) == 4
    # one decode step: token 8 joins the recent window, token 7 stays recent, token 6 (lowest score) leaves
    q8 = q[:, :1].clone()
    k8, v8 = torch.zeros(2, 1, 4), torch.randn(2, 1, 4)
    out = decode(method, st, q8, k8, v8)
    assert st.pos.sort(-1).values.tolist() == [[1, 3, 7, 8], [2, 4, 7, 8]]  # slots reused: a set per head
    # the output attended the 4 kept tokens + the current one, per KV head
    attended = [[1, 3, 6, 7], [2, 4, 6, 7]]
    keys = torch.stack([torch.cat([k[h, attended[h]], k8[h]]) for h in range(2)]).repeat_interleave(n_q // 2, 0)
    vals = torch.stack([torch.cat([v[h, attended[h]], v8[h]]) for h in range(2)]).repeat_interleave(n_q // 2, 0)
    torch.testing.assert_close(out[:, 0], eager_attention(q8[:, 0], keys, vals)[0])


def reference_h2o(q, k, v, n_prompt, budget, heavy, agg):
    """Set-based H2O simulation (full K/V, explicit sets per KV head): returns the per-step outputs and
    the kept position sets after prefill and after each decode step."""
    n_q, n_kv, n = q.shape[0], k.shape[0], q.shape[1]
    g, recent = n_q // n_kv, budget - heavy
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    causal = torch.ones(n_prompt, n_prompt, dtype=torch.bool).triu(1)
    logits = torch.einsum("hid,hjd->hij", q[:, :n_prompt], kk[:, :n_prompt])
    scores = torch.zeros(n_q, n)
    scores[:, :n_prompt] = logits.masked_fill(causal, float("-inf")).softmax(-1).sum(1)

    def cut(kept, t):  # keep the last `recent` positions <= t and the best-scored others
        ranked = aggregate_group(scores, n_kv, agg)
        out = []
        for h in range(n_kv):
            rec = [p for p in kept[h] if p > t - recent]
            old = sorted((p for p in kept[h] if p <= t - recent), key=lambda p: -float(ranked[h, p]))
            out.append(sorted(old[: budget - len(rec)] + rec))
        return out

    kept = cut([list(range(n_prompt))] * n_kv, n_prompt - 1)
    history, outputs = [kept], []
    for t in range(n_prompt, n):
        out = []
        for hq in range(n_q):
            idx = kept[hq // g] + [t]
            o, p = eager_attention(q[hq, t][None], kk[hq, idx][None], vv[hq, idx][None])
            scores[hq, idx] += p[0]
            out.append(o[0])
        outputs.append(torch.stack(out))
        kept = cut([kh + [t] for kh in kept], t)
        history.append(kept)
    return outputs, history


@pytest.mark.parametrize("n_kv,n_q,agg,ratio", [(1, 4, "mean", 0.5), (2, 4, "max", 0.5), (4, 4, "sum", 0.25),
                                                (2, 4, "mean", 0.0)])
def test_h2o_matches_set_based_reference(n_kv, n_q, agg, ratio):
    torch.manual_seed(1)
    n_prompt, steps, d, budget = 12, 20, 8, 8
    q, k, v = torch.randn(n_q, n_prompt + steps, d), torch.randn(n_kv, n_prompt + steps, d), torch.randn(
        n_kv, n_prompt + steps, d)
    method = H2O(budget=budget, heavy_ratio=ratio, group_agg=agg, chunk_size=6, debug=True)
    ref_out, ref_kept = reference_h2o(q, k, v, n_prompt, budget, method.heavy_size, agg)
    st, _ = prefill(method, q[:, :n_prompt], k[:, :n_prompt], v[:, :n_prompt])
    assert st.pos.tolist() == ref_kept[0]
    for i, t in enumerate(range(n_prompt, n_prompt + steps)):
        out = decode(method, st, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        torch.testing.assert_close(out[:, 0], ref_out[i])
        assert st.pos.sort(-1).values.tolist() == ref_kept[i + 1], f"step {i}"


# --------------------------------------------------------------------------- SnapKV
@pytest.mark.parametrize("n_kv,n_q", [(1, 4), (2, 4), (4, 4)])
def test_snapkv_window_votes_equal_eager_softmax(n_kv, n_q):
    torch.manual_seed(0)
    n, d, w = 30, 8, 6
    q, k = torch.randn(n_q, n, d), torch.randn(n_kv, n, d)
    logits = torch.einsum("hid,hjd->hij", q, k.repeat_interleave(n_q // n_kv, 0)) * 0.5
    full = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    torch.testing.assert_close(window_votes(q, k, 0.5, w), full[:, n - w:, : n - w].sum(1))


def test_snapkv_pooling():
    votes = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0]])
    assert pool_votes(votes, 3, "max").tolist() == [[0.0, 5.0, 5.0, 5.0, 0.0, 1.0, 1.0]]
    torch.testing.assert_close(pool_votes(votes, 3, "avg"), torch.tensor([[0.0, 5, 5, 5, 0, 1, 1]]) / 3)
    assert pool_votes(votes, 1, "max").tolist() == votes.tolist()


def snapkv_inputs(n_q: int):
    """16 tokens, window 4: the window queries of KV head 0 look at tokens {2, 7}, of KV head 1 at {5, 9}."""
    return planted_inputs(n_q, 16, [2, 7], [5, 9])


@pytest.mark.parametrize("n_q", [2, 4])
@pytest.mark.parametrize("policy", ["sliding", "grow"])
def test_snapkv_keeps_voted_prefix_and_window(n_q, policy):
    q, k, v = snapkv_inputs(n_q)
    method = SnapKV(budget=6, window_size=4, kernel_size=1, decode_policy=policy, selection="per_kv_head",
                    debug=True)
    st, _ = prefill(method, q, k, v)
    assert st.pos.tolist() == [[2, 7, 12, 13, 14, 15], [5, 9, 12, 13, 14, 15]]
    for t in range(16, 21):
        decode(method, st, q[:, :1], torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    if policy == "sliding":  # the voted prefix stays; the window slid over the generated tokens 17..20
        assert st.pos.tolist() == [[2, 7, 17, 18, 19, 20], [5, 9, 17, 18, 19, 20]]
    else:  # paper: every generated token is kept
        assert st.pos.tolist() == [[2, 7, *range(12, 21)], [5, 9, *range(12, 21)]]


def test_snapkv_grow_policy_declares_the_generated_tail():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 60))
    _, cache = generate_with(model, ids, 6, "snapkv", 20, window_size=8, decode_policy="grow", debug=True)
    assert cache.resident_tokens() == [20 + 5] * 4  # 5 decode steps each left their token resident
    method = SnapKV(budget=6, window_size=4, debug=True)
    st, _ = prefill(method, *snapkv_inputs(2))
    st.k, st.v = torch.cat([st.k, st.k], 1), torch.cat([st.v, st.v], 1)  # an over-budget "sliding" state
    with pytest.raises(AssertionError, match="over the allowed 6"):
        method.check_resident(st)


def ranked_inputs(strengths: dict[int, float], n: int = 16, n_q: int = 1):
    """One KV head, d = 4: token ``t``'s key is ``strengths[t] * e0`` (others zero), every query is e0, so the
    window votes rank the planted tokens by strength."""
    k = torch.zeros(1, n, 4)
    for t, s in strengths.items():
        k[0, t, 0] = s
    q = torch.zeros(n_q, n, 4)
    q[..., 0] = 1.0
    return q, k, torch.randn(1, n, 4)


def test_snapkv_pinned_keeps_the_selection_and_window_while_generated_tokens_slide():
    """budget 8 = window 4 + room 2 + 2 pinned voted; the room first holds the next-best voted tokens (3,
    then 6), which leave lowest-voted first; then generated tokens slide in the room."""
    q, k, v = ranked_inputs({2: 10.0, 7: 10.0, 3: 9.0, 6: 8.0})
    method = SnapKV(budget=8, window_size=4, kernel_size=1, decode_window=2, decode_policy="pinned", debug=True)
    assert method.room == 2
    st, _ = prefill(method, q, k, v)
    assert sorted(st.pos[0].tolist()) == [2, 3, 6, 7, 12, 13, 14, 15]
    kept = []
    for _ in range(5):
        decode(method, st, q[:, :1], torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        kept.append(sorted(st.pos[0].tolist()))
    assert kept == [[2, 3, 7, 12, 13, 14, 15, 16], [2, 7, 12, 13, 14, 15, 16, 17], [2, 7, 12, 13, 14, 15, 17, 18],
                    [2, 7, 12, 13, 14, 15, 18, 19], [2, 7, 12, 13, 14, 15, 19, 20]]


def test_snapkv_pinned_short_prompt_attends_everything_then_evicts_unpinned_prefix_first():
    """A prompt of <= budget tokens is kept whole (first step = full attention); on overflow the prefix tokens
    outside the pinned selection leave before any generated token, and the window never leaves."""
    torch.manual_seed(0)
    n, budget = 16, 16
    q, k, v = torch.randn(2, n, 4), torch.randn(1, n, 4), torch.randn(1, n, 4)
    method = SnapKV(budget=budget, window_size=4, kernel_size=1, decode_window=4, decode_policy="pinned",
                    debug=True)  # room 4, 8 pinned
    st, _ = prefill(method, q, k, v)
    assert st.k.shape == (2, n, 4) and sorted(st.pos[0].tolist()) == list(range(n))
    q1, k1, v1 = torch.randn(2, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out = decode(method, st, q1, k1, v1)
    full_k, full_v = torch.cat([k, k1], 1).expand(2, -1, -1), torch.cat([v, v1], 1).expand(2, -1, -1)
    torch.testing.assert_close(out[:, 0], eager_attention(q1[:, 0], full_k, full_v)[0])
    pinned = [set(row.tolist()) for row in window_votes(q, k, 1.0, 4).topk(8, dim=-1).indices]  # kernel 1
    for s in range(2, 12):  # after decode step s: tokens n..n+s-1 generated
        decode(method, st, q1, torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        for h in range(2):
            pos = set(st.pos[h].tolist())
            assert len(pos) == budget and pinned[h] | set(range(12, n)) <= pos
            assert len(pos - pinned[h] - set(range(12, 16 + s))) == max(0, 4 - s)  # unpinned prefix left
            assert sorted(p for p in pos if p >= n) == list(range(n, n + s))[-min(s, 4):]  # the room slides


@pytest.mark.parametrize("policy,keeps_window", [("pinned", True), ("sliding", False)])
def test_snapkv_observation_window_survives_generation_only_when_pinned(policy, keeps_window):
    """``sliding`` pushes the observation window (the LongBench question) out during the first
    window_size generated tokens; ``pinned`` never does."""
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    _, cache = generate_with(model, ids, 12, "snapkv", 20, window_size=8, decode_policy=policy, debug=True)
    window = set(range(52, 60))
    assert all((window <= set(row.tolist())) == keeps_window for st in cache.states for row in st.pos)
    assert cache.resident_tokens() == [20] * 4


def test_snapkv_selects_per_query_head_or_per_kv_head():
    """One KV head, two query heads that look at different tokens: the official per-query-head selection
    keeps each head's own tokens (and stores K/V per query head); per_kv_head keeps the group's summed best."""
    n, d = 16, 4
    k = torch.zeros(1, n, d)
    k[0, [2, 7], 0] = 10.0
    k[0, [5, 9], 1] = 10.0
    k[0, 11, 1] = 9.0  # head 1's mass is split over three tokens, so the summed votes prefer 2 and 7
    q = torch.zeros(2, n, d)
    q[0, :, 0], q[1, :, 1] = 1.0, 1.0
    v = torch.randn(1, n, d)
    window = [12, 13, 14, 15]
    per_q = SnapKV(budget=6, window_size=4, kernel_size=1, decode_policy="sliding", debug=True)
    st, _ = prefill(per_q, q, k, v)
    assert st.k.shape == (2, 6, d)  # G = 2 times the K/V of one KV head
    assert st.pos.tolist() == [[2, 7, *window], [5, 9, *window]]
    q1, k1, v1 = torch.randn(2, 1, d), torch.randn(1, 1, d), torch.randn(1, 1, d)
    out = decode(per_q, st, q1, k1, v1)
    for h, kept in enumerate([[2, 7, *window], [5, 9, *window]]):
        ref, _ = eager_attention(q1[h], torch.cat([k[0, kept], k1[0]])[None], torch.cat([v[0, kept], v1[0]])[None])
        torch.testing.assert_close(out[h, 0], ref[0])
    per_kv = SnapKV(budget=6, window_size=4, kernel_size=1, decode_policy="sliding", selection="per_kv_head")
    st, _ = prefill(per_kv, q, k, v)
    assert st.k.shape == (1, 6, d) and st.pos.tolist() == [[2, 7, *window]]
