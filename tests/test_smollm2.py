"""Integration on the embedded SmolLM2-135M-Instruct: methods equal full attention at ~1k tokens."""
from __future__ import annotations

import pytest
from helpers import generate_reference, generate_with, natural_prompt_ids

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method,budget", [("full", None), ("streaming_llm", 2048)])
def test_smollm2_equals_transformers_generate(smollm2, method, budget):
    model, tokenizer = smollm2
    ids = natural_prompt_ids(tokenizer, 1000)
    ref = generate_reference(model, ids, 8)
    out, _ = generate_with(model, ids, 8, method, budget)
    assert out.sequences.tolist() == ref.sequences.tolist()
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst < 2e-3, worst


@pytest.mark.parametrize("method", ["icecache", "icecache_reuse"])
def test_smollm2_icecache_covering_budget_through_the_index_equals_full(smollm2, method):
    """Every page retrieved through the index (exhaustive search, K = 124 pages > the ~70 pages of
    ~1k offloaded tokens): greedy tokens equal and logits match transformers' full attention."""
    model, tokenizer = smollm2
    ids = natural_prompt_ids(tokenizer, 1000)
    ref = generate_reference(model, ids, 8)
    out, cache = generate_with(model, ids, 8, method, 2048, always_index=True, prop_to_retrieve=1.0,
                               min_fov=1 << 20)
    assert all(s.offloaded and s.bytes_moved > 0 for s in cache.states[2:])
    assert out.sequences.tolist() == ref.sequences.tolist()
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst < 2e-3, worst


def test_smollm2_streaming_llm_small_budget_changes_the_output(smollm2):
    model, tokenizer = smollm2
    ids = natural_prompt_ids(tokenizer, 1000)
    ref = generate_reference(model, ids, 8)
    out, cache = generate_with(model, ids, 8, "streaming_llm", 64)
    assert max(cache.resident_tokens()) <= 64
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst > 1e-2
