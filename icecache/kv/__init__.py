"""The common KV-cache interface: method base class, transformers adapters, timing."""
from .attention import attend, causal_attention
from .cache import KVCache
from .method import BudgetError, Fetched, KVMethod, LayerState, ModelSpec, UnknownNameError

__all__ = ["attend", "causal_attention", "KVCache", "BudgetError", "Fetched", "KVMethod", "LayerState",
           "ModelSpec", "UnknownNameError"]
