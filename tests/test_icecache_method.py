"""IceCache and IceCache(reuse) (icecache/method.py; official yuzhenmao/IceCache)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ICECACHE_EXHAUSTIVE, assert_matches_full, build_tiny, generate_with, replace_hook

from evals.config import compose_config
from evals.registry import make_method
from icecache.kv import BudgetError, KVCache, ModelSpec, compat
from icecache.kv.timing import PhaseTimer
from icecache.offload import OffloadStore

# K covers every index page: exhaustive search (every child scored, unbounded field of view) and
# indexing even though the prompt fits in the budget, so every page is retrieved through the index.
EXHAUSTIVE = ICECACHE_EXHAUSTIVE


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ equals full attention
@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_covering_budget_through_the_index_matches_full(tiny_model, method):
    cache = assert_matches_full(tiny_model, method, budget=256, prompt_len=200, new_tokens=8, debug=True,
                                **EXHAUSTIVE)
    budgeted = [s for s in cache.states if cache.method.is_budgeted(s)]
    assert budgeted and all(s.offloaded and s.bytes_moved > 0 for s in budgeted)
    anchors = [s for s in budgeted if cache.method.builds_index(s.layer_idx)]
    assert all(s.index is not None for s in anchors)
    if method == "icecache_reuse":  # tiny models have 4 layers: layer 2 is the anchor of layer 3
        assert cache.states[3].index is None
    # every past token was attended at every step (7 steps over 200..206 past tokens: mean 203)
    assert all(e == pytest.approx(200 + 3) for e in cache.effective_tokens())


@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_prompt_within_budget_is_not_indexed_and_matches_full(method):
    cache = assert_matches_full(build_tiny("tiny-llama", 2, 4), method, budget=256, prompt_len=200, debug=True)
    assert not any(s.offloaded for s in cache.states)


@pytest.mark.parametrize("method", ["icecache_tuned", "icecache_reuse_rerank"])
def test_short_prompt_offloads_on_the_background_worker_once_generation_outgrows_the_budget(method):
    """``short_prompt="offload"`` (the tuned variants'): a 60-token prompt at budget 64 attends everything until its context
    exceeds 64 tokens; that step hands the store and index build to the background worker (not inline), and the
    layer keeps the budget from then on (``debug=True`` checks it every step)."""
    m = make_method(method, budget=64, page_size=8, debug=True)
    submitted, submit = [], m.submit_background
    replace_hook(m, "submit_background", lambda st, fn, *args: (submitted.append(st.n_seen), submit(st, fn, *args)))
    out, cache = generate_with(build_tiny("tiny-llama", 2, 4), torch.randint(0, 256, (1, 60)), 20, m)
    budgeted = [s for s in cache.states if m.is_budgeted(s)]
    assert all(s.offloaded for s in budgeted) and submitted == [65] * len(budgeted)
    assert max(m.resident_tokens(s) for s in budgeted) <= 64


@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_official_short_prompt_is_never_indexed_and_matches_full(method):
    """``short_prompt="dense"`` (official, the default): a prompt within the budget is never indexed, so the
    layer attends everything for the whole generation, beyond the budget, exactly as full attention."""
    assert make_method(method, budget=64).short_prompt == "dense"
    assert make_method(f"{method}_tuned" if method == "icecache" else f"{method}_rerank", budget=64).short_prompt \
        == "offload"
    cache = assert_matches_full(build_tiny("tiny-llama", 2, 4), method, budget=64, prompt_len=60, new_tokens=20,
                                debug=True, short_prompt="dense", page_size=8)
    assert not any(s.offloaded for s in cache.states)
    with pytest.raises(ValueError, match="short_prompt"):
        make_method(method, budget=64, short_prompt="never")


def test_official_default_reproduces_the_c_candidate_rule_pipeline_and_projection_draw():
    """``icecache`` takes the C code's candidate rule, prefill backpressure and per-prompt projection;
    ``icecache_tuned`` keeps this project's; explicit values win; bad values are refused."""
    official = make_method("icecache", budget=128)
    assert (official.candidate_rule, official.prefill_pipeline, official.projection) == (
        "official", "official", "per_prompt")
    assert official.dci_config().candidate_rule == "official"
    ours = make_method("icecache_tuned", budget=128)
    assert (ours.candidate_rule, ours.prefill_pipeline, ours.projection) == ("scored", "overlap", "seeded")
    assert make_method("icecache", budget=128, candidate_rule="scored").dci_config().candidate_rule == "scored"
    for key in ("candidate_rule", "prefill_pipeline", "projection"):
        with pytest.raises(ValueError, match=key):
            make_method("icecache", budget=128, **{key: "C"})


@pytest.mark.parametrize("pipeline", ["overlap", "official"])
def test_official_prefill_pipeline_keeps_one_build_in_flight_and_returns_with_every_index_built(pipeline, monkeypatch):
    monkeypatch.setenv("ICECACHE_BACKGROUND", "thread")  # the worker thread (a CPU runs the jobs inline by default)
    """``prefill_pipeline="official"``: when layer ``i`` queues its job, the job queued before it is done,
    and the prefill returns with every job done; ``"overlap"`` never waits (the jobs run behind the prefill)."""
    import time
    m = make_method("icecache", budget=64, page_size=8, prefill_pipeline=pipeline)
    slow, events = m.offload_job, []

    def offload_job(st, *args):
        time.sleep(0.2)
        slow(st, *args)
        events.append(("done", st.layer_idx))

    replace_hook(m, "offload_job", offload_job)
    submit = m.submit_background
    replace_hook(m, "submit_background", lambda st, fn, *args: (events.append(("queued", st.layer_idx)), submit(st, fn, *args)))
    model = build_tiny("tiny-llama", 2, 4, n_layers=6)
    cache = KVCache.for_model(m, model)
    try:
        cache.begin_prefill()
        model(torch.randint(0, 256, (1, 200)), use_cache=True, **compat.cache_kwargs(cache))
        after_prefill = list(events)
    finally:
        cache.close()
    budgeted = [s.layer_idx for s in cache.states if m.is_budgeted(s)]
    if pipeline == "official":
        assert after_prefill == [e for i in budgeted for e in (("queued", i), ("done", i))]
    else:
        assert [e for e in after_prefill if e[0] == "queued"] == [("queued", i) for i in budgeted]
        assert sum(e[0] == "done" for e in after_prefill) < len(budgeted)  # 4 x 200 ms behind a tiny prefill


@pytest.mark.parametrize("projection", ["seeded", "per_prompt"])
def test_projection_is_shared_by_the_layers_of_a_prompt_and_redrawn_per_prompt_only_when_asked(projection):
    m = make_method("icecache", budget=64, page_size=8, projection=projection)
    model, directions = build_tiny("tiny-llama", 2, 4), []
    for _ in range(2):
        _, cache = generate_with(model, torch.randint(0, 256, (1, 200)), 2, m)
        layers = [s.index.u for s in cache.states if s.index is not None]
        assert len(layers) == 2 and all(np.array_equal(u, layers[0]) for u in layers)
        directions.append(layers[0])
    assert np.array_equal(*directions) == (projection == "seeded")


# --------------------------------------------------------------------------- budgets and layouts
def test_layouts():
    official = {}
    assert make_method("icecache", budget=64, **official).layout() == (1, 2, 1)  # 64 -> (1, 2, 1) of 16
    assert make_method("icecache", budget=80, **official).layout() == (2, 2, 1)
    assert make_method("icecache", budget=128, **official).layout() == (2, 2, 4)
    assert make_method("icecache", budget=256, **official).layout() == (2, 2, 12)
    assert make_method("icecache", budget=64, page_size=8).layout() == (2, 2, 4)
    assert make_method("icecache", budget=64, n_sink_pages=0, budget_layout="fixed", **official).layout() == (0, 2, 2)
    retrieved = make_method("icecache", budget=64, budget_layout="retrieved")  # 64 retrieved tokens + sink + window
    assert retrieved.layout() == (2, 2, 4) and retrieved.attended_tokens == 128
    assert make_method("icecache", budget=256).attended_tokens == 256


def test_the_retrieved_reading_attends_its_pages_on_top_of_the_budget():
    """``budget_layout="retrieved"``: 64 retrieved tokens plus 2 sink and 2 window pages, never more."""
    m = make_method("icecache", budget=64, budget_layout="retrieved", debug=True)
    drv = Driver(m, prompt=400)
    q = torch.randn(H_Q, 1, D)
    for _ in range(20):
        drv.step(q)
    st = drv.states[2]
    assert st.offloaded and m.resident_tokens(st) <= 128
    assert (st.slot_page >= 0).sum(dim=1).tolist() == [4] * H_KV


def test_tuned_resolves_per_budget_and_explicit_values_win():
    """icecache_tuned: 8-token pages below 256 tokens, the official 16 from 256, every child of an expanded node
    scored; icecache: 16 everywhere and 80% of a large node; an explicit value overrides either."""
    for budget, page in [(32, 8), (64, 8), (120, 8), (128, 8), (248, 8), (256, 16), (512, 16)]:
        m = make_method("icecache_tuned", budget=budget)
        assert (m.page_size, m.gqa_merge) == (page, "interleaved")
        assert m.prop_to_retrieve == 1.0 == m.dci_config().prop_to_retrieve
        assert make_method("icecache_tuned", budget=budget, prop_to_retrieve=0.5).dci_config().prop_to_retrieve == 0.5
        official = make_method("icecache", budget=max(64, budget - budget % 16))
        assert (official.page_size, official.gqa_merge, official.prop_to_retrieve) == (16, "interleaved", 0.8)
    assert make_method("icecache_tuned", budget=64).layout() == (2, 2, 4)
    assert make_method("icecache_tuned", budget=128).layout() == (2, 2, 12)
    assert make_method("icecache_tuned", budget=256).layout() == (2, 2, 12)
    m = make_method("icecache_reuse_rerank", budget=64, page_size=16, gqa_merge="max")
    assert (m.page_size, m.gqa_merge, m.layout()) == (16, "max", (1, 2, 1))


@pytest.mark.parametrize("budget,hp,nearest", [
    (None, {}, "budget=128"),
    (100, {}, "96 or 112"),
    (100, dict(page_size=8), "96 or 104"),
    (48, {}, "64"),
    (8, dict(page_size=8), "32"),
    (64, dict(budget_layout="fixed"), "80"),
    (36, dict(page_size=8), "32 or 40"),
])
def test_invalid_budgets(budget, hp, nearest):
    with pytest.raises(BudgetError, match=nearest):
        make_method("icecache", budget=budget, **hp)


def test_invalid_options():
    with pytest.raises(ValueError, match="budget_layout"):
        make_method("icecache", budget=64, budget_layout="tight")
    with pytest.raises(ValueError, match="gqa_merge"):
        make_method("icecache", budget=64, gqa_merge="best")
    with pytest.raises(ValueError, match="gqa_candidates"):
        make_method("icecache", budget=64, gqa_candidates=-1)
    with pytest.raises(ValueError, match="n_window_pages"):
        make_method("icecache", budget=128, n_window_pages=1)
    with pytest.raises(ValueError, match="n_reuse_layers"):
        make_method("icecache_reuse", budget=128, n_reuse_layers=0)


def test_reuse_anchors_follow_check_reuse():
    m = make_method("icecache_reuse", budget=128, page_size=16)
    assert [m.anchor_of(i) for i in range(12)] == [0, 1, 2, 2, 2, 5, 5, 5, 8, 8, 8, 11]


# ------------------------------------------------------------------ the method driven on raw tensors
H_KV, H_Q, D = 2, 4, 16
SPEC = ModelSpec(n_layers=4, n_q_heads=H_Q, n_kv_heads=H_KV, head_dim=D, scaling=D ** -0.5, max_position=4096)


class Driver:
    """Drives layers ``2..3`` of a method directly with random post-RoPE tensors, keeping the whole K/V
    history for explicit reference computations."""

    def __init__(self, method, prompt: int, seed: int = 0, copy: tuple[slice, slice] | None = None):
        """``copy = (dst, src)``: prompt keys at positions ``dst`` are copies of those at ``src``."""
        self.gen = torch.Generator().manual_seed(seed)
        self.method, self.timer = method, PhaseTimer()
        bound = method.bind(SPEC)
        self.states = dict(enumerate(method.new_sequence(bound).layers))
        self.k = {i: torch.randn(H_KV, prompt, D, generator=self.gen) for i in (2, 3)}
        if copy is not None:
            for i in (2, 3):
                self.k[i][:, copy[0]] = self.k[i][:, copy[1]]
        self.v = {i: torch.randn(H_KV, prompt, D, generator=self.gen) for i in (2, 3)}
        for i in (2, 3):
            st = self.states[i]
            method.fill(st, self.k[i], self.v[i], torch.randn(H_Q, prompt, D, generator=self.gen))

    def step(self, q: torch.Tensor | None = None, keys: dict | None = None):
        """One decode step of layers 2 and 3; returns ``{layer: (q, out)}``."""
        q = torch.randn(H_Q, 1, D, generator=self.gen) if q is None else q
        outs = {}
        for i in (2, 3):
            st = self.states[i]
            k = torch.randn(H_KV, 1, D, generator=self.gen) if keys is None else keys[i]
            v = torch.randn(H_KV, 1, D, generator=self.gen)
            self.k[i], self.v[i] = torch.cat([self.k[i], k], 1), torch.cat([self.v[i], v], 1)
            outs[i] = self.method.step(st, q, k, v, self.timer)
        return q, outs


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[list[int]]):
    """fp64 softmax attention of query head ``i`` over ``positions[i // G]`` of KV head ``i // G``."""
    out = []
    for i in range(q.shape[0]):
        h = i // (q.shape[0] // k.shape[0])
        idx = torch.tensor(positions[h])
        scores = (q[i, 0].double() @ k[h, idx].double().T) * SPEC.scaling
        out.append(torch.softmax(scores, -1) @ v[h, idx].double())
    return torch.stack(out)[:, None]


