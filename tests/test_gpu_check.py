"""scripts/gpu_check.py: the cell plan covers every (method, length) once, and the report renders."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_every_cell_is_planned_and_ordered_once():
    for cfg in (gpu_check.GPU, gpu_check.CPU):
        order = gpu_check.cell_order(cfg["lengths"])
        assert sorted(order) == sorted((m, L) for m in gpu_check.METHODS for L in cfg["lengths"])
    assert set(gpu_check.PLAN_S) == set(gpu_check.METHODS)
    assert all(set(by_len) == set(gpu_check.GPU["lengths"]) for by_len in gpu_check.PLAN_S.values())
    order = gpu_check.cell_order(gpu_check.GPU["lengths"])
    assert order[0] == ("full", 8192) and order.index(("icecache", 131072)) < order.index(("pqcache", 32768))
    assert gpu_check.cell_order([32768], ["pqcache", "full"]) == [("full", 32768), ("pqcache", 32768)]


def test_report_renders_measured_skipped_and_failed_cells():
    row = {"tt2t_s": 1.5, "tpot_s": 0.02, "breakdown": {"select": 0.001, "transfer": 0.002, "attention": 0.003,
                                                         "update": 0.0, "other": 0.014},
           "peak_memory_bytes": 3 * 2 ** 30}
    report = {"environment": {"model": "llama-8b-random", "gpu": "NVIDIA H200", "dtype": "torch.bfloat16",
                              "budget": 256, "new_tokens": 64, "torch": "2.11.0"},
              "parts": {"b_cuda_tests": {"elapsed_s": 80.0}}, "tests": "43 passed",
              "cells": {"full": {"8192": row}, "icecache": {"8192": {**row, "tpot_s": 0.01},
                                                            "131072": {"skipped": "planned 150 s > 20 s left"}},
                        "pqcache": {"8192": {"error": "RuntimeError: boom\n"}}}}
    md = gpu_check.markdown(report)
    assert "| full | 8192 | 1.50 | 20.0 | 1.0 | 2.0 | 3.0 | 0.0 | 14.0 | 3.0 | 1.00 |" in md
    assert "| icecache | 8192 | 1.50 | 10.0 |" in md and "| 0.50 |" in md
    assert "planned 150 s > 20 s left" in md and "RuntimeError: boom" in md
    assert all(line.count("|") == 12 for line in md.splitlines() if line.startswith("| "))


def test_the_documented_time_plan_is_the_one_the_check_uses():
    """docs/gpu.md's "Time plan" table is ``PLAN_S``, row for row."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    table = text[text.index("## Time plan"):]
    for method, by_len in gpu_check.PLAN_S.items():
        cells = " | ".join(f"{by_len[L]:,}" for L in gpu_check.GPU["lengths"])
        assert f"| {method} | {cells} |" in table, method
