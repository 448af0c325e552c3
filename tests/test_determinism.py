"""Determinism under load: every registered method gives the same outputs for the same seed, and a replayed
prefill decodes as a live one, while other processes keep every CPU core busy.

A method whose decisions read the clock or the machine's idle cores (a time-budgeted k-means, an index build
cut short by a deadline, a background result used only if it is ready in time) passes on a quiet machine and
fails here: under load the timings of two runs differ. The tiny random models of ``tests/helpers.py`` keep
each case to a few seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import BUDGET_64_HP, build_tiny, generate_twice, skip_without_requirement

from baselines import pqcache as pq
from evals.prefill_cache import Prefill, replay_refusal
from evals.registry import METHODS, make_method
from evals.runner import generate

BUDGET = 64  # valid for every method's own constraints (test_reliability.py's SMALL_BUDGET)

# one intra-op thread: on cores that other processes keep busy, a team of spinning OpenMP threads waits for its
# slowest member at every op (minutes instead of seconds); it also leaves cores "idle" for the methods that
# count them (icecache.kv.state.spare_cpu_share), so their background and time-budgeted paths run
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def busy_cores():
    """One CPU-burning process per core for the whole module, ended (by their own ids) when it is done."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)
        assert all(p.poll() is None for p in burners), "a CPU burner did not start"
        yield burners
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()


def method_options(method: str) -> dict:
    return {"budget": None if method == "full" else BUDGET, **BUDGET_64_HP.get(method, {})}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_seed_gives_identical_outputs_under_load(busy_cores, method):
    skip_without_requirement(method)
    model = build_tiny(n_kv_heads=2, n_heads=4, n_layers=8)
    ids = torch.randint(0, 200, (1, 160), generator=torch.Generator().manual_seed(0))
    (seq_a, logits_a), (seq_b, logits_b) = generate_twice(model, ids, method, **method_options(method))
    assert all(p.poll() is None for p in busy_cores), "the load ended before the test did"
    assert torch.equal(seq_a, seq_b) and torch.equal(logits_a, logits_b)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_replayed_prefill_generates_what_a_live_prefill_generates_under_load(busy_cores, method):
    skip_without_requirement(method)
    reason = replay_refusal(make_method(method, **method_options(method)))
    if reason is not None:
        pytest.skip(reason)  # covered by the same-seed test above
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    prefilled = Prefill.capture(model, ids)
    live = generate(model, None, make_method(method, **method_options(method)), ids, 24, ignore_eos=True)
    replayed = generate(model, None, make_method(method, **method_options(method)), ids, 24, ignore_eos=True,
                        prefilled=prefilled)
    assert all(p.poll() is None for p in busy_cores), "the load ended before the test did"
    assert replayed.token_ids == live.token_ids
    assert replayed.effective_tokens == pytest.approx(live.effective_tokens)
    assert replayed.max_resident_tokens == live.max_resident_tokens


def test_pq_kmeans_is_the_same_on_any_thread_count_under_load(busy_cores):
    """PQCache's default bound (300 iterations, tol 1e-4: run to convergence) reads no clock, and its reductions
    give the same bits on 1 and 3 threads: the same codebooks, codes and iterations."""
    keys = torch.randn(6, 3000, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.2, 3, 32)
    method = pq.PQCache(budget=64)
    runs = []
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            stats = {}
            centroids, codes = pq.kmeans(keys, 2 ** method.n_bits, method.kmeans_iters,
                                         torch.Generator().manual_seed(1), tol=method.kmeans_tol, stats=stats)
            runs.append((centroids, codes, stats["iterations"]))
    finally:
        torch.set_num_threads(threads)
    (c1, k1, it1), (c3, k3, it3) = runs
    assert torch.equal(c1, c3) and torch.equal(k1, k3) and torch.equal(it1, it3)
    assert (it1 > 3).all() and (it1 < method.kmeans_iters).all()  # convergence, not the cap, ended every problem
