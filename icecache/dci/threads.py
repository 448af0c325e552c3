"""Threads of the M-DCI index: the numba threading layer and numpy's BLAS threads.

numba layer. IceCache runs parallel numba kernels from two threads at once: the page search
(``_search.search``, decode, main thread) and the tree build (``_build.bulk_load``, the background
prefill pipeline). numba's ``workqueue`` layer is not thread-safe and aborts the process on concurrent
parallel regions ("Terminating: Nested parallel kernel launch detected"); ``omp`` and ``tbb`` are
(numba docs, "The Threading Layers"). :func:`pin_threading_layer` therefore asks numba for its
``threadsafe`` selection when the ``omp`` or ``tbb`` pool can be loaded, and otherwise keeps
``workqueue`` and serialises the parallel kernels behind one lock (:func:`install`). An explicit
``NUMBA_THREADING_LAYER`` is respected (serialised too when it names ``workqueue``).

BLAS. The insert's parent search is one small ``np.matmul`` per step (``[H, 16, d] x [H, d, n1]``); with
OpenBLAS at its default thread count its threads compete with torch's OpenMP pool and the product takes
far longer than on one thread. :func:`one_blas_thread` limits numpy's BLAS to one thread around it
(threadpoolctl; the controller is built once).
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
from contextlib import contextmanager

import numba

POOLS = {"tbb": "numba.np.ufunc.tbbpool", "omp": "numba.np.ufunc.omppool"}
PARALLEL_KERNELS = ("bulk_load", "search")  # the ``parallel=True`` kernels (``_build``, ``_search``)
PARALLEL_LOCK = threading.Lock()
_controller = None


def threadsafe_layers() -> list[str]:
    """The thread-safe numba threading layers whose pool loads on this machine."""
    found = []
    for name, module in POOLS.items():
        try:
            importlib.import_module(module)
        except (ImportError, OSError):
            continue
        found.append(name)
    return found


def pin_threading_layer(available: list[str] | None = None) -> str:
    """Sets ``numba.config.THREADING_LAYER`` before the first parallel launch; returns the layer asked for
    (``"threadsafe"``, or ``"workqueue"`` when no thread-safe pool loads, or the user's choice)."""
    chosen = os.environ.get("NUMBA_THREADING_LAYER")
    if chosen:
        return chosen
    available = threadsafe_layers() if available is None else available
    numba.config.THREADING_LAYER = "threadsafe" if available else "workqueue"
    return numba.config.THREADING_LAYER


def serialised(kernel):
    """``kernel`` run under :data:`PARALLEL_LOCK` (one parallel region at a time)."""
    if getattr(kernel, "_serialised", False):
        return kernel

    @functools.wraps(kernel)
    def locked(*args, **kwargs):
        with PARALLEL_LOCK:
            return kernel(*args, **kwargs)
    locked._serialised = True
    return locked


def install(modules, available: list[str] | None = None) -> str:
    """Pins the layer and, under ``workqueue``, replaces the parallel kernels (:data:`PARALLEL_KERNELS`) of the
    kernel ``modules`` by serialised wrappers (callers reach them as ``<module>.<name>``). Returns the layer
    asked for."""
    layer = pin_threading_layer(available)
    if layer == "workqueue":
        for module in modules:
            for name in PARALLEL_KERNELS:
                if hasattr(module, name):
                    setattr(module, name, serialised(getattr(module, name)))
    return layer


@contextmanager
def one_blas_thread():
    """numpy's BLAS limited to one thread inside the block (threadpoolctl)."""
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController
        _controller = ThreadpoolController().select(user_api="blas")
    with _controller.limit(limits=1):
        yield
