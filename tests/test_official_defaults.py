"""A method's name runs its paper's method: every init field of every published method's class is held to a table
written here from the papers and official code (each value with the file and line it comes from, independent of
the classes), at the budgets 64, 128 and 256 and under each suite's official setting (conf/suite_cache/, composed
by Hydra as ``python run.py eval=<suite> cache=<name>`` does); each of this project's registered variants differs
from the method it extends in exactly the fields it documents. A changed default fails here until the table (and
its source) says why.

Fields the official code has no counterpart for (how this harness stores, seeds or schedules the same computation)
are in the table too, marked ``harness``: changing one is a decision to record as well."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from evals.config import compose_config, method_defaults
from evals.output import results, tables
from evals.registry import METHODS, SUITES, make_cache, make_method, method_class
from helpers import build_tiny
from icecache.dci import DCIConfig

CONF = Path(__file__).resolve().parents[1] / "conf"
BUDGETS = (64, 128, 256)

# name -> every init field (but ``budget`` and ``debug``, top-level settings) and its official value, the source in
# the comment: owner/repo path, line. "harness": a field without an official counterpart.
OFFICIAL = {
    "streaming_llm": dict(
        n_sink=4,  # mit-han-lab/streaming-llm examples/run_streaming_llama.py line 118 (--start_size 4); paper: 4 sinks
        rerotate=True,  # streaming_llm/enable_streaming_llm.py lines 7-11: pos_shift attention for Llama models
    ),
    "h2o": dict(
        heavy_ratio=0.5,  # FMInference/H2O h2o_hf/scripts/generation/llama_h2o.sh line 4: heavy 0.1 = recent 0.1
        group_agg="mean",  # harness: GQA aggregation of the per-query-head scores (h2o_hf is MHA; kvpress' mean)
        chunk_size=64,  # harness: prefill queries per chunk of the score computation (the same scores)
    ),
    "snapkv": dict(
        window_size=32,  # FasterDecoding/SnapKV experiments/LongBench/config/ablation_c*_w32_k7_maxpool.json line 1
        kernel_size=7,  # the same config, line 1 ("kernel_sizes": 7), for every capacity (1024, 2048, 4096)
        pooling="max",  # the same config, line 1 ("pooling": "maxpool")
        selection="per_query_head",  # snapkv/monkeypatch/mistral_hijack_4_37.py lines 96-98: repeat_kv before update_kv
        group_agg="sum",  # harness: used by selection="per_kv_head" only (kvpress' SnapKVPress)
        decode_policy="grow",  # snapkv_utils.py lines 38-70: compression at prefill only, generated tokens appended
        decode_window=32,  # harness: used by decode_policy="pinned" only (the variant snapkv_pinned)
    ),
    "quest": dict(
        page_size=16,  # mit-han-lab/Quest scripts/longbench.sh line 14, scripts/passkey.sh line 15 (--chunk_size 16)
        n_dense_layers=2,  # evaluation/quest_attention.py line 84 (self.layer_id < 2: dense)
        force_last_page=False,  # evaluation/quest_attention.py lines 55-57: plain top max(3, budget // chunk_size)
    ),
    "arkvale": dict(
        page_size=32,  # pku-liang/ArkVale source/arkvale/adapter/modeling.py line 198 (enable_arkvale page_size=32)
        n_sink_pages=2,  # source/arkvale/infer_state.py line 31
        n_win_pages=2,  # source/arkvale/infer_state.py line 32
        page_topks=0,  # source/arkvale/infer_state.py lines 28 and 63-64: None -> page_budgets // 2
        digest="cuboid_mean",  # source/arkvale/infer_state.py lines 448-458 (_summarize_keys: mean |c - k|)
        n_dense_layers=0,  # source/arkvale/infer_state.py lines 26 and 57-58: n_unlimited_layers None -> 0
    ),
    "pqcache": dict(
        n_sink=2,  # HugoZHL/PQCache vq_pred.py line 37 (--sink-size default 2)
        n_subvec=2,  # run_llama.sh line 14 (SUBVEC=2)
        n_bits=6,  # run_llama.sh line 15 (SUBBITS=6)
        # the one deliberate deviation (baselines/pqcache.py, docs/fidelity.md): the official sklearn call
        # (multi_core_compressor_v2.py lines 165-175) with --max_iter 300 (vq_pred.py line 51), i.e. run to
        # convergence; the official default MAX_ITER=0 (run_llama.sh line 20) sizes it to a predicted prefill time
        kmeans_iters=300,
        kmeans_tol=1e-4,  # vq_method/retrieval_based/multi_core_compressor_v2.py line 169 (tol = 0.0001)
        recent_ratio=0.5,  # run_llama.sh line 12 (RECENT_RATIO=0.5); pq_search.py lines 235-237
        seed=0,  # harness: the k-means initialisation's generator (the official numpy seed RANDOM_SEED=4321)
        joint_scores=True,  # harness: scores each tuple of codes once (the official selection up to ties)
    ),
    "omnikv": dict(
        filter_layers=None,  # antgroup/OmniKV configs/example.json line 12 ("2,8,18" of 32, scaled to the depth)
        wait_layers=1,  # configs/example.json line 13 (num_wait_load_layers)
        selector="last",  # configs/example.json line 17 (selector_cls)
    ),
    "magicpig": dict(
        n_bits=10,  # Infini-AI-Lab/MagicPIG models/attnserver.py line 11 (K=10)
        n_tables=150,  # models/attnserver.py line 12 (L=150)
        min_collisions=2,  # evaluations/RULER/pred/cache_ref.py line 133 (>= 2 collisions), line 157 (its weight)
        n_sink=4,  # models/attnserver.py line 14 (num_sink_tokens=4)
        local_window=64,  # models/attnserver.py line 15 (num_local_tokens=64)
        dense_layers=None,  # models/attnserver.py line 18 ([0, 16] of 32, scaled to the depth)
        shrink_local=False,  # models/attnserver.py line 129: the last 64 prompt tokens, whatever the budget
        calibrate=False,  # models/attnserver.py lines 11-12: one K for every layer and prompt
        max_bits=20,  # harness: the largest K the calibrated variant may pick (unused here)
        seed=0,  # harness: the SimHash projections' generator
        background_build=None,  # harness: where the tables are built (the same tables)
    ),
    # yuzhenmao/IceCache (IceCache/benchmark/run_longbench.sh, passkey_pred.py; IceCache/source/icecache/
    # infer_state.py) and its M-DCI (yuzhenmao/M-DCI src/dci.c)
    "icecache": dict(
        page_size=16,  # run_longbench.sh line 22 (--page-size 16); passkey_pred.py line 167
        n_sink_pages=2,  # run_longbench.sh line 22 (--n-sink-pages 2); passkey_pred.py line 174
        n_window_pages=2,  # run_longbench.sh line 22 (--n-win-pages 2); passkey_pred.py line 173
        budget_layout="auto",  # harness: at 64 tokens (4 pages of 16) the official InferState asserts
        n_dense_layers=2,  # passkey_pred.py line 170 (--n-unlimited-layers 2)
        gqa_merge="interleaved",  # infer_state.py first_k_unique over the group's query heads
        gqa_candidates=0,  # harness: used by gqa_merge="mass"/"max" only
        always_index=False,  # infer_state.py: a prompt within the budget is never indexed
        short_prompt="dense",  # infer_state.py: such a layer attends everything
        ratio_1=0.01,  # passkey_pred.py line 176 (--ratio_1 0.01)
        ratio_2=0.2,  # passkey_pred.py line 177 (--ratio_2 0.2)
        search_ratio=1.5e-3,  # infer_state.py line 79 (self.search_ratio = 1.5e-3)
        min_fov=30,  # infer_state.py InferState._DCI_query: max(int(seq_len * search_ratio), 30)
        prop_to_retrieve=0.8,  # infer_state.py InferState._DCI_query: query_prop_to_retrieve = 0.8
        candidate_rule="official",  # M-DCI src/dci.c dci_query_single_point with add_to_list
        prefill_pipeline="official",  # infer_state.py: each layer's offload and index build awaited in turn
        projection="per_prompt",  # M-DCI src/dci.c dci_init: drand48 reseeded per instance (here per prompt)
        window_insert="when_full",  # infer_state.py: the full window's oldest page staged, inserted next step
        key_storage="auto",  # harness: bf16 keys stored as bf16 (the same scores)
        seed=0,  # harness: seeds the projection with the prompt's digest
    ),
}
# IceCache(reuse): IceCache's plus run_longbench.sh line 27 (--n_reuse_layers 3) and infer_state.py
# InferState.check_reuse (a reusing layer copies its anchor's pages)
OFFICIAL["icecache_reuse"] = dict(OFFICIAL["icecache"], n_reuse_layers=3, rerank=0, own_candidates=0)

# M-DCI's constants (icecache/dci/config.py DCIConfig): yuzhenmao/M-DCI and IceCache's infer_state.py
DCI_OFFICIAL = dict(
    page_size=16,  # yuzhenmao/M-DCI include/btree_common.h line 21 (BTREE_LEAF_MAX_NUM_SLOTS 16)
    ratio_1=0.01,  # yuzhenmao/IceCache IceCache/benchmark/passkey_pred.py line 176
    ratio_2=0.2,  # passkey_pred.py line 177
    promotion="deterministic",  # M-DCI src/dci.c lines 1108-1121 (positional promotion; drand48 only if random)
    search_ratio=1.5e-3,  # IceCache infer_state.py line 79
    min_fov=30,  # IceCache infer_state.py InferState._DCI_query
    prop_to_retrieve=0.8,  # IceCache infer_state.py InferState._DCI_query
    visit_chunk=128,  # M-DCI src/dci.c line 55 (#define CLOSEST 128)
    candidate_rule="scored",  # harness: the index's own default; IceCache passes its candidate_rule ("official")
    exact_parent_threshold=3000,  # M-DCI src/dci.c line 895 (numa_threshold = 3000)
    anchor_interval=60,  # IceCache infer_state.py InferState._DCI_first_call (interval=60)
    anchor_window=60,  # IceCache infer_state.py InferState._DCI_first_call (X=60)
    anchor_threshold=1.02,  # IceCache infer_state.py InferState._DCI_first_call (anchor_threshold=1.02)
    use_anchors=True,  # M-DCI src/dci.c line 1371 (anchors above numa_threshold points when interval > 0)
    key_storage="auto",  # harness
    seed=0,  # harness
)

# (suite, name) -> the fields an official script for that suite sets to other values than the table above, with
# its source (conf/suite_cache/<suite>_<name>.yaml carries them). A suite without an entry has no official script
# for the method, or one that passes the class values (docs/fidelity.md, per method).
SUITE_OFFICIAL = {
    ("longbench", "arkvale"): dict(
        n_dense_layers=2,  # pku-liang/ArkVale benchmark/longbench_pred.py line 35 (--n-unlimited-layers 2)
        n_sink_pages=1,  # benchmark/longbench_pred.py line 40 (--n-sink-pages 1)
        page_topks=32,  # benchmark/longbench_pred.py line 38; at 64-256 tokens read as the paper's cap: 4 of 8 pages
    ),
    ("passkey", "arkvale"): dict(
        n_dense_layers=2,  # pku-liang/ArkVale benchmark/passkey_pred.py line 140
        page_topks=32,  # benchmark/passkey_pred.py line 139
    ),
    ("longbench", "pqcache"): dict(
        n_sink=32,  # HugoZHL/PQCache run_llama.sh (and run_mistral.sh) line 13 (SINK_SIZE=32, --sink-size line 50)
    ),
    ("gsm8k", "pqcache"): dict(
        n_sink=32,  # HugoZHL/PQCache GSM8k/evaluation_gsm8k.py line 203 (--sink-size default 32)
    ),
    ("gsm8k", "icecache"): dict(
        ratio_1=0.03,  # yuzhenmao/IceCache infer_state.py line 61 (InferState default; gsm8k_pred.py passes none)
    ),
    ("gsm8k", "icecache_reuse"): dict(
        ratio_1=0.03,  # the same
    ),
}

# not a paper's method: the full cache, the exact top-k oracle, the kvpress adapter, the exact page-ranking bound
NOT_PUBLISHED = {"full", "topk", "kvpress", "page_oracle"}

SOURCE = re.compile(r"^[\w.-]+/[\w.-]+ \S+ lines? \d+")  # owner/repo path line N ...


def init_fields(method) -> dict:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method)
            if f.init and f.name not in results.METHOD_TOP_LEVEL}


def small_budget_options(name: str, budget: int) -> dict:
    """What a method needs to accept 64 or 128 tokens: ArkVale's 32-token pages leave no scored page below 256, so
    its pages shrink to keep 8 per budget (16 tokens at 128, 8 at 64; docs/fidelity.md)."""
    return {"page_size": budget // 8} if name == "arkvale" and budget < 256 else {}


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


def suite_file(suite: str, name: str) -> Path:
    return CONF / "suite_cache" / f"{suite}_{name}.yaml"


def test_every_published_method_has_an_official_row():
    published = library_methods() - NOT_PUBLISHED - set(variants())
    assert published == set(OFFICIAL), (
        f"add the official values of {sorted(published - set(OFFICIAL))} to OFFICIAL in "
        f"tests/test_official_defaults.py (or give a variant's class its `deviations`)")


@pytest.mark.parametrize("name", sorted(OFFICIAL))
@pytest.mark.parametrize("budget", BUDGETS)
def test_every_field_is_the_official_value(name, budget):
    """Every init field, the table's value: no field missing from the table, none different."""
    options = small_budget_options(name, budget)
    assert init_fields(make_method(name, budget=budget, **options)) == {**OFFICIAL[name], **options}


