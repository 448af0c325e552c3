"""fp32 vs bf16 on this CPU: prefill and decode of SmolLM2-135M (full cache), plus one GEMM, measured
side by side in one process (interleaved repeats, medians), for the ``model.dtype=auto`` CPU choice
(icecache/hardware.py). Prints the CPU model, its native-bf16 flags and the bf16 / fp32 time ratios.

    python -m evals.bench.cpu_dtype [--prompt 1024] [--new-tokens 16] [--repeats 3] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import json
import statistics
import time

import torch

from evals.registry import make_method
from evals.runner import generate
from evals.models import load_model
from icecache import hardware


def gemm_seconds(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    return (time.perf_counter() - start) / reps


def model_seconds(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill = TTFT, median TPOT) of one greedy generation with the full cache."""
    gen = generate(model, None, make_method("full"), prompt, new_tokens, ignore_eos=True)
    return gen.ttft_s, statistics.median(gen.intervals_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {dt: load_model(args.model, dtype=dt) for dt in ("float32", "bfloat16")}
    prompt = [int(t) for t in torch.randint(100, 20000, (args.prompt,), generator=torch.Generator().manual_seed(0))]
    rows = {dt: {"gemm_s": [], "prefill_s": [], "tpot_s": []} for dt in models}
    for _ in range(args.repeats):  # interleaved, so load changes hit both dtypes alike
        for dt, model in models.items():
            rows[dt]["gemm_s"].append(gemm_seconds(getattr(torch, dt)))
            prefill, tpot = model_seconds(model, prompt, args.new_tokens)
            rows[dt]["prefill_s"].append(prefill)
            rows[dt]["tpot_s"].append(tpot)
    med = {dt: {k: statistics.median(v) for k, v in r.items()} for dt, r in rows.items()}
    ratio = {k: med["bfloat16"][k] / med["float32"][k] for k in med["float32"]}
    out = {"choice": hardware.dtype_choice(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "load_average": os.getloadavg(),
           "prompt": args.prompt, "new_tokens": args.new_tokens, "median": med, "bf16_over_fp32": ratio}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
