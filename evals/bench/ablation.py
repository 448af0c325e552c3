"""Ablation of IceCache's small-budget choices: ``python -m evals.bench.ablation [options]``.

Measures passkey (lengths x depths x seeds) and RULER niah tasks on one model for a grid of IceCache
configurations -- GQA merge (``interleaved`` = official ``first_k_unique``, ``union`` = over the budget,
``mass`` / ``max`` = group-level merges within the budget), page size, sink size -- next to the full cache
and the exact top-k oracle as bounds, and prints one table (accuracy, and the most past tokens any
budgeted layer attended per head, which must not exceed the budget except for ``union``).

Every method here computes exact attention at prefill, so a sample's prompt is prefilled once with the
full cache and its per-layer K/V and last logits (:class:`Prefill`) are replayed into each
configuration's cache (:meth:`KVMethod.store` + :meth:`KVMethod.finish_prefill`, what the live prefill
does after attention); decoding then runs the harness's own loop (:func:`evals.runner.generate`), so
stopping rules and scores are the suites'. A test checks that a replayed generation equals a live one.

Rows are appended to ``--out`` (JSON lines) as they finish; a rerun skips the rows already there, so a
long grid can be extended or resumed. ``--ruler-max-new-tokens`` caps RULER's generation (official:
128 for niah) to save time; the cap is recorded in each row. ``--probe`` adds each row's live attention-mass
recall and needle share (``diagnostics=recall``'s probe, docs/diagnostics.md) and the table a column of each.
``--table FILE ... --ci`` also prints each configuration's ratio to full on the same samples with a 95% paired
bootstrap interval; ``--alias [FILE:]OLD=NEW`` renames a configuration (in one file), so that files of several
seeds pool. These tables are :mod:`evals.output.row_tables`'s, which docs/results.md prints from the committed rows.

``--recall capture.pt`` prints each configuration's attention-mass recall on captured keys instead
(offline); ``--live`` also runs each configuration on the capture's own prompt with the probe, side by side.
"""
from __future__ import annotations

import argparse
import os
import itertools
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from evals.bench.capture import build_prompt
from evals.bench.index import model_spec
from evals.bench.method_options import parse_spec
from evals.harness import REPO_ROOT, repo_path
from evals.tasks.passkey import Passkey
from evals.prefill_cache import Prefill, replay_refusal
from evals.registry import make_method
from evals.output.results import row_provenance
from evals.tasks.ruler import Ruler
from evals.runner import generate
from evals.output.row_tables import misses, parse_aliases, ratio_to_full, read_rows, table
from evals.models import load_model, load_tokenizer
from icecache.kv import KVMethod
from icecache.kv.recall import RecallProbe, positions_mask

NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue")
MERGES = ("interleaved", "union", "mass", "max")


@dataclass(frozen=True)
class Config:
    """One ablation cell: a method with hyperparameters at a budget, under a readable label."""

    label: str
    method: str
    budget: int | None
    options: tuple = ()

    def build(self) -> KVMethod:
        return make_method(self.method, budget=self.budget, **dict(self.options))


def icecache_config(budget: int, merge: str, page_size: int, sink_tokens: int, method: str = "icecache",
                    **extra) -> Config | None:
    """An IceCache cell with ``sink_tokens`` of sink (a multiple of the page size) and the official 2-page
    window; None when the combination leaves no retrieved page or is not page-aligned. The grid's values are
    pinned (``prop_to_retrieve`` at the official 0.8 unless ``extra`` names it, and then in the label), so a label
    means the same configuration whatever the method's defaults are."""
    if sink_tokens % page_size or budget % page_size:
        return None
    options = {"gqa_merge": merge, "page_size": page_size, "n_sink_pages": sink_tokens // page_size,
               "budget_layout": "fixed", "prop_to_retrieve": 0.8, **extra}
    try:
        make_method(method, budget=budget, **options)
    except ValueError:
        return None
    tail = "".join(f",{k}={v}" for k, v in extra.items())
    label = f"{method}[{merge},page={page_size},sink={sink_tokens}{tail}]"
    return Config(label, method, budget, tuple(sorted(options.items())))