def test_the_m_dci_constants_are_the_official_values():
    assert {f.name: f.default for f in dataclasses.fields(DCIConfig)} == DCI_OFFICIAL


@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_each_suite_composes_its_official_setting(suite, name):
    """``eval=<suite> cache=<name>`` resolves the cache block to the table plus that suite's official values, and
    the method it builds holds them at every budget."""
    cfg = compose_config([f"eval={suite}", f"cache={name}"])
    cache = {k: v for k, v in cfg["cache"].items() if k != "name"}
    expected = {**OFFICIAL[name], **SUITE_OFFICIAL.get((suite, name), {})}
    assert cache == expected
    sources = cfg.get("official_source") or {}
    assert {k: entry["value"] for k, entry in sources.items()} == SUITE_OFFICIAL.get((suite, name), {})
    for budget in BUDGETS:
        options = small_budget_options(name, budget)
        assert init_fields(make_method(name, budget=budget, **{**cache, **options})) == {**expected, **options}


def test_every_suite_file_names_its_source_and_is_in_the_table():
    """conf/suite_cache/<suite>_<name>.yaml of a published method sets only values other than the class's, records
    each under ``official_source`` with the official file and line, and is the table's entry; a variant's file
    repeats the entry of the method it extends."""
    pairs = {f"{s}_{m}": (s, m) for s in SUITES for m in METHODS}
    listed = set()
    for path in sorted((CONF / "suite_cache").glob("*.yaml")):
        assert path.stem in pairs, f"{path} names no (suite, method) pair"
        suite, name = pairs[path.stem]
        if name in NOT_PUBLISHED:  # a bound's setting (e.g. the page oracle's index build as IceCache's): no claim
            continue
        node = yaml.safe_load(path.read_text())
        assert set(node) == {"cache", "official_source"}, path
        assert {k: e["value"] for k, e in node["official_source"].items()} == node["cache"], path
        assert all(SOURCE.match(e["source"]) for e in node["official_source"].values()), path
        defaults = method_defaults(name)
        assert all(k in defaults and v != defaults[k] for k, v in node["cache"].items()), path
        official = name if name in OFFICIAL else extended_method(name)
        assert node["cache"] == SUITE_OFFICIAL[(suite, official)], path
        listed.add((suite, official))
    assert listed == set(SUITE_OFFICIAL)


