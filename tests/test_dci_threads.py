"""The numba threading layer and BLAS threads of the M-DCI index (icecache/dci/threads.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from icecache.dci import threads

ROOT = Path(__file__).resolve().parents[1]

# The search (main thread) and a tree build (background thread) run parallel kernels at the same time,
# as in IceCache's pipelined prefill; prints the threading layer numba used.
CONCURRENT = """
import sys, threading, torch, numba
import icecache.dci as dci
from icecache.dci import threads
if sys.argv[1] == "no-threadsafe":
    assert threads.install((dci._build, dci._search), available=[]) == "workqueue"
numba.set_num_threads(2)
keys = torch.randn(2, 3000, 32)
index = dci.MDCIIndex.build(keys, torch.arange(3000), dci.DCIConfig())
errors = []
def builds():
    try:
        for _ in range(6):
            dci.MDCIIndex.build(keys, torch.arange(3000), dci.DCIConfig())
    except Exception as err:
        errors.append(err)
worker = threading.Thread(target=builds)
worker.start()
while worker.is_alive():
    index.search(torch.randn(4, 32), 4)
worker.join()
assert not errors, errors
print("layer", numba.threading_layer())
"""


def run_concurrent(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    return subprocess.run([sys.executable, "-c", CONCURRENT, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(not threads.threadsafe_layers(), reason="no thread-safe numba layer (omp/tbb) loads here")
def test_concurrent_search_and_build_run_on_a_threadsafe_layer():
    out = run_concurrent("default")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] in threads.threadsafe_layers()


def test_without_a_threadsafe_layer_the_parallel_kernels_are_serialised():
    """workqueue aborts on concurrent parallel regions; serialised behind the lock the run completes."""
    out = run_concurrent("no-threadsafe")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "workqueue"


def test_serialised_kernels_hold_the_lock():
    seen = []
    locked = threads.serialised(lambda: seen.append(threads.PARALLEL_LOCK.locked()))
    locked()
    assert seen == [True] and threads.serialised(locked) is locked


def test_one_blas_thread_limits_numpy_blas_inside_the_block_only():
    from threadpoolctl import threadpool_info

    def blas_threads():
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    before = blas_threads()
    if not before:
        pytest.skip("numpy exposes no BLAS library to threadpoolctl here")
    with threads.one_blas_thread():
        assert blas_threads() == [1] * len(before)
        np.matmul(np.ones((2, 3, 4), np.float32), np.ones((2, 4, 5), np.float32))
    assert blas_threads() == before
