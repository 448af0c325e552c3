"""A method's name runs its paper's method: every published method's defaults are the official code's values
(one table, written here from the papers and official scripts, independent of the classes), and each of this
project's registered variants differs from the method it extends in exactly the fields it documents."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from evals.registry import METHODS, make_cache, make_method, method_class
from helpers import build_tiny

# name -> the official values (paper / official repository file in the comment)
OFFICIAL = {
    # IceCache run_longbench.sh, passkey_pred.py, infer_state.py, src/dci.c
    "icecache": dict(page_size=16, n_sink_pages=2, n_window_pages=2, n_dense_layers=2, gqa_merge="interleaved",
                     always_index=False, short_prompt="dense", ratio_1=0.01, ratio_2=0.2, search_ratio=1.5e-3,
                     min_fov=30, prop_to_retrieve=0.8, candidate_rule="official", prefill_pipeline="official",
                     projection="per_prompt"),
    # the same plus --n_reuse_layers 3 and infer_state.check_reuse's copy of the anchor's pages
    "icecache_reuse": dict(page_size=16, n_dense_layers=2, prop_to_retrieve=0.8, candidate_rule="official",
                           short_prompt="dense", n_reuse_layers=3, rerank=0, own_candidates=0),
    # streaming_llm/enable_streaming_llm.py: start_size 4, pos_shift attention for Llama-style models
    "streaming_llm": dict(n_sink=4, rerotate=True),
    # h2o_hf/utils_real_drop: heavy and recent halves of the budget
    "h2o": dict(heavy_ratio=0.5),
    # snapkv_utils.py SnapKVCluster defaults; generated tokens are appended and never evicted
    "snapkv": dict(window_size=32, kernel_size=7, pooling="max", selection="per_query_head", decode_policy="grow"),
    # evaluation/quest_attention.py: 16-token pages, the first two layers dense
    "quest": dict(page_size=16, n_dense_layers=2),
    # arkvale InferState defaults
    "arkvale": dict(page_size=32, n_sink_pages=2, n_win_pages=2, page_topks=0, digest="cuboid_mean",
                    n_dense_layers=0),
    # configs/example.json: filter layers 2, 8, 18 of 32 (scaled when None), one wait layer, the last query
    "omnikv": dict(filter_layers=None, wait_layers=1, selector="last"),
    # models/attnserver.py LSHSparseAttnServer(K=10, L=150), dense layers [0, 16] (scaled when None)
    "magicpig": dict(n_bits=10, n_tables=150, min_collisions=2, n_sink=4, local_window=64, dense_layers=None,
                     calibrate=False),
    # vq_method.py / pq_search.py: 2 sub-vectors x 6 bits, 4 sink tokens
    "pqcache": dict(n_sink=4, n_subvec=2, n_bits=6),
}

NOT_PUBLISHED = {"full", "topk", "page_oracle", "kvpress"}  # the full cache, the two oracles and the kvpress adapter


def init_fields(method) -> dict:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init and f.name != "debug"}


def variants() -> list[str]:
    return [name for name in METHODS if "deviations" in vars(method_class(name))]


def extended_method(name: str) -> str:
    """The registered method whose official configuration a variant varies (its class's ``extends``)."""
    parent = method_class(name).extends
    assert parent in METHODS and issubclass(method_class(name), method_class(parent)), parent
    return parent


def library_methods() -> set[str]:
    """Registered methods whose class this repository's library defines (baselines/, icecache/): the ones that
    claim a paper. A method a user registers from a module of their own needs no row here."""
    return {name for name in METHODS if method_class(name).__module__.split(".")[0] in ("baselines", "icecache")}


def test_every_published_method_has_an_official_row():
    published = library_methods() - NOT_PUBLISHED - set(variants())
    assert published == set(OFFICIAL), (
        f"add the official values of {sorted(published - set(OFFICIAL))} to OFFICIAL in "
        f"tests/test_official_defaults.py (or give a variant's class its `deviations`)")


@pytest.mark.parametrize("name", sorted(OFFICIAL))
@pytest.mark.parametrize("budget", [128, 256])
def test_defaults_are_the_official_values(name, budget):
    hp = {"page_size": 8} if name == "arkvale" and budget < 256 else {}
    method = init_fields(make_method(name, budget=budget, **hp))
    expected = {**OFFICIAL[name], **hp}
    assert {k: method[k] for k in expected} == expected


@pytest.mark.parametrize("name", variants())
def test_a_variant_differs_exactly_in_its_documented_fields(name):
    """Over the budgets 64, 128 and 256, the fields in which the variant's resolved configuration differs from
    the method it extends are exactly its ``deviations``; the docstring names each."""
    parent = extended_method(name)
    changed = set()
    for budget in (64, 128, 256):
        hp = {"page_size": 8} if parent == "arkvale" else {}
        ours, official = init_fields(make_method(name, budget=budget, **hp)), make_method(parent, budget=budget, **hp)
        changed |= {k for k, v in init_fields(official).items() if ours.get(k) != v}
    deviations = set(method_class(name).deviations)
    assert changed == deviations, f"{name} differs from {parent} in {sorted(changed)}, documents {sorted(deviations)}"
    doc = method_class(name).__doc__
    assert all(f"``{field}``" in doc or f"``{field}=" in doc for field in deviations), doc


def test_the_official_reuse_does_no_selection_in_reusing_layers(monkeypatch):
    """``icecache_reuse`` copies its anchor's pages (official ``check_reuse``): per decode step one index search
    per anchor, none in a reusing layer, no re-ranking and no scan of its own page bounds."""
    from icecache import reuse
    from icecache.dci import MDCIIndex

    calls = {"search": 0, "rerank": 0, "own": 0}
    search = MDCIIndex.search_scored

    def counted_search(self, *args, **kwargs):
        calls["search"] += 1
        return search(self, *args, **kwargs)

    monkeypatch.setattr(MDCIIndex, "search_scored", counted_search)
    monkeypatch.setattr(reuse.IceCacheReuse, "rerank_pages", lambda *a: calls.__setitem__("rerank", 1))
    monkeypatch.setattr(reuse.IceCacheReuse, "own_pages", lambda *a: calls.__setitem__("own", 1))
    model = build_tiny(n_layers=6)  # layers 0-1 dense, 2 and 5 anchors, 3-4 reuse layer 2's pages
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    cache = make_cache("icecache_reuse", model, budget=64)
    try:
        new_tokens = 6
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       past_key_values=cache)
    finally:
        cache.close()
    anchors = 2
    assert calls == {"search": anchors * (new_tokens - 1), "rerank": 0, "own": 0}
