"""KV memory by place (:meth:`icecache.kv.KVCache.memory_bytes`): the device-resident bytes equal the budget arithmetic
(budget x budgeted layers x H_kv x head_dim x 2 x dtype bytes, plus the dense layers' full KV, plus transit buffers),
apart from the host store and the index; recorded per sample, in ``timing.json`` (maximum) and in decode benchmark rows."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import METHOD_CASES, build_tiny, skip_without_requirement

from evals.harness import run_eval
from evals.registry import make_cache
from evals.runner import generate
from evals.output.summary import collect
from icecache.kv import KVCache
from icecache.kv.base import MEMORY_KEYS

PROMPT, NEW = 200, 8
LAYERS, H_KV, HEAD_DIM = 4, 2, 16  # build_tiny's shape, float32
PER_TOKEN = 2 * H_KV * HEAD_DIM * 4  # K and V of one token in one layer
CONTEXT = PROMPT + NEW - 1  # the last generated token is never fed back


@pytest.fixture(scope="module")
def model():
    return build_tiny()


def run(model, name: str, **hp) -> KVCache:
    cache = make_cache(name, model, **hp)
    ids = torch.randint(0, 264, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    model.generate(ids, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return cache


def test_full_holds_every_token_on_the_device(model, one_thread):
    assert run(model, "full").memory_bytes() == {"device_kv_bytes": LAYERS * CONTEXT * PER_TOKEN, "transit_bytes": 0,
                                                 "host_kv_bytes": 0, "index_bytes": 0}


def test_icecache_device_bytes_are_the_budget_plus_the_dense_layers(model, one_thread):
    cache = run(model, "icecache", budget=64)  # 16-token pages: 1 sink + 1 retrieved + 2 window pages
    memory, method = cache.memory_bytes(), cache.method
    budgeted = [s for s in cache.states if method.is_budgeted(s)]
    assert len(budgeted) == LAYERS - method.n_dense_layers == 2 and all(s.offloaded for s in budgeted)
    transit = len(budgeted) * 2 * H_KV * method.layout()[2] * method.page_size * HEAD_DIM * 4  # K and V of every slot
    assert memory["transit_bytes"] == transit
    assert memory["device_kv_bytes"] == 64 * len(budgeted) * PER_TOKEN + method.n_dense_layers * CONTEXT * PER_TOKEN \
        + transit
    assert memory["host_kv_bytes"] == sum(CONTEXT - s.buffer.n_sink - s.buffer.win_len for s in budgeted) * PER_TOKEN
    assert memory["index_bytes"] > 0


def test_pqcache_device_bytes_are_the_budget_with_the_gathered_top_k_in_transit(model, one_thread):
    cache = run(model, "pqcache", budget=64)  # every layer budgeted: 2 sinks + 31 recent resident + 31 gathered
    memory, method = cache.memory_bytes(), cache.method
    assert memory["device_kv_bytes"] == 64 * LAYERS * PER_TOKEN
    assert memory["transit_bytes"] == method.topk * LAYERS * PER_TOKEN
    assert memory["host_kv_bytes"] == CONTEXT * LAYERS * PER_TOKEN  # the store keeps every token
    assert memory["index_bytes"] > 0


def test_arkvale_device_bytes_are_its_page_slots(model, one_thread):
    cache = run(model, "arkvale", budget=64, page_size=8)
    memory = cache.memory_bytes()
    assert memory["device_kv_bytes"] == 64 * LAYERS * PER_TOKEN and memory["transit_bytes"] == 0
    assert memory["host_kv_bytes"] == CONTEXT * LAYERS * PER_TOKEN and memory["index_bytes"] > 0


def test_magicpig_keeps_sinks_local_and_generated_tokens_on_the_device(model, one_thread):
    cache = run(model, "magicpig", budget=64)
    memory, method = cache.memory_bytes(), cache.method
    sparse = [s.layer_idx for s in cache.states if method.is_budgeted(s)]
    exact = method.n_sink + method.local
    assert memory["device_kv_bytes"] == ((LAYERS - len(sparse)) * CONTEXT + len(sparse) * (exact + NEW - 1)) * PER_TOKEN
    assert memory["host_kv_bytes"] == len(sparse) * (PROMPT - exact) * PER_TOKEN and memory["index_bytes"] > 0


@pytest.mark.parametrize("case", METHOD_CASES, ids=lambda c: c.name)
def test_every_method_reports_its_memory_by_place(model, case, one_thread):
    skip_without_requirement(case.name)
    memory = run(model, case.name, **case.small or case.covering).memory_bytes()
    assert set(memory) == set(MEMORY_KEYS) and memory["device_kv_bytes"] > 0
    assert 0 <= memory["transit_bytes"] <= memory["device_kv_bytes"]
    assert memory["device_kv_bytes"] <= LAYERS * CONTEXT * PER_TOKEN + memory["transit_bytes"]  # never above full


def test_runs_and_decode_benchmark_rows_record_the_memory(model, tmp_path, one_thread):
    ids = torch.randint(0, 264, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    from evals.registry import make_method

    gen = generate(model, None, make_method("icecache", budget=64), ids, NEW, ignore_eos=True)
    assert set(MEMORY_KEYS) <= set(gen.timing()) and gen.memory == run(model, "icecache", budget=64).memory_bytes()

    from evals.bench import decode
    row = decode.measure(model, None, "full", 64, ids, NEW)
    assert row["device_kv_bytes"] == LAYERS * CONTEXT * PER_TOKEN and row["host_kv_bytes"] == 0

    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "icecache"}, "budget": 64, "limit": None, "seed": 0, "device": "cpu",
           "eval": {"name": "passkey", "lengths": [160, 320], "depths": 1, "max_new_tokens": 4},
           "results_dir": str(tmp_path / "results"), "data_dir": None, "debug": False, "progress": False}
    run_dir = run_eval(cfg)
    rows = [json.loads(line)["timing"] for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    timing = json.loads((run_dir / "timing.json").read_text())
    for key in MEMORY_KEYS:
        assert timing[key] == max(r[key] for r in rows)
    assert rows[1]["host_kv_bytes"] > rows[0]["host_kv_bytes"]  # the longer prompt offloads more
    frame = collect(tmp_path / "results")
    assert frame["device_kv_bytes"].tolist() == [timing["device_kv_bytes"]]
