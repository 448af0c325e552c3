"""Decode benchmark: every method x context lengths on the same prompt text, printed as TPOT side by
side, its growth with the context, and ratios to the full cache. ``python -m evals.bench.decode
[--methods ...] [--lengths ...]`` (defaults: all registered methods, 2k..32k tokens, budget 256).

Configurations (:mod:`evals.bench.method_options`): ``--methods`` takes ``name:key=value,...`` (values typed as the
dataclass field); each method runs at ``--suite``'s official setting (``conf/suite_cache/<suite>_<name>.yaml``,
LongBench by default; ``--suite none``: the class defaults) with the command line's options on top, its rows keyed
by its label (the name, plus the command line's options in brackets). ``--equal-dense N`` adds a row set in which
every budgeted method keeps its first ``N`` layers dense (labels ``<name>[dense=N]``; a method already on those
terms serves with its default row; OmniKV, and for ``N > 0`` the methods without a dense-layer option, cannot be
put on them and are listed with why). ``configurations`` records per label the options, which came from the
suite file (with their official sources) and which from the command line, the row sets and each set's TPOT /
full by length, also printed side by side at the end.

For each (method, length): TT2T, TTFT, TPOT over tokens 3..N (``tpot_s`` the mean, as in every
``timing.json``; ``tpot_p50_s`` the median, which the printed table and the summary use because one
stalled step on a shared machine moves the mean; :func:`evals.output.timing.tpot_stats`) and the TPOT breakdown
(select / transfer / attention / update / other, seconds per output token), with EOS ignored so every
method decodes the same number of tokens. The summary gives, per method, TPOT at every length and its
growth from ``--growth-from`` to ``--growth-to`` (4k -> 32k): the context-growing part of TPOT in
milliseconds and as a ratio (on the median TPOT), split by phase (per-token means: which phase grows
with the context; ``other`` = step time outside the cache's phases: MLPs, projections, LM head). Writes
``bench_decode.json`` as ``{method: {length: {"tt2t_s", "tpot_s", "tpot_p50_s", "breakdown": {...}}}, "summary": {...},
"environment": {...}}``. Every cell names the code and configuration it measured (:func:`evals.output.results.row_provenance`:
``commit``, ``dirty`` and ``method_config``, every init field of the method as constructed, presets resolved), as
cells of one file may come from several commits (``--resume``); ``environment`` names the writing process's.

``--prefill-cache DIR`` replays each length's exact prefill (:mod:`evals.prefill_cache`; the first cell of a length
captures it) instead of running the prompt's forward pass in every cell: TPOT and its phases are what a live prefill
gives (the method ingests the same K/V), while TTFT and TT2T keep only the method's ingest (index build, k-means,
hashing), so their tables leave them out (``environment.prefill``: ``replayed``). It makes 32k-token cells of
several methods and repeats affordable on a CPU.

Every (method, length) cell runs in a fresh process by default (``--in-process`` to share one), so no
cell inherits another's allocator state, threads or caches (the numba kernels are compiled once before the
first cell, :func:`warm_jit`, so no cell's TT2T includes a compilation; and each cell first runs one untimed
short generation with its method, :func:`warm_cell`, so its TT2T is a request's, not the process's first, which
loads the numba kernels from the disk cache), and each records its peak memory
(``peak_rss_bytes``, the process's ``ru_maxrss``: model + prefill + decode; on CUDA also
``peak_memory_bytes``, max allocated), which is how the prefill memory bound of a method is measured, and its KV
memory by place after the last step (``device_kv_bytes``, what a GPU holds; ``host_kv_bytes``; ``index_bytes``).
A cell that fails is recorded with its error and the run goes on. The file is rewritten after every
cell; ``--resume`` keeps the finished cells of ``--out`` (same model, budget and number of new tokens)
and measures the missing or failed ones, so a long run can be extended.

``--repeats N`` measures every cell ``N`` times, in rounds (round ``r`` runs every length and method once before
round ``r + 1`` starts), so the cells that are compared run minutes, not a whole run, apart; a cell's row is then
the median of its repeats for each timing and each phase (the phases' medians need not sum to the median TPOT)
and its peak memory the maximum, with every repeat kept under ``runs``. On a shared machine whose speed drifts
(docs/benchmarks.md, "Threads and OpenMP waiting") one cell per method cannot separate small effects.

OpenMP waiting (``--omp-wait``, CPU; recorded per cell as ``omp_wait``): ``spin`` (default) is libgomp's own
default, idle threads spin ~300k iterations before they sleep (``GOMP_SPINCOUNT=300000``, set explicitly so an
inherited ``OMP_WAIT_POLICY`` does not change it); ``passive`` makes them sleep at once, so every parallel region
pays a thread wake-up (docs/benchmarks.md, "Threads and OpenMP waiting"); ``active`` never sleeps. Every method
runs under the same rule. A method's background worker exits once its last job is awaited
(``KVMethod.await_background``): a live worker's OpenMP team beside the main one makes libgomp count more threads
than cores and cut every team's spin to 1000 iterations.

Floor (:mod:`evals.bench.floor`): every cell also gets ``floor_s``, the TPOT its method would have if selecting,
moving and updating keys were free: full's ``other`` at the same length + full's ``attention`` there x
``n_dense_layers / n_layers`` (the method's dense layers, read from its ``is_budgeted`` on the model's layers)
+ ``exact_attention_s x`` the budgeted layers, where
``exact_attention_s`` is one layer's exact attention of one decode query over ``budget`` keys
(:func:`icecache.kv.attention.attend`, the model's head counts, head dim and dtype), timed in the cell's process
after its generation (median of 15 repetitions); ``tpot_over_floor`` is the median TPOT over it (full's is its
TPOT over its own ``other + attention``, ~1). Rows keep ``floor_parts_s`` and the summary ``floor_s`` and
``tpot_over_floor`` per length; ``python -m evals.output.latency_figure`` draws TPOT and the floors.

On CUDA the breakdown comes from CUDA events (no added syncs); ``--profile`` synchronises around every
phase instead, for exact host-side attribution.

``--model llama-8b-random`` builds a Llama-3.1-8B-shaped model with random weights (latency needs no
trained weights) for GPU machines: see ``scripts/gpu_bench.sh``.
"""
from __future__ import annotations