def page_pairs(pages: torch.Tensor) -> set[tuple[int, int]]:
    """``{(head, page)}`` of a ``[H_kv, W]`` page-id table (-1 = none)."""
    return {(h, p) for h, row in enumerate(pages.tolist()) for p in row if p >= 0}


def page_bytes(method) -> int:
    return 2 * method.page_size * D * 4  # K and V of one (head, page) block, fp32


@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_attends_exactly_sink_selected_pages_and_window(method):
    """40 steps crossing three window evictions: the output equals an explicit attention over sink ∪
    the selected pages' valid tokens ∪ window, the resident set stays within the budget (debug=True)."""
    m = make_method(method, budget=128, page_size=16, debug=True)
    drv = Driver(m, prompt=300)
    sink, window, k_pages = m.layout()
    attended, attend = {}, m.attend

    def spy(st, q, fetched):  # the attended positions at attention time (the window may evict after)
        attended[st.layer_idx] = m.attended_positions(st)
        return attend(st, q, fetched)

    replace_hook(m, "attend", spy)
    evictions = 0
    for _ in range(40):
        before = drv.states[2].win_start
        q, outs = drv.step()
        evictions += drv.states[2].win_start != before
        starts = {i: drv.states[i].win_start for i in (2, 3)}  # evictions happen before the search
        for i in (2, 3):
            st = drv.states[i]
            table = m.page_source(st).index.page_table
            selection = st.selection if st.selection is not None else m.page_source(st).selection
            positions = []
            for h in range(H_KV):
                pages = selection[h][selection[h] >= 0]
                assert 1 <= len(pages) <= k_pages
                selected = table[h, pages].flatten()
                selected = selected[selected >= 0].tolist()
                win = list(range(starts[i], st.n_seen))  # the current token and < n_window pages of past
                assert (window - 1) * m.page_size < len(win) <= window * m.page_size
                expected = sorted(list(range(sink * m.page_size)) + selected + win)
                got = attended[i][h]
                assert sorted(got[got >= 0].tolist()) == expected  # no duplicates, nothing else
                assert len(expected) - 1 <= m.budget
                positions.append(expected)
            ref = reference_attention(q, drv.k[i], drv.v[i], positions)
            torch.testing.assert_close(outs[i].double(), ref, atol=1e-5, rtol=1e-5)
            assert m.resident_tokens(st) <= m.budget
    assert evictions == 3


