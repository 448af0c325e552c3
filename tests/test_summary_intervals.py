"""Bootstrap intervals of the summary table: each run's score with a percentile interval over its samples and its
paired difference to the full cache, checked against plain-loop computations on crafted rows and run directories."""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from evals.output import results, summary
from evals.tasks.gsm8k import GSM8K
from evals.tasks.longbench import LongBench
from evals.tasks.longgenbench import LongGenBench
from evals.tasks.passkey import Passkey
from evals.tasks.ruler import Ruler

DRAWS = 300


def row(sid: str, task: str, score: float, length: int = 1024, **scores) -> dict:
    return {"id": sid, "task": task, "prediction": "", "reference": "", "scores": {"score": score, **scores},
            "meta": {"length": length}, "timing": None}


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, by hand."""
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def hand_replicates(row_lists: list[list[dict]], draws: int, seed: int) -> list[list[float]]:
    """Mean over tasks of each task's mean (x100) of each aligned row list, for ``draws`` resamples drawn within each
    task (tasks in order of first appearance), one index draw shared by the lists: a plain loop."""
    rng = np.random.default_rng(seed)
    tasks = list(dict.fromkeys(r["task"] for r in row_lists[0]))
    positions = {t: [i for i, r in enumerate(row_lists[0]) if r["task"] == t] for t in tasks}
    indices = {t: rng.integers(0, len(positions[t]), (draws, len(positions[t]))) for t in tasks}
    out = [[] for _ in row_lists]
    for d in range(draws):
        for k, rows in enumerate(row_lists):
            per_task = []
            for t in tasks:
                picked = [rows[positions[t][j]]["scores"]["score"] for j in indices[t][d]]
                per_task.append(100 * sum(picked) / len(picked))
            out[k].append(sum(per_task) / len(per_task))
    return out


MIXED = ([row(f"a-{i}", "passkey_a", s) for i, s in enumerate([1, 0, 1, 1, 0, 1, 0])] +
         [row(f"b-{i}", "passkey_b", s) for i, s in enumerate([1, 1, 0, 1, 1])])


def test_score_interval_is_the_percentile_interval_of_resampled_means():
    out = summary.score_interval(MIXED, summary.TASK_MEAN, draws=DRAWS, seed=3)
    (boot,) = hand_replicates([MIXED], DRAWS, 3)
    assert out["n"] == len(MIXED)
    assert out["score"] == pytest.approx((100 * 4 / 7 + 100 * 4 / 5) / 2, abs=1e-12)
    assert out["score_ci_low"] == pytest.approx(percentile(boot, 2.5), abs=1e-9)
    assert out["score_ci_high"] == pytest.approx(percentile(boot, 97.5), abs=1e-9)
    assert out["score_ci_low"] < out["score"] < out["score_ci_high"]
    again = summary.score_interval(MIXED, summary.TASK_MEAN, draws=DRAWS, seed=3)
    assert again == out  # a fixed seed: the same interval every time


def test_constant_scores_have_a_zero_width_interval():
    for value in (0.0, 1.0):
        rows = [row(f"{t}-{i}", t, value) for t in ("a", "b") for i in range(6)]
        out = summary.score_interval(rows, summary.TASK_MEAN, draws=DRAWS)
        assert out["score"] == out["score_ci_low"] == out["score_ci_high"] == 100 * value


def test_a_method_equal_to_full_differs_by_zero_with_a_zero_width_interval():
    out = summary.paired_difference(MIXED, [dict(r) for r in MIXED], summary.TASK_MEAN, draws=DRAWS)
    assert (out["diff_to_full"], out["diff_ci_low"], out["diff_ci_high"], out["n_paired"]) == (0, 0, 0, len(MIXED))


def test_paired_difference_uses_only_the_common_samples_with_one_draw_for_both():
    full = [row(r["id"], r["task"], 1.0 - r["scores"]["score"] * (i % 2)) for i, r in enumerate(MIXED)]
    full += [row("a-extra", "passkey_a", 1.0)]  # full only: left out
    method = [r for r in MIXED if r["id"] not in ("a-0", "b-4")] + [row("b-extra", "passkey_b", 0.0)]  # ids it alone has
    common = [r for r in method if r["id"] in {f["id"] for f in full}]
    full_common = [next(f for f in full if f["id"] == r["id"]) for r in common]
    out = summary.paired_difference(method, full, summary.TASK_MEAN, draws=DRAWS, seed=5)
    assert out["n_paired"] == len(common) == len(MIXED) - 2
    own_point = summary.score_interval(common, summary.TASK_MEAN, draws=2)["score"]
    full_point = summary.score_interval(full_common, summary.TASK_MEAN, draws=2)["score"]
    assert out["diff_to_full"] == pytest.approx(own_point - full_point, abs=1e-12)
    own, ref = hand_replicates([common, full_common], DRAWS, 5)
    diffs = [a - b for a, b in zip(own, ref)]
    assert out["diff_ci_low"] == pytest.approx(percentile(diffs, 2.5), abs=1e-9)
    assert out["diff_ci_high"] == pytest.approx(percentile(diffs, 97.5), abs=1e-9)


def test_no_common_sample_leaves_the_difference_empty():
    out = summary.paired_difference(MIXED[:3], MIXED[3:], summary.TASK_MEAN, draws=DRAWS)
    assert out == {"diff_to_full": None, "diff_ci_low": None, "diff_ci_high": None, "n_paired": 0}


def ruler_rows(rng: random.Random) -> list[dict]:
    return [row(f"{task}-{length}-{i}", task, rng.choice([0.0, 0.5, 1.0]), length=length, null=0.0)
            for task in ("niah_single_1", "niah_multikey_1", "vt") for length in (1024, 2048)
            for i in range(3 if length == 1024 else 7) if not (task == "vt" and length == 2048)]


def suites_and_rows():
    rng = random.Random(0)
    ruler = object.__new__(Ruler)
    ruler.skipped = {}
    gsm = object.__new__(GSM8K)
    gsm.protocol = "lm_eval"
    lgb = object.__new__(LongGenBench)
    lgb.subset, lgb.judge_model, lgb.decoding, lgb.max_new_tokens_cap = "short", None, "official", None
    longbench = [row(f"{t}-{i}", t, rng.random()) for t in ("qasper", "trec", "dureader") for i in range(3 + len(t) % 4)]
    gsm_rows = [row(f"gsm8k-{i}", "gsm8k", float(rng.random() < 0.6), strict_match=0.0, flexible_extract=0.0)
                for i in range(9)]
    kinds = {f"{k}_{p}": float(rng.randint(0 if p == "yes" else 3, 3 if p == "yes" else 6))
             for k in ("once", "range", "periodic") for p in ("yes", "judged")}
    lgb_rows = [row(f"short-{i}", "Week", 0.0, completion_rate=1.0, **{k: v + i % 2 for k, v in kinds.items()})
                for i in range(6)]
    return [("passkey", object.__new__(Passkey), MIXED), ("ruler", ruler, ruler_rows(rng)),
            ("longbench", object.__new__(LongBench), longbench), ("gsm8k", gsm, gsm_rows),
            ("longgenbench", lgb, lgb_rows)]


@pytest.mark.parametrize("name", ["passkey", "ruler", "longbench", "gsm8k", "longgenbench"])
def test_point_estimate_is_the_suites_own_score(name):
    """Each eval's aggregate (per-task means, RULER's (length, task) cells, LongBench's rounded English tasks,
    LongGenBench's pooled checks) recomputed from the per-stratum means equals Suite.aggregate's score."""
    _, suite, rows = next(s for s in suites_and_rows() if s[0] == name)
    out = summary.score_interval(rows, summary.AGGREGATES[name], draws=DRAWS)
    assert out["score"] == pytest.approx(suite.aggregate(rows)["score"], abs=1e-9)
    assert out["score_ci_low"] <= out["score_ci_high"]


def test_ruler_resamples_within_each_length_and_task_cell():
    """Every replicate keeps each (length, task) cell's size: a cell that is constant stays constant, so a run whose
    cells are each constant has a zero-width interval although its samples differ."""
    rows = [row(f"{t}-{n}-{i}", t, float(n == 2048), length=n) for t in ("a", "b") for n in (1024, 2048) for i in range(4)]
    out = summary.score_interval(rows, summary.AGGREGATES["ruler"], draws=DRAWS)
    assert out["score"] == out["score_ci_low"] == out["score_ci_high"] == 50.0


# ---------------------------------------------------------------- run directories
def write_run(root: Path, cache: str, budget, rows: list[dict], seed: int = 0, ev: str = "ruler",
              score: float | None = None) -> Path:
    """A finished run directory as evals/harness.py writes it; metrics.json from the suite's aggregate."""
    cfg = {"eval": {"name": ev}, "model": {"name": "tiny-llama"}, "cache": {"name": cache}, "budget": budget,
           "seed": seed, "results_dir": str(root)}
    run_dir = results.run_dir_for(cfg)
    run = results.RunDir(run_dir, cfg, yaml.safe_dump(cfg))
    for r in rows:
        run.append(r)
    suite = object.__new__(Ruler)
    suite.skipped = {}
    metrics = suite.aggregate(rows) if ev == "ruler" else Passkey.aggregate(None, rows)
    if score is not None:
        metrics["score"] = score
    results.write_json(run_dir / "metrics.json", metrics)
    results.write_json(run_dir / "timing.json", {"ttft_s": 0.5, "tt2t_s": 0.6, "tpot_s": 0.01})
    return run_dir


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    full = ruler_rows(random.Random(1))
    write_run(root, "full", 64, full)
    write_run(root, "full", 256, full[:-3])  # a budget sweep repeats full: the one sharing most samples is used
    method = [dict(r, scores={"score": r["scores"]["score"] * (i % 3 > 0), "null": 0.0}) for i, r in enumerate(full)]
    write_run(root, "icecache", 128, method[2:])  # two samples fewer
    write_run(root, "streaming_llm", 64, method, seed=1)  # another seed: no full run to pair with
    write_run(root, "quest", 64, method, score=12.0)  # metrics.json from another aggregate: no interval
    return root