def test_the_user_setting_wins_over_the_suite_and_is_labelled():
    """``cache.<option>=`` overrides a suite's official value; the run records the suite's sources beside it
    (``official_source``, not part of the run's identity), and the tables label the official setting by the bare
    name and a user's other value as a variant."""
    official = compose_config(["eval=longbench", "cache=pqcache"])
    user = compose_config(["eval=longbench", "cache=pqcache", "cache.n_sink=8"])
    assert (official["cache"]["n_sink"], user["cache"]["n_sink"]) == (32, 8)
    assert user["official_source"] == official["official_source"]
    bare = {k: v for k, v in official.items() if k != "official_source"}
    assert results.config_hash(official) == results.config_hash(bare)


@pytest.mark.parametrize("n_sink,label", [(32, "pqcache"), (8, "pqcache[n_sink=8]")])
def test_the_suite_setting_is_no_variant_in_tables(tmp_path, n_sink, label):
    cfg = compose_config(["eval=longbench", "cache=pqcache", f"cache.n_sink={n_sink}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert tables.method_label(pd.Series({"run_dir": str(tmp_path), "cache": "pqcache"})) == label
    passkey = compose_config(["eval=passkey", "cache=pqcache", "cache.n_sink=32"])  # no official setting there
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(passkey))
    assert tables.method_label(pd.Series({"run_dir": str(tmp_path), "cache": "pqcache"})) == "pqcache[n_sink=32]"


@pytest.mark.parametrize("name", variants())
def test_a_variant_differs_exactly_in_its_documented_fields(name):
    """Over the budgets 64, 128 and 256, the fields in which the variant's resolved configuration differs from
    the method it extends are exactly its ``deviations``; the docstring names each."""
    parent = extended_method(name)
    changed = set()
    for budget in BUDGETS:
        options = small_budget_options(parent, budget)
        ours = init_fields(make_method(name, budget=budget, **options))
        official = init_fields(make_method(parent, budget=budget, **options))
        changed |= {k for k, v in official.items() if ours.get(k) != v}
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