@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_repeated_query_moves_nothing_and_changed_pages_are_refetched(method):
    # the window [256, 284) fills at the 4th step, which inserts its oldest page (official timing: it leaves the
    # window at the 5th); that page holds copies of the keys at 100..115, so the insert changes the page of
    # token 100 ...
    official_reuse = {"rerank": 0} if method == "icecache_reuse" else {}  # the reusing layer loads the anchor's pages
    m = make_method(method, budget=128, page_size=16, prop_to_retrieve=1.0, min_fov=1 << 20, **official_reuse)
    drv = Driver(m, prompt=284, copy=(slice(256, 272), slice(100, 116)))
    st, anchor = drv.states[3], drv.states[2]
    # ... which a query aligned with key 100 selects (query head i reads KV head i // 2)
    q = 10 * drv.k[2][torch.arange(H_Q) // 2, 100][:, None]
    drv.step(q)
    first = st.step_bytes
    assert first == page_bytes(m) * int((st.slot_page >= 0).sum()) > 0
    drv.step(q)
    assert st.step_bytes == 0 and anchor.step_bytes == 0  # same query, same pages: nothing moves
    assert st.bytes_moved == first
    drv.step(q)
    assert anchor.win_len == m.n_window_pages * m.page_size - 1 and anchor.step_bytes == 0
    held = {layer: page_pairs(layer.slot_page) for layer in (anchor, st)}
    drv.step(q)  # fills the window and inserts its oldest page, then selects with the same query
    assert anchor.win_len == m.n_window_pages * m.page_size and anchor.window_page_indexed
    inserted_at = anchor.changed_at
    for layer in (anchor, st):
        src = m.page_source(layer)  # IceCache: the layer itself; IceCache(reuse): the anchor
        now, changed = page_pairs(src.selection), {(h, p) for h, p in src.changed.nonzero().tolist()}
        if layer is anchor:
            assert held[layer] & changed & now, "the test must change a resident, still selected page"
        refetch = (held[layer] & changed & now) | (now - held[layer])
        assert layer.step_bytes == page_bytes(m) * len(refetch)
        # every resident copy equals the current page content: no stale slot survives
        table = m.page_source(layer).index.page_table
        for h in range(H_KV):
            for slot, page in enumerate(layer.slot_page[h].tolist()):
                if page < 0:
                    continue
                assert torch.equal(layer.slot_tokens[h, slot], table[h, page])
                ok = table[h, page] >= 0
                torch.testing.assert_close(layer.slot_k[h, slot][ok], drv.k[layer.layer_idx][h, table[h, page][ok]])
    drv.step(q)  # the inserted page leaves the window without a second insert
    assert anchor.win_len == (m.n_window_pages - 1) * m.page_size + 1 and not anchor.window_page_indexed
    assert anchor.changed_at == inserted_at and anchor.step_bytes == 0


def test_reuse_layer_loads_its_own_kv_in_the_anchors_layout():
    m = make_method("icecache_reuse", budget=128, page_size=16, rerank=0)
    drv = Driver(m, prompt=300)
    drv.step()
    anchor, st = drv.states[2], drv.states[3]
    assert st.index is None and torch.equal(st.slot_page, anchor.slot_page)
    assert torch.equal(st.slot_tokens, anchor.slot_tokens)
    ok = st.slot_tokens >= 0
    heads = torch.arange(H_KV)[:, None, None].expand_as(st.slot_tokens)
    torch.testing.assert_close(st.slot_k[ok], drv.k[3][heads[ok], st.slot_tokens[ok]])
    assert not torch.equal(st.slot_k[ok], anchor.slot_k[ok])


def test_rerank_attends_the_candidates_with_the_most_attention_of_the_layer():
    """IceCache(reuse) with rerank: the anchor's selection is the first K of its m*K candidates; a reusing
    layer attends the K candidates on which its own query group puts the most exact softmax mass (a direct
    reference over its own keys), and loads its own K/V of them."""
    m = make_method("icecache_reuse", budget=128, page_size=16, rerank=3, own_candidates=0)
    drv = Driver(m, prompt=400)
    for _ in range(3):
        q, _ = drv.step()
    anchor, st = drv.states[2], drv.states[3]
    k = m.layout()[2]
    assert anchor.candidates.shape[1] == 3 * k and torch.equal(anchor.selection, anchor.candidates[:, :k])
    table = anchor.index.page_table
    q3 = q  # the driver feeds one query to both layers; the keys differ
    for h in range(H_KV):
        masses = []
        for page in anchor.candidates[h].tolist():
            if page < 0:
                continue
            tokens = table[h, page][table[h, page] >= 0]
            masses.append((page, tokens))
        every = torch.cat([t for _, t in masses])
        mass = {}
        for qh in range(h * SPEC.group, (h + 1) * SPEC.group):
            probs = torch.softmax((drv.k[3][h, every].double() @ q3[qh, 0].double()) * SPEC.scaling, -1)
            split = torch.split(probs, [len(t) for _, t in masses])
            for (page, _), p in zip(masses, split):
                mass[page] = mass.get(page, 0.0) + float(p.sum())
        expected = sorted(mass, key=mass.get, reverse=True)[:k]
        assert sorted(st.selection[h].tolist()) == sorted(expected)
    ok = st.slot_tokens >= 0
    heads = torch.arange(H_KV)[:, None, None].expand_as(st.slot_tokens)
    torch.testing.assert_close(st.slot_k[ok], drv.k[3][heads[ok], st.slot_tokens[ok]])


def test_reuse_of_one_layer_is_icecache_exactly():
    """n_reuse_layers=1: every layer is its own anchor, so IceCache(reuse) must be IceCache bit for bit
    (same logits, selections and bytes moved) over a generation crossing window evictions."""
    model = build_tiny("tiny-qwen3", 2, 4)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    (ref, plain), (out, reuse) = (generate_with(model, ids, 40, name, budget=64, **hp)
                                  for name, hp in (("icecache", {}), ("icecache_reuse", dict(n_reuse_layers=1))))
    assert all(reuse.method.builds_index(i) for i in range(4))
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits))
    for a, b in zip(plain.states[2:], reuse.states[2:]):
        assert a.offloaded and torch.equal(a.selection, b.selection) and torch.equal(a.slot_tokens, b.slot_tokens)
        assert a.bytes_moved == b.bytes_moved > 0


