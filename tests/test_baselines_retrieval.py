"""Retrieval baselines: PQCache, OmniKV, MagicPIG (baselines/pqcache.py, omnikv.py, magicpig.py)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches_full, build_tiny, generate_with, replace_hook, restore_hook

from baselines import magicpig as mp
from baselines import omnikv as okv
from baselines import pqcache as pq
from evals.bench import pq_scoring
from evals.registry import make_cache, make_method
from icecache.kv import BudgetError, ModelSpec
from icecache.kv.attention import attend
from icecache.kv.timing import PhaseTimer

# Budgets that cover the whole context (prompt 48 + 8 new tokens): PQCache's top-k (29) holds every
# candidate; OmniKV selects all 48 prompt tokens; MagicPIG's sample target (26) holds all 18 offloaded
# tokens, so calibration picks K = 0 (the official fixed K given as 0, with a 26-token local window: the official
# 64 would hold the whole prompt): every key is a candidate with inclusion probability exactly 1.
COVERING = [("pqcache", dict(budget=60)),
            ("omnikv", dict(budget=48, filter_layers=[1], wait_layers=0)),
            ("magicpig", dict(budget=56, n_bits=0, local_window=26)),
            ("magicpig_calibrated", dict(budget=56))]


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- equals full attention
@pytest.mark.parametrize("method,hp", COVERING, ids=[m for m, _ in COVERING])
def test_budget_covering_context_matches_full(tiny_model, method, hp):
    cache = assert_matches_full(tiny_model, method, debug=True, **hp)
    budgeted = [s for s in cache.states if cache.method.is_budgeted(s)]
    assert budgeted, "the configuration must exercise budgeted layers"
    if method.startswith("magicpig"):  # the sampled path (K = 0, weights 1) ran, it was not all exact
        assert all(s.store_k is not None and s.n_bits == 0 for s in budgeted)
    else:  # K/V were gathered from the offload store
        assert all(s.bytes_moved > 0 for s in budgeted)


def test_magicpig_all_candidates_with_exact_weights_matches_full():
    """K = 0 bits at a small budget: the exact part is small, every offloaded key is sampled with w = 1."""
    cache = assert_matches_full(build_tiny("tiny-llama", 2, 4), "magicpig", budget=16, calibrate=False, n_bits=0,
                                local_window=6, debug=True)
    sparse = [s for s in cache.states if cache.method.is_budgeted(s)]
    assert all(s.store_k.shape[1] == 48 - 4 - 6 for s in sparse)


# ----------------------------------------------------------------------------------------- PQCache
def _pq_problem(n: int, n_bits: int, seed: int = 0):
    torch.manual_seed(seed)
    h_kv, h_q, d, m = 2, 4, 16, 2
    keys, q = torch.randn(h_kv, n, d), torch.randn(h_q, d)
    sub = pq.split_subvectors(keys, m).reshape(h_kv * m, n, d // m)
    cents, codes = pq.kmeans(sub, 2 ** n_bits, 10, torch.Generator().manual_seed(seed))
    cents = cents.reshape(h_kv, m, *cents.shape[1:])
    codes = codes.reshape(h_kv, m, n).permute(0, 2, 1)
    return keys, q, cents, codes


def _reconstruct(cents: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Keys ``[H_kv, n, d]`` rebuilt from their PQ codes."""
    h, m = cents.shape[:2]
    parts = [cents[torch.arange(h)[:, None], s, codes[..., s]] for s in range(m)]  # each [H, n, ds]
    return torch.cat(parts, dim=-1)


def test_pq_lookup_scores_equal_dot_products_with_reconstructed_keys():
    keys, q, cents, codes = _pq_problem(n=200, n_bits=3)
    k_hat = _reconstruct(cents, codes)
    assert not torch.allclose(k_hat, keys, atol=1e-3)  # 8 centroids: a real quantisation
    explicit = torch.einsum("hd,hnd->hn", q, k_hat.repeat_interleave(2, 0))
    torch.testing.assert_close(pq.lookup_scores(q, cents, codes), explicit, rtol=1e-5, atol=1e-5)


def test_pq_topk_on_exact_codes_equals_exact_topk():
    keys, q, cents, codes = _pq_problem(n=40, n_bits=6)  # 64 >= 40 keys: one centroid per key
    torch.testing.assert_close(_reconstruct(cents, codes), keys)
    scaling = 16 ** -0.5
    got = pq.topk_sorted(pq.group_probs(pq.lookup_scores(q, cents, codes), scaling, 2), k=7)
    exact = torch.softmax(torch.einsum("hd,hnd->hn", q, keys.repeat_interleave(2, 0)) * scaling, -1)
    want = exact.reshape(2, 2, -1).sum(1).topk(7).indices.sort(-1).values
    assert torch.equal(got, want)


@pytest.mark.parametrize("m,n_bits,n", [(1, 6, 300), (2, 3, 500), (2, 6, 3000), (4, 2, 400)])
def test_pq_joint_code_scores_equal_the_per_token_softmax(m, n_bits, n):
    """Scoring each tuple of codes once gives every token the group-summed softmax of its PQ logits (the
    per-token reference), and the same top-k up to ties (equal reference scores)."""
    gen = torch.Generator().manual_seed(m * 100 + n_bits)
    h_kv, group, d, c = 2, 3, 16, 2 ** n_bits
    q = torch.randn(h_kv * group, d, generator=gen) * 4  # peaked softmax: tiny terms must not underflow to 0
    cents = torch.randn(h_kv, m, c, d // m, generator=gen)
    codes = torch.randint(0, c, (h_kv, n, m), generator=gen)
    ids = pq.joint_code_ids(codes, c)
    counts = torch.zeros(h_kv, c ** m, dtype=torch.float64).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float64))
    scaling = d ** -0.5
    want = pq.group_probs(pq.lookup_scores(q, cents, codes), scaling, h_kv)
    got = pq.joint_code_scores(q, cents, counts, scaling).gather(1, ids)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-7)
    k = 37
    chosen, ref = pq.topk_sorted(got, k), pq.topk_sorted(want, k)
    torch.testing.assert_close(want.gather(1, chosen).sort(-1).values, want.gather(1, ref).sort(-1).values,
                               rtol=1e-5, atol=1e-8)