def grid(budgets, merges=MERGES, page_sizes=(16, 8), sinks=(16, 32), methods=("icecache",),
         reranks=(0,), props=(0.8,), owns=(0,), defaults=False, baselines=()) -> list[Config]:
    """Full and top-k bounds, then (``defaults``) each method as shipped, labelled by its registered name -- then each of ``baselines`` by its registered name (:func:`named_config`, any
    registered method whose prefill stores the exact K/V: :func:`replayable`), then every valid IceCache cell
    of the cross product (IceCache(reuse)
    once per ``rerank`` and ``own_candidates`` value, the latter named in the label unless 0;
    ``prop_to_retrieve`` once per ``props`` value, named in the label unless it is the official 0.8)."""
    cells = [Config("full", "full", None)]
    for budget in budgets:
        cells.append(Config("topk", "topk", budget))
        if defaults:
            cells += [Config(method, method, budget) for method in methods]
        cells += [named_config(spec, budget) for spec in baselines if spec not in ("full", "topk")]
        for method, page, sink, merge, prop in itertools.product(methods, page_sizes, sinks, merges, props):
            scoring = {} if prop == 0.8 else {"prop_to_retrieve": prop}
            extras = ([{**scoring, "rerank": r, **({"own_candidates": o} if o else {})}
                       for r, o in itertools.product(reranks, owns)] if method == "icecache_reuse" else [scoring])
            for extra in extras:
                cell = icecache_config(budget, merge, page, sink, method, **extra)
                if cell is not None and cell not in cells:
                    cells.append(cell)
    return cells


def named_config(spec: str, budget: int) -> Config:
    """A registered method by name, its defaults (``"icecache"``, labelled ``icecache``) or with options
    (``"topk:n_dense_layers=2"``, labelled ``topk[n_dense_layers=2]``; :func:`evals.bench.method_options.parse_spec`),
    values read as YAML scalars."""
    import yaml

    name, raw = parse_spec(spec)
    options = tuple(sorted((k, yaml.safe_load(v)) for k, v in raw.items()))
    label = name + (f"[{','.join(f'{k}={v}' for k, v in options)}]" if options else "")
    return Config(label, name, budget, options)


def replayable(spec: str) -> str:
    """``spec`` (:func:`named_config`) if its method's prefill is exact attention + :meth:`KVMethod.store`
    or reads only the last query (:class:`Prefill` replays it), else a ValueError."""
    name = spec.partition(":")[0]
    reason = replay_refusal(make_method(name, budget=64))
    if reason is not None:
        raise ValueError(f"--baselines {spec}: {reason} (python run.py eval=passkey cache={name} ...)")
    return spec


def model_max_length(name: str) -> int:
    """A registered model's context length: its ``model.max_length`` as ``run.py model=<name>`` composes it
    (``conf/model/<name>.yaml``, the one place it is written)."""
    from evals.config import compose_config

    return int(compose_config([f"model={name}"])["model"]["max_length"])


def suite_samples(tokenizer, args) -> list[tuple[str, object, object]]:
    """``(suite label, suite, sample)`` triples for passkey (every seed) and the RULER tasks."""
    out = []
    max_length = model_max_length(args.model)
    for seed in args.seeds:
        if "passkey" in args.suites:
            suite = Passkey(tokenizer, lengths=args.lengths, depths=args.depths, seed=seed, max_length=max_length)
            out += [(f"passkey/s{seed}", suite, s) for s in suite.samples()]
        if "ruler" in args.suites:
            suite = Ruler(tokenizer, data_dir=repo_path(args.data_dir), lengths=[args.ruler_length],
                          num_samples=args.ruler_samples, tasks=list(args.ruler_tasks), seed=seed, max_length=max_length)
            out += [(f"ruler/s{seed}", suite, s) for s in suite.samples()]
    return out


def run_cell(model, tokenizer, suite, sample, cell: Config, prefilled: Prefill, cap: int | None,
             probe: bool = False) -> dict:
    """One configuration on one sample; with ``probe``, also the live attention-mass recall (``recall_mean``,
    ``needle_share_mean``, ``needle_top_mean``: :mod:`icecache.kv.recall`) of its decode steps."""
    method = cell.build()
    max_new = sample.max_new_tokens if cap is None or not sample.task.startswith("niah") else min(cap, sample.max_new_tokens)
    recall = RecallProbe(needle=suite.needle_positions(sample)) if probe else None
    gen = generate(model, tokenizer, method, sample.prompt_ids, max_new, decode_ids=sample.decode_ids,
                   stop=sample.stop, ignore_eos=sample.ignore_eos, stop_token_ids=sample.stop_token_ids,
                   min_new_tokens=sample.min_new_tokens, eos_token_ids=sample.eos_token_ids, prefilled=prefilled,
                   probe=recall)
    budgeted = [e for i, e in enumerate(gen.effective_tokens) if e is not None and i in gen.budgeted_layers]
    row = {"prediction": gen.text, "score": suite.score(sample, gen.text)["score"], "max_new_tokens": max_new,
           "max_attended_per_head": max(budgeted, default=None), "max_resident": gen.max_resident_tokens}
    if gen.recall:
        row.update({k: gen.recall.get(k) for k in ("recall_mean", "needle_share_mean", "needle_top_mean")})
    return row


def done_keys(path: Path) -> set[tuple]:
    if not path.exists():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["config"], r["budget"], r["suite"], r["id"]) for r in rows}