def test_union_merge_attends_the_group_union():
    m = make_method("icecache", budget=128, page_size=16, gqa_merge="union", debug=True)
    drv = Driver(m, prompt=300)
    q, _ = drv.step()
    st = drv.states[2]
    pages = st.index.search(q[:, 0], m.layout()[2], n_seq=st.n_seen)
    for h in range(H_KV):
        union = set(pages[2 * h: 2 * h + 2].flatten().tolist()) - {-1}
        assert set(st.selection[h].tolist()) - {-1} == union
    assert m.resident_bound(SPEC.group) == 128 + 4 * 16


# ------------------------------------------------------------------------------------ model level
@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
@pytest.mark.parametrize("prompt", [200, 40], ids=["indexed-at-prefill", "indexed-during-decode"])
def test_resident_set_stays_within_budget_over_a_long_generation(method, prompt):
    model = build_tiny("tiny-qwen3", 2, 4)
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
    # short_prompt="offload" (the tuned variants'): the 40-token prompt is indexed once the context outgrows 64
    _, cache = generate_with(model, ids, 40, method, budget=64, debug=True, short_prompt="offload")
    budgeted = [s for s in cache.states if cache.method.is_budgeted(s)]
    assert all(s.offloaded for s in budgeted)
    assert cache.max_budgeted_resident() <= 64
    effective = cache.effective_tokens()
    assert all(e <= 64 for s, e in zip(cache.states, effective) if cache.method.is_budgeted(s))
    assert effective[0] == pytest.approx(prompt + 19)  # dense layers attend everything (39 steps)


