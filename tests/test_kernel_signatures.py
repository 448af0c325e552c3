"""Every numba kernel of the library takes at most eight parameters: what a kernel needs beyond that travels
bundled (the index's storage, ``intrinsics.Pages``/``Nodes``/``Tokens``; the search's scalars, query heads,
rankings and outputs, ``_search``/``_level0``; the points to lay out or insert, ``_build``/``_insert``, as tuples
the kernel unpacks by name), so a call site names what it passes instead of lining up a dozen positional arrays."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

from numba.core.registry import CPUDispatcher

import icecache

MAX_PARAMETERS = 8


def kernels() -> dict[str, CPUDispatcher]:
    """Every numba dispatcher (``@njit``/``@jit``) an ``icecache`` module holds, by its defining module and name;
    a kernel wrapped by ``functools.wraps`` (``dci.threads.serialised``) counts through its ``__wrapped__``."""
    found = {}
    for info in pkgutil.walk_packages(icecache.__path__, "icecache."):
        for obj in vars(importlib.import_module(info.name)).values():
            if not isinstance(obj, CPUDispatcher):
                obj = getattr(obj, "__wrapped__", None)
            if isinstance(obj, CPUDispatcher):
                found[f"{obj.py_func.__module__}.{obj.py_func.__qualname__}"] = obj
    return found


def test_the_walk_finds_the_kernels():
    names = kernels()
    for name in ("icecache.dci._search.search", "icecache.dci._level0.level0", "icecache.dci._level0.rank_top_children",
                 "icecache.dci._insert.insert", "icecache.dci._build.bulk_load", "icecache.resident._load_host"):
        assert name in names


def test_no_kernel_takes_more_than_eight_parameters():
    counts = {name: len(inspect.signature(k.py_func).parameters) for name, k in kernels().items()}
    too_many = {name: n for name, n in sorted(counts.items()) if n > MAX_PARAMETERS}
    assert not too_many, f"kernels with more than {MAX_PARAMETERS} parameters: {too_many}"