def test_pq_joint_and_per_token_decodes_attend_the_same_mass():
    """A decode with tuple scores and one with per-token scores retrieve tokens of the same reference
    score at every step (fed the same query, on the same state), and the tuple counts follow the candidates."""
    model = build_tiny("tiny-llama", 2, 4)
    _, cache = generate_with(model, _ids(300), 6, "pqcache", budget=24, n_sink=4)
    method = cache.method
    per_token = pq.PQCache(budget=24, n_sink=4, joint_scores=False)
    q = torch.randn(cache.spec.n_q_heads, 1, cache.spec.head_dim, generator=torch.Generator().manual_seed(0))
    for st in cache.states:
        n_cand = method.n_candidates(st)
        joint, token = method.select(st, q), per_token.select(st, q)
        want = pq.group_probs(pq.lookup_scores(q[:, 0], st.centroids, st.codes[:, :n_cand]), cache.spec.scaling,
                              cache.spec.n_kv_heads)
        torch.testing.assert_close(want.gather(1, joint - 4).sort(-1).values,
                                   want.gather(1, token - 4).sort(-1).values)
        ids = pq.joint_code_ids(st.codes[:, :n_cand], st.centroids.shape[2])
        assert torch.equal(st.code_ids[:, :n_cand], ids)
        assert torch.equal(st.code_counts, torch.stack([torch.bincount(i, minlength=st.code_counts.shape[1])
                                                        for i in ids]).float())
        assert torch.equal(st.code_mask, pq.candidate_mask(st.code_counts))


