"""Decode benchmark: methods x context lengths on the same prompt text, one process, printed as ratios
to the full cache. ``python -m evals.bench.decode [--methods ...] [--lengths ...]``.

For each (method, length): TT2T, TTFT, TPOT (median over tokens 3..N, and mean) and the TPOT breakdown
(select / transfer / attention / update / other, seconds per output token), with EOS ignored so every
method decodes the same number of tokens. Writes ``bench_decode.json`` as
``{method: {length: {"tt2t_s", "tpot_s", "breakdown": {...}}}, "environment": {...}}``.

``--model llama-8b-random`` builds a Llama-3.1-8B-shaped model with random weights (latency needs no
trained weights) for GPU machines: see ``scripts/gpu_bench.sh``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see run.py

import argparse  # noqa: E402
import json
import statistics
from pathlib import Path

import torch

from evals.harness import REPO_ROOT, environment
from evals.latency import Latency
from evals.runner import generate
from icecache.kv import make_method
from icecache.models import load_model, load_tokenizer

DEFAULT_METHODS = ("full", "streaming_llm", "icecache", "icecache_reuse", "pqcache", "quest")


def llama_8b_random(device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                      rope_theta=500000.0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def measure(model, tokenizer, method: str, budget: int, prompt_ids: list[int], new_tokens: int) -> dict:
    gen = generate(model, tokenizer, make_method(method, budget=None if method == "full" else budget),
                   prompt_ids, new_tokens, ignore_eos=True)
    n = len(gen.intervals_s)
    return {"tt2t_s": gen.tt2t_s, "ttft_s": gen.ttft_s, "tpot_s": statistics.median(gen.intervals_s),
            "tpot_mean_s": statistics.fmean(gen.intervals_s),
            "breakdown": {p: s / n for p, s in gen.breakdown_s.items()},
            "breakdown_sum_over_tpot": sum(gen.breakdown_s.values()) / sum(gen.intervals_s)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m", help="a model name, or llama-8b-random")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    parser.add_argument("--out", default="bench_decode.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "llama-8b-random":
        model, tokenizer = llama_8b_random(args.device), load_tokenizer("smollm2-135m")
    else:
        model = load_model(args.model, device=args.device)
        tokenizer = load_tokenizer(args.model)
    suite = Latency(tokenizer, lengths=args.lengths, new_tokens=args.new_tokens, data_dir=args.data_dir,
                    max_length=max(args.lengths))
    prompts = {s.meta["length"]: s.prompt_ids for s in suite.samples()}
    results: dict = {}
    for length, ids in prompts.items():
        for method in args.methods:
            results.setdefault(method, {})[str(length)] = row = measure(model, tokenizer, method, args.budget,
                                                                        ids, args.new_tokens)
            print(f"{method:>15} {length:>6}: TT2T {row['tt2t_s']:.3f} s  TPOT {1000 * row['tpot_s']:.2f} ms  " +
                  " ".join(f"{p} {1000 * v:.2f}" for p, v in row["breakdown"].items()), flush=True)
    results["environment"] = {**environment(model), "budget": args.budget, "new_tokens": args.new_tokens,
                              "model": args.model}
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_ratios(results)
    print(f"wrote {args.out}")


def print_ratios(results: dict) -> None:
    if "full" not in results:
        return
    print("\nratio to full (TT2T / TPOT):")
    for method, rows in results.items():
        if method in ("full", "environment"):
            continue
        cells = [f"{L}: {r['tt2t_s'] / results['full'][L]['tt2t_s']:.2f} / {r['tpot_s'] / results['full'][L]['tpot_s']:.2f}"
                 for L, r in rows.items() if L in results["full"]]
        print(f"{method:>15}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
