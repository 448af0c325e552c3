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

ATTN_IMPLEMENTATION = "kvbench"
CACHE_KWARG = "past_key_values"

__all__ = ["ATTN_IMPLEMENTATION", "CACHE_KWARG", "Cache", "CacheLayerMixin", "register_attention",
           "enable_attention", "cache_kwargs"]


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
