"""The ablation runner (evals/bench/ablation.py): a replayed prefill decodes exactly like a live one."""
from __future__ import annotations

import pytest
import torch
from helpers import build_tiny

from evals.bench.ablation import Prefilled, grid, icecache_config
from evals.registry import make_method
from evals.runner import generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method,options", [
    ("icecache", {"budget": 64, "gqa_merge": "mass"}),
    ("icecache_reuse", {"budget": 64, "page_size": 8}),
    ("topk", {"budget": 32}),
    ("full", {}),
])
def test_replayed_prefill_generates_what_a_live_prefill_generates(method, options):
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    prefilled = Prefilled.capture(model, ids)
    live = generate(model, None, make_method(method, **options), ids, 24, ignore_eos=True)
    replayed = generate(model, None, make_method(method, **options), ids, 24, ignore_eos=True, prefilled=prefilled)
    assert replayed.token_ids == live.token_ids
    assert replayed.effective_tokens == pytest.approx(live.effective_tokens)
    assert replayed.max_resident_tokens == live.max_resident_tokens


def test_replay_refuses_methods_with_prefill_statistics_and_other_prompts():
    model = build_tiny("tiny-llama", 2, 4)
    ids = list(range(100))
    prefilled = Prefilled.capture(model, ids)
    with pytest.raises(ValueError, match="statistics during prefill"):
        generate(model, None, make_method("h2o", budget=32), ids, 4, prefilled=prefilled)
    with pytest.raises(ValueError, match="prompt differs"):
        generate(model, None, make_method("full"), ids[:-1], 4, prefilled=prefilled)


def test_grid_keeps_only_valid_cells():
    assert icecache_config(64, "mass", 16, 32) is None  # 2 sink + 2 window pages leave no retrieved page
    cell = icecache_config(64, "mass", 8, 16)
    assert cell.build().layout() == (2, 2, 4)
    labels = [c.label for c in grid([64], merges=("interleaved",), page_sizes=(16, 8), sinks=(16, 32))]
    assert labels == ["full", "topk", "icecache[interleaved,page=16,sink=16]",
                      "icecache[interleaved,page=8,sink=16]", "icecache[interleaved,page=8,sink=32]"]