def _extreme_unused_centroid_layer(method: pq.PQCache, spec: ModelSpec, n: int = 60):
    """A decoding layer whose ``n`` candidates have distinct tuples of codes, none using centroid 0 of sub-vector
    0; every query head's sub-vector 0 has norm 10 along that centroid, scaled to norm 400: its logit stands ~1000
    nats above every used one, whose logits stay within a few nats (no ties, no underflow per token)."""
    gen = torch.Generator().manual_seed(7)
    c, half = 2 ** method.n_bits, spec.head_dim // 2
    st = method.new_sequence(method.bind(spec)).layers[0]
    zeros = torch.zeros(spec.n_kv_heads, method.n_sink + n + method.recent, spec.head_dim)
    method.fill(st, zeros, zeros)  # resident: the sinks and the recent window; n candidates between them
    method.await_background(st)  # the codebook of the prompt, replaced below
    st.centroids = torch.randn(spec.n_kv_heads, 2, c, half, generator=gen)
    direction = torch.nn.functional.normalize(st.centroids[:, 0, 0], dim=-1)
    st.centroids[:, 0, 0] = 400 * direction
    q = torch.randn(spec.n_q_heads, 1, spec.head_dim, generator=gen)
    q[:, 0, :half] = 10 * direction.repeat_interleave(spec.group, 0)
    ids = torch.stack([c + torch.randperm(c * c - c, generator=gen)[:n] for _ in range(spec.n_kv_heads)])
    st.codes = torch.stack([ids // c, ids % c], dim=-1)  # sub-vector 0 never takes code 0
    st.code_ids = pq.joint_code_ids(st.codes, c)
    return st, q


def test_pq_joint_scores_stay_finite_with_an_extreme_unused_centroid():
    """Tuple scores shift by the largest logit of a tuple that has candidates: with an unused centroid whose
    scaled logit is hundreds of nats above every used one (the old shift, the sum of per-subspace maxima over
    all centroids, underflowed the normaliser even in float64: NaN scores), the scores stay finite and the
    selection equals the per-token path's (distinct tuples: no ties)."""
    spec = ModelSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, scaling=0.25, max_position=4096)
    joint, per_token = pq.PQCache(budget=24, n_bits=3), pq.PQCache(budget=24, n_bits=3, joint_scores=False)
    st, q = _extreme_unused_centroid_layer(joint, spec)
    tables = torch.einsum("hgd,hcd->hgc", q[:, 0, :8].reshape(2, 2, 8), st.centroids[:, 0]) * spec.scaling
    assert (tables[..., 0] - tables[..., 1:].amax(-1) > 800).all()  # exp(-800) is 0 even in float64
    assert (tables[..., 1:].amax(-1) - tables[..., 1:].amin(-1) < 20).all()  # the used logits: a few nats
    counts, mask = joint.count_candidates(st, 60)
    scores = pq.joint_code_scores(q[:, 0], st.centroids, counts, spec.scaling, mask)
    assert torch.isfinite(scores).all() and (scores.gather(1, st.code_ids) > 0).any(-1).all()
    assert torch.equal(joint.select(st, q), per_token.select(st, q))


def test_pq_joint_scores_refuse_a_non_finite_normaliser():
    spec = ModelSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, scaling=0.25, max_position=4096)
    method = pq.PQCache(budget=24, n_bits=3)
    st, q = _extreme_unused_centroid_layer(method, spec)
    q[1, 0, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite softmax normaliser"):
        method.select(st, q)


def test_pq_scoring_bench_times_both_selections_and_checks_they_agree(capsys):
    rows = pq_scoring.main(["--lengths", "300", "900", "--repeats", "3", "--budget", "64"])
    assert [r["length"] for r in rows] == [300, 900]
    assert all(r["same_selected_mass"] and r["joint_ms"] > 0 and r["per_token_ms"] > 0 for r in rows)
    assert "growth_ms_per_layer" in capsys.readouterr().out


def test_pq_kmeans_is_seeded():
    a = _pq_problem(n=200, n_bits=3, seed=1)[2]
    b = _pq_problem(n=200, n_bits=3, seed=1)[2]
    keys = torch.randn(4, 200, 8, generator=torch.Generator().manual_seed(1))
    other = pq.kmeans(keys, 8, 10, torch.Generator().manual_seed(2))[0]
    same = pq.kmeans(keys, 8, 10, torch.Generator().manual_seed(3))[0]
    assert torch.equal(a, b) and not torch.equal(other, same)


def reference_lloyd(x, init, iters, tol):
    """One problem ``x: [n, ds]`` of sklearn's Lloyd (``_kmeans_single_lloyd``): stop on unchanged labels or on
    a summed squared centre shift <= tol * mean(var(x, axis=0)); an empty cluster keeps its centre."""
    centres, threshold = x[init].clone(), float(x.var(0, unbiased=False).mean()) * tol
    labels = torch.cdist(x, centres).argmin(-1)
    for it in range(1, iters + 1):
        new = torch.stack([x[labels == j].mean(0) if (labels == j).any() else centres[j] for j in range(len(centres))])
        shift, centres = float(((new - centres) ** 2).sum()), new
        new_labels = torch.cdist(x, centres).argmin(-1)
        converged = torch.equal(new_labels, labels) or shift <= threshold
        labels = new_labels
        if converged:
            break
    return centres, labels, it


@pytest.mark.parametrize("iters,tol", [(300, 0.0), (300, 1e-2), (3, 0.0)])
def test_pq_kmeans_matches_sklearn_lloyd_rules_per_problem(iters, tol):
    """The batched k-means stops each problem as sklearn's KMeans(tol, max_iter) would."""
    x = torch.randn(3, 120, 4, generator=torch.Generator().manual_seed(0))
    stats = {}
    cents, codes = pq.kmeans(x, 8, iters, torch.Generator().manual_seed(5), tol=tol, stats=stats)
    gen = torch.Generator().manual_seed(5)
    inits = [torch.randperm(120, generator=gen)[:8] for _ in range(3)]
    for i in range(3):
        want_c, want_l, want_it = reference_lloyd(x[i], inits[i], iters, tol)
        torch.testing.assert_close(cents[i], want_c)
        assert torch.equal(codes[i], want_l) and int(stats["iterations"][i]) == want_it
    assert (stats["iterations"] <= iters).all() and (iters == 3 or (stats["iterations"] > 3).any())


def test_pq_convergence_bound_never_quantises_worse_than_ten():
    """Defaults pinned to multi_core_compressor_v2.py: the cap 300 of its bound and sklearn's tol=1e-4 (run to
    convergence); ``kmeans_iters=0`` is its adaptive ``max_iter=0``, clamped to [3, 300]. From the same
    initialisation Lloyd's objective never increases, so the codebook run to convergence quantises at least as
    well as a fixed 10 iterations."""
    method = pq.PQCache(budget=64)
    assert (method.kmeans_iters, method.kmeans_tol, method.ADAPTIVE, method.ADAPTIVE_ITERS) == (300, 1e-4, 0, (3, 300))
    keys = torch.randn(4, 1500, 32, generator=torch.Generator().manual_seed(0))
    errors = {}
    for iters, tol in ((10, 0.0), (300, 1e-4)):
        stats = {}
        cents, codes = pq.kmeans(keys, 64, iters, torch.Generator().manual_seed(1), tol=tol, stats=stats)
        recon = cents.gather(1, codes[..., None].expand(-1, -1, 32))
        errors[iters] = float(((recon - keys) ** 2).sum(-1).mean())
        if iters == 300:
            assert (stats["iterations"] > 10).all()  # the bound let it run past 10
    assert errors[300] < errors[10]


def test_pq_kmeans_time_budget_stops_after_the_minimum_iterations():
    """A zero budget runs exactly ``min_iters`` iterations; an ample one runs to convergence (as no budget)."""
    keys = torch.randn(4, 1500, 32, generator=torch.Generator().manual_seed(0))
    runs = {}
    for budget in (0.0, 1e9, None):
        stats = {}
        pq.kmeans(keys, 64, 300, torch.Generator().manual_seed(1), tol=1e-4, stats=stats, time_budget_s=budget,
                  min_iters=3)
        runs[budget] = stats["iterations"]
    assert (runs[0.0] == 3).all() and torch.equal(runs[1e9], runs[None]) and (runs[None] > 3).all()


def test_pq_adaptive_iterations_on_a_cpu_without_idle_cores(monkeypatch):
    """The adaptive bound (``kmeans_iters=0``) on a CPU whose every core runs torch's threads: no core is idle
    during the prefill, so each layer gets the official minimum of 3 iterations, reported in ``layer_stats``.
    The default, a fixed bound, reads no clock and runs every layer to convergence."""
    monkeypatch.setattr("os.cpu_count", lambda: torch.get_num_threads())
    model = build_tiny("tiny-llama", 2, 4)
    _, cache = generate_with(model, _ids(400), 3, "pqcache", budget=24, kmeans_iters=0)
    assert all(cache.method.layer_stats(st) == {"kmeans_iterations": 3.0} for st in cache.states)
    assert pq.spare_cpu_share(torch.device("cpu")) == 0.0 and pq.spare_cpu_share(torch.device("cuda")) == 1.0
    assert pq.PQCache(budget=24).kmeans_time_budget(pq.PQState(1)) is None
    _, cache = generate_with(model, _ids(400), 3, "pqcache", budget=24)
    assert all(cache.method.layer_stats(st)["kmeans_iterations"] > 3 for st in cache.states)


def test_pq_window_codes_and_budget_split():
    model = build_tiny("tiny-llama", 2, 4)
    _, cache = generate_with(model, _ids(96), 12, "pqcache", budget=24, n_sink=4, debug=True)
    method = cache.method
    assert (method.n_sink, method.recent, method.topk) == (4, 10, 10)
    for st in cache.states:
        n_past = st.n_seen - 1  # the last generated token is past now, but has not been attended yet
        assert st.resident_tokens() == 4 + 10
        assert cache.effective_tokens()[st.layer_idx] == 24  # 4 sinks + 10 recent + 10 top-k, every step
        # every token between the sinks and the window has a code; those generated got the nearest centroid
        assert st.codes.shape[1] == int(st.pos[4]) - 4 == n_past + 1 - 10 - 4
        n_prompt_coded = 96 - 4
        late = st.store.keys()[:, 4 + n_prompt_coded:int(st.pos[4])]
        sub = pq.split_subvectors(late, 2)
        want = pq.nearest_centroid(sub.reshape(-1, *sub.shape[2:]), st.centroids.reshape(-1, *st.centroids.shape[2:]))
        assert late.shape[1] > 0
        assert torch.equal(st.codes[:, n_prompt_coded:], want.reshape(2, 2, -1).permute(0, 2, 1))


# ------------------------------------------------------------------------------------------ OmniKV
def test_omnikv_layer_roles_follow_the_official_code():
    roles = okv.layer_roles(32, (2, 8, 18), wait_layers=1)
    dense = {i for i, (r, _) in roles.items() if r != "sparse"}
    assert dense == {0, 1, 2, 3, 8, 9, 18, 19}
    assert roles[7] == ("sparse", 2) and roles[31] == ("sparse", 18)
    assert okv.scaled_filter_layers(32) == (2, 8, 18)
    assert okv.scaled_filter_layers(30) == (2, 8, 17)


def test_omnikv_sparse_layers_attend_exactly_the_filter_selection():
    """Reference independent of the cache: each layer's q/k/v recomputed with the model's own projections
    and rotary embedding from the hidden states entering its attention (forward hooks). At each decode step,
    the filter layer's query picks the 10 prompt tokens of largest logit (max over its query heads; OmniKV
    ``last``), and each sparse layer's attention output (the input of its ``o_proj``) must be exact
    attention over those prompt tokens plus every generated token."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = build_tiny("tiny-llama", 2, 4, n_layers=6)
    hidden, attn_out = {i: [] for i in range(6)}, {i: [] for i in range(6)}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: hidden[i].append(kwargs["hidden_states"][0].detach()), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args, i=i: attn_out[i].append(args[0][0].detach())))
    method = okv.OmniKV(budget=10, filter_layers=[1, 3], wait_layers=0, debug=True)
    cache = make_cache(method, model)
    try:
        model.generate(_ids(40), max_new_tokens=6, min_new_tokens=6, do_sample=False, past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    assert {st.layer_idx for st in cache.states if method.is_budgeted(st)} == {2, 4, 5}
    n_q, n_kv = 4, 2
    d = model.config.hidden_size // n_q

    def qkv(i):  # [H, n, d] for every position so far (prefill + decode calls), rotated at their positions
        attn, x = model.model.layers[i].self_attn, torch.cat(hidden[i])
        n = x.shape[0]
        q = attn.q_proj(x).view(n, n_q, d).transpose(0, 1)[None]
        k = attn.k_proj(x).view(n, n_kv, d).transpose(0, 1)[None]
        v = attn.v_proj(x).view(n, n_kv, d).transpose(0, 1)[None]
        cos, sin = model.model.rotary_emb(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q[0], repeat_kv(k, n_q // n_kv)[0], repeat_kv(v, n_q // n_kv)[0]

    with torch.no_grad():
        for layer, filt in ((2, 1), (4, 3), (5, 3)):
            fq, fk, _ = qkv(filt)
            q, k, v = qkv(layer)
            for step, t in enumerate(range(40, 45)):  # 6 new tokens: the first comes from the prefill pass
                chosen = torch.einsum("hd,hnd->hn", fq[:, t], fk[:, :40]).max(0).values.topk(10).indices
                keys = torch.cat([chosen.sort().values, torch.arange(40, t + 1)])
                probs = torch.softmax(torch.einsum("hd,hnd->hn", q[:, t], k[:, keys]) * d ** -0.5, -1)
                want = torch.einsum("hn,hnd->hd", probs, v[:, keys]).reshape(-1)
                torch.testing.assert_close(attn_out[layer][1 + step][0], want, atol=1e-5, rtol=1e-4)
    for layer in (2, 4, 5):
        assert cache.effective_tokens()[layer] == 10 + 2.0  # generated tail of 0..4 past tokens
    cache.close()


def fill_looking(method, st, k, v, q, look) -> None:
    """``method.fill(st, k, v, q)``, calling ``look(st)`` between the layer's prefill and its ``finish_prefill``."""
    finish = method.finish_prefill

    def looked(state):
        look(state)
        finish(state)

    replace_hook(method, "finish_prefill", looked)
    try:
        method.fill(st, k, v, q)
    finally:
        restore_hook(method, "finish_prefill")


# ---------------------------------------------------------------------------------------- MagicPIG
def test_omnikv_sparse_layers_free_their_device_prefill_buffer():
    """Once a sparse layer's prompt K/V are in the offload store, no tensor of its state may
    keep the device prefill buffer alive (a prefix view did), and the generated tail lives in its own
    small buffer rather than being written into that one. On CPU the store is that buffer's memory itself."""
    import gc
    import weakref

    method = okv.OmniKV(budget=8, filter_layers=[0], wait_layers=0, debug=True)
    bound = method.bind(ModelSpec(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=8, scaling=0.35, max_position=4096))
    states = method.new_sequence(bound).layers
    g = torch.Generator().manual_seed(0)
    n = 500
    q, k, v = (torch.randn(h, n, 8, generator=g) for h in (4, 2, 2))
    sparse, prefill = states[1], {}

    def look(st):  # the sparse layer's prefill buffers, before finish_prefill moves its K/V to the store
        prefill["buffers"] = [weakref.ref(st.buffers[name]) for name in ("k", "v", "pos")]
        prefill["k_memory"] = st.buffers["k"].untyped_storage().data_ptr()

    method.fill(states[0], k, v, q)
    fill_looking(method, sparse, k, v, q, look)
    assert sparse.store_k.untyped_storage().data_ptr() == prefill["k_memory"]  # on CPU: that memory, no copy
    gc.collect()
    assert all(ref() is None for ref in prefill["buffers"]), "the sparse layer's prefill buffer is still alive"
    prompt_bytes = 2 * n * 8 * 4
    for _ in range(3):
        q1, k1, v1 = (torch.randn(h, 1, 8, generator=g) for h in (4, 2, 2))
        for st in states:
            method.step(st, q1, k1, v1, PhaseTimer())
    device_tensors = [sparse.k, sparse.v, *sparse.buffers.values()]
    assert all(t.untyped_storage().nbytes() < prompt_bytes / 4 for t in device_tensors)
    assert sparse.k.shape[1] == 3 and torch.equal(sparse.pos, torch.arange(n, n + 3))
    assert sparse.store_k.shape == (2, n, 8) and torch.equal(sparse.store_k, k)  # the offload copy holds the prompt
    assert states[0].k.untyped_storage().nbytes() >= prompt_bytes  # the dense filter layer keeps its buffer


def test_magicpig_store_is_the_prefill_memory_and_decoding_never_writes_into_it():
    """On CPU the offload store is a view of the layer's prefill K/V (no copy, :func:`icecache.kv.storage.to_store`);
    the resident sinks, local window and generated tokens get buffers of their own, so the store still holds
    the prompt's middle tokens after decoding."""
    method = mp.MagicPIG(budget=24, local_window=6, dense_layers=[], calibrate=False, n_bits=3, n_tables=8)
    bound = method.bind(ModelSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=8, scaling=0.35, max_position=4096))
    st = method.new_sequence(bound).layers[0]
    g = torch.Generator().manual_seed(0)
    n = 200
    q, k, v = (torch.randn(h, n, 8, generator=g) for h in (4, 2, 2))
    prefill_memory = []
    fill_looking(method, st, k, v, q,
                 lambda st: prefill_memory.extend(st.buffers[name].untyped_storage().data_ptr() for name in ("k", "v")))
    assert [t.untyped_storage().data_ptr() for t in (st.store_k, st.store_v)] == prefill_memory
    for _ in range(5):
        q1, k1, v1 = (torch.randn(h, 1, 8, generator=g) for h in (4, 2, 2))
        method.step(st, q1, k1, v1, PhaseTimer())
    assert torch.equal(st.store_k, k[:, 4:n - 6]) and torch.equal(st.store_v, v[:, 4:n - 6])
    assert torch.equal(st.pos, torch.cat([torch.arange(4), torch.arange(n - 6, n + 5)]))
    assert st.k.untyped_storage().data_ptr() not in prefill_memory


