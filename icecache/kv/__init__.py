"""The common KV-cache interface: method base class, transformers adapters, timing."""
from .attention import attend, causal_attention
from .cache import KVCache
from .base import BudgetError, Fetched, KVMethod, ModelSpec, UnknownNameError
from .state import LayerState

__all__ = ["attend", "causal_attention", "KVCache", "BudgetError", "Fetched", "KVMethod", "LayerState",
           "ModelSpec", "UnknownNameError"]