def run(args) -> Path:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype)
    cells = grid(args.budgets, args.merges, args.page_sizes, args.sinks, args.methods, args.reranks, args.props,
                 args.own_candidates, args.defaults, [replayable(b) for b in args.baselines])
    if args.only:
        cells = [c for c in cells if any(o == c.label or o in c.label for o in args.only)]
    done = done_keys(out)
    triples = suite_samples(tokenizer, args)
    print(f"{len(cells)} configurations x {len(triples)} samples ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads)", flush=True)
    for label, suite, sample in triples:
        todo = [c for c in cells if (c.label, c.budget, label, sample.id) not in done]
        if not todo:
            continue
        prefilled = Prefill.capture(model, sample.prompt_ids)
        for cell in todo:
            row = {"config": cell.label, "budget": cell.budget, "suite": label, "id": sample.id, "task": sample.task,
                   "options": dict(cell.options), **row_provenance(cell.build(), cell.method),
                   **run_cell(model, tokenizer, suite, sample, cell, prefilled, args.ruler_max_new_tokens, args.probe)}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"{label} {sample.id}: done", flush=True)
    print(table(out).to_string())
    return out


def config_recall(data: dict, cells: list[Config]) -> pd.DataFrame:
    """Attention-mass recall of each cell on captured keys (``python -m evals.bench.capture``): for every
    captured budgeted layer, decode query and query head, the share of the exact (fp64) softmax attention
    over the prompt that falls on the positions the method attends, found by the method's own code
    (``finish_prefill`` on the prompt keys, then ``select`` + ``fetch`` per step and
    :meth:`~icecache.method.IceCache.attended_positions`; the top-k oracle's ``prompt_selection``). As in the
    index benchmark, the captured prompt stands for the context (generated tokens are not captured)."""
    spec = model_spec(data)
    rows = []
    for cell in cells:
        if cell.method not in ("topk", "icecache", "icecache_reuse"):
            continue
        method = cell.build()
        seq, states = method.new_sequence(method.bind(spec)), {}
        for layer, keys in zip(data["layers"], data["keys"]):
            st = states[layer] = seq.layers[layer]
            method.fill(st, keys.float(), keys.float())
        for st in states.values():
            method.await_background(st)
        values = []
        for step in range(min(len(q) for q in data["queries"])):
            for layer, keys, queries in zip(data["layers"], data["keys"], data["queries"]):
                q = queries[step].float()[:, None]  # [H_q, 1, d]
                mask = attended_mask(method, states[layer], q, keys.shape[1])
                logits = torch.einsum("hrd,hnd->hrn", q[:, 0].double().view(keys.shape[0], spec.group, -1),
                                      keys.double())
                probs = (logits * spec.scaling).softmax(-1).flatten(0, 1)  # [H_q, n]
                values += (probs * mask).sum(-1).tolist()
        seq.close()
        rows.append({"config": cell.label, "budget": cell.budget, "recall_mean": float(np.mean(values)),
                     "recall_p10": float(np.percentile(values, 10)), "cases": len(values)})
    return pd.DataFrame(rows).set_index(["config", "budget"]).round(3)


def attended_mask(method: KVMethod, st, q: torch.Tensor, n: int) -> torch.Tensor:
    """``[H_q, n]`` bool: the prompt positions each query head attends at this step (the live probe's
    :func:`~icecache.kv.recall.positions_mask` of the method's own ``attended_positions``)."""
    if method.name == "topk":  # no current token offline: every prompt key is ranked, the last one included
        tokens = method.prompt_selection(st, q)
        return positions_mask(method.attended_positions(st, tokens), n, q.shape[0])
    selection = method.select(st, q)
    method.fetch(st, selection)
    return positions_mask(method.attended_positions(st, selection), n, q.shape[0])