# ------------------------------------------------------------------------------------ offload store
def test_bulk_load_packs_pages_in_one_transfer():
    k, v = torch.randn(2, 40, D), torch.randn(2, 40, D)
    store = OffloadStore.copy_of(k[:, :30], v[:, :30], first_pos=10, device="cpu", max_blocks=4, page_size=4)
    store.append(k[:, 30:], v[:, 30:])  # positions 40..49
    positions = torch.tensor([[10, 12, 49, -1], [45, 11, -1, -1]])
    heads = torch.tensor([1, 0])
    got_k, got_v = store.bulk_load(heads, positions)
    for b in range(2):
        ok = positions[b] >= 0
        torch.testing.assert_close(got_k[b][ok], k[heads[b], positions[b][ok] - 10])
        torch.testing.assert_close(got_v[b][ok], v[heads[b], positions[b][ok] - 10])
    assert got_k.shape == got_v.shape == (2, 4, D)  # the methods count the bytes they move (state.bytes_moved)
    with pytest.raises(IndexError):
        store.bulk_load(torch.tensor([0]), torch.tensor([[50, -1, -1, -1]]))
    with pytest.raises(ValueError):
        store.bulk_load(torch.zeros(5, dtype=torch.long), torch.full((5, 4), 10))


def test_cpu_store_adopts_the_prefill_buffers_without_a_copy():
    """On CPU the prefill buffers (row p = position p) become the store as they are; loads read the
    right rows, positions outside ``first .. end - 1`` are refused, and appends grow past the capacity."""
    k_buf, v_buf = torch.randn(2, 24, D), torch.randn(2, 24, D)
    store = OffloadStore.adopt(k_buf, v_buf, first_pos=4, end_pos=20, device="cpu", max_blocks=4, page_size=4)
    assert store.k_data.data_ptr() == k_buf.data_ptr() and store.n == 16
    torch.testing.assert_close(store.keys(), k_buf[:, 4:20])
    with pytest.raises(IndexError):
        store.bulk_load(torch.tensor([0]), torch.tensor([[3, 4, 5, 6]]))
    new_k, new_v = torch.randn(2, 8, D), torch.randn(2, 8, D)
    store.append(new_k, new_v)  # positions 20..27: past the 24 rows, so the buffers grow
    assert store.end_pos == 28 and store.k_data.shape[1] >= 28
    got_k, got_v = store.bulk_load(torch.tensor([1, 0]), torch.tensor([[4, 19, 27, -1], [21, 5, -1, -1]]))
    torch.testing.assert_close(got_k[0, :3], torch.stack([k_buf[1, 4], k_buf[1, 19], new_k[1, 7]]))
    torch.testing.assert_close(got_v[1, :2], torch.stack([new_v[0, 1], v_buf[0, 5]]))
    copied = OffloadStore.adopt(k_buf[:, ::2], v_buf[:, ::2], 2, 8, "cpu", 4, 4)  # not contiguous: copied
    assert copied.k_data.data_ptr() != k_buf.data_ptr()
    torch.testing.assert_close(copied.keys(), k_buf[:, ::2][:, 2:8])


