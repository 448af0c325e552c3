"""The cells a results table is meant to hold, and which of them have no committed rows yet.

A plan is a tuple of cells ``"<label>@<budget>"`` or ``"<label>@<budget>/<limit>"``, the label as
:func:`evals.output.tables.method_label` prints it (``topk[n_dense_layers=2]``, ``arkvale[page_size=8]``). A cell
with a limit is held by a finished run of at least that many samples (a run of the first 50 problems holds a cell
of 20); a cell without one by a complete run. :func:`missing` lists the cells no run under a folder holds, so the
results page says which rows are still to be run (``docs/results.md``).

The plans of the paper's tables (IceCache, ICLR 2026, Table 2 and the GSM8K / LongGenBench comparisons), at this
harness's scale: budgets 64, 128 and 256 for IceCache, its tuned variant and the two bounds, IceCache's 64-token
readings (docs/fidelity.md), every other method at 256 and at 64 where it takes that budget, the live-prefill
methods (SnapKV, H2O) at 256; GSM8K-CoT at the paper's 10% budget on the first 50 problems for the full cache,
IceCache, IceCache(reuse) and PQCache and on the first 20 for the others, IceCache also at 64 and 256 (first 20);
LongGenBench at 256 on the short subset's first item of each of its four types.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .summary import collect
from .tables import budget_text, with_labels

BOUNDS = ("topk[n_dense_layers=2]", "page_oracle")
READINGS_64 = ("icecache[budget_layout=fixed, n_sink_pages=0]", "icecache[page_size=8]",
               "icecache[budget_layout=retrieved]")
AT_64_AND_256 = ("icecache_reuse", "pqcache", "quest", "omnikv", "magicpig", "streaming_llm")
LONGBENCH = ("full@64",
             *(f"{m}@{b}" for m in ("icecache", "icecache_tuned", *BOUNDS) for b in (64, 128, 256)),
             *(f"{m}@64" for m in READINGS_64),
             *(f"{m}@{b}" for m in AT_64_AND_256 for b in (64, 256)),
             "arkvale[page_size=8]@64", "arkvale@256", "snapkv@256", "h2o@256")
# on GSM8K the page oracle takes IceCache's index build there (conf/suite_cache/gsm8k_page_oracle.yaml), which its
# label names: ratio_1 is an official value of IceCache's, not of a method of the oracle's own
GSM8K = (*(f"{m}@0.1/50" for m in ("full", "icecache", "icecache_reuse", "pqcache")),
         "icecache@64/20", "icecache@256/20",
         *(f"{m}@0.1/20" for m in ("quest", "arkvale", "omnikv", "magicpig", "streaming_llm", "icecache_tuned",
                                    BOUNDS[0], "page_oracle[ratio_1=0.03]", "snapkv", "h2o")))
LONGGENBENCH = tuple(f"{m}@256/4" for m in ("full", "icecache", "icecache_reuse", "pqcache", "quest", "arkvale",
                                          "omnikv", "magicpig", "streaming_llm", "snapkv", "h2o"))


def held(frame: pd.DataFrame) -> list[tuple[str, str, int | None]]:
    """``(label, budget, samples or None)`` of each finished run of ``frame`` (a :func:`collect` frame):
    ``None`` for a complete run, the samples it ran for a finished limited one."""
    frame = with_labels(frame[frame["status"] != "incomplete"])
    return [(row["method"], budget_text(row["budget"]),
             None if row["status"] == "complete" else int(row["n_samples"])) for _, row in frame.iterrows()]


def missing(folder: str | Path, plan: tuple[str, ...]) -> list[str]:
    """The cells of ``plan`` that no finished run under ``folder`` holds, in the plan's order."""
    frame = collect(folder, 0) if Path(folder).is_dir() else pd.DataFrame()
    runs = held(frame) if not frame.empty else []
    out = []
    for cell in plan:
        label, _, rest = cell.rpartition("@")
        budget, _, limit = rest.partition("/")
        if not any(m == label and b == budget and (n is None or (limit and n >= int(limit)))
                   for m, b, n in runs):
            out.append(cell)
    return out


def missing_text(folder: str | Path, plan: tuple[str, ...]) -> str:
    """One line for the results page: the cells still to run, or that every cell has rows."""
    cells = missing(folder, plan)
    if not cells:
        return f"Every cell of this table's plan ({len(plan)} in all) has committed rows."
    return (f"Not yet run ({len(cells)} of the plan's {len(plan)} cells, `label@budget[/samples]`): "
            + ", ".join(f"`{c}`" for c in cells) + ".")
