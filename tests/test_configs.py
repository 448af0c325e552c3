"""Every default is written once: the methods' dataclass fields and the suites' ``Options`` are the run
config (evals/config.py); YAML under conf/ holds presets and model settings, never a copy of a default."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from helpers import skip_without_requirement

from evals import config
from evals.config import ConfigError, check_config
from evals.registry import METHODS, SUITES, make_method, method_class, suite_class

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_cache_config_is_the_dataclass(name):
    skip_without_requirement(name)
    cache = config.compose_config([f"cache={name}", "eval=latency"])["cache"]  # a suite with no official setting
    assert cache == config.method_defaults(name)
    options = {k: v for k, v in cache.items() if k != "name"}
    cls = method_class(name)
    budget = None if not cls.needs_budget else max(128, cls.example_budget)  # arkvale: 256 at least
    assert make_method(name, budget=budget, **options) == cls(budget=budget)


@pytest.mark.parametrize("name", sorted(SUITES))
def test_eval_config_is_the_options_dataclass(name):
    cfg = config.compose_config([f"eval={name}", "model=smollm2-135m"])
    suite = suite_class(name)
    expected = {**config.suite_defaults(name), **{k: _resolve(v, cfg) for k, v in suite.model_links.items()}}
    assert cfg["eval"] == expected
    assert set(suite.model_links) <= {f.name for f in dataclasses.fields(suite.Options)}


def _resolve(link: str, cfg: dict):
    value = cfg
    for key in link.removeprefix("${").removesuffix("}").split("."):
        value = value[key]
    return value


def test_no_default_is_written_twice():
    """No method YAML exists (the cache group is generated); an eval preset writes only overrides of its
    suite's defaults; and no YAML value repeats the Python default it would override."""
    assert not (CONF / "cache").exists()
    generated = set(SUITES)
    for path in sorted((CONF / "eval").glob("*.yaml")):
        assert path.stem not in generated, f"{path} shadows the generated eval/{path.stem}"
        preset = yaml.safe_load(path.read_text())
        parents = [d for d in preset.pop("defaults") if d != "_self_"]
        assert len(parents) == 1 and parents[0] in SUITES, path
        defaults = config.suite_defaults(parents[0])
        for key, value in preset.items():
            assert key in defaults, f"{path}: {key} is not an option of {parents[0]}"
            assert value != defaults[key], f"{path}: {key}={value!r} repeats the default"



def test_a_suite_carries_the_official_setting_of_a_method():
    """conf/suite_cache/<suite>_<method>.yaml (selected by conf/config.yaml) overrides only that method's
    options for that suite (beside ``official_source``, where each value comes from: tests/test_official_defaults.py),
    differs from the defaults, and loses to the user's own ``cache.<option>``."""
    pairs = {f"{s}_{m}": (s, m) for s in SUITES for m in METHODS}
    for path in sorted((CONF / "suite_cache").glob("*.yaml")):
        assert path.stem in pairs, f"{path} names no (suite, method) pair"
        overrides = yaml.safe_load(path.read_text())
        assert set(overrides) - {"official_source"} == {"cache"}, path
        defaults = config.method_defaults(pairs[path.stem][1])
        for key, value in overrides["cache"].items():
            assert key in defaults and value != defaults[key], f"{path}: {key}={value!r}"
    for method in ("icecache", "icecache_reuse"):  # the official GSM8K script passes no --ratio_1: 0.03
        assert config.compose_config(["eval=gsm8k", f"cache={method}"])["cache"]["ratio_1"] == 0.03
        assert config.compose_config(["eval=passkey", f"cache={method}"])["cache"]["ratio_1"] == 0.01
        assert config.compose_config(["eval=longbench", f"cache={method}"])["cache"]["ratio_1"] == 0.01
        user = config.compose_config(["eval=gsm8k", f"cache={method}", "cache.ratio_1=0.01"])
        assert user["cache"]["ratio_1"] == 0.01
    assert config.compose_config(["eval=gsm8k", "cache=quest"])["cache"] == config.method_defaults("quest")