# ------------------------------------------------------------------------------ SmolLM2 integration
def _passkey_cfg(cache: str, budget, out: Path, **passkey) -> dict:
    cfg = compose_config(["model=smollm2-135m", f"cache={cache}", "eval=passkey"])
    cfg["eval"].update(passkey)
    return dict(cfg, budget=budget, results_dir=str(out), data_dir=None, progress=False, debug=True)


def _smollm2_or_skip():
    from evals.models import ModelUnavailableError, smollm2_checkpoint
    try:
        smollm2_checkpoint()
    except ModelUnavailableError as err:
        pytest.skip(str(err))


def _passkey_scores(out: Path, **passkey) -> dict[str, dict]:
    """Per-sample passkey scores of ``full`` and of each ``(cache, budget)`` in ``passkey["runs"]``."""
    from evals.harness import run_eval
    runs = passkey.pop("runs")
    scores = {}
    for name, budget in (("full", None), *runs):
        run = run_eval(_passkey_cfg(name, budget, out, **passkey))
        rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
        scores[name] = {"per_sample": {r["id"]: r["scores"]["score"] for r in rows},
                        "timing": json.loads((run / "timing.json").read_text())}
    return scores


@pytest.mark.slow
def test_smollm2_passkey_budget_64_matches_full(tmp_path):
    """The #3 acceptance check on the default protocol (IceCache's passkey_pred.py: question prefilled):
    at 2k and 4k tokens, budget 64 (1 sink + 1 retrieved + 2 window pages), IceCache answers every sample
    exactly as full does, with the per-step resident assertions on (``debug``)."""
    _smollm2_or_skip()
    scores = _passkey_scores(tmp_path, runs=[("icecache", 64)], lengths=[2048, 4096], depths=[0.3, 0.7])
    assert set(scores["full"]["per_sample"].values()) == {1.0}
    assert scores["icecache"]["per_sample"] == scores["full"]["per_sample"]
    timing = scores["icecache"]["timing"]
    assert 0 < timing["max_resident_tokens"] <= 64
    effective = timing["effective_tokens_per_layer"]
    assert all(e > 1000 for e in effective[:2]) and all(e <= 64 for e in effective[2:])


