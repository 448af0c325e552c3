"""The common interface: equality with full attention, StreamingLLM's kept set, phases, GQA shapes."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_full, build_tiny, generate_reference, generate_with

from baselines.streaming_llm import StreamingLLM, rotate_by
from evals.registry import make_cache, make_method
from icecache.kv import BudgetError, ModelSpec, compat
from icecache.kv.attention import attend
from icecache.kv.timing import PhaseTimer


@pytest.mark.parametrize("method,budget", [("full", None), ("streaming_llm", 1024), ("streaming_llm", 56)])
def test_equals_full_attention_when_budget_covers_context(tiny_model, method, budget):
    # 48 prompt + 8 new tokens: 56 past tokens at most, so budget=56 never evicts
    assert_matches_full(tiny_model, method, budget)


def test_streaming_llm_with_small_budget_differs_from_full():
    model = build_tiny()
    ids = torch.randint(0, 200, (1, 80), generator=torch.Generator().manual_seed(1))
    ref = generate_reference(model, ids, 6)
    out, _ = generate_with(model, ids, 6, "streaming_llm", 16)
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst > 1e-3


def _spec(n_q=4, n_kv=2, d=8, layers=1):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return ModelSpec(n_layers=layers, n_q_heads=n_q, n_kv_heads=n_kv, head_dim=d, scaling=d ** -0.5,
                     max_position=4096, inv_freq=inv_freq)


def test_streaming_llm_attends_exactly_sinks_and_recent_tokens():
    torch.manual_seed(0)
    spec, budget, n_sink = _spec(), 12, 4
    method = StreamingLLM(budget=budget, n_sink=n_sink, rerotate=False, debug=True)  # original positions
    st, timer = method.new_sequence(method.bind(spec)).layers[0], PhaseTimer()
    L = 30
    k_all, v_all = torch.randn(2, 50, 8), torch.randn(2, 50, 8)
    method.fill(st, k_all[:, :L], v_all[:, :L], torch.randn(4, L, 8))
    assert st.pos.tolist() == [0, 1, 2, 3] + list(range(L - 8, L))
    for t in range(L, 40):
        q = torch.randn(4, 1, 8)
        out = method.step(st, q, k_all[:, t:t + 1], v_all[:, t:t + 1], timer)
        # reference: sinks + the budget - n_sink most recent past tokens + the current token
        keep = list(range(n_sink)) + list(range(t - (budget - n_sink), t)) + [t]
        ref = attend(q, k_all[:, keep], v_all[:, keep], spec.scaling)
        torch.testing.assert_close(out, ref)
        assert method.resident_tokens(st) <= budget
    assert st.attended_sum / st.attended_steps == budget


def test_rotation_by_delta_composes_like_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    spec = _spec()
    x = torch.randn(2, 5, 8)

    def rope(vectors, positions):
        angles = positions.float()[:, None] * spec.inv_freq[None]
        emb = torch.cat([angles, angles], -1)
        return apply_rotary_pos_emb(vectors, vectors, emb.cos()[None], emb.sin()[None])[0][0]

    pos, delta = torch.tensor([0, 3, 7, 100, 2000]), torch.tensor([5, -3, 0, -100, 17])
    torch.testing.assert_close(rotate_by(rope(x[None], pos), delta, spec.inv_freq), rope(x[None], pos + delta),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_rerotated_keys_are_the_models_keys_at_the_cache_positions(name):
    """Reference independent of ``rotate_by``: the model's own rotary embedding (``rotary_emb`` +
    ``apply_rotary_pos_emb``) applied to the raw keys at the shifted positions. Key ``j`` of the ``m`` resident
    ones must look as if at cache index ``j`` seen from the query at index ``m - 1``, i.e. at position
    ``j + (pos_query - (m - 1))`` since the query keeps its own position."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = build_tiny(name, 2, 4)
    spec = compat.model_spec(model)
    rotary, d = model.model.rotary_emb, spec.head_dim

    def rope(raw, positions):  # raw [H, n, d] at positions [n], as the model's attention rotates its keys
        cos, sin = rotary(raw[None], positions[None])
        return apply_rotary_pos_emb(raw[None], raw[None], cos, sin)[1][0]

    torch.manual_seed(0)
    raw = torch.randn(2, 7, d)
    pos = torch.tensor([0, 1, 50, 51, 52, 53, 54])  # 2 sinks, then a recent window ending at the query
    method = StreamingLLM(budget=6, n_sink=2, rerotate=True)
    st = method.new_sequence(method.bind(spec)).layers[0]
    st.k, st.v, st.pos = rope(raw, pos), torch.randn(2, 7, d), pos
    fetched = method.fetch(st, None)
    shifted = torch.arange(7) + (54 - 6)
    torch.testing.assert_close(fetched.k, rope(raw, shifted), atol=1e-4, rtol=1e-4)
    # so the query's scores are those of a query at cache index 6 against keys at cache indices 0..6
    q_raw = torch.randn(2, 1, d)
    scores = rope(q_raw, torch.tensor([54])) @ fetched.k.transpose(1, 2)
    at_cache = rope(q_raw, torch.tensor([6])) @ rope(raw, torch.arange(7)).transpose(1, 2)
    torch.testing.assert_close(scores, at_cache, atol=1e-4, rtol=1e-4)
    # after O(1) evictions the slots are not in position order (the query stays last): a key's cache index
    # is its rank by position
    perm = torch.tensor([3, 0, 5, 1, 4, 2, 6])
    st.k, st.v, st.pos = rope(raw, pos)[:, perm], st.v[:, perm], pos[perm]
    torch.testing.assert_close(method.fetch(st, None).k, rope(raw, shifted)[:, perm], atol=1e-4, rtol=1e-4)


