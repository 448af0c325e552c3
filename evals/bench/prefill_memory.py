"""Peak resident memory of a long prefill, one fresh process per (method, length):
``python -m evals.bench.prefill_memory --methods full icecache --lengths 8192 16384 32768``.

Each child loads the model, prefills ``length`` tokens of natural text, decodes two tokens (so background
index builds finish) and reports the process's peak RSS (``ru_maxrss``) and the prefill time.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(method: str, length: int, budget: int, model_name: str) -> dict:
    import torch

    from evals.harness import REPO_ROOT
    from evals.latency import Latency
    from evals.runner import generate
    from icecache.kv import make_method
    from icecache.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name)
    prompt = next(Latency(tokenizer, lengths=[length], new_tokens=3, max_length=length,
                          data_dir=REPO_ROOT.parent / "shared" / "data").samples()).prompt_ids
    start = time.perf_counter()
    gen = generate(model, tokenizer, make_method(method, budget=None if method == "full" else budget), prompt, 3,
                   ignore_eos=True)
    return {"method": method, "length": length, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "ttft_s": gen.ttft_s, "tt2t_s": gen.tt2t_s, "wall_s": time.perf_counter() - start,
            "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["full", "icecache"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LENGTH"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.budget, args.model)))
        return
    for length in args.lengths:
        for method in args.methods:
            out = subprocess.run([sys.executable, "-m", "evals.bench.prefill_memory", "--child", method, str(length),
                                  "--budget", str(args.budget), "--model", args.model],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{method:>10} {length:>6} tokens: peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB, "
                  f"TTFT {row['ttft_s']:.1f} s, TT2T {row['tt2t_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
