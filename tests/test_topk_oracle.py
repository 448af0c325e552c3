"""The TOP-k oracle's IceCache-like options (baselines/topk_oracle.py): dense first layers, the sink/window
layout, equality with full attention at a covering budget, and the offline recall of ``evals.bench.ablation
--recall`` agreeing with the live probe on the last prompt key."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_full

from baselines.topk_oracle import TopKOracle
from evals.bench.ablation import Config, attended_mask, config_recall
from icecache.kv import BudgetError, KVCache, ModelSpec
from icecache.kv.recall import RecallProbe

H_KV, H_Q, D, SCALING = 2, 4, 8, 8 ** -0.5


def spec(n_layers: int) -> ModelSpec:
    return ModelSpec(n_layers=n_layers, n_q_heads=H_Q, n_kv_heads=H_KV, head_dim=D, scaling=SCALING,
                     max_position=4096)


def one_step(method: TopKOracle, n_layers: int, n: int, seed: int = 0, probe=None):
    """Prefills every layer with ``n`` random tokens, then runs one decode step; returns the cache and, per
    layer, the step's ``(q [H_q, d], keys [H_kv, n + 1, d], values)``."""
    torch.manual_seed(seed)
    cache = KVCache(method, spec(n_layers), probe=probe)
    cache.begin_prefill()
    ctx = {}
    for layer in range(n_layers):
        k, v = torch.randn(H_KV, n, D), torch.randn(H_KV, n, D)
        cache.run_attention(layer, torch.randn(H_Q, n, D), k, v)
        ctx[layer] = (k, v)
    cache.begin_step()
    steps = {}
    for layer in range(n_layers):
        q, k1, v1 = torch.randn(H_Q, 1, D), torch.randn(H_KV, 1, D), torch.randn(H_KV, 1, D)
        out = cache.run_attention(layer, q, k1, v1)
        k, v = ctx[layer]
        steps[layer] = (q[:, 0], torch.cat([k, k1], 1), torch.cat([v, v1], 1), out[:, 0])
    return cache, steps