def test_simhash_collision_rate_matches_theory():
    """Per-table collision rate ~ (1 - theta/pi)^K and >= 2-of-L inclusion ~ w (Monte-Carlo, 4 sigma)."""
    g = torch.Generator().manual_seed(0)
    d, bits, n_tables, trials = 16, 3, 10, 600
    q = torch.randn(d, generator=g)
    x = torch.stack([q + s * torch.randn(d, generator=g) for s in (0.3, 0.8, 1.5, 3.0)])
    proj = torch.randn(d, n_tables * trials, bits, generator=g)
    hit = mp.simhash(x, proj) == mp.simhash(q, proj)  # [4, tables]
    cos = torch.nn.functional.cosine_similarity(x, q[None], dim=-1)
    p = mp.collision_probability(cos, bits)
    rate = hit.double().mean(-1)
    assert torch.all((rate - p).abs() <= 4 * torch.sqrt(p * (1 - p) / hit.shape[1]))
    w = mp.inclusion_probability(p, n_tables, 2)
    incl = (hit.reshape(4, trials, n_tables).sum(-1) >= 2).double().mean(-1)
    assert torch.all((incl - w).abs() <= 4 * torch.sqrt(w * (1 - w) / trials) + 1e-9)
    assert float(mp.inclusion_probability(torch.tensor(1.0), 150, 2)) == 1.0


