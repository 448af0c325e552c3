"""The results page, generated from the committed rows: ``python -m evals.output.results_page`` writes
``docs/results.md``; ``--check`` only compares and exits 1 when the page differs from what the rows give.

The first section sets the paper's claims beside the rows (:mod:`evals.output.claims`). Every other section is
either one folder of committed run directories under ``reference_results/`` (:class:`Section`), whose tables are
:func:`evals.output.tables.render` of that folder (scores with 95% bootstrap intervals, paired differences to the
full cache, misses, agreement with the full cache's output), or committed benchmark rows (:class:`Rows`):
ablation-format JSON lines, a decode-benchmark or a search-bound JSON, printed by :mod:`evals.output.row_tables`.
Each is headed by what was run, the command that prints its table, the commits the rows were made at and the
machine, read from the rows (a run's ``timing.json``, a benchmark file's ``environment``). A section with a
``mirror`` is also written into that doc, between its markers (:func:`mirrored`: the equal-terms latency table in
docs/benchmarks.md). A test regenerates the page and the mirrors and fails when the docs differ, so a number on the
page is always what the committed rows give.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from . import claims, plan
from .row_tables import ablation_markdown, decode_markdown, parse_aliases, read_rows, search_bound_markdown
from .tables import render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results.md"
REFERENCE = "reference_results"
LONGCTX = ("`PF` the prefill directory (0.8 GB per 32k prompt), "
           "`M=\"model=qwen2.5-coder-0.5b prefill_cache=$PF results_dir=results/longctx\"`, `OTHERS=icecache_reuse,"
           "icecache_reuse_rerank,pqcache,omnikv,magicpig,magicpig_calibrated,quest,arkvale,streaming_llm`; the run "
           "directories are copied with `python -m evals.output.archive results/longctx reference_results/longctx`. "
           "Qwen2.5-Coder-0.5B-Instruct installs with `make model-qwen2.5-coder`. Each prompt is prefilled once with "
           "exact attention and replayed into every configuration (`prefill_cache`, docs/sweeps.md); H2O and SnapKV "
           "compute statistics during the prefill and cannot replay one, so they are not here. "
           "`topk[n_dense_layers=2]` is the exact top-k with IceCache's two dense layers; "
           "`icecache[min_fov=1000000, prop_to_retrieve=1]` is IceCache with every key scored (docs/fidelity.md, "
           "\"Bounds\").")
PAPER = ("`M=\"model=qwen2.5-coder-0.5b prefill_cache=$PF results_dir=results/paper\"` and `PF` the prefill "
         "directory; the run directories are copied with `python -m evals.output.archive results/paper "
         "reference_results/paper`:")
SMOLLM2 = ("SmolLM2-135M-Instruct; every prompt prefilled once and replayed into each configuration "
           "(`evals.bench.ablation`, docs/benchmarks.md). Columns: accuracy in % per task and its mean over the "
           "tasks, samples, the most past tokens attended per head in a budgeted layer (mean over a step), and the "
           "ratio to full on the same samples with its 95% paired bootstrap interval.")
ORIGINAL_LABELS = ("`icecache[interleaved,page=16,sink=32,prop_to_retrieve=1.0]` and `icecache_tuned` label "
                   "`icecache_tuned`'s configuration at 256 when the rows were made (16-token pages, 32 sink tokens, "
                   "every child of an expanded node scored); `icecache_tuned[prop_to_retrieve=0.8]` is the same with "
                   "the official share of children scored.")
RULER_TASKS = ("niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 "
               "niah_multivalue niah_multiquery vt cwe fwe qa_1")


def bash(*lines: str) -> str:
    return "\n\n```bash\n" + "\n".join(lines) + "\n```"


@dataclass(frozen=True)
class Section:
    title: str
    folder: str  # under reference_results/
    about: str
    limited: bool = False  # tabulate runs made with limit=N (evals.output.tables --limited)
    plan: tuple[str, ...] = ()  # the cells the table is meant to hold (evals.output.plan); the missing ones listed


@dataclass(frozen=True)
class Rows:
    """A section printed from benchmark rows under reference_results/ (:mod:`evals.output.row_tables`)."""
    title: str
    files: tuple[str, ...]  # under reference_results/
    about: str
    kind: str = "ablation"  # ablation (JSON lines) | decode | search_bound (one JSON each)
    aliases: tuple[str, ...] = ()  # evals.bench.ablation --alias [FILE:]OLD=NEW
    misses: bool = False  # list the samples each configuration scored below full
    mirror: str = ""  # another doc (repository path) that shows this section too, between its markers (mirrored)


SECTIONS = (
    Section("LongBench (Qwen2.5-Coder-0.5B-Instruct, the 24 shared rows)", "paper/longbench",
            "Every prompt prefilled once with exact attention and replayed into each method "
            "(`prefill_cache`); every method at its LongBench settings (`conf/suite_cache/`, docs/fidelity.md); "
            "SnapKV and H2O compute statistics during the prefill and run it live. Runs (one method per command), "
            "with " + PAPER + bash(
                "python run.py -m $M eval=longbench cache=icecache budget=64,128,256   # and icecache_tuned, "
                "page_oracle",
                "python run.py -m $M eval=longbench cache=topk cache.n_dense_layers=2 budget=64,128,256",
                "python run.py -m $M eval=longbench cache=icecache budget=64 "
                "cache.budget_layout=fixed cache.n_sink_pages=0   # the 64-token readings",
                "python run.py -m $M eval=longbench cache=icecache budget=64 cache.page_size=8",
                "python run.py -m $M eval=longbench cache=icecache budget=64 cache.budget_layout=retrieved",
                "python run.py -m $M eval=longbench cache=pqcache budget=64,256   # and icecache_reuse, quest, "
                "omnikv, magicpig, streaming_llm",
                "python run.py -m $M eval=longbench cache=arkvale budget=256   # at 64: cache.page_size=8",
                "python run.py -m $M eval=longbench cache=snapkv budget=256   # and h2o; cache=full budget=64"),
            plan=plan.LONGBENCH),
    Section("GSM8K chain-of-thought (Qwen2.5-Coder-0.5B-Instruct, the first test problems)", "paper/gsm8k",
            "PQCache's protocol (10-shot CoT file, 256 new tokens); the problems are the first `limit` of "
            "`gsm8k/test.jsonl` in file order, fixed before any run; budget 0.1 = 10% of each prompt (IceCache "
            "with GSM8K's `ratio_1=0.03`, conf/suite_cache/); the 50-problem runs also stand in the 20-problem table "
            "on their first 20 problems, marked `(first 20 of 50)`, so that every method is compared on the same "
            "problems there (their attended tokens and search statistics stay the whole run's). Runs, with " + PAPER + bash(
                "python run.py -m $M eval=gsm8k limit=50 budget=0.1 cache=full   # and icecache, "
                "icecache_reuse, pqcache",
                "python run.py -m $M eval=gsm8k limit=20 cache=icecache budget=64,256",
                "python run.py -m $M eval=gsm8k limit=20 budget=0.1 cache=quest   # and every other method"),
            limited=True, plan=plan.GSM8K),
    Section("LongGenBench, short subset capped at 512 new tokens (Qwen2.5-Coder-0.5B-Instruct)", "paper/longgenbench",
            "The first item of each of the short subset's four types (`limit=1`), 512 new tokens each (the official "
            "16,000 are out of reach on a CPU; a capped run scores the units written before the cap); the judge is "
            "the model under test (`eval.judge_model=null`: the official Llama-3.1-8B judge is not installed here), "
            "the official sampled decoding with its seed; agreement with the full cache's output beside it. Runs, "
            "with " + PAPER + bash(
                "python run.py -m $M eval=longgenbench eval.max_new_tokens=512 eval.judge_model=null limit=1 \\",
                "    budget=256 cache=full   # and every method"),
            limited=True, plan=plan.LONGGENBENCH),
    Section("The 64-token readings and the two bounds (SmolLM2-135M-Instruct; Qwen2.5-Coder-0.5B-Instruct at 16k)",
            "readings",
            "IceCache's four readings of a 64-token budget (docs/fidelity.md, the table under IceCache) beside the "
            "page oracle (`page_oracle`: IceCache's pages, the exact best ones) and the exact top-k (`topk` with "
            "IceCache's two dense layers), at 64, 128 and 256 tokens: IceCache vs `page_oracle` is the search's "
            "loss, `page_oracle` vs `topk` the page granularity's. Passkey at 2k and 4k tokens, 10 depths, seeds 0 "
            "and 1; RULER niah at 4k, 4 samples per task. Runs, with `M=\"model=smollm2-135m "
            "prefill_cache=$PF results_dir=results/readings\"`:" + bash(
                "P=\"eval=passkey eval.lengths=[2048,4096] eval.depths=10 seed=0\"   # and seed=1",
                "R=\"eval=ruler eval.lengths=[4096] eval.num_samples=4 seed=0\"",
                "T='eval.tasks=[niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue]'",
                "python run.py -m $M $P cache=full budget=256",
                "python run.py -m $M $P cache=icecache,page_oracle budget=64,128,256",
                "python run.py -m $M $P cache=topk cache.n_dense_layers=2 budget=64,128,256",
                "python run.py -m $M $P cache=icecache,page_oracle budget=64 cache.budget_layout=fixed "
                "cache.n_sink_pages=0",
                "python run.py -m $M $P cache=icecache,page_oracle budget=64 cache.page_size=8",
                "python run.py -m $M $P cache=icecache,page_oracle budget=64 cache.budget_layout=retrieved",
                "# the same six commands with $R \"$T\" in place of $P",
                "# Qwen2.5-Coder-0.5B-Instruct: M with model=qwen2.5-coder-0.5b, the same six commands with",
                "P16=\"eval=passkey eval.lengths=[16384] seed=0\"   # 10 depths",
                "R16=\"eval=ruler eval.lengths=[16384] eval.num_samples=4 limit=2 seed=0\"   # with \"$T\"") +
            "\n\nOn Qwen2.5-Coder-0.5B-Instruct RULER niah at 16k ran on the first 2 of the 4 samples per task of "
            "the section \"RULER needle-in-a-haystack at 16k and 32k tokens\" (`limit=2`: each sample is an "
            "independent draw, so these are the same prompts), as each needs a 16k-token prefill of about 4.5 minutes "
            "on one core of the machine named below.", limited=True),
    Section("Passkey at 8k-32k tokens (Qwen2.5-Coder-0.5B-Instruct)", "longctx/passkey",
            "Every method that can replay a prefill, IceCache's prompt layout: 10 depths at 8k (seeds 0 and 1) and "
            "16k, 5 at 32k; ArkVale's 32-token pages need a budget of 256. The 16k runs carry the live attention-mass "
            "probe (`diagnostics=recall`, docs/diagnostics.md), and so does PQCache at 32k and budget 1024. Runs, "
            "with " + LONGCTX + bash(
                "P='eval=passkey seed=0 eval.depths=10'",
                "python run.py -m $M $P 'eval.lengths=[16384]' diagnostics=recall \\",
                "    cache=full,icecache,icecache_tuned,$OTHERS budget=64,128,256",
                "python run.py -m $M eval=passkey seed=0 eval.depths=5 'eval.lengths=[32000]' \\",
                "    cache=full,icecache,icecache_tuned,$OTHERS budget=64,128,256,1024",
                "python run.py -m $M $P 'eval.lengths=[8192]' \\",
                "    cache=full,icecache,icecache_tuned,topk,$OTHERS budget=64,128,256   # and seed=1 without topk",
                "# at 16k and 32k also cache=topk cache.n_dense_layers=2, and at budget 64",
                "# cache=icecache cache.min_fov=1000000 cache.prop_to_retrieve=1.0")),
    Section("RULER needle-in-a-haystack at 16k and 32k tokens (Qwen2.5-Coder-0.5B-Instruct)", "longctx/ruler",
            "Five niah tasks at the official generation lengths: four samples per task at 16k, two at 32k. These "
            "runs have no live probe (no `recall.json`); the next section has the probed runs at 16k. Runs, with "
            + LONGCTX + bash(
                "T='eval.tasks=[niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue]'",
                "python run.py -m $M eval=ruler seed=0 \"$T\" 'eval.lengths=[16384]' eval.num_samples=4 \\",
                "    cache=full,icecache,icecache_tuned,$OTHERS budget=256   # 64, 128: cache=icecache,icecache_tuned",
                "python run.py -m $M eval=ruler seed=0 \"$T\" 'eval.lengths=[32000]' eval.num_samples=2 \\",
                "    cache=full,icecache,icecache_tuned,$OTHERS budget=256   # 64, 128, 1024: the same two") +
            "\n\nAt 16k the exact top-k also ran at 64 (`cache=topk`) and IceCache with every key scored at 256; "
            "the top-k with IceCache's dense layers (`cache=topk cache.n_dense_layers=2`) ran at 256 at both lengths."),
    Section("RULER niah at 16k with the live probe (Qwen2.5-Coder-0.5B-Instruct)", "longctx/ruler_recall",
            "The 16k RULER command of the previous section with `diagnostics=recall` and "
            "`results_dir=results/longctx_recall`, at budget 256, for full, `icecache`, `icecache_tuned`, `quest` "
            "and `topk[n_dense_layers=2]`: every prediction equals that of the same configuration without the probe."),
    Rows("Official IceCache beside the variants: passkey at 2k-4k tokens (SmolLM2)",
         ("official/passkey_smollm2_s67.jsonl",),
         "2k + 4k tokens x 10 depths x seeds 6 and 7 (40 samples per cell), IceCache's prompt layout; seeds the "
         "variants' settings were not chosen on. " + SMOLLM2 + " `topk` budgets every layer; "
         "`topk[n_dense_layers=2]` keeps IceCache's two dense layers (the like-for-like bound). Rows (`--page-sizes 7` "
         "leaves the configuration grid empty, so only the named configurations run):" + bash(
             "python -m evals.bench.ablation --suites passkey --budgets 64 128 256 --page-sizes 7 --seeds 6 7 \\",
             "    --baselines icecache icecache_tuned icecache_reuse icecache_reuse_rerank topk:n_dense_layers=2 \\",
             "    --out reference_results/official/passkey_smollm2_s67.jsonl"), misses=True),
    Rows("Official IceCache beside the variants: RULER niah at 4k tokens, budget 64 (SmolLM2)",
         ("official/niah4k_b64_smollm2_s3.jsonl",),
         "Five niah tasks x 8 samples, seed 3, generation capped at 48 tokens (every niah answer fits). " + SMOLLM2 +
         " Rows:" + bash(
             "python -m evals.bench.ablation --suites ruler --budgets 64 --page-sizes 7 --seeds 3 --ruler-samples 8 \\",
             "    --ruler-max-new-tokens 48 --baselines icecache icecache_tuned icecache_reuse \\",
             "    icecache_reuse_rerank topk:n_dense_layers=2 \\",
             "    --out reference_results/official/niah4k_b64_smollm2_s3.jsonl"),
         misses=True),
    Rows("RULER, all 12 tasks at 4k tokens, budget 256 (SmolLM2)",
         ("ablation/ruler256_16.jsonl", "ablation/ruler256_seed1.jsonl", "ablation/ruler256_seed2.jsonl"),
         "Seeds 0 (16 samples per task), 1 (4) and 2 (8, with the exact top-k oracle and the live probe: its "
         "columns are seed 2's) pooled; official generation lengths; qa_2 has no data. " + SMOLLM2 + " Each "
         "configuration's ratio is over the samples it ran. " + ORIGINAL_LABELS + " Seed 2's rows:" + bash(
             "python -m evals.bench.ablation --suites ruler --budgets 256 --merges interleaved --page-sizes 16 \\",
             "    --sinks 32 --props 1.0 --baselines icecache_tuned --only full icecache_tuned topk \\",
             f"    --ruler-samples 8 --seeds 2 --probe --ruler-tasks {RULER_TASKS} \\",
             "    --out reference_results/ablation/ruler256_seed2.jsonl"),
         aliases=("icecache[interleaved,page=16,sink=32,prop_to_retrieve=1.0]=icecache_tuned",)),
    Rows("Page layouts at budget 256: RULER at 4k tokens, seed 0 (SmolLM2)",
         ("ablation/ruler256_16.jsonl", "ablation/ruler256_alt.jsonl", "ablation/ruler256_p8.jsonl"),
         "The configuration labels read "
         "`icecache[<GQA merge>,page=<page size>,sink=<sink tokens>,prop_to_retrieve=1.0]`; 16 samples per task. "
         "The rows with only fwe and qa_1 filled ran those two tasks (their mean and ratio are over those two). "
         + SMOLLM2 + " " + ORIGINAL_LABELS),
    Rows("Decode latency on equal terms: official settings and equal dense layers (SmolLM2 on a CPU, 4k-32k)",
         ("bench/decode_equal_smollm2_cpu_f25m17.json",),
         "Every method at its official LongBench setting (`conf/suite_cache/longbench_<name>.yaml`: ArkVale with the "
         "official script's 2 dense layers, 1 sink page and `page_topks=32`, PQCache with 32 sinks; the others at "
         "their class defaults, which are their papers'), and the row sets in which every method keeps exactly its "
         "first 0 or 2 layers dense (`--equal-dense 0 2`; docs/benchmarks.md, \"Method configurations\"), so that a "
         "difference in TPOT splits into the method's and its dense layers'. Budget 256, 64 new tokens with EOS "
         "ignored, a fresh process per cell with one untimed warm-up generation, Paul Graham essays cut to each "
         "length; each length's exact prefill captured once and replayed into every cell (`--prefill-cache`): TPOT "
         "and its phases are what a live prefill gives, TT2T would leave out the forward pass and is not shown. "
         "Three rounds, each running every cell once (medians); one thread, with a single-thread accuracy run on "
         "the machine's other core throughout, so the ratios are of one run under one load. Rows:" + bash(
             "python -m evals.bench.decode --methods full icecache arkvale pqcache quest omnikv magicpig \\",
             "    --equal-dense 0 2 --lengths 4096 8192 16384 32768 --repeats 3 --threads 1 \\",
             "    --prefill-cache \"$PF\" --data-dir \"$ICECACHE_DATA_DIR\" --out decode.json",
             "python -m evals.output.latency_figure reference_results/bench/decode_equal_smollm2_cpu_f25m17.json \\",
             "    -o docs/figures/tpot_vs_context_f25m17.png --floors icecache arkvale   # the figure") +
         "\n\n![TPOT vs context](figures/tpot_vs_context_f25m17.png)",
         kind="decode", mirror="docs/benchmarks.md"),
    Rows("What bounds IceCache's select: the search against a scan of the keys it scores (SmolLM2)",
         ("bench/search_bound_smollm2_cpu_f6m167_142afe2.json",),
         "Per capture, every budgeted layer's index built as IceCache builds it; the official search (`K` = 12 pages "
         "at budget 256) against a plain pass over as many stored keys as it scored (docs/benchmarks.md, "
         "\"Search bound\"); medians of 5 rounds, ms per layer and decode step. Rows:" + bash(
             "python -m evals.bench.capture --out keys16k.pt --tokens 16000 --steps 2 \\",
             "    --data-dir \"$ICECACHE_DATA_DIR\"",
             "# likewise keys4k.pt (--tokens 4000 --steps 4), keys8k.pt (8000, 4) and keys32k.pt (32000, 4)",
             "python -m evals.bench.search_bound --keys keys4k.pt keys8k.pt keys16k.pt keys32k.pt \\",
             "    --steps 8 --rounds 5"),
         kind="search_bound"),
)


def machines(folder: Path) -> list[str]:
    """The distinct machines of the runs under ``folder``: CPU model and signature (or GPU), dtype, threads,
    torch, as each run's ``timing.json`` records them."""
    found = set()
    for timing in sorted(folder.rglob("timing.json")):
        found.add(machine(json.loads(timing.read_text()).get("environment", {})))
    return sorted(found)