def logits_of(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[H_q, n]`` plain ``q . k`` of each query head against its KV head's keys."""
    return torch.einsum("hd,hnd->hn", q, keys.repeat_interleave(H_Q // H_KV, 0))


def reference_sets(q, keys, budget, n_sink=0, n_window=0) -> list[set[int]]:
    """Per query head: the first ``n_sink`` and last ``n_window`` past tokens, ``torch.topk`` of ``q . k`` over
    the other past tokens for the rest of the budget, and the current token (the last of ``keys``)."""
    n_past = keys.shape[1] - 1
    if n_past <= budget:
        return [set(range(n_past + 1))] * H_Q
    fixed = set(range(n_sink)) | set(range(n_past - n_window, n_past)) | {n_past}
    logits = logits_of(q, keys)[:, n_sink:n_past - n_window]
    top = logits.topk(budget - n_sink - n_window, dim=-1).indices + n_sink
    return [fixed | set(top[h].tolist()) for h in range(H_Q)]


def attended_sets(method, st, q) -> list[set[int]]:
    """Per query head, the positions the method attends for query ``q: [H_q, d]`` (its own select)."""
    pos = method.attended_positions(st, method.select(st, q[:, None]))
    pos = pos.expand(H_Q, -1) if pos.dim() == 1 else pos.repeat_interleave(H_Q // pos.shape[0], 0)
    return [set(pos[h].tolist()) for h in range(H_Q)]


def check_step(method, cache, steps, layer, expected: list[set[int]]) -> None:
    """The layer's attended sets (re-selected with the step's query) and its output against ``expected``."""
    q, keys, values, out = steps[layer]
    assert attended_sets(method, cache.states[layer], q) == expected, f"layer {layer}"
    for h in range(H_Q):
        kv = h // (H_Q // H_KV)
        chosen = sorted(expected[h])
        probs = ((keys[kv, chosen] @ q[h]) * SCALING).softmax(-1)
        torch.testing.assert_close(out[h], probs @ values[kv, chosen], rtol=1e-5, atol=1e-5)


def test_dense_layers_attend_everything_and_the_others_exactly_the_top_b():
    n, budget = 40, 10
    method = TopKOracle(budget=budget, n_dense_layers=2, debug=True)
    cache, steps = one_step(method, 4, n)
    for layer in range(4):
        q, keys, _, _ = steps[layer]
        dense = layer < 2
        assert method.is_budgeted(cache.states[layer]) is not dense
        expected = [set(range(n + 1))] * H_Q if dense else reference_sets(q, keys, budget)
        check_step(method, cache, steps, layer, expected)
    assert cache.effective_tokens() == [n, n, budget, budget]  # timing.json's effective_tokens_per_layer


@pytest.mark.parametrize("n_sink,n_window", [(4, 0), (0, 6), (4, 6), (3, 7)])
def test_sink_and_window_are_attended_and_the_rest_is_exact_top_k(n_sink, n_window):
    n, budget = 40, 16
    method = TopKOracle(budget=budget, n_sink=n_sink, n_window=n_window, debug=True)
    cache, steps = one_step(method, 2, n, seed=n_sink + n_window)
    for layer in range(2):
        q, keys, _, _ = steps[layer]
        expected = reference_sets(q, keys, budget, n_sink, n_window)
        assert all(len(s) == budget + 1 for s in expected)
        check_step(method, cache, steps, layer, expected)
    assert cache.effective_tokens() == [budget, budget]


def test_sink_and_window_filling_the_budget_is_streaming():
    n, budget = 30, 8
    method = TopKOracle(budget=budget, n_sink=4, n_window=4)
    cache, steps = one_step(method, 1, n)
    check_step(method, cache, steps, 0, [set(range(4)) | set(range(n - 4, n + 1))] * H_Q)


def test_defaults_are_the_pure_oracle():
    method = TopKOracle(budget=10)
    assert (method.n_dense_layers, method.n_sink, method.n_window) == (0, 0, 0)
    cache, steps = one_step(method, 2, 30)
    for layer in range(2):
        q, keys, _, _ = steps[layer]
        assert method.is_budgeted(cache.states[layer])
        check_step(method, cache, steps, layer, reference_sets(q, keys, 10))


@pytest.mark.parametrize("hp", [dict(n_dense_layers=2), dict(n_sink=4, n_window=8), dict(heads="kv", n_sink=2,
                                                                                      n_window=2, n_dense_layers=1)])
def test_covering_budget_equals_full_attention(tiny_model, hp):
    assert_matches_full(tiny_model, "topk", budget=48 + 8 - 2, prompt_len=48, new_tokens=8, debug=True, **hp)


def test_invalid_options_are_clear_errors():
    with pytest.raises(BudgetError, match="smaller than n_sink \\+ n_window = 12"):
        TopKOracle(budget=10, n_sink=4, n_window=8)
    for key in ("n_dense_layers", "n_sink", "n_window"):
        with pytest.raises(ValueError, match=f"{key} must be a whole number"):
            TopKOracle(budget=10, **{key: -1})


# --------------------------------------------------------------------------- offline vs live recall
def test_offline_and_live_topk_agree_on_the_last_prompt_key():
    """The offline recall (captured prompt keys, no current token) ranks the last prompt key like a live step
    after that prompt: here it carries the most attention, so leaving it out would lose a large share."""
    torch.manual_seed(5)
    n, budget = 30, 6
    q = torch.randn(H_Q, D)
    keys, values = torch.randn(H_KV, n, D), torch.randn(H_KV, n, D)
    keys[:, -1] = 3 * q.view(H_KV, -1, D).mean(1)  # the last prompt key: the top score of every head
    k_cur, v_cur = torch.randn(H_KV, 1, D), torch.randn(H_KV, 1, D)

    method, probe = TopKOracle(budget=budget), RecallProbe()
    cache = KVCache(method, spec(1), probe=probe)
    cache.begin_prefill()
    cache.run_attention(0, torch.randn(H_Q, n, D), keys, values)
    cache.begin_step()
    cache.run_attention(0, q[:, None], k_cur, v_cur)
    live = method.attended_positions(cache.states[0], method.select(cache.states[0], q[:, None]))
    assert (live == n - 1).any(-1).all()  # live, every head attends the last prompt key

    offline_method = TopKOracle(budget=budget)
    bound = offline_method.bind(spec(1))
    st = offline_method.new_sequence(bound).layers[0]
    offline_method.fill(st, keys, values)
    offline = attended_mask(offline_method, st, q[:, None], n)
    live_prompt = [sorted(int(p) for p in row if p < n) for row in live]
    assert [torch.nonzero(row).flatten().tolist() for row in offline] == live_prompt

    # the recall numbers: the live one over the prompt + current token, renormalised to the prompt, is the
    # offline one (config_recall rounds to 3 decimals)
    full = torch.cat([keys, k_cur], 1).double()
    p_cur = (logits_of(q.double(), full) * SCALING).softmax(-1)[:, -1]
    live_recall = probe.values[0]["recall"][0].double()
    on_prompt = float(((live_recall - p_cur) / (1 - p_cur)).mean())
    data = {"layers": [0], "keys": [keys], "queries": [q[None]], "meta": {}}
    got = config_recall(data, [Config("topk", "topk", budget)]).loc[("topk", budget), "recall_mean"]
    assert got == pytest.approx(on_prompt, abs=6e-4)