import argparse
import os
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import numba
import torch

from evals.bench import floor
from evals.bench.method_options import Cell, configure, print_row_sets, resume_conflicts, tpot_over_full
from evals.harness import REPO_ROOT
from evals.tasks.latency import FILLER, Latency
from evals.registry import METHODS, SUITES, make_method
from evals.output.results import git_state, row_provenance
from evals.prefill_cache import PrefillStore
from evals.config import check_writable_dir
from evals.runner import generate
from evals.threads import set_threads
from evals.output.timing import environment, omp_wait_record, tpot_stats
from evals.models import load_model, load_tokenizer, resolve_dtype, tiny_config
from icecache.hardware import cpu_info
from evals.bench.decode_report import (NOT_CELLS, TPOT, print_cell, print_floors, print_ratios, print_summary,
                                       summary)

JIT_METHODS = ("icecache", "icecache_tuned", "icecache_reuse", "icecache_reuse_rerank", "magicpig",
               "magicpig_calibrated")  # numba kernels (icecache/dci, icecache/resident.py, magicpig buckets)
OPTIONAL_METHODS = ("kvpress",)  # need an optional extra (docs/kvpress.md): benchmarked when named
OMP_WAIT = {"spin": {"GOMP_SPINCOUNT": "300000"},  # libgomp's default spin; what each rule puts in a cell's environment
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # idle threads sleep at once
            "active": {"OMP_WAIT_POLICY": "ACTIVE"}}  # idle threads never sleep


def llama_8b_random(device: str):
    """The Llama-3.1-8B-shaped random model in bf16 (``evals.models``, model ``llama-8b-random``)."""
    return load_model("llama-8b-random", dtype="bfloat16", device=device)


def as_cell(method: str | Cell) -> Cell:
    """A :class:`~evals.bench.method_options.Cell`; a bare name is its method at the class defaults."""
    return method if isinstance(method, Cell) else Cell(method, method)


