"""Baseline KV-cache methods, one module each, all implementing :class:`icecache.kv.KVMethod`."""