def machine(env: dict) -> str:
    chip = env.get("gpu") or " ".join(filter(None, (env.get("cpu_model"), env.get("cpu_signature"))))
    return (f"{chip or 'unknown'}, {env.get('dtype', '?')}, {env.get('threads', '?')} threads, "
            f"torch {env.get('torch', '?')}")


def section_text(section: Section, root: Path, draws: int) -> str:
    folder = root / REFERENCE / section.folder
    head = [f"## {section.title}", "", section.about, ""]
    if not folder.is_dir():
        return "\n".join(head + [f"No committed rows yet (`{REFERENCE}/{section.folder}` is empty).", ""])
    flag = " --limited" if section.limited else ""
    head += [f"Command: `python -m evals.output.tables{flag} {REFERENCE}/{section.folder}`; machine: "
             + "; ".join(machines(folder)) + ".", ""]
    if section.plan:
        head += [plan.missing_text(folder, section.plan), ""]
    return "\n".join(head) + "\n" + render(folder, draws, section.limited).rstrip() + "\n"


def rows_text(section: Rows, root: Path, draws: int) -> str:
    paths = [root / REFERENCE / f for f in section.files]
    names = " ".join(f"{REFERENCE}/{f}" for f in section.files)
    head = [f"## {section.title}", "", section.about, ""]
    if missing := [p for p in paths if not p.is_file()]:
        return "\n".join(head + [f"No committed rows yet (`{missing[0].relative_to(root)}` is missing).", ""])
    if section.kind == "ablation":
        aliases = parse_aliases(list(section.aliases))
        rows = read_rows(*paths, aliases=aliases)
        commits = sorted({str(c)[:7] for c in rows.get("commit", []) if isinstance(c, str)})
        flags = (" --ci" + (" --misses" if section.misses else "")
                 + (" --alias " + " ".join(f'"{a}"' for a in section.aliases) if section.aliases else ""))
        head.append(f"Command: `python -m evals.bench.ablation --table {names}{flags}`; commit: "
                    f"{', '.join(commits) or 'not recorded in these rows'}.")
        body = ablation_markdown(paths, aliases, section.misses, draws)
    else:
        data = json.loads(paths[0].read_text())
        env = data.get("environment", data)
        commit = str(env.get("commit") or "not recorded")[:7]
        if section.kind == "decode":
            where = (f"machine: {machine(env)}; model {env.get('model')}, budget {env.get('budget')}, "
                     f"{env.get('new_tokens')} new tokens")
            body = decode_markdown(data)
        else:
            where = f"machine: {env.get('cpu')}, {env.get('threads')} threads; budget {env.get('budget')}"
            body = search_bound_markdown(data)
        head.append(f"Rows: `{names}`; commit {commit}; {where}.")
    return "\n".join(head + ["", body.rstrip(), ""])