def test_collect_fills_intervals_and_differences(results_dir, capsys):
    frame = summary.collect(results_dir, draws=DRAWS).set_index(["cache", "budget"])
    err = capsys.readouterr().err
    full = frame.loc[("full", 64)]
    assert (full["diff_to_full"], full["diff_ci_low"], full["diff_ci_high"], full["n_paired"]) == (0, 0, 0, full["n"])
    assert full["score_ci_low"] <= full["score"] <= full["score_ci_high"]
    ice = frame.loc[("icecache", 128)]
    rows = results.load_predictions(Path(ice["run_dir"]) / "predictions.jsonl")
    full_rows = results.load_predictions(Path(full["run_dir"]) / "predictions.jsonl")
    expected = summary.paired_difference(rows, full_rows, summary.AGGREGATES["ruler"], draws=DRAWS)
    assert ice["n"] == len(rows) and ice["n_paired"] == len(rows) == expected["n_paired"]
    assert ice["diff_to_full"] == pytest.approx(expected["diff_to_full"], abs=1e-12) and ice["diff_to_full"] < 0
    assert (ice["diff_ci_low"], ice["diff_ci_high"]) == pytest.approx((expected["diff_ci_low"], expected["diff_ci_high"]))
    assert ice["score"] == pytest.approx(summary.score_interval(rows, summary.AGGREGATES["ruler"], draws=2)["score"])
    unpaired = frame.loc[("streaming_llm", 64)]
    assert not np.isnan(unpaired["score_ci_low"]) and np.isnan(unpaired["diff_to_full"])
    assert np.isnan(frame.loc[("quest", 64)]["score_ci_low"]) and "quest" in err and "differs" in err


def test_intervals_do_not_depend_on_the_other_runs(results_dir, tmp_path):
    alone = tmp_path / "alone"
    full = ruler_rows(random.Random(1))
    write_run(alone, "full", 64, full)
    a = summary.collect(results_dir, draws=DRAWS).set_index(["cache", "budget"]).loc[("full", 64)]
    b = summary.collect(alone, draws=DRAWS).iloc[0]
    assert (a["score_ci_low"], a["score_ci_high"]) == (b["score_ci_low"], b["score_ci_high"])


def test_console_table_prints_the_interval_columns(results_dir, capsys):
    summary.main([str(results_dir), "--draws", str(DRAWS)])
    header = capsys.readouterr().out.splitlines()[0].split()
    assert [c for c in header if c in summary.INTERVAL_COLUMNS] == list(summary.INTERVAL_COLUMNS)
    assert header.index("score") < header.index("score_ci_low")
