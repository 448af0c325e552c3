"""The common KV-cache interface: method base class, transformers adapters, timing, registry."""
from .attention import attend, causal_attention
from .cache import KVCache
from .method import BudgetError, Fetched, KVMethod, LayerState, ModelSpec
from .registry import METHODS, UnknownNameError, make_cache, make_method, method_class

__all__ = ["attend", "causal_attention", "KVCache", "BudgetError", "Fetched", "KVMethod", "LayerState",
           "ModelSpec", "METHODS", "UnknownNameError", "make_cache", "make_method", "method_class"]
