"""Methods hold hyperparameters only (icecache/kv/base.py): every registered method is a frozen dataclass, what it
resolves from a model comes back from ``bind`` and stays with the cache, so one method object serves models of
different depths and head shapes in turn and generates what a fresh object generates for each."""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.models import tiny_config
from evals.registry import METHODS, make_cache, make_method, method_class
from helpers import METHOD_CASES, build_tiny, skip_without_requirement


def _model_b():
    """Another shape than ``build_tiny``'s default: 6 layers (MagicPIG's dense layers and OmniKV's filter layers
    scale with the depth), one KV head for four query heads (a group of 4, not 2) and 8-dimensional heads."""
    torch.manual_seed(1)
    config = tiny_config("tiny-llama", n_kv_heads=1, n_heads=4, n_layers=6, head_dim=8)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _tokens(method, model, ids) -> torch.Tensor:
    cache = make_cache(method, model)
    try:
        return model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, past_key_values=cache)
    finally:
        cache.close()


def test_every_registered_method_is_a_frozen_dataclass():
    for name in METHODS:
        cls = method_class(name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name


@pytest.mark.parametrize("case", [c for c in METHOD_CASES if c.small or c.covering], ids=lambda c: c.name)
def test_one_method_object_serves_two_models_in_turn(case):
    skip_without_requirement(case.name)
    settings = dict(case.small or case.covering)
    budget = settings.pop("budget", None)
    method = make_method(case.name, budget=budget, **settings)
    before = dataclasses.replace(method)
    models = {"a": build_tiny("tiny-llama", 2, 4), "b": _model_b()}
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    fresh = {key: _tokens(make_method(case.name, budget=budget, **settings), model, ids)
             for key, model in models.items()}
    for key in ("a", "b", "a"):  # the same object, model after model
        assert torch.equal(_tokens(method, models[key], ids), fresh[key]), f"{case.name} on model {key}"
    assert method == before and repr(method) == repr(before)
    with pytest.raises(dataclasses.FrozenInstanceError):
        method.budget = 1