def measure(model, tokenizer, method: str | Cell, budget: int, prompt_ids: list[int], new_tokens: int,
            profile: bool = False, prefilled: PrefillStore | None = None) -> dict:
    """One timed generation of ``method``: its timings, what its floor needs (:func:`evals.bench.floor.floor_inputs`),
    its KV memory by place (``device_kv_bytes``, of which
    ``transit_bytes``, ``host_kv_bytes``, ``index_bytes``: :meth:`icecache.kv.KVCache.memory_bytes`, the same on a CPU
    and a GPU), and the commit and resolved configuration it ran. With ``prefilled`` (``--prefill-cache``) the
    prompt's exact prefill is replayed (``prefill``: ``replayed``): TTFT and TT2T then leave out the prefill's
    forward pass and keep the method's ingest of the prompt's K/V (its index build, its k-means); TPOT is unchanged."""
    cell = as_cell(method)
    built = cell.build(budget)
    gen = generate(model, tokenizer, built, prompt_ids, new_tokens, ignore_eos=True, profile=profile,
                   prefilled=prefilled)
    n = len(gen.intervals_s)
    measured = floor.floor_inputs(model, built, budget)  # after the timed generation, never inside it
    return {"tt2t_s": gen.tt2t_s, "ttft_s": gen.ttft_s, "prefill": gen.prefill, **tpot_stats(gen.intervals_s),
            "breakdown": {p: s / n for p, s in gen.breakdown_s.items()},
            "breakdown_sum_over_tpot": sum(gen.breakdown_s.values()) / sum(gen.intervals_s),
            "peak_memory_bytes": gen.peak_memory_bytes, **gen.memory, **row_provenance(built, cell.method), **measured}