def live_recall(data: dict, cells: list[Config], data_dir: Path) -> pd.DataFrame:
    """The same cells run live (``diagnostics=recall``'s probe) on the capture's own prompt, for as many decode
    steps as were captured, pooled over the captured layers, next to :func:`config_recall` on the capture
    (docs/diagnostics.md: the two differ in where the queries come from and in the generated tokens)."""
    meta = data["meta"]
    if "tokens" not in meta:
        raise SystemExit("--live needs a capture written by this version of evals.bench.capture (its meta records "
                         "--tokens); capture again")
    model, tokenizer = load_model(meta["model"]), load_tokenizer(meta["model"])
    prompt, _ = build_prompt(tokenizer, data_dir, meta["tokens"])
    ids = tokenizer(prompt).input_ids
    if len(ids) != meta["prompt_tokens"]:
        raise SystemExit(f"--live: the rebuilt prompt has {len(ids)} tokens, the capture {meta['prompt_tokens']}: "
                         "another data_dir or tokenizer?")
    offline, rows = config_recall(data, cells), []
    for cell in cells:
        if (cell.label, cell.budget) not in offline.index:
            continue
        probe = RecallProbe()
        generate(model, tokenizer, cell.build(), ids, meta["steps"] + 1, ignore_eos=True, probe=probe)
        summary = probe.summary()
        per_layer = summary["per_layer"]["recall"]
        kept = [(m, n) for layer, m, n in zip(summary["layers"], per_layer["mean"], per_layer["n"])
                if layer in data["layers"]]
        rows.append({"config": cell.label, "budget": cell.budget,
                     "offline_mean": offline.loc[(cell.label, cell.budget), "recall_mean"],
                     "live_mean": sum(m * n for m, n in kept) / sum(n for _, n in kept)})
    return pd.DataFrame(rows).set_index(["config", "budget"]).round(3)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--suites", nargs="+", default=["passkey", "ruler"], choices=["passkey", "ruler"])
    p.add_argument("--budgets", nargs="+", type=int, default=[64, 128])
    p.add_argument("--merges", nargs="+", default=list(MERGES), choices=MERGES)
    p.add_argument("--page-sizes", nargs="+", type=int, default=[16, 8])
    p.add_argument("--sinks", nargs="+", type=int, default=[16, 32], help="sink sizes in tokens")
    p.add_argument("--methods", nargs="+", default=["icecache"], choices=["icecache", "icecache_reuse"])
    p.add_argument("--reranks", nargs="+", type=int, default=[0, 3], help="IceCache(reuse) rerank values")
    p.add_argument("--own-candidates", nargs="+", type=int, default=[0],
                   help="IceCache(reuse) own_candidates values (pages per K from each reusing layer's own bounds)")
    p.add_argument("--props", nargs="+", type=float, default=[0.8],
                   help="prop_to_retrieve values (share of an expanded node's children the search scores)")
    p.add_argument("--defaults", action="store_true",
                   help="add each method as shipped, labelled by its registered name")
    p.add_argument("--baselines", nargs="+", default=[], metavar="METHOD[:K=V,...]", help="add these registered "
                   "methods by name, as shipped or with options (topk:n_dense_layers=2); only exact-attention prefills (not h2o, snapkv, magicpig, arkvale)")
    p.add_argument("--only", nargs="*", default=None, help="keep only configurations whose label contains one of these ('full' and 'topk' name the bounds)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    p.add_argument("--depths", type=int, default=10)
    p.add_argument("--ruler-tasks", nargs="+", default=list(NIAH_TASKS))
    p.add_argument("--ruler-length", type=int, default=4096)
    p.add_argument("--ruler-samples", type=int, default=8)
    p.add_argument("--ruler-max-new-tokens", type=int, default=None)
    p.add_argument("--data-dir", default=os.environ.get("ICECACHE_DATA_DIR", "../shared/data"))
    p.add_argument("--out", default=str(REPO_ROOT / "results" / "ablation" / "ablation.jsonl"))
    p.add_argument("--table", nargs="*", default=None, help="only print the table of these files (default --out)")
    p.add_argument("--ci", action="store_true", help="with --table: also each configuration's ratio to full on the "
                   "same samples, with a 95%% paired bootstrap interval")
    p.add_argument("--misses", action="store_true", help="with --table: also list every row scored below the full "
                   "cache on the same sample")
    p.add_argument("--alias", nargs="*", default=[], metavar="[FILE:]OLD=NEW",
                   help="with --table: rename a configuration label, in the file named FILE only when given")
    p.add_argument("--recall", default=None, help="a capture file (evals.bench.capture): print the attention-mass "
                   "recall of every configuration on its keys instead of running the suites")
    p.add_argument("--probe", action="store_true", help="record each row's live attention-mass recall and needle "
                   "share (diagnostics=recall's probe); the table gains <suite>_recall / <suite>_needle_share columns")
    p.add_argument("--live", action="store_true", help="with --recall: also run each configuration live on the "
                   "capture's prompt (diagnostics=recall's probe) and print both")
    args = p.parse_args(argv)
    if args.recall:
        data = torch.load(args.recall, map_location="cpu")
        cells = grid(args.budgets, args.merges, args.page_sizes, args.sinks, args.methods, args.reranks, args.props,
                     args.own_candidates, args.defaults)
        if args.only:
            cells = [c for c in cells if any(o == c.label or o in c.label for o in args.only)]
        frame = live_recall(data, cells, Path(args.data_dir)) if args.live else config_recall(data, cells)
        print(frame.to_string())
        return
    if args.table is not None:
        paths = list(map(Path, args.table or [args.out]))
        aliases = parse_aliases(args.alias)
        print(table(*paths, aliases=aliases).to_string())
        if args.misses:
            print(misses(*paths, aliases=aliases).to_string())
        if args.ci:
            print(ratio_to_full(read_rows(*paths, aliases=aliases)).to_string())
        return
    run(args)


if __name__ == "__main__":
    main()
