"""The ablation runner (evals/bench/ablation.py): a replayed prefill decodes exactly like a live one."""
from __future__ import annotations

import pytest
import torch
from helpers import build_tiny

from evals.bench.ablation import grid, icecache_config, replayable
from evals.prefill_cache import Prefill
from evals.registry import make_method
from evals.runner import generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method,options", [
    ("icecache", {"budget": 64, "gqa_merge": "mass"}),
    ("icecache_reuse", {"budget": 64, "page_size": 8}),
    ("topk", {"budget": 32}),
    ("full", {}),
    ("streaming_llm", {"budget": 32}),
    ("quest", {"budget": 64}),
    ("pqcache", {"budget": 64}),
    ("omnikv", {"budget": 64}),
])
def test_replayed_prefill_generates_what_a_live_prefill_generates(method, options):
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    prefilled = Prefill.capture(model, ids)
    live = generate(model, None, make_method(method, **options), ids, 24, ignore_eos=True)
    replayed = generate(model, None, make_method(method, **options), ids, 24, ignore_eos=True, prefilled=prefilled)
    assert replayed.token_ids == live.token_ids
    assert replayed.effective_tokens == pytest.approx(live.effective_tokens)
    assert replayed.max_resident_tokens == live.max_resident_tokens


def test_replay_refuses_methods_with_prefill_statistics_and_other_prompts():
    model = build_tiny("tiny-llama", 2, 4)
    ids = list(range(100))
    prefilled = Prefill.capture(model, ids)
    with pytest.raises(ValueError, match="statistics during prefill"):
        generate(model, None, make_method("h2o", budget=32), ids, 4, prefilled=prefilled)
    with pytest.raises(ValueError, match="run it live"):
        replayable("snapkv")
    with pytest.raises(ValueError, match="prompt differs"):
        generate(model, None, make_method("full"), ids[:-1], 4, prefilled=prefilled)


def test_grid_keeps_only_valid_cells():
    assert icecache_config(64, "mass", 16, 32) is None  # 2 sink + 2 window pages leave no retrieved page
    cell = icecache_config(64, "mass", 8, 16)
    assert cell.build().layout() == (2, 2, 4)
    labels = [c.label for c in grid([64], merges=("interleaved",), page_sizes=(16, 8), sinks=(16, 32))]
    assert labels == ["full", "topk", "icecache[interleaved,page=16,sink=16]",
                      "icecache[interleaved,page=8,sink=16]", "icecache[interleaved,page=8,sink=32]"]
    shipped = grid([64], merges=(), defaults=True, methods=("icecache",), baselines=("full", "quest"))
    assert [(c.label, c.budget) for c in shipped] == [("full", None), ("topk", 64), ("icecache", 64), ("quest", 64)]


def test_ratio_to_full_pools_seeds_and_bootstraps_paired_samples(tmp_path):
    """The ratio is the mean over tasks of per-task means, against full on the same samples; renaming per file
    keeps a label that meant two configurations apart; identical answers give ratio 1 with a zero-width interval."""
    import json

    from evals.bench.ablation import parse_aliases, ratio_to_full, read_rows

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    def row(config, seed, task, i, score):
        return {"config": config, "budget": 0 if config == "full" else 256, "suite": f"ruler/s{seed}",
                "id": f"{task}-{i}", "task": task, "score": score, "max_attended_per_head": None}

    full0 = [row("full", 0, "a", i, s) for i, s in enumerate([1, 1, 0, 0])] + [row("full", 0, "b", 0, 1)]
    old = [row("icecache[default]", 0, "a", i, 0) for i in range(4)] + [row("icecache[default]", 0, "b", 0, 0)]
    new0 = [row("icecache[p=1]", 0, "a", i, s) for i, s in enumerate([1, 0, 0, 0])] + [row("icecache[p=1]", 0, "b", 0, 1)]
    seed1 = [row("full", 1, "a", 0, 1), row("icecache[default]", 1, "a", 0, 1), row("topk", 1, "a", 0, 1)]
    paths = [write("s0.jsonl", full0 + old + new0), write("s1.jsonl", seed1)]
    aliases = parse_aliases(["s0.jsonl:icecache[default]=icecache[old]", "icecache[p=1]=icecache[default]"])
    frame = ratio_to_full(read_rows(*paths, aliases=aliases))
    pooled = frame.loc[("ruler", "icecache[default]", 256)]
    # task a: (1+0+0+0+1)/5 = 0.4 vs full 3/5; task b: 1 vs 1 -> (0.4 + 1) / 2 / ((0.6 + 1) / 2)
    assert pooled["n"] == 6 and pooled["ratio"] == pytest.approx(0.7 / 0.8, abs=1e-3)
    assert pooled["ci_low"] <= pooled["ratio"] <= pooled["ci_high"]
    assert frame.loc[("ruler", "icecache[old]", 256)]["ratio"] == 0
    topk = frame.loc[("ruler", "topk", 256)]
    assert (topk["ratio"], topk["ci_low"], topk["ci_high"]) == (1, 1, 1)