def default_methods() -> list[str]:
    """The methods benchmarked when none are named: every method registered in ``evals.registry.METHODS`` when
    the arguments are parsed, except :data:`OPTIONAL_METHODS`."""
    return [m for m in METHODS if m not in OPTIONAL_METHODS]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=default_methods(), metavar="METHOD[:KEY=VALUE,...]",
                        help="methods, each with options of its own (arkvale:page_topks=16,n_sink_pages=2)")
    parser.add_argument("--suite", default="longbench", choices=[*SUITES, "none"],
                        help="run each method at this suite's official setting (conf/suite_cache/<suite>_<method>"
                             ".yaml) under the command line's options; none: the class defaults")
    parser.add_argument("--equal-dense", nargs="+", type=int, default=[], metavar="N",
                        help="add a row set per N in which every budgeted method keeps its first N layers dense")
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m", help="a model name, or llama-8b-random")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto, float32, bfloat16")
    parser.add_argument("--profile", action="store_true", help="CUDA: synchronise around every phase")
    parser.add_argument("--growth-from", type=int, default=4096)
    parser.add_argument("--growth-to", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    parser.add_argument("--out", default="bench_decode.json")
    parser.add_argument("--in-process", dest="isolate", action="store_false",
                        help="measure every cell in this process (default: one fresh process per cell)")
    parser.add_argument("--isolate", dest="isolate", action="store_true", default=True, help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    parser.add_argument("--prefill-cache", default=None, metavar="DIR",
                        help="replay each length's exact prefill from DIR (captured by the first cell that needs it): "
                             "TPOT as measured live, TTFT/TT2T without the prefill's forward pass")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure every cell this many times, in rounds; report the medians")
    parser.add_argument("--omp-wait", choices=tuple(OMP_WAIT), default="spin",
                        help="how idle OpenMP threads wait in each cell (module docstring)")
    parser.add_argument("--cell", nargs=2, metavar=("LABEL", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--cell-config", default=None, help=argparse.SUPPRESS)  # Cell.to_json of --cell's label
    return parser.parse_args(argv)


def load(args):
    if args.threads:  # torch's pool and numba's: a numba pool wider than the cores given stalls its parallel loops
        set_threads(args.threads)
    return load_model(args.model, dtype=args.dtype, device=args.device), load_tokenizer(args.model)


def prefill_mode(args) -> str:
    """How the cells' prompts are prefilled: ``replayed`` with ``--prefill-cache``, else ``live``."""
    return "replayed" if args.prefill_cache else "live"


def prefill_store(args) -> PrefillStore | None:
    """The store of ``--prefill-cache`` (None without it), keyed by the model's name as a run's is."""
    if not args.prefill_cache:
        return None
    path = Path(args.prefill_cache).expanduser()
    check_writable_dir(path, "--prefill-cache")
    return PrefillStore(path, model_id=args.model)


def latency_suite(tokenizer, args, lengths) -> Latency:
    return Latency(tokenizer, lengths=lengths, new_tokens=args.new_tokens, data_dir=args.data_dir,
                   max_length=max(lengths))


def prompts(tokenizer, args, lengths) -> dict[int, list[int]]:
    """The same natural text cut to each length (evals.tasks.latency)."""
    return {s.meta["length"]: s.prompt_ids for s in latency_suite(tokenizer, args, lengths).samples()}


def prompt_text(args) -> str:
    """The text the prompts are cut from (recorded in the results' environment), with a warning when it is
    the passkey filler: the essays were not found under ``--data-dir``."""
    source = latency_suite(None, args, args.lengths).text_source()
    if source == FILLER:
        print(f"warning: no pg_essays/PaulGrahamEssays.json under {args.data_dir}: the prompts are the passkey "
              "filler, not the essays of the documented runs (pass --data-dir)", file=sys.stderr)
    return source


WARMUP_NEW_TOKENS = 8


def warm_cell(model, tokenizer, method: str | Cell, budget: int, prompt_ids: list[int]) -> int:
    """One untimed generation of :data:`WARMUP_NEW_TOKENS` tokens with ``method`` on the prompt's first ``4 x
    budget`` tokens (past every method's compression point), in the cell's process before its timed one, so the
    timed TT2T leaves out what only a process's first request pays (kernels loaded from numba's disk cache,
    oneDNN primitives created, the lazy imports of the method's modules), as a server that has answered one
    request. Every method gets the same warm-up. Returns the warm-up's prompt length (recorded per cell)."""
    warm_ids = prompt_ids[:min(len(prompt_ids), 4 * budget)]
    generate(model, tokenizer, as_cell(method).build(budget), warm_ids, WARMUP_NEW_TOKENS, ignore_eos=True)
    return len(warm_ids)


def run_cell(args) -> None:
    """Child of ``--isolate``: one (method, length) in this fresh process, after :func:`warm_cell`; prints its
    row as JSON."""
    label, length = args.cell[0], int(args.cell[1])
    method = Cell.from_json(label, args.cell_config) if args.cell_config else Cell(label, label)
    model, tokenizer = load(args)
    prompt_ids = prompts(tokenizer, args, [length])[length]
    warmup_tokens = warm_cell(model, tokenizer, method, args.budget, prompt_ids)
    row = measure(model, tokenizer, method, args.budget, prompt_ids, args.new_tokens, args.profile, prefill_store(args))
    row["warmup_prompt_tokens"] = warmup_tokens
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row["omp_wait"] = omp_wait_record()
    row["numba_threads"] = numba.get_num_threads()  # the search's pool, set with torch's by --threads
    row["environment"] = {**environment(model), "model": args.model}
    print(json.dumps(row))


def isolated_cell(args, cell: Cell, length: int) -> dict:
    cmd = [sys.executable, "-m", "evals.bench.decode", "--cell", cell.label, str(length), "--cell-config",
           cell.to_json(), "--budget", str(args.budget),
           "--new-tokens", str(args.new_tokens), "--model", args.model, "--device", args.device,
           "--data-dir", args.data_dir, "--dtype", args.dtype] + (["--threads", str(args.threads)] if args.threads
                                                                  else []) + (["--profile"] if args.profile else []) + (
        ["--prefill-cache", args.prefill_cache] if args.prefill_cache else [])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, **OMP_WAIT[args.omp_wait]})
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def previous_results(args) -> dict:
    """Cells already in ``--out`` when ``--resume`` is given and the settings match (every label's options too:
    :func:`~evals.bench.method_options.resume_conflicts`), else nothing."""
    path = Path(args.out)
    if not (args.resume and path.exists()):
        return {}
    old = json.loads(path.read_text())
    old.pop("summary", None)
    old = {m: {L: r for L, r in rows.items() if "error" not in r} if m not in NOT_CELLS else rows
           for m, rows in old.items()}  # failed cells are measured again
    env = old.get("environment", {})
    if (env.get("model"), env.get("budget"), env.get("new_tokens"), env.get("prefill", "live")) != (
            args.model, args.budget, args.new_tokens, prefill_mode(args)):
        raise SystemExit(f"--resume: {path} holds model={env.get('model')} budget={env.get('budget')} "
                         f"new_tokens={env.get('new_tokens')} prefill={env.get('prefill', 'live')}; pass the same "
                         "settings (--prefill-cache for replayed prefills) or another --out")
    conflicts = resume_conflicts(old, args.configurations)
    if conflicts:
        raise SystemExit(f"--resume: in {path} " + "; ".join(conflicts) + "; pass the same --suite and options "
                         "or another --out")
    return old


def warm_jit(methods, budget: int, dtype: str, device: str) -> None:
    """Compiles the numba kernels of ``methods`` (:data:`JIT_METHODS`) once, on a tiny random model of the
    benchmark's dtype, before any cell is timed. They are cached on disk (``@njit(cache=True)``), so every cell
    loads them instead of compiling inside its prefill and first decode steps (on a cold cache the first cell of
    a method would otherwise time its compilation in its TT2T)."""
    jit = [m for m in methods if m in JIT_METHODS]
    if not jit:
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=resolve_dtype(dtype, device)).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (4 * budget,), generator=torch.Generator().manual_seed(0))
    for method in jit:  # 40 steps: past the first window pages' insertion into the index
        generate(model, None, make_method(method, budget=budget), ids.tolist(), 40, ignore_eos=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cell:
        return run_cell(args)
    cells = configure(args)
    args.prompt_text = prompt_text(args)
    warm_jit(list(dict.fromkeys(c.method for c in cells)), args.budget, args.dtype, args.device)
    results = previous_results(args)
    environment_row = results.pop("environment", {})
    old_cells = results.pop("configurations", {}).get("cells", {})
    args.configurations = {**args.configurations, "cells": {**old_cells, **args.configurations["cells"]}}
    model = tokenizer = ids_by_length = None
    store = prefill_store(args)
    if not args.isolate:
        model, tokenizer = load(args)
        ids_by_length = prompts(tokenizer, args, args.lengths)
        environment_row = environment(model)
    for rep in range(args.repeats):
        for length in args.lengths:
            for method in cells:
                cell = results.get(method.label, {}).get(str(length))
                runs = [] if cell is None else cell.get("runs", [floor.without_floor(cell)])
                if sum("error" not in r for r in runs) > rep:
                    continue
                if args.isolate:
                    row = isolated_cell(args, method, length)
                    environment_row = row.pop("environment", environment_row)
                else:
                    row = measure(model, tokenizer, method, args.budget, ids_by_length[length], args.new_tokens,
                                  args.profile, store)
                results.setdefault(method.label, {})[str(length)] = median_row(runs + [row])
                floor.annotate(results, TPOT)
                print_cell(method.label, length, row, results[method.label][str(length)].get("floor_s"))
                write(args, results, environment_row)
    floor.annotate(results, TPOT)
    print_summary(results, args.growth_from, args.growth_to)
    print_floors(results)
    print_ratios(results)
    if len(args.configurations["row_sets"]) > 1:
        print_row_sets(results, args.configurations, TPOT)
    print(f"wrote {args.out}")


def median_row(runs: list[dict]) -> dict:
    """One cell from its repeats (``--repeats``): the median of every timing and of each phase, the maximum of
    the peak memories, every repeat under ``runs``; a single run is its own row."""
    ok = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not ok:
        return runs[-1]
    row = {**ok[-1], "runs": runs}
    for key in ("tt2t_s", "ttft_s", "tpot_s", "tpot_p50_s", "tpot_p90_s", "breakdown_sum_over_tpot",
                "exact_attention_s"):
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    row["breakdown"] = {p: statistics.median(r["breakdown"][p] for r in ok) for p in ok[-1]["breakdown"]}
    for key in ("peak_rss_bytes", "peak_memory_bytes"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            row[key] = max(values)
    return row


def write(args, results: dict, environment_row: dict) -> None:
    env = {**environment_row, **git_state(), "budget": args.budget, "new_tokens": args.new_tokens, "model": args.model,
           "prompt_text": args.prompt_text, "repeats": args.repeats,
           "isolate": args.isolate, "profile": args.profile, "prefill": prefill_mode(args),
           "cpu_model": cpu_info()[0],
           "load_average": os.getloadavg()}
    tmp = Path(args.out).with_suffix(".tmp")
    body = {m: rows for m, rows in results.items() if m not in NOT_CELLS}  # failed cells too
    body["summary"] = summary(results, args.growth_from, args.growth_to)
    body["configurations"] = {**args.configurations, "tpot_over_full": tpot_over_full(results, args.configurations, TPOT)}
    tmp.write_text(json.dumps({**body, "environment": env}, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
