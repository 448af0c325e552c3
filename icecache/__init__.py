"""IceCache benchmark harness, the library: the KV-cache interface every method implements (:mod:`icecache.kv`:
the method base class, the cache and its per-sequence state, the shared storage mechanics, the transformers
adapters) and IceCache itself (:mod:`icecache.method`, its variants :mod:`icecache.reuse` and
:mod:`icecache.tuned`, its M-DCI index :mod:`icecache.dci`, its resident buffer :mod:`icecache.resident` and
offload store :mod:`icecache.offload`). It imports nothing from ``baselines`` or ``evals``.

Quick use::

    from icecache import KVCache
    from icecache.method import IceCache
    out = model.generate(**inputs, past_key_values=KVCache.for_model(IceCache(budget=128), model))

By name (any method, baselines included): ``from evals.registry import make_cache``.
"""
from .kernel_cache import use_versioned_cache

use_versioned_cache()  # before any kernel module is imported: the cache folder follows the kernels' source

from .kv import KVCache, KVMethod  # noqa: E402

__all__ = ["KVCache", "KVMethod"]
