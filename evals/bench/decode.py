"""Decode benchmark: methods x context lengths on the same prompt text, one process, printed as ratios
to the full cache. ``python -m evals.bench.decode [--methods ...] [--lengths ...]``.

For each (method, length): TT2T, TTFT, TPOT (median over tokens 3..N, and mean) and the TPOT breakdown
(select / transfer / attention / update / other, seconds per output token), with EOS ignored so every
method decodes the same number of tokens. Writes ``bench_decode.json`` as
``{method: {length: {"tt2t_s", "tpot_s", "breakdown": {...}}}, "environment": {...}}``.

``--isolate`` runs every (method, length) cell in a fresh process and adds its peak resident memory
(``peak_rss_bytes``, the process's ``ru_maxrss``: model + prefill + decode), which is how the prefill
memory bound of a method is measured (``--methods full icecache --lengths 8192 16384 32768``).
The file is rewritten after every cell; ``--resume`` keeps the cells already in ``--out`` (same model,
budget and number of new tokens) and measures only the missing ones, so a long run can be extended.

``--model llama-8b-random`` builds a Llama-3.1-8B-shaped model with random weights (latency needs no
trained weights) for GPU machines: see ``scripts/gpu_bench.sh``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see run.py

import argparse  # noqa: E402
import json
import resource
import statistics
import subprocess
import sys
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


def parse_args(argv):
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
    parser.add_argument("--isolate", action="store_true", help="one fresh process per cell, with its peak RSS")
    parser.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    parser.add_argument("--cell", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "llama-8b-random":
        return llama_8b_random(args.device), load_tokenizer("smollm2-135m")
    return load_model(args.model, device=args.device), load_tokenizer(args.model)


def prompts(tokenizer, args, lengths) -> dict[int, list[int]]:
    """The same natural text cut to each length (evals.latency)."""
    suite = Latency(tokenizer, lengths=lengths, new_tokens=args.new_tokens, data_dir=args.data_dir,
                    max_length=max(lengths))
    return {s.meta["length"]: s.prompt_ids for s in suite.samples()}


def run_cell(args) -> None:
    """Child of ``--isolate``: one (method, length) in this fresh process; prints its row as JSON."""
    method, length = args.cell[0], int(args.cell[1])
    model, tokenizer = load(args)
    row = measure(model, tokenizer, method, args.budget, prompts(tokenizer, args, [length])[length], args.new_tokens)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row["environment"] = {**environment(model), "model": args.model}
    print(json.dumps(row))


def isolated_cell(args, method: str, length: int) -> dict:
    cmd = [sys.executable, "-m", "evals.bench.decode", "--cell", method, str(length), "--budget", str(args.budget),
           "--new-tokens", str(args.new_tokens), "--model", args.model, "--device", args.device,
           "--data-dir", args.data_dir] + (["--threads", str(args.threads)] if args.threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{method} at {length} tokens failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def previous_results(args) -> dict:
    """Cells already in ``--out`` when ``--resume`` is given and the settings match, else nothing."""
    path = Path(args.out)
    if not (args.resume and path.exists()):
        return {}
    old = json.loads(path.read_text())
    env = old.get("environment", {})
    if (env.get("model"), env.get("budget"), env.get("new_tokens")) != (args.model, args.budget, args.new_tokens):
        raise SystemExit(f"--resume: {path} holds model={env.get('model')} budget={env.get('budget')} "
                         f"new_tokens={env.get('new_tokens')}; pass the same settings or another --out")
    return old


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cell:
        return run_cell(args)
    results = previous_results(args)
    environment_row = results.pop("environment", {})
    model = tokenizer = ids_by_length = None
    if not args.isolate:
        model, tokenizer = load(args)
        ids_by_length = prompts(tokenizer, args, args.lengths)
        environment_row = environment(model)
    for length in args.lengths:
        for method in args.methods:
            if str(length) in results.get(method, {}):
                continue
            if args.isolate:
                row = isolated_cell(args, method, length)
                environment_row = row.pop("environment")
            else:
                row = measure(model, tokenizer, method, args.budget, ids_by_length[length], args.new_tokens)
            results.setdefault(method, {})[str(length)] = row
            rss = f"  peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB" if "peak_rss_bytes" in row else ""
            print(f"{method:>15} {length:>6}: TT2T {row['tt2t_s']:.3f} s  TPOT {1000 * row['tpot_s']:.2f} ms  " +
                  " ".join(f"{p} {1000 * v:.2f}" for p, v in row["breakdown"].items()) + rss, flush=True)
            write(args, results, environment_row)
    print_ratios(results)
    print(f"wrote {args.out}")


def write(args, results: dict, environment_row: dict) -> None:
    env = {**environment_row, "budget": args.budget, "new_tokens": args.new_tokens, "model": args.model,
           "isolate": args.isolate}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps({**results, "environment": env}, indent=2) + "\n")
    tmp.replace(args.out)


def print_ratios(results: dict) -> None:
    if "full" not in results:
        return
    print("\nratio to full (TT2T / TPOT):")
    for method, rows in results.items():
        if method in ("full", "environment"):
            continue
        full = results["full"]
        cells = [f"{L}: {r['tt2t_s'] / full[L]['tt2t_s']:.2f} / {r['tpot_s'] / full[L]['tpot_s']:.2f}"
                 for L, r in rows.items() if L in full]
        print(f"{method:>15}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
