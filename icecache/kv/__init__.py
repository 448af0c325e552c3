"""The common KV-cache interface: the method base class (:mod:`.base`), the transformers cache (:mod:`.cache`)
and its per-sequence state (:mod:`.state`), the storage mechanics methods share (:mod:`.storage`), the
transformers adapters (:mod:`.compat`), attention (:mod:`.attention`), timing and the recall probe."""
from .attention import attend, causal_attention
from .base import Bound, BudgetError, Fetched, KVMethod, ModelSpec, UnknownNameError
from .cache import KVCache
from .state import LayerState, SequenceState

__all__ = ["attend", "causal_attention", "KVCache", "Bound", "BudgetError", "Fetched", "KVMethod", "LayerState",
           "ModelSpec", "SequenceState", "UnknownNameError"]