@pytest.mark.slow
def test_smollm2_passkey_budget_64_finds_every_key_full_finds():
    """Guard on the tuned variant's small-budget choices: 2 lengths x 2 depths x 2 seeds (not the seeds it was
    chosen on) at budget 64; ``icecache_tuned`` must answer every pass key the full cache answers (the official
    configuration's one retrieved 16-token page misses some: docs/results.md). Each prompt is prefilled once
    and replayed into both caches (evals.prefill_cache.Prefill; tests/test_prefill_cache.py checks replay = live)."""
    _smollm2_or_skip()
    from evals.prefill_cache import Prefill
    from evals.tasks.passkey import Passkey
    from evals.runner import generate
    from evals.models import load_model, load_tokenizer
    tokenizer, model = load_tokenizer("smollm2-135m"), load_model("smollm2-135m")
    misses, found = [], 0
    for seed in (3, 11):
        suite = Passkey(tokenizer, lengths=[2048, 4096], depths=[0.35, 0.85], seed=seed)
        for sample in suite.samples():
            prefilled = Prefill.capture(model, sample.prompt_ids)
            answers = {name: generate(model, tokenizer, make_method(name, **hp), sample.prompt_ids,
                                      sample.max_new_tokens, prefilled=prefilled).text
                       for name, hp in (("full", {}), ("icecache_tuned", {"budget": 64, "debug": True}))}
            if suite.score(sample, answers["full"])["score"]:
                found += 1
                if not suite.score(sample, answers["icecache_tuned"])["score"]:
                    misses.append((seed, sample.id, sample.reference, answers["icecache_tuned"]))
    assert found >= 6, "full should find most of these keys"
    assert not misses