def test_simhash_codes_are_the_sign_bits_of_each_table_in_any_chunking():
    g = torch.Generator().manual_seed(0)
    x, proj = torch.randn(2, 37, 16, generator=g), torch.randn(16, 5, 6, generator=g)
    signs = torch.einsum("hnd,dlk->hnlk", x, proj) > 0
    plain = sum(signs[..., b].long() * 2 ** b for b in range(6))  # [2, 37, 5]
    assert torch.equal(mp.simhash(x, proj).long(), plain)
    assert torch.equal(mp.simhash(x[0, 0], proj).long(), plain[0, 0])  # a single vector keeps its shape [L]
    assert torch.equal(mp.simhash(x[1], proj).long(), plain[1])  # [n, d]: one code row per vector


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_simhash_in_the_inputs_dtype_is_the_sign_of_its_product(dtype, monkeypatch):
    """Hashing in the model's dtype (the official bf16 ``hash_func``): small integers make every product and
    sum exact in each dtype, so the codes must equal the sign bits of the exact product, zeros included; the
    products are chunked (3 rows at a time here) and packed into a table-major buffer."""
    from baselines.magicpig import lsh

    monkeypatch.setattr(lsh, "ROWS_PER_PRODUCT", 3)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (3, 11, 16), generator=g).to(dtype)
    proj = torch.randint(-2, 3, (16, 7, 5), generator=g).float()
    signs = torch.einsum("hnd,dlk->hnlk", x.double(), proj.double()) > 0
    plain = sum(signs[..., b].long() * 2 ** b for b in range(5))
    codes = mp.simhash(x, proj)
    assert codes.dtype == torch.int16 and torch.equal(codes.long(), plain)
    assert codes.transpose(1, 2).is_contiguous()  # [H, L, n]: what build_tables sorts, without a copy
    assert mp.simhash(torch.ones(2, 16, dtype=dtype), torch.ones(16, 3, 16)).dtype == torch.int32  # K > 15


