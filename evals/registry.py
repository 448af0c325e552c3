"""Methods and suites found by name: ``"module:Class"``, imported only when used.

A published method's name runs its paper's configuration by default; this project's improvements are
registered variants (``icecache_tuned``, ``icecache_reuse_rerank``, ``snapkv_pinned``, ``magicpig_calibrated``)
whose class lists its ``deviations`` (the fields it changes) and the measurement behind each.

This table sits above the library (``icecache/``) and the baselines, which never import it: adding a method
is one file (its ``@dataclass``) and one line in :data:`METHODS`; its run configuration ``cache=<name>`` is
generated from the dataclass (:mod:`evals.config`).
"""
from __future__ import annotations

import importlib
import math
from dataclasses import fields

import torch

from icecache.kv import KVCache, KVMethod, UnknownNameError

METHODS: dict[str, str] = {
    "full": "baselines.full:FullCache",
    "streaming_llm": "baselines.streaming_llm:StreamingLLM",
    "h2o": "baselines.h2o:H2O",
    "snapkv": "baselines.snapkv:SnapKV",
    "snapkv_pinned": "baselines.snapkv:SnapKVPinned",
    "quest": "baselines.quest:Quest",
    "arkvale": "baselines.arkvale:ArkVale",
    "topk": "baselines.topk_oracle:TopKOracle",
    "page_oracle": "baselines.page_oracle:PageOracle",
    "pqcache": "baselines.pqcache:PQCache",
    "omnikv": "baselines.omnikv:OmniKV",
    "magicpig": "baselines.magicpig:MagicPIG",
    "magicpig_calibrated": "baselines.magicpig:MagicPIGCalibrated",
    "icecache": "icecache.method:IceCache",
    "icecache_tuned": "icecache.tuned:IceCacheTuned",
    "icecache_reuse": "icecache.reuse:IceCacheReuse",
    "icecache_reuse_rerank": "icecache.reuse:IceCacheReuseRerank",
    "kvpress": "baselines.kvpress_adapter:KVPress",
}

SUITES: dict[str, str] = {
    "passkey": "evals.tasks.passkey:Passkey",
    "longbench": "evals.tasks.longbench:LongBench",
    "gsm8k": "evals.tasks.gsm8k:GSM8K",
    "ruler": "evals.tasks.ruler:Ruler",
    "longgenbench": "evals.tasks.longgenbench:LongGenBench",
    "latency": "evals.tasks.latency:Latency",
}

__all__ = ["METHODS", "SUITES", "UnknownNameError", "make_cache", "make_method", "method_class", "suite_class"]


def _load(table: dict[str, str], kind: str, name: str):
    if name not in table:
        raise UnknownNameError(f"unknown {kind} '{name}'; valid: {', '.join(sorted(table))}")
    module, cls = table[name].split(":")
    return getattr(importlib.import_module(module), cls)


def method_class(name: str) -> type[KVMethod]:
    return _load(METHODS, "cache method", name)


def suite_class(name: str):
    return _load(SUITES, "eval", name)


def budget_multiple(name: str, hyperparameters: dict) -> int:
    """The multiple of tokens a fractional budget resolves to for method ``name`` (:func:`evals.task.resolve_budget`):
    16 (PQCache's ``compress_ratio`` budgets), or for a method with pages of a fixed size its least common multiple
    with that size, so that a fraction is read as whole pages (ArkVale's 32-token pages: multiples of 32; its
    budget is a whole number of pages, ``page_budgets = budget / page_size``). A page size resolved from the
    budget itself (``icecache_tuned``) leaves 16."""
    size = hyperparameters.get("page_size", next((f.default for f in fields(method_class(name))
                                                  if f.name == "page_size"), None))
    return math.lcm(16, size) if isinstance(size, int) and size > 0 else 16


def method_for_prompt(name: str, budget, n_prompt_tokens: int, **hyperparameters) -> KVMethod:
    """``name`` built at ``budget`` as read for a prompt of ``n_prompt_tokens`` tokens: a fraction resolves to whole
    multiples of :func:`budget_multiple` (:func:`evals.task.resolve_budget`), tokens stay as given."""
    from .task import resolve_budget

    resolved = resolve_budget(budget, n_prompt_tokens, budget_multiple(name, hyperparameters))
    return make_method(name, budget=resolved, **hyperparameters)


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
    """A cache for ``model.generate(..., past_key_values=make_cache("streaming_llm", model, budget=64))``
    (:meth:`icecache.kv.KVCache.for_model` of the named method). One cache serves one sequence."""
    if isinstance(method, str):
        method = make_method(method, budget=budget, **hyperparameters)
    return KVCache.for_model(method, model, profile=profile)