def page(root: Path = ROOT, draws: int = 2000) -> str:
    intro = ("# Results\n\nGenerated by `python -m evals.output.results_page` from the committed rows under "
             f"`{REFERENCE}/` (`{REFERENCE}/README.md` lists which file feeds which section); do not edit by hand. "
             "In the tables of run directories, entries are `score [95% bootstrap interval]` and, for a method, "
             "`(difference to full [95% paired interval])`, `*` where that interval excludes 0; each table names the "
             "commits of its rows. The accuracy sections report no latency: replayed prefills and shared cores make "
             "their timings meaningless as a comparison of methods (their `min` column, a run's generation time on "
             "the machine named, under whatever else ran beside it, says what a rerun costs); the last two sections "
             "are latency benchmarks (docs/benchmarks.md says how "
             "each benchmark runs and what its columns mean). What the tables say about each method against its "
             "paper: docs/fidelity.md.\n\nSections:\n\n- The paper's claims\n"
             + "\n".join(f"- {s.title}" for s in SECTIONS) + "\n")
    claims_text = ["## The paper's claims", "",
                   "Each claim of the IceCache paper these rows can speak to, the paper's numbers (8B/7B models, the "
                   "16 LongBench tasks, GPUs) and the numbers here (Qwen2.5-Coder-0.5B, the 24 shared LongBench rows, "
                   "the first GSM8K problems, a CPU): a difference the interval does not resolve says only that this "
                   "scale cannot tell the two apart. Command: `python -m evals.output.claims`.", "",
                   claims.render(root, draws)]
    return "\n".join([intro] + claims_text + [section_text(s, root, draws) if isinstance(s, Section)
                                               else rows_text(s, root, draws) for s in SECTIONS])


