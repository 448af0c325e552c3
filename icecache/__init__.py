"""IceCache benchmark harness: KV-cache methods behind one interface on transformers.

Quick use::

    from icecache import make_cache
    out = model.generate(**inputs, past_key_values=make_cache("icecache", model, budget=64))
"""
from .kv import KVCache, KVMethod, make_cache, make_method

__all__ = ["KVCache", "KVMethod", "make_cache", "make_method"]