def test_rerotate_runs_end_to_end():
    model = build_tiny()
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    out, cache = generate_with(model, ids, 5, "streaming_llm", 16, rerotate=True)
    assert out.sequences.shape[1] == 45
    assert max(cache.resident_tokens()) <= 16


def test_multi_token_decode_pass_equals_token_by_token():
    model = build_tiny()
    ids = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(3))
    extra = torch.randint(0, 200, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        cache_a = make_cache("full", model)
        model(ids, past_key_values=cache_a)
        chunk = model(extra, past_key_values=cache_a).logits
        cache_b = make_cache("full", model)
        model(ids, past_key_values=cache_b)
        single = torch.cat([model(extra[:, i:i + 1], past_key_values=cache_b).logits for i in range(4)], 1)
    torch.testing.assert_close(chunk, single, atol=1e-5, rtol=1e-5)
    assert cache_a.get_seq_length() == 34


def test_phases_are_explicit_and_steps_are_timed():
    model = build_tiny()
    cache = make_cache("streaming_llm", model, budget=16)
    with torch.inference_mode():
        cache.begin_prefill()
        model(torch.randint(0, 200, (1, 20)), past_key_values=cache)
        cache.begin_step()
        model(torch.tensor([[5]]), past_key_values=cache)
        phases = cache.end_step()
    assert set(phases) == {"update", "select", "transfer", "attention"}
    assert all(v >= 0 for v in phases.values())
    assert cache.effective_tokens() == [16.0] * model.config.num_hidden_layers


def test_batch_size_above_one_is_a_clear_error():
    model = build_tiny()
    with pytest.raises(ValueError, match="batch size 1"):
        model(torch.randint(0, 200, (2, 10)), past_key_values=make_cache("full", model))


def test_model_without_a_kv_cache_says_how_to_recover():
    model = build_tiny()
    make_cache("full", model)
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        model(torch.randint(0, 200, (1, 10)))


@pytest.mark.parametrize("budget,msg", [(0, "positive"), (-5, "positive"), (4, "n_sink")])
def test_invalid_budgets_fail_at_config_time(budget, msg):
    with pytest.raises(BudgetError, match=msg):
        make_method("streaming_llm", budget=budget)


def test_unknown_method_lists_valid_names():
    with pytest.raises(ValueError, match="valid: .*streaming_llm"):
        make_method("nope", budget=64)


def test_unknown_hyperparameter_is_named():
    with pytest.raises(ValueError, match="no hyperparameter.*n_sinks"):
        make_method("streaming_llm", budget=64, n_sinks=4)
