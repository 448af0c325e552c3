"""The time plan of ``scripts/gpu_check.sh`` on a given GPU, from pieces measured on this CPU.

The check decodes ``llama-8b-random`` (Llama-3.1-8B's shape) at 8k/32k/128k for seven methods. What runs
on the GPU is estimated from the GPU's rates (``--tflops`` bf16 GEMM, ``--bandwidth`` device memory; the
defaults are an H200's, ~790 TFLOP/s and ~4.3 TB/s) at a stated efficiency; what runs on the host CPU --
the M-DCI index build and search (IceCache), the k-means (PQCache) and the hash tables and sampled
attention (MagicPIG) -- is *measured here* at the 8B layer shape (8 KV heads, 32 query heads, head_dim
128) at two sizes, extrapolated in the context length with the exponent measured between them, and
divided by ``--cpu-speedup`` (how much faster the GPU machine's host cores are than this machine's). The
per-layer Python dispatch of each method's decode step is measured on the tiny model here and counted for
32 layers.

    python scripts/gpu_plan.py [--sizes 2048 8192] [--cpu-speedup 3] [--tflops 790] [--bandwidth 4.3]
                               [--out gpu_plan.json]

Prints one row per (method, length): prefill, background build (the part not hidden behind the
prefill), TPOT, and the cell's seconds for 64 tokens; writes them as JSON for ``scripts/gpu_check.py``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals.registry import make_method  # noqa: E402
from icecache.kv import ModelSpec  # noqa: E402

METHODS = ("full", "icecache", "icecache_reuse", "pqcache", "omnikv", "magicpig", "quest")
LENGTHS = (8192, 32768, 131072)
# Llama-3.1-8B
N_LAYERS, H_Q, H_KV, D, HIDDEN, PARAMS = 32, 32, 8, 128, 4096, 8.03e9
WEIGHT_BYTES = 2 * PARAMS  # bf16
# default GPU rates (an H200): bf16 GEMM 790 TFLOP/s, device memory ~4.3 TB/s; --tflops / --bandwidth
GEMM_FLOPS, HBM_BYTES_S = 790e12, 4.3e12
PREFILL_EFFICIENCY, DECODE_EFFICIENCY = 0.5, 0.7
PCIE_BYTES_S = 25e9  # pinned host -> device, Gen5 x16 in practice
PROCESS_START_S = 20.0  # python + torch + CUDA context + building the 8B random weights on the GPU


def timed(fn, reps: int = 3) -> float:
    fn()  # warm (numba compiles, allocator)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def spec() -> ModelSpec:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    return ModelSpec(n_layers=N_LAYERS, n_q_heads=H_Q, n_kv_heads=H_KV, head_dim=D, scaling=D ** -0.5,
                     max_position=131072, inv_freq=inv_freq)


def cpu_pieces(n: int) -> dict[str, dict[str, float]]:
    """Host seconds per layer at ``n`` keys: ``build`` (background, once per prefill) and ``step`` (per
    decode step), for the methods with host-side work."""
    from baselines.magicpig import PigState
    from baselines.pqcache import kmeans, split_subvectors
    from icecache.dci import MDCIIndex

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(H_KV, n, D, generator=g)
    q = torch.randn(H_Q, D, generator=g)
    out: dict[str, dict[str, float]] = {}

    ice = make_method("icecache", budget=256)
    ice.bind(spec())
    cfg, k_pages = ice.dci_config(), ice.layout()[2]
    index = MDCIIndex.build(keys, torch.arange(n), cfg)
    build = timed(lambda: MDCIIndex.build(keys, torch.arange(n), cfg), reps=1)
    search = timed(lambda: index.search_scored(q, k_pages, k_pages, n_seq=n), reps=5)
    pos = [n]

    def insert():
        index.insert(torch.randn(H_KV, ice.page_size, D, generator=g), torch.arange(pos[0], pos[0] + ice.page_size))
        pos[0] += ice.page_size
    out["icecache"] = {"build": build, "step": search + timed(insert, reps=3) / ice.page_size}

    pq = make_method("pqcache", budget=256)
    sub = split_subvectors(keys, pq.n_subvec).reshape(H_KV * pq.n_subvec, n, -1)
    out["pqcache"] = {"build": timed(lambda: kmeans(sub, 2 ** pq.n_bits, pq.kmeans_iters or pq.ADAPTIVE_ITERS[1],
                                                    torch.Generator().manual_seed(0), tol=pq.kmeans_tol), reps=1), "step": 0.0}

    pig = make_method("magicpig", budget=256)
    pig.bind(spec())
    st = PigState(2)
    st.store_k, st.store_v, st.calib_q = keys, torch.randn(H_KV, n, D, generator=g), q
    st.k = st.v = torch.randn(H_KV, pig.n_sink + pig.local, D, generator=g)
    build = timed(lambda: pig.build_index(st), reps=1)
    q1 = q[:, None]

    def pig_step():
        fetched = pig.fetch(st, pig.select(st, q1))
        pig.sampled_attention(st, q1, fetched)
    out["magicpig"] = {"build": build, "step": timed(pig_step, reps=3)}
    return out


def dispatch_per_layer(budget: int = 256, prompt: int = 600, new: int = 12) -> dict[str, float]:
    """Seconds per layer per decode step of each method on the tiny model here (4 layers, tiny tensors):
    the Python/torch dispatch that a 32-layer model pays 32 times per token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from evals.runner import generate
    from evals.models import load_model

    model = load_model("tiny-llama", dtype="float32", device="cpu")
    ids = torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for m in METHODS:
        gen = generate(model, None, make_method(m, budget=None if m == "full" else budget), ids, new, ignore_eos=True)
        out[m] = statistics.median(gen.intervals_s) / model.config.num_hidden_layers
    return out


