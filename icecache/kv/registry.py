"""Methods found by name. Each entry is ``"module:Class"``, imported only when used, so adding a method
is one line here and one file in ``baselines/`` (or ``icecache/``) and never touches another method."""
from __future__ import annotations

import importlib
from dataclasses import fields

import torch

from . import compat
from .cache import KVCache
from .method import KVMethod, ModelSpec

METHODS: dict[str, str] = {
    "full": "baselines.full:FullCache",
    "streaming_llm": "baselines.streaming_llm:StreamingLLM",
    "h2o": "baselines.h2o:H2O",
    "snapkv": "baselines.snapkv:SnapKV",
    "quest": "baselines.quest:Quest",
    "topk": "baselines.topk_oracle:TopKOracle",
    "pqcache": "baselines.pqcache:PQCache",
    "omnikv": "baselines.omnikv:OmniKV",
    "magicpig": "baselines.magicpig:MagicPIG",
    "icecache": "icecache.method:IceCache",
    "icecache_reuse": "icecache.method:IceCacheReuse",
}


class UnknownNameError(ValueError):
    """A model/cache/eval name that is not registered."""


def method_class(name: str) -> type[KVMethod]:
    if name not in METHODS:
        raise UnknownNameError(f"unknown cache method '{name}'; valid: {', '.join(sorted(METHODS))}")
    module, cls = METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_method(name: str, budget: int | None = None, **hyperparameters) -> KVMethod:
    """Builds (and validates) a method from its name, the common budget and its own hyperparameters."""
    cls = method_class(name)
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise ValueError(f"cache '{name}' has no hyperparameter(s) {unknown}; valid: {sorted(known - {'budget'})}")
    return cls(budget=budget, **hyperparameters)


def make_cache(method: str | KVMethod, model: torch.nn.Module, budget: int | None = None,
               profile: bool = False, **hyperparameters) -> KVCache:
    """A cache for ``model.generate(..., past_key_values=make_cache("streaming_llm", model, budget=64))``.

    Also switches the model's attention to the cache-aware function (idempotent). One cache serves one
    sequence (batch size 1): make a new one per prompt.
    """
    if isinstance(method, str):
        method = make_method(method, budget=budget, **hyperparameters)
    compat.enable_attention(model)
    return KVCache(method, ModelSpec.from_model(model), profile=profile)