@pytest.mark.slow
def test_smollm2_passkey_question_via_decode_budget_256_matches_full(tmp_path):
    """The harder protocol (Quest: the question fed through the decode path) at 2k, depth 0.5 and budget
    256 (2 + 12 + 2 pages). IceCache(reuse) is not asserted here: on this sample its first answer token
    flips from " " to " a" (measured log-probs, full: -0.89 vs -1.61; icecache: -1.19 vs -1.27; reuse:
    -1.38 vs -1.16), a knife-edge decision, while its attended sets and K/V match the direct reference."""
    _smollm2_or_skip()
    scores = _passkey_scores(tmp_path, runs=[("icecache", 256)], lengths=[2048], depths=[0.5],
                             question_via_decode=True)
    assert set(scores["full"]["per_sample"].values()) == {1.0}
    assert scores["icecache"]["per_sample"] == scores["full"]["per_sample"]


@pytest.mark.parametrize("method,smallest", [("icecache", 64), ("icecache_reuse", 64), ("icecache_tuned", 32),
                                             ("icecache_reuse_rerank", 32)])
def test_default_configuration_keeps_every_head_within_every_budget(method, smallest):
    """For every budget the default configuration accepts, from the smallest valid one to 512 tokens, no head of
    a budgeted layer ever attends more than ``budget`` past tokens (the current token excluded)."""
    model = build_tiny("tiny-llama", 2, 6)  # GQA group 3, as SmolLM2
    ids = torch.randint(0, 256, (1, 600), generator=torch.Generator().manual_seed(4))
    budgets = []
    for budget in range(8, 513, 8):
        try:
            make_method(method, budget=budget)
        except BudgetError:
            continue
        budgets.append(budget)
    assert budgets[0] == smallest and budgets[-1] == 512 and 264 not in budgets  # tuned: 8-token pages below 256
    for budget in budgets:
        m = make_method(method, budget=budget, debug=True)
        most, attend = {}, m.attend

        def spy(st, q, fetched, m=m, most=most, attend=attend):
            if m.is_budgeted(st):
                per_head = fetched.valid.sum(-1) - 1 if fetched.valid is not None else torch.tensor([fetched.k.shape[1] - 1])
                most[st.layer_idx] = max(most.get(st.layer_idx, 0), int(per_head.max()))
            return attend(st, q, fetched)

        replace_hook(m, "attend", spy)
        generate_with(model, ids, 20, m)
        assert most and max(most.values()) <= budget, (budget, most)


def test_jobs_run_inline_when_the_prefill_uses_every_core_with_the_same_output_as_on_the_worker_thread(monkeypatch):
    """``ICECACHE_BACKGROUND`` (``icecache.kv.state.jobs_inline``): ``inline`` runs the offload and index build at
    submission on the calling thread, ``thread`` on the worker, with equal generations; ``auto`` inlines them when
    torch's threads take every core of a CPU, never on a GPU; a bad value is refused with the accepted ones."""
    import threading

    from icecache.kv import state

    model, ids = build_tiny("tiny-llama", 2, 4), torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    outputs = {}
    for mode in ("inline", "thread"):
        monkeypatch.setenv("ICECACHE_BACKGROUND", mode)
        seen = []
        m = make_method("icecache", budget=64, page_size=8)
        job = m.offload_job
        replace_hook(m, "offload_job", lambda st, *args: (seen.append(threading.current_thread() is threading.main_thread()),
                                  job(st, *args)))
        outputs[mode] = generate_with(model, ids, 8, m)[0].sequences
        assert seen and all(seen) == (mode == "inline") and any(seen) == (mode == "inline")
    assert torch.equal(outputs["inline"], outputs["thread"])
    monkeypatch.setenv("ICECACHE_BACKGROUND", "auto")
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for threads, inline in ((state.os.cpu_count(), True), (max(1, state.os.cpu_count() - 1), state.os.cpu_count() == 1)):
        monkeypatch.setattr(state.torch, "get_num_threads", lambda n=threads: n)
        assert state.jobs_inline(cpu) == inline and not state.jobs_inline(gpu)
    monkeypatch.setenv("ICECACHE_BACKGROUND", "later")
    with pytest.raises(ValueError, match="auto .*thread or inline"):
        state.jobs_inline(cpu)