def _check_tables(tables, codes, n_bits):
    """``tables`` group ``codes [H, L, n]`` stably by code: the key order of a stable ``torch.sort``, and bucket
    offsets (CSR) when ``2^K <= n``, else the sorted codes."""
    want_codes, want_order = codes.long().sort(dim=-1, stable=True)
    assert torch.equal(tables.order.long(), want_order)
    n = codes.shape[-1]
    assert (tables.offsets is not None) == (2 ** n_bits <= n) and (tables.sorted_codes is None) == (2 ** n_bits <= n)
    if tables.offsets is not None:
        sizes = torch.stack([torch.bincount(row, minlength=2 ** n_bits) for row in codes.long().view(-1, n)])
        want_offsets = torch.cat([torch.zeros(sizes.shape[0], 1, dtype=torch.long), sizes.cumsum(-1)], -1)
        assert torch.equal(tables.offsets.long().view(-1, 2 ** n_bits + 1), want_offsets)
    else:
        assert torch.equal(tables.sorted_codes.long(), want_codes)


def test_bucket_tables_are_a_stable_sort_of_each_tables_codes():
    """The CPU counting sort (bucket offsets, ``2^K <= n``) and the sorted codes beyond both group each table's
    keys as a stable ``torch.sort``; an explicit ``K`` gives the same grouping as the inferred one; key ids are
    int16 up to 2^15 keys, int32 beyond."""
    from baselines.magicpig import lsh

    g = torch.Generator().manual_seed(1)
    for n_bits in (1, 4, 8, 11):  # 2^8 <= 333 < 2^11: both layouts
        codes = torch.randint(0, 2 ** n_bits, (3, 5, 333), generator=g)  # 15 rows: an odd last row
        for tables, k in ((mp.build_tables(codes), n_bits), (mp.build_tables(codes.short(), n_bits + 1), n_bits + 1)):
            assert tables.order.dtype == torch.int16  # fewer than 2^15 keys
            _check_tables(tables, codes, k)
    many = torch.randint(0, 2 ** 11, (1, 2, 40_000), generator=g)  # past 2^15 keys: int32 ids and offsets
    tables = mp.build_tables(many, 11)
    assert tables.order.dtype == tables.offsets.dtype == torch.int32
    _check_tables(tables, many, 11)
    assert lsh.id_dtype(2 ** 15) == torch.int16 and lsh.id_dtype(2 ** 15 + 1) == torch.int32


@pytest.mark.parametrize("n_bits", [4, 9])  # 2^4 <= 300 keys: bucket offsets; 2^9 > 300: sorted codes
def test_bucket_lookup_equals_brute_force_collision_count(n_bits):
    g = torch.Generator().manual_seed(0)
    h_kv, group, n, d = 2, 3, 300, 16
    proj = torch.randn(d, 20, n_bits, generator=g)
    key_codes = mp.simhash(torch.randn(h_kv, n, d, generator=g), proj).transpose(1, 2)  # [H_kv, L, n]
    q_codes = mp.simhash(torch.randn(h_kv * group, d, generator=g), proj)  # [H_q, L]
    tables = mp.build_tables(key_codes, n_bits)
    assert (tables.offsets is not None) == (n_bits == 4)
    got = mp.lookup(tables, q_codes.reshape(h_kv, group, -1).transpose(1, 2).contiguous(), 2)
    brute = (key_codes.repeat_interleave(group, 0) == q_codes[..., None]).sum(1) >= 2
    assert got.any() and torch.equal(got, brute)


def test_lse_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 1, 16, generator=g), torch.randn(2, 30, 16, generator=g), torch.randn(2, 30, 16, generator=g)
    a, b = torch.arange(0, 30, 3), torch.tensor([i for i in range(30) if i % 3])
    out_a, lse_a = mp.partial_attention(q, k[:, a], v[:, a], 0.25)
    out_b, lse_b = mp.partial_attention(q, k[:, b], v[:, b], 0.25)
    merged, lse = mp.merge_attention(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, attend(q, k, v, 0.25), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.repeat_interleave(2, 0).transpose(1, 2) * 0.25, -1))
    # importance weights: softmax(logit - log w) over the union; an empty part contributes nothing
    log_w = torch.rand(2, 20, generator=g)
    out_w, lse_w = mp.partial_attention(q, k[:, b], v[:, b], 0.25, log_weight=log_w)
    merged_w, _ = mp.merge_attention(out_a, lse_a, out_w, lse_w)
    logits = torch.cat([q @ k[:, a].repeat_interleave(2, 0).transpose(1, 2) * 0.25,
                        q @ k[:, b].repeat_interleave(2, 0).transpose(1, 2) * 0.25 - log_w.repeat_interleave(2, 0)[:, None]], -1)
    want = torch.softmax(logits, -1) @ torch.cat([v[:, a], v[:, b]], 1).repeat_interleave(2, 0)
    torch.testing.assert_close(merged_w, want, rtol=1e-5, atol=1e-6)
    none = torch.zeros(2, 20, dtype=torch.bool)
    out_e, lse_e = mp.partial_attention(q, k[:, b], v[:, b], 0.25, valid=none)
    torch.testing.assert_close(mp.merge_attention(out_a, lse_a, out_e, lse_e)[0], out_a)


