"""The GPU check behind ``scripts/gpu_check.sh`` (see docs/gpu.md), for any CUDA machine: CUDA tests, then
the decode benchmark of ``llama-8b-random`` at 8k/32k/128k for seven methods, within one deadline; writes
``gpu_check.json`` and ``gpu_check.md`` to the output folder and prints the elapsed time of each part.

    python scripts/gpu_check.py [OUT] [--deadline 1200] [--cpu]

The benchmark runs in one worker process (the 16 GB model is built once) that measures the cells in a
fixed priority order, each with a fresh cache, and skips a cell whose planned time (docs/gpu.md, scaled
by how the finished cells compared with their plan) no longer fits before the deadline; the worker
appends each finished cell to a JSONL file, and the parent kills it at the deadline, so whatever was
measured is reported. ``--cpu`` runs the same steps at tiny sizes on the CPU (tiny-llama, 512-2048
tokens, 8 new tokens; the CUDA tests with ``ICECACHE_CUDA_TESTS_DEVICE=cpu``).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("full", "icecache", "icecache_reuse", "quest", "omnikv", "pqcache", "magicpig")
GPU = dict(model="llama-8b-random", lengths=(8192, 32768, 131072), budget=256, new_tokens=64, device="cuda")
CPU = dict(model="tiny-llama", lengths=(512, 1024, 2048), budget=256, new_tokens=8, device="cpu")
# Planned seconds per cell on an H200-class GPU (docs/gpu.md "Time plan": prefill + the background build
# not hidden behind it + 64 x TPOT), from scripts/gpu_plan.py: GPU work from the GPU's published rates, host
# work (index build and search, k-means, hash tables) measured at the 8B layer shape on 2 CPU cores (so
# likely pessimistic for the host-bound methods; the worker rescales by the cells it ran). Only the order
# of the cells and the skip decision use it; on a slower GPU the rescaling absorbs the difference.
PLAN_S = {
    "full": {8192: 2, 32768: 4, 131072: 20},
    "icecache": {8192: 20, 32768: 55, 131072: 190},
    "icecache_reuse": {8192: 9, 32768: 20, 131072: 65},
    "quest": {8192: 4, 32768: 6, 131072: 21},
    "omnikv": {8192: 3, 32768: 5, 131072: 21},
    "pqcache": {8192: 45, 32768: 440, 131072: 4100},
    "magicpig": {8192: 80, 32768: 310, 131072: 1280},
}
TESTS_LIMIT_S = 150  # part (b) never takes more than this (about 90 s on an H200)
REPORT_RESERVE_S = 15  # kept for part (d) and a clean exit


HOST_BOUND = ("icecache", "icecache_reuse", "pqcache", "magicpig")  # their cost is host work (index, k-means, hashing)


def cell_order(lengths, methods=METHODS) -> list[tuple[str, int]]:
    """Priority order: the methods with little host work (and IceCache) at the two shorter lengths,
    PQCache and MagicPIG at the shortest (their k-means / hash tables run on the host and dominate the
    plan), then the longest length (IceCache first), then PQCache and MagicPIG at the longer lengths."""
    lengths = sorted(lengths)
    main = [m for m in METHODS if m not in ("pqcache", "magicpig")]
    costly = ["pqcache", "magicpig"]
    longest = ["full", "icecache", "icecache_reuse", "quest", "omnikv"]
    short, last = lengths[:-1], lengths[-1]
    order = [(m, L) for L in short for m in main] + [(m, short[0]) for m in costly if short]
    order += [(m, last) for m in longest] + [(m, L) for L in (lengths[1:] if short else lengths) for m in costly]
    return [(m, L) for m, L in order if m in methods]


def planned(method: str, length: int, cpu: bool) -> float:
    return 1.0 if cpu else float(PLAN_S[method][length])


# ----------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    """Builds the model once and measures the cells in :func:`cell_order` until ``args.until`` (epoch s)."""
    import torch

    from evals.bench.decode import measure, prompts
    from evals.models import load_model, load_tokenizer

    cfg = CPU if args.cpu else GPU
    if args.cpu:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = Path(args.cells)
    t0 = time.perf_counter()
    model = load_model(cfg["model"], dtype="auto", device=cfg["device"], progress=False)
    tokenizer = load_tokenizer(cfg["model"])
    ns = argparse.Namespace(new_tokens=cfg["new_tokens"], data_dir=str(ROOT.parent / "shared" / "data"))
    ids = prompts(tokenizer, ns, list(cfg["lengths"]))
    param = next(model.parameters())
    env = {"model": cfg["model"], "device": str(param.device), "dtype": str(param.dtype),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else None,
           "torch": torch.__version__, "budget": cfg["budget"], "new_tokens": cfg["new_tokens"],
           "model_start_s": time.perf_counter() - t0}
    with out.open("a") as f:
        f.write(json.dumps({"environment": env}) + "\n")
    print(f"worker: model {cfg['model']} on {env['device']} ({env['dtype']}) ready in {env['model_start_s']:.1f} s",
          flush=True)
    ratios: dict[bool, list[float]] = {True: [], False: []}  # measured / planned, host-bound or not
    lengths = [L for L in cfg["lengths"] if not args.lengths or L in args.lengths]
    for method, length in cell_order(lengths, args.methods or METHODS):
        done = ratios[method in HOST_BOUND]
        scale = min(3.0, max(0.3, sorted(done)[len(done) // 2])) if len(done) >= 2 else 1.0
        need = planned(method, length, args.cpu) * scale
        left = args.until - time.time()
        if need > left:
            row = {"skipped": f"planned {need:.0f} s > {left:.0f} s left before the deadline"}
        else:
            start = time.perf_counter()
            try:
                row = measure(model, tokenizer, method, cfg["budget"], ids[length], cfg["new_tokens"])
            except Exception as err:  # recorded; the next cell still runs
                row = {"error": f"{type(err).__name__}: {err}"}
            row["wall_s"] = time.perf_counter() - start
            ratios[method in HOST_BOUND].append(row["wall_s"] / planned(method, length, args.cpu))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row.update(planned_s=planned(method, length, args.cpu), plan_scale=scale)  # to judge the plan afterwards
        with out.open("a") as f:
            f.write(json.dumps({"method": method, "length": length, **row}) + "\n")
        status = row.get("skipped") or row.get("error") or (
            f"TT2T {row['tt2t_s']:.2f} s  TPOT {1000 * row['tpot_s']:.1f} ms  ({row['wall_s']:.1f} s)")
        print(f"worker: {method:>15} {length:>6}: {status}", flush=True)


# ----------------------------------------------------------------------------------------- parent
def run_part(name: str, cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None) -> dict:
    """Runs ``cmd`` with its output streamed to the console (and ``log``), killed after ``timeout`` s."""
    start = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])} (limit {timeout:.0f} s)", flush=True)
    sink = log.open("w") if log else None

    def pump(stream) -> None:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            if sink:
                sink.write(line)

    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=ROOT)
    except OSError as err:
        rc = f"could not start: {err}"
    else:
        reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "killed at the deadline"
        reader.join(timeout=5)
    if sink:
        sink.close()
    elapsed = time.perf_counter() - start
    print(f"== {name}: {'ok' if rc == 0 else f'exit {rc}' if isinstance(rc, int) else rc} in {elapsed:.1f} s",
          flush=True)
    return {"rc": rc, "elapsed_s": elapsed}


def pytest_summary(log: Path) -> str:
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []
    tail = [ln for ln in lines if " passed" in ln or " failed" in ln or " skipped" in ln or " error" in ln]
    return tail[-1].strip("= ") if tail else (lines[-1] if lines else "no output")


def read_cells(path: Path) -> tuple[dict, dict]:
    env, cells = {}, {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "environment" in row:
                env = row["environment"]
            else:
                cells.setdefault(row.pop("method"), {})[str(row.pop("length"))] = row
    return env, cells


def markdown(report: dict) -> str:
    env, cells = report["environment"], report["cells"]
    lengths = sorted({int(L) for rows in cells.values() for L in rows})
    gib = 2 ** 30
    out = [f"# GPU check: {env.get('model')} on {env.get('gpu') or env.get('device')} ({env.get('dtype')})", "",
           f"budget {env.get('budget')}, {env.get('new_tokens')} new tokens, torch {env.get('torch')}; parts: " +
           ", ".join(f"{k} {v['elapsed_s']:.0f} s" for k, v in report["parts"].items()) +
           f"; CUDA tests: {report['tests']}", "",
           "| method | context | TT2T s | TPOT ms | select | transfer | attention | update | other | "
           "peak GPU GiB | TPOT / full |", "|" + "---|" * 11]
    for method in METHODS:
        for L in lengths:
            row = cells.get(method, {}).get(str(L))
            if row is None:
                continue
            if "tpot_s" not in row:
                why = row.get("skipped") or row.get("error", "")
                out.append(f"| {method} | {L} | {why.strip().splitlines()[-1][:100] if why else ''} |" + " |" * 8)
                continue
            b = row["breakdown"]
            full = cells.get("full", {}).get(str(L), {}).get("tpot_s")
            peak = row.get("peak_memory_bytes")
            phases = " | ".join(f"{1000 * b.get(p, 0.0):.1f}" for p in ("select", "transfer", "attention", "update",
                                                                          "other"))
            ratio = f"{row['tpot_s'] / full:.2f}" if full else "-"
            peak_gib = f"{peak / gib:.1f}" if peak else "-"  # None on a CPU
            out.append(f"| {method} | {L} | {row['tt2t_s']:.2f} | {1000 * row['tpot_s']:.1f} | {phases} | "
                       f"{peak_gib} | {ratio} |")
    out += ["", "Breakdown: ms per output token (CUDA events on a GPU). Paper (Llama-3.1-8B, 36k): IceCache TPOT "
            "0.11 s, 0.06 s with reuse; bandwidth bound ~3.3 ms (16 GB of weights at 4.8 TB/s)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="gpu_check_out")
    parser.add_argument("--deadline", type=float, default=1200.0,
                        help="seconds for everything (default 1200; cells that would not fit are skipped)")
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                        help="the same steps at tiny sizes on the CPU")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="only these methods (e.g. a second run)")
    parser.add_argument("--lengths", nargs="+", type=int, help="only these of the lengths (8192 32768 131072)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--cells", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    begin = time.time()
    until = begin + args.deadline - REPORT_RESERVE_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, dict] = {}
    if "GPU_CHECK_WHEELS_S" in os.environ:  # part (a), timed by gpu_check.sh
        parts["a_wheels"] = {"rc": 0, "elapsed_s": float(os.environ["GPU_CHECK_WHEELS_S"])}

    tests_log = out / "pytest.txt"
    if args.skip_tests:
        tests = "not run (--skip-tests)"
    else:
        env = {"ICECACHE_CUDA_TESTS_DEVICE": "cpu"} if args.cpu else {}
        parts["b_cuda_tests"] = run_part("(b) CUDA tests", [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-m",
                                                            "cuda", "-rfEs", "-p", "no:cacheprovider"],
                                         min(TESTS_LIMIT_S, until - time.time()), env, tests_log)
        tests = pytest_summary(tests_log)

    cells_path = out / "cells.jsonl"
    cells_path.unlink(missing_ok=True)
    parts["c_decode_bench"] = run_part(
        "(c) decode benchmark", [sys.executable, str(Path(__file__).resolve()), "--worker", "--until", str(until),
                                 "--cells", str(cells_path)] + (["--cpu"] if args.cpu else []) +
        (["--methods", *args.methods] if args.methods else []) +
        (["--lengths", *map(str, args.lengths)] if args.lengths else []),
        max(1.0, until - time.time()))

    start = time.perf_counter()
    environment, cells = read_cells(cells_path)
    cfg = CPU if args.cpu else GPU
    if not environment:  # the worker died before its model was ready
        environment = {k: cfg[k] for k in ("model", "device", "budget", "new_tokens")}
        environment["note"] = "the benchmark worker ended before its model was ready (see gpu_check.log)"
    lengths = [L for L in cfg["lengths"] if not args.lengths or L in args.lengths]
    for method, length in cell_order(lengths, args.methods or METHODS):  # cells the deadline cut off
        cells.setdefault(method, {}).setdefault(str(length), {"skipped": "not reached before the deadline"})
    report = {"environment": environment, "tests": tests, "parts": parts, "cells": cells,
              "deadline_s": args.deadline, "dry_run_on_cpu": args.cpu}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    parts["d_report"] = {"rc": 0, "elapsed_s": time.perf_counter() - start}
    report["parts"] = parts
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    cells_path.unlink(missing_ok=True)  # folded into gpu_check.json
    print(markdown(report))
    print("elapsed per part: " + ", ".join(f"{k} {v['elapsed_s']:.1f} s" for k, v in parts.items()) +
          f"; total {time.time() - begin:.1f} s of {args.deadline:.0f} s")
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