def markers(title: str) -> tuple[str, str]:
    """The lines that enclose a mirrored section in another doc (:func:`mirrored`)."""
    return (f"<!-- generated by python -m evals.output.results_page from the committed rows: {title} -->",
            "<!-- end of the generated section -->")


def mirrored(root: Path = ROOT, draws: int = 2000) -> dict[Path, str]:
    """Each doc that mirrors a section (``Rows.mirror``), as it reads with that section's text, generated as on the
    results page, put between the section's markers (which the doc must already hold: they say where it goes)."""
    docs: dict[Path, str] = {}
    for section in SECTIONS:
        if not getattr(section, "mirror", ""):
            continue
        path = root / section.mirror
        text = docs.get(path) or path.read_text()
        begin, end = markers(section.title)
        if begin not in text or end not in text.split(begin, 1)[1]:
            raise SystemExit(f"{section.mirror} has no place for the section {section.title!r}: put the lines "
                             f"{begin!r} and {end!r} where it goes")
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1]
        body = rows_text(section, root, draws).split("\n", 2)[2]  # without its "## title" heading
        docs[path] = f"{before}{begin}\n{body.rstrip()}\n{end}{after}"
    return docs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/results.md (and the docs that mirror a section) instead of writing")
    args = parser.parse_args(argv)
    pages = {PAGE: page(), **mirrored()}
    if args.check:
        stale = [p.relative_to(ROOT) for p, text in pages.items() if not (p.exists() and p.read_text() == text)]
        print("docs/results.md is up to date" if not stale else
              f"{', '.join(map(str, stale))} differ from the committed rows: run python -m evals.output.results_page")
        sys.exit(1 if stale else 0)
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
