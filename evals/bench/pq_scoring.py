"""PQCache's decode selection, scored by tuples of codes against scored token by token, side by side.

    python -m evals.bench.pq_scoring --lengths 4096 32768 --threads 2

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64) with the official codebooks (2
sub-vectors x 64 centroids), random codes over ``length`` candidates and random queries: the median time of
:meth:`baselines.pqcache.PQCache.select` (``joint_scores=True``, the default, against ``False``), the ratio, and
whether both picked tokens of the same per-token score (they differ only in ties and rounding). The growth of
each from the first to the last length is the part of PQCache's TPOT that grows with the context, per layer.
Each printed row names the code and both configurations it timed (``commit``, ``dirty``, ``method_configs``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from baselines.pqcache import PQCache, PQState, group_probs, joint_code_ids, lookup_scores
from evals.output.results import git_state, method_record
from icecache.kv import ModelSpec

SMOLLM2 = dict(n_layers=1, n_q_heads=9, n_kv_heads=3, head_dim=64, scaling=64 ** -0.5, max_position=1 << 20)


def layer_state(method: PQCache, spec: ModelSpec, length: int, generator: torch.Generator) -> PQState:
    """A decoding layer of a model of ``spec`` with ``length`` coded candidates between its sinks and its recent
    window: a prefill of zero K/V (its k-means stops at the first iteration), then random codebooks and codes."""
    c = 2 ** method.n_bits
    resident = method.n_sink + method.recent
    st = method.new_sequence(method.bind(spec)).layers[0]
    zeros = torch.zeros(spec.n_kv_heads, length + resident, spec.head_dim)
    method.fill(st, zeros, zeros)
    method.await_background(st)
    st.centroids = torch.randn(spec.n_kv_heads, method.n_subvec, c, spec.head_dim // method.n_subvec,
                               generator=generator)
    st.codes = torch.randint(0, c, (spec.n_kv_heads, length, method.n_subvec), generator=generator)
    st.code_ids = joint_code_ids(st.codes, c)
    return st


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(length: int, budget: int, repeats: int, seed: int = 0) -> dict:
    """Times of both selections on one layer state, and whether they retrieved the same score mass."""
    generator = torch.Generator().manual_seed(seed)
    joint, per_token = PQCache(budget=budget), PQCache(budget=budget, joint_scores=False)
    st = layer_state(joint, ModelSpec(**SMOLLM2), length, generator)
    q = torch.randn(SMOLLM2["n_q_heads"], 1, SMOLLM2["head_dim"], generator=generator) * 2
    ms_joint = median_ms(lambda: joint.select(st, q), repeats)
    ms_token = median_ms(lambda: per_token.select(st, q), repeats)
    scores = group_probs(lookup_scores(q[:, 0], st.centroids, st.codes), st.spec.scaling, st.spec.n_kv_heads)
    mass = [scores.gather(1, m.select(st, q) - m.n_sink).sum().item() for m in (joint, per_token)]
    return {"length": length, "joint_ms": round(ms_joint, 4), "per_token_ms": round(ms_token, 4),
            "joint_over_per_token": round(ms_joint / ms_token, 3),
            "same_selected_mass": abs(mass[0] - mass[1]) <= 1e-5 * max(mass), **git_state(),
            "method_configs": {"joint": method_record(joint, "pqcache"), "per_token": method_record(per_token, "pqcache")}}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [compare(n, args.budget, args.repeats) for n in args.lengths]
    for row in rows:
        print(json.dumps(row))
    first, last = rows[0], rows[-1]
    print(json.dumps({"growth_ms_per_layer": {
        "joint": round(last["joint_ms"] - first["joint_ms"], 4),
        "per_token": round(last["per_token_ms"] - first["per_token_ms"], 4)}}))
    return rows


if __name__ == "__main__":
    main()
