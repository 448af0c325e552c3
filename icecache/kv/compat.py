"""Everything that depends on the transformers version lives here (tested range: see pyproject).

transformers 5.4-5.23 call ``past_key_values.update(k, v, layer_idx)`` with no extra arguments, derive
``position_ids`` from ``cache.get_seq_length()`` and build masks through ``get_mask_sizes(query_length,
layer_idx)``; 5.24 renamed the kwarg to ``cache`` (``generation/utils.py`` and ``cache_utils.py`` of the
wheels). The rest of the project
only uses the names exported here.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .base import ModelSpec

ATTN_IMPLEMENTATION = "kvbench"
CACHE_KWARG = "past_key_values"

__all__ = ["ATTN_IMPLEMENTATION", "CACHE_KWARG", "Cache", "CacheLayerMixin", "register_attention",
           "enable_attention", "cache_kwargs", "model_spec", "attention_modules", "rotary_embedding"]


def register_attention(fn: Callable) -> None:
    """Registers ``fn`` under :data:`ATTN_IMPLEMENTATION`. No mask function is registered for that
    name, so transformers passes ``attention_mask=None`` and the function masks causally itself."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, fn)


def enable_attention(model: torch.nn.Module) -> None:
    """Routes every attention layer of ``model`` through the registered cache-aware function."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def cache_kwargs(cache: Cache) -> dict:
    """The keyword under which a forward/generate call takes the cache in this transformers version."""
    return {CACHE_KWARG: cache}


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``self_attn`` module of every decoder layer of ``model``, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def rotary_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's shared rotary-embedding module, or None."""
    return getattr(model.model, "rotary_emb", None)


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """The :class:`~icecache.kv.ModelSpec` of ``model``, read from its config, first attention layer and
    rotary embedding."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = attention_modules(model)[0]
    rotary = rotary_embedding(model)
    return ModelSpec(
        n_layers=cfg.num_hidden_layers, n_q_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        scaling=float(getattr(attn, "scaling", head_dim ** -0.5)),
        max_position=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        device=next(model.parameters()).device, dtype=next(model.parameters()).dtype,
        inv_freq=None if rotary is None else rotary.inv_freq.detach().float().cpu(),
    )