def layer_counts() -> dict[str, dict[str, int]]:
    """Per method over Llama-8B's 32 layers: budgeted layers and the layers that build/search an index."""
    counts = {}
    for m in METHODS:
        method = make_method(m, budget=None if m == "full" else 256)
        method.bind(spec())
        budgeted = [i for i in range(N_LAYERS) if method.is_budgeted(i)] if m != "full" else []
        builds = [i for i in budgeted if getattr(method, "builds_index", lambda i: True)(i)]
        counts[m] = {"budgeted": len(budgeted), "index_layers": len(builds)}
    return counts


def extrapolate(sizes: list[int], values: list[float], n: int, lowest: float = 1.0) -> float:
    """Power law through the two measured points (exponent clamped to [lowest, 2]: builds are at least
    linear in the keys, a tree search may be sublinear)."""
    (n0, n1), (v0, v1) = sizes[-2:], values[-2:]
    exponent = min(2.0, max(lowest, math.log(max(v1, 1e-9) / max(v0, 1e-9)) / math.log(n1 / n0)))
    return v1 * (n / n1) ** exponent


def plan(pieces: dict[int, dict], dispatch: dict[str, float], counts: dict, cpu_speedup: float,
         new_tokens: int = 64, budget: int = 256, gemm_flops: float = GEMM_FLOPS,
         hbm_bytes_s: float = HBM_BYTES_S) -> dict:
    sizes = sorted(pieces)
    rows = {}
    for m in METHODS:
        for L in LENGTHS:
            flops = 2 * (PARAMS - 128256 * HIDDEN) * L + 2 * L * L * N_LAYERS * H_Q * D  # causal: 4 L^2/2
            prefill = flops / (gemm_flops * PREFILL_EFFICIENCY)
            kv_bytes = L * N_LAYERS * H_KV * D * 2 * 2
            c = counts[m]
            dense = N_LAYERS - c["budgeted"]
            resident = (dense * L + c["budgeted"] * budget) * H_KV * D * 2 * 2
            read = WEIGHT_BYTES + (kv_bytes if m == "full" else resident)
            host = 0.0
            build = 0.0
            if m in ("icecache", "icecache_reuse"):
                p = {n: pieces[n]["icecache"] for n in sizes}
                build = extrapolate(sizes, [p[n]["build"] for n in sizes], L) * c["index_layers"] / cpu_speedup
                host = extrapolate(sizes, [p[n]["step"] for n in sizes], L, lowest=0.5) * c["index_layers"]
                host += c["budgeted"] * budget * H_KV * D * 2 * 2 / PCIE_BYTES_S  # worst case: every page reloaded
            elif m in ("pqcache", "magicpig"):
                p = {n: pieces[n][m] for n in sizes}
                build = extrapolate(sizes, [p[n]["build"] for n in sizes], L) * c["budgeted"] / cpu_speedup
                host = extrapolate(sizes, [p[n]["step"] for n in sizes], L) * c["budgeted"] / cpu_speedup
            elif m == "omnikv":
                host = c["budgeted"] * budget * H_KV * D * 2 * 2 / PCIE_BYTES_S
            tpot = read / (hbm_bytes_s * DECODE_EFFICIENCY) + host + dispatch[m] * N_LAYERS
            ttft = max(prefill, build) + prefill * 0.1  # the build overlaps the prefill; the rest shows in TT2T
            rows.setdefault(m, {})[str(L)] = {"prefill_s": prefill, "background_build_s": build,
                                              "tpot_s": tpot, "cell_s": ttft + new_tokens * tpot}
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs=2, type=int, default=[2048, 8192])
    parser.add_argument("--cpu-speedup", type=float, default=3.0,
                        help="host work on the GPU machine's cores vs this machine's (default 3)")
    parser.add_argument("--tflops", type=float, default=GEMM_FLOPS / 1e12, help="the GPU's bf16 GEMM TFLOP/s")
    parser.add_argument("--bandwidth", type=float, default=HBM_BYTES_S / 1e12,
                        help="the GPU's device-memory bandwidth in TB/s")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="gpu_plan.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pieces = {n: cpu_pieces(n) for n in args.sizes}
    dispatch = dispatch_per_layer()
    counts = layer_counts()
    rows = plan(pieces, dispatch, counts, args.cpu_speedup, gemm_flops=args.tflops * 1e12,
                hbm_bytes_s=args.bandwidth * 1e12)
    print("host pieces per layer here (s):", json.dumps({n: {m: {k: round(v, 4) for k, v in d.items()}
                                                             for m, d in p.items()} for n, p in pieces.items()}))
    print("dispatch per layer per step here (ms):", {m: round(1000 * v, 3) for m, v in dispatch.items()})
    print("layers:", counts)
    print(f"\n{'method':>15} {'length':>7} {'prefill s':>9} {'build s':>8} {'TPOT ms':>8} {'cell s':>7}")
    total = 0.0
    for m, by_len in rows.items():
        for L, r in by_len.items():
            total += r["cell_s"]
            print(f"{m:>15} {L:>7} {r['prefill_s']:9.2f} {r['background_build_s']:8.2f} {1000 * r['tpot_s']:8.1f} "
                  f"{r['cell_s']:7.1f}")
    print(f"\ncells: {total:.0f} s, plus the model's start ({PROCESS_START_S:.0f} s); measured here in "
          f"{time.perf_counter() - t0:.0f} s at load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    Path(args.out).write_text(json.dumps({"cells": rows, "process_start_s": PROCESS_START_S,
                                          "load_average": os.getloadavg()[0],
                                          "pieces": {str(n): p for n, p in pieces.items()}, "dispatch_s": dispatch,
                                          "layers": counts, "cpu_speedup": args.cpu_speedup}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