def test_magicpig_sampled_part_is_unbiased_for_exact_attention_over_hash_draws():
    """Reference independent of the implementation's formulas: exact attention over the offloaded keys. Over
    independent SimHash draws (seeds), each key is a candidate with the frequency the importance weights
    assume, and the sampled part's unnormalised sums ``exp(lse)`` and ``exp(lse) * out`` average to the exact
    ``sum_j exp(s_j)`` and ``sum_j exp(s_j) v_j`` (the weights' 1e-4 floor is negligible here: every
    ``w_j`` > 0.05). Measured: mass within 0.7%, weighted sum within 1.5%; with the weights ignored the mass is
    10-15% low and the sum up to 11.5% off, which fails."""
    g = torch.Generator().manual_seed(0)
    spec = ModelSpec(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, scaling=0.25, max_position=128)
    store_k, store_v = torch.randn(2, 60, 16, generator=g) + 0.5, torch.randn(2, 60, 16, generator=g)
    q = torch.randn(4, 1, 16, generator=g)
    kv = torch.arange(4) // 2
    s = torch.einsum("hd,hnd->hn", q[:, 0], store_k[kv]) * 0.25  # exact logits [H_q, 60]
    exact_mass, exact_num = s.exp().sum(-1), torch.einsum("hn,hnd->hd", s.exp(), store_v[kv])
    draws, mass, num, hits, weights = 400, 0.0, 0.0, 0.0, 0.0
    for seed in range(draws):
        method = mp.MagicPIG(budget=16, n_bits=2, n_tables=10, calibrate=False, seed=seed)
        st = method.new_sequence(method.bind(spec)).layers[1]
        st.store_k, st.store_v = store_k, store_v
        st.k, st.v = torch.randn(2, 7, 16, generator=g), torch.randn(2, 7, 16, generator=g)
        method.build_index(st)
        selection = method.select(st, q)
        out, lse = method.sampled_attention(st, q, method.fetch(st, selection))
        mass = mass + lse[:, 0].double().exp()
        num = num + lse[:, 0].double().exp()[:, None] * out[:, 0].double()
        hits = hits + selection.double()
        centred = store_k[kv] - store_k.mean(1, keepdim=True)[kv]
        cos = torch.cosine_similarity(centred, q, dim=-1)
        weights = mp.inclusion_probability(mp.collision_probability(cos, 2), 10, 2)  # the same every draw
    assert float(weights.min()) > 0.05
    assert float((hits / draws - weights).abs().max()) < 0.1  # sampling frequency = the assumed weights
    torch.testing.assert_close(mass / draws, exact_mass.double(), rtol=0.03, atol=0)
    rel = (num / draws - exact_num.double()).norm(dim=-1) / exact_num.double().norm(dim=-1)
    assert float(rel.max()) < 0.04


@pytest.mark.parametrize("name,local", [("magicpig", 64), ("magicpig_calibrated", 30)])
def test_magicpig_calibration_and_effective_tokens(name, local):
    """The official local window is 64 tokens at any budget (models/attnserver.py num_local_tokens=64); the
    calibrated variant's takes at most half of what the budget leaves after the 4 sinks."""
    model = build_tiny("tiny-llama", 2, 4)
    _, cache = generate_with(model, _ids(300), 8, name, budget=64, debug=True)
    method = cache.method
    assert cache.bound.dense == {0, 2} and method.local == local
    for st in cache.states:
        eff = cache.effective_tokens()[st.layer_idx]
        if st.layer_idx in cache.bound.dense:
            assert eff == 300 + 3.0  # 7 decode steps: 0..6 generated past tokens
            continue
        assert st.n_bits > 0 and st.store_k.shape[1] == 300 - 4 - local
        exact = 4 + local + 3.0  # sinks + local + the generated tokens (kept, exempt)
        assert exact < eff < exact + st.store_k.shape[1]  # some, not all, offloaded tokens were sampled


# ------------------------------------------------------------------------------- shared properties
SMALL = [("pqcache", dict(budget=16)), ("omnikv", dict(budget=16, filter_layers=[1], wait_layers=0)),
         ("magicpig", dict(budget=16, local_window=6))]


@pytest.mark.parametrize("method,hp", SMALL, ids=[m for m, _ in SMALL])
def test_deterministic_and_resident_budget_respected(method, hp):
    model = build_tiny("tiny-llama", 2, 4)
    runs = []
    for _ in range(2):
        out, cache = generate_with(model, _ids(80), 10, method, debug=True, **hp)  # debug: asserts every step
        runs.append(out)
        for st in cache.states:
            if cache.method.is_budgeted(st):
                generated = st.n_seen - 80 if method != "pqcache" else 0  # OmniKV/MagicPIG keep them (exempt)
                assert cache.method.resident_tokens(st) - generated <= 16
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))


def test_seeds_change_the_randomised_parts():
    model = build_tiny("tiny-llama", 2, 4)
    a = make_cache("magicpig", model, budget=16, seed=0).bound.proj
    b = make_cache("magicpig", model, budget=16, seed=1).bound.proj
    assert not torch.equal(a, b)


@pytest.mark.parametrize("method,budget", [("pqcache", 3), ("pqcache", None), ("magicpig", 5), ("omnikv", None)])
def test_invalid_budgets_fail_at_config_time(method, budget):
    with pytest.raises(BudgetError):
        make_method(method, budget=budget)


# ------------------------------------------------------------------------- MagicPIG: the estimator and its K
def test_magicpig_default_is_the_official_configuration():
    """models/attnserver.py LSHSparseAttnServer(K=10, L=150), sinks 4, local 64, no calibration."""
    from evals.config import compose_config

    for budget in (64, 128, 256):  # the official exact part is 4 sinks + 64 local tokens whatever the budget
        official = make_method("magicpig", budget=budget)
        assert (official.n_bits, official.n_tables, official.calibrate, official.n_sink, official.local) == (
            10, 150, False, 4, 64)
    ours = make_method("magicpig_calibrated", budget=64)  # our extensions are a named variant
    assert (ours.calibrate, ours.shrink_local, ours.local, ours.sample_target) == (True, True, 30, 30)
    cache = compose_config(["cache=magicpig"])["cache"]
    assert (cache["name"], cache["calibrate"], cache["n_bits"], cache["n_tables"]) == ("magicpig", False, 10, 150)