# The published settings, written here from the papers and official code (not read from the dataclasses), so
# a changed default fails until it is justified: (method, option) -> value, with its source.
PUBLISHED = {
    ("streaming_llm", "n_sink"): 4,  # Xiao et al. 2024: 4 initial tokens as attention sinks
    ("h2o", "heavy_ratio"): 0.5,  # Zhang et al. 2023: heavy hitters and recent tokens 1:1
    ("snapkv", "window_size"): 32,  # Li et al. 2024: observation window of 32 tokens
    ("snapkv", "kernel_size"): 7,  # Li et al. 2024: pooling kernel 7
    ("snapkv", "pooling"): "max",  # Li et al. 2024: max pooling
    ("quest", "page_size"): 16,  # Tang et al. 2024: pages of 16 tokens
    ("quest", "n_dense_layers"): 2,  # Tang et al. 2024: the first two layers are not sparsified
    ("arkvale", "page_size"): 32,  # pku-liang/ArkVale README and adapter.enable_arkvale: page_size=32
    ("arkvale", "n_sink_pages"): 2,  # ArkVale infer_state.py InferState: n_sink_pages=2
    ("arkvale", "n_win_pages"): 2,  # ArkVale infer_state.py InferState: n_win_pages=2
    ("pqcache", "n_subvec"): 2,  # HugoZHL/PQCache scripts: SUBVEC=2
    ("pqcache", "n_bits"): 6,  # HugoZHL/PQCache scripts: SUBBITS=6
    ("pqcache", "recent_ratio"): 0.5,  # PQCache: half of the non-sink budget is the local window
    ("omnikv", "wait_layers"): 1,  # antgroup/OmniKV configs: num_wait_load_layers=1
    ("magicpig", "n_bits"): 10,  # Infini-AI-Lab/MagicPIG models/attnserver.py: K=10
    ("magicpig", "n_tables"): 150,  # MagicPIG attnserver.py: L=150
    ("magicpig", "min_collisions"): 2,  # MagicPIG: a key is sampled when it collides in >= 2 tables
    ("magicpig", "calibrate"): False,  # the official K is fixed
    ("icecache", "n_dense_layers"): 2,  # yuzhenmao/IceCache scripts: --n-unlimited-layers 2
    ("icecache", "n_sink_pages"): 2,  # IceCache scripts: --n-sink-pages 2
    ("icecache", "n_window_pages"): 2,  # IceCache scripts: --n-win-pages 2
    ("icecache", "ratio_1"): 0.01,  # IceCache passkey_pred.py: --ratio_1 0.01
    ("icecache", "ratio_2"): 0.2,  # IceCache passkey_pred.py: --ratio_2 0.2
}


@pytest.mark.parametrize("method,option", sorted(PUBLISHED))
def test_defaults_are_the_published_settings(method, option):
    assert config.compose_config([f"cache={method}"])["cache"][option] == PUBLISHED[(method, option)]


def test_official_layer_choices_are_the_published_ones():
    from baselines.magicpig import OFFICIAL_DENSE_LAYERS
    from baselines.omnikv import scaled_filter_layers

    assert scaled_filter_layers(32) == (2, 8, 18)  # OmniKV configs/example.json (32-layer Llama-3-8B)
    assert OFFICIAL_DENSE_LAYERS == (0, 16)  # MagicPIG: layers 0 and 16 of 32 stay dense

def test_icecache_reuse_extends_icecache_through_the_defaults_list():
    node = config.method_node("icecache_reuse")
    assert node["defaults"] == ["icecache", "_self_"]
    assert set(node) == {"defaults", "name", "n_reuse_layers", "rerank", "own_candidates"}
    cfg = config.compose_config(["cache=icecache_reuse", "cache.page_size=8"])["cache"]
    assert cfg["page_size"] == 8 and cfg["rerank"] == 0  # the official copy of the anchor's pages
    variant = config.compose_config(["cache=icecache_reuse_rerank"])["cache"]
    assert variant["rerank"] == 3 and variant["own_candidates"] is None  # resolved from the budget when built


def test_types_are_checked_against_the_python_defaults():
    cfg = config.compose_config(["cache=quest", "eval=passkey"])
    with pytest.raises(ConfigError, match="cache.page_size must be a whole number"):
        check_config(dict(cfg, cache=dict(cfg["cache"], page_size=1.5)))
    with pytest.raises(ConfigError, match="eval.max_new_tokens must be a whole number"):
        check_config(dict(cfg, eval=dict(cfg["eval"], max_new_tokens="ten")))
