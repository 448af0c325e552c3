"""The kvpress adapter (``cache=kvpress``, baselines/kvpress_adapter.py): its kept sets equal kvpress' own
(tests/fixtures/kvpress_sets.json, made by scripts/kvpress_reference.py with kvpress 0.5.5 running natively on
transformers 5.2), importing kvpress leaves our attention working, and a bad press name is a clear error. The
covering / small-budget contract is its row in tests/helpers.py ``METHOD_CASES``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_SHAPES, build_tiny, generate_with

from baselines.kvpress_adapter import TESTED_PRESSES
from evals.registry import make_cache, make_method

kvpress = pytest.importorskip("kvpress", reason="kvpress is an optional extra (docs/kvpress.md)")
pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURE = Path(__file__).parent / "fixtures" / "kvpress_sets.json"


def kept_bitmasks(cache, n: int) -> list[list[str]]:
    """Per layer and KV head, the resident prompt positions as the fixture's hex bitmasks."""
    width = (n + 3) // 4
    return [[format(sum(1 << p for p in head.tolist()), f"0{width}x") for head in st.pos] for st in cache.states]


@pytest.fixture(scope="module")
def smollm2_fp32():
    from transformers import AutoModelForCausalLM

    from evals.models import ModelUnavailableError, smollm2_checkpoint
    try:
        path = smollm2_checkpoint()
    except ModelUnavailableError as err:
        pytest.skip(f"embedded SmolLM2 unavailable: {err}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow
def test_kept_sets_equal_kvpress_own(smollm2_fp32):
    ref = json.loads(FIXTURE.read_text())
    ids = torch.tensor([ref["input_ids"]])
    for press, expected in ref["sets"].items():
        cache = make_cache("kvpress", smollm2_fp32, budget=ref["kept"], press=press)
        with torch.no_grad():
            smollm2_fp32(ids, past_key_values=cache)  # the prefill: each layer keeps its top-`kept` per KV head
        got = kept_bitmasks(cache, ids.shape[1])
        wrong = [(layer, head) for layer, heads in enumerate(expected) for head, mask in enumerate(heads)
                 if got[layer][head] != mask]
        assert not wrong, f"{press}: kept sets differ from kvpress' on (layer, head) {wrong[:8]}"


@pytest.mark.slow
@pytest.mark.parametrize("press,method,options", [
    ("SnapKVPress", "snapkv", dict(window_size=64, kernel_size=5, pooling="avg", selection="per_kv_head",
                                   group_agg="mean", decode_policy="grow")),
    ("StreamingLLMPress", "streaming_llm", {})])
def test_our_ports_with_kvpress_settings_keep_kvpress_sets(smollm2_fp32, press, method, options):
    """Our snapkv with kvpress' SnapKVPress settings, and our streaming_llm, keep kvpress' own sets."""
    ref = json.loads(FIXTURE.read_text())
    ids = torch.tensor([ref["input_ids"]])
    cache = make_cache(method, smollm2_fp32, budget=ref["kept"], **options)
    with torch.no_grad():
        smollm2_fp32(ids, past_key_values=cache)
    n_kv = len(ref["sets"][press][0])
    for st in cache.states:  # streaming_llm keeps one set for every head
        st.pos = st.pos.expand(n_kv, -1) if st.pos.dim() == 1 else st.pos
    assert kept_bitmasks(cache, ids.shape[1]) == ref["sets"][press]


def test_importing_kvpress_wraps_our_attention_harmlessly():
    """kvpress' attention_patch passes ``dropout`` positionally to every registered attention function; ours
    takes it in transformers' order, so a wrapped ``kv_attention`` still works (same tokens as unwrapped)."""
    from kvpress.attention_patch import attention_patch

    from icecache.kv import cache as kv_cache
    from icecache.kv.compat import register_attention

    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    plain, _ = generate_with(model, ids, 6, "streaming_llm", budget=24)
    register_attention(attention_patch(kv_cache.kv_attention))
    try:
        wrapped, _ = generate_with(model, ids, 6, "streaming_llm", budget=24)
    finally:
        register_attention(kv_cache.kv_attention)
    assert torch.equal(plain.sequences, wrapped.sequences)


def test_bad_press_name_lists_the_supported_presses():
    with pytest.raises(ValueError, match="SnapKVPress.*KnormPress") as err:
        make_method("kvpress", budget=64, press="AdaKVPress")
    assert "AdaKVPress" in str(err.value)
    with pytest.raises(ValueError, match="compression_ratio"):
        make_method("kvpress", budget=64, press="KnormPress", press_kwargs=dict(compression_ratio=0.5))


def test_generated_tokens_are_kept_on_top_of_the_budget():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    _, cache = generate_with(model, ids, 6, "kvpress", budget=16, debug=True, press="KnormPress")
    # 16 prompt tokens per KV head + the 5 generated tokens appended before the last one (kvpress' decoding)
    assert cache.resident_tokens() == [21] * len(cache.states)
    assert all(bool((st.pos[:, -5:] >= 40).all()) for st in cache.states)


def test_a_new_cache_per_prompt_captures_its_own_prefill():
    """One method object, several caches (the runner's pattern): each prefill is scored from its own inputs,
    and the hook registered on each ``self_attn`` stays one."""
    model = build_tiny("tiny-llama", 2, 4)
    method = make_method("kvpress", budget=16, press="TOVAPress")
    sets = []
    for seed in (0, 1, 0):
        ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(seed))
        cache = make_cache(method, model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        sets.append([st.pos.clone() for st in cache.states])
        assert not cache.sequence.inputs and not cache.sequence.capturing
    assert all(torch.equal(a, b) for a, b in zip(sets[0], sets[2]))
    assert not all(torch.equal(a, b) for a, b in zip(sets[0], sets[1]))
    assert all(len(layer.self_attn._forward_pre_hooks) == 1 for layer in model.model.layers)


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda s: f"{s[0]}-kv{s[1]}-q{s[2]}")
def test_tested_presses_run_on_every_head_layout(shape):
    """MQA, GQA, MHA and Qwen3's q/k-norm (kvpress' get_prerope_query_states applies q_norm): each tested
    press keeps ``budget`` prompt tokens per KV head and runs under the debug accounting."""
    name, n_kv, n_q = shape
    model = build_tiny(name, n_kv, n_q)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    for press in TESTED_PRESSES:
        options = dict(press_kwargs=dict(window_size=8)) if press == "SnapKVPress" else {}
        _, cache = generate_with(model, ids, 3, "kvpress", budget=16, debug=True, press=press, **options)
        assert all(int((st.pos < 48).sum(-1).max()) == 16 for st in cache.states), press