def test_magicpig_official_weight_cap():
    w = torch.tensor([1.0, 0.5, 1e-12, 0.0], dtype=torch.float64)
    got = mp.importance_log_weight(w)
    want = torch.log(w + 1e-4) - math.log(1 + 1e-4)  # sparse_attention.cc: score - log(w + 1e-4), shifted
    torch.testing.assert_close(got, want.float())
    assert got[0] == 0.0 and got[-1] == pytest.approx(math.log(1e-4), abs=1e-3)  # capped at -9.2, not -inf


def test_magicpig_records_k_and_expected_sample_size_per_layer():
    model = build_tiny("tiny-llama", 2, 4)
    _, cache = generate_with(model, _ids(300), 4, "magicpig_calibrated", budget=64)
    stats = cache.method_stats()
    assert set(stats) == {"lsh_bits", "expected_samples", "sample_target"}
    for st in cache.states:
        if st.layer_idx in cache.bound.dense:
            assert stats["lsh_bits"][st.layer_idx] is None
            continue
        assert stats["lsh_bits"][st.layer_idx] == st.n_bits > 0
        assert stats["sample_target"][st.layer_idx] == 30
        assert 0 < stats["expected_samples"][st.layer_idx] <= 30  # calibration met the target
    _, official = generate_with(model, _ids(300), 4, "magicpig", budget=64)
    assert {official.method_stats()["lsh_bits"][i] for i in (1, 3)} == {10.0}


def test_magicpig_calibration_picks_the_smallest_k_whose_expected_sample_fits():
    """The bisection over K returns what a scan of every K from 0 up returns, for targets from 'everything' to
    'less than any K gives'; the expected size is recomputed here from its definition (mean over query heads
    of sum_j P[Binomial(L, p_j^K) >= 2])."""
    g = torch.Generator().manual_seed(3)
    spec = ModelSpec(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, scaling=0.25, max_position=4096)
    st = mp.PigState(1)
    st.calib_q = torch.randn(4, 16, generator=g)
    centred = torch.randn(2, 500, 16, generator=g) + 0.3 * st.calib_q.view(2, 2, 16)[:, :1]
    cos = torch.cosine_similarity(centred.repeat_interleave(2, 0), st.calib_q[:, None], dim=-1)

    def expected(bits):
        p = mp.collision_probability(cos, bits)
        return float(mp.inclusion_probability(p, 20, 2).sum(-1).mean())

    sizes = [expected(bits) for bits in range(13)]
    for target_budget in (520, 300, 100, 40, 12, 7):
        method = mp.MagicPIG(budget=target_budget, n_tables=20, max_bits=12, local_window=2, calibrate=True)
        st.bound = method.bind(spec)
        target = method.sample_target
        fits = [bits for bits, size in enumerate(sizes) if size <= target]
        bits, size = method.choose_bits(st, centred, centred.norm(dim=-1))
        assert bits == (fits[0] if fits else 12)
        assert size == pytest.approx(sizes[bits], rel=1e-6)


def test_magicpig_builds_the_same_tables_inline_and_in_the_background(monkeypatch):
    """The build's place (inline at the end of each layer's prefill, or on the background worker) changes
    nothing but timing: the same tables and the same generation. ``None`` builds inline on a CPU whose cores
    all run torch's threads, in the background when one is idle."""
    submitted = []
    real_submit = mp.MagicPIG.submit_background
    monkeypatch.setattr(mp.MagicPIG, "submit_background", lambda self, st, *job: submitted.append(st.layer_idx)
                        or real_submit(self, st, *job))
    model = build_tiny("tiny-llama", 2, 4)
    runs = {flag: generate_with(model, _ids(300), 6, "magicpig", budget=64, background_build=flag)
            for flag in (False, True)}
    assert submitted == [1, 3]  # the sparse layers, only with background_build=True
    for cores, expected in ((torch.get_num_threads(), []), (torch.get_num_threads() + 1, [1, 3])):
        submitted.clear()
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        generate_with(model, _ids(300), 2, "magicpig", budget=64)
        assert submitted == expected
    (out_a, cache_a), (out_b, cache_b) = runs[False], runs[True]
    assert torch.equal(out_a.sequences, out_b.sequences)
    built = [(a.tables, b.tables) for a, b in zip(cache_a.states, cache_b.states) if a.tables is not None]
    assert len(built) == 2  # the two sparse layers
    for a, b in built:
        for x, y in ((a.order, b.order), (a.offsets, b.offsets), (a.sorted_codes, b.sorted_codes)):
            assert (x is None and y is None) or torch.equal(x, y)
    with pytest.raises(ValueError, match="background_build"):
        make_method("magicpig", budget=64, background_build="yes")


def test_magicpig_warns_once_when_no_k_meets_the_target():
    """max_bits = 0: K = 0 samples every offloaded key (266 > the target 30) in both sparse layers."""
    import warnings

    model = build_tiny("tiny-llama", 2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, cache = generate_with(model, _ids(300), 4, "magicpig_calibrated", budget=64, max_bits=0)
        cache.method_stats()
    missed = [w for w in caught if "no K <= max_bits=0" in str(w.message)]
    assert len(missed) == 1 and issubclass(missed[0].category, RuntimeWarning)
    stats = cache.method_stats()
    assert [stats["expected_samples"][i] for i in (1, 3)] == [pytest.approx(266.0)] * 2
    assert [stats["lsh_bits"][i] for i in (1, 3)] == [0.0, 0.0]
