"""``limit`` (part of a suite): a run of its own (directory and hash), a status that is not ``complete``, a
warning when it starts and with its results, samples spread over the suite's grid and tasks, and the summary's
console ``n``."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import DATA_DIR, build_byte_tokenizer
from test_ruler import tokenizer  # noqa: F401  (the fixture: a BPE trained on RULER's words)

from evals.harness import run_eval
from evals.models import tiny_tokenizer
from evals.output import results, summary
from evals.output.schema import limit_warning, run_status, sample_count
from evals.task import spread
from evals.tasks.gsm8k import GSM8K
from evals.tasks.longbench import LongBench
from evals.tasks.passkey import Passkey
from evals.tasks.ruler import Ruler

needs_config = pytest.mark.skipif(not (DATA_DIR / "longbench_config").is_dir(),
                                  reason=f"official LongBench config not found at {DATA_DIR}/longbench_config")


def tiny_cfg(tmp_path, **over):
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "streaming_llm"},
           "eval": {"name": "passkey", "lengths": [160], "depths": 3, "question_via_decode": True,
                    "max_new_tokens": 4},
           "budget": 32, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "debug": False, "progress": False}
    return {**cfg, **over}


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def never(row):
    raise AssertionError(f"sample {row['id']} was computed again")


# ---------------------------------------------------------------- identity: a limited run is a run of its own
def test_limit_is_part_of_the_run_directory_and_hash_only_when_set(tmp_path):
    whole, limited = tiny_cfg(tmp_path), tiny_cfg(tmp_path, limit=1)
    assert results.run_dir_for(limited) != results.run_dir_for(whole)
    assert results.config_hash(limited) != results.config_hash(whole)
    assert results.run_dir_for(limited).name.startswith("streaming_llm-b32-limit1-")
    assert results.run_dir_for(tiny_cfg(tmp_path, limit=2)) != results.run_dir_for(limited)
    no_key = {k: v for k, v in whole.items() if k != "limit"}  # a run without limit keeps its identity
    assert results.run_dir_for(no_key) == results.run_dir_for(whole)
    assert results.config_hash(no_key) == results.config_hash(whole)
    assert results.run_dir_for(tiny_cfg(tmp_path, limit=1.0)) == results.run_dir_for(limited)


def test_a_limited_run_never_mixes_with_the_whole_run_and_resumes_under_its_limit(tmp_path):
    limited = run_eval(tiny_cfg(tmp_path, limit=1))
    assert metrics(limited)["n_samples"] == 1
    assert run_eval(tiny_cfg(tmp_path, limit=1), on_row=never) == limited  # same limit: resumed, nothing redone
    computed = []
    whole = run_eval(tiny_cfg(tmp_path), on_row=lambda r: computed.append(r["id"]))
    assert whole != limited and len(computed) == 3 and metrics(whole)["n_samples"] == 3
    assert metrics(limited)["n_samples"] == 1  # the whole run did not touch the limited one
    assert run_eval(tiny_cfg(tmp_path, limit=1), on_row=never) == limited and metrics(limited)["n_samples"] == 1


# ---------------------------------------------------------------- status and warning
def test_limited_run_is_partial_and_warns_at_start_and_with_its_results(tmp_path, capsys):
    run_dir = run_eval(tiny_cfg(tmp_path, limit=1))
    err = capsys.readouterr().err
    expected = "WARNING: limit=1: 1 of 3 samples; scores are not comparable to full runs"
    assert expected in err
    found = metrics(run_dir)
    assert (found["limit"], found["n_total"], found["n_samples"]) == (1, 3, 1)
    assert run_status(found, {}) == "partial (limit=1)"
    summary.print_run(run_dir)
    assert expected in capsys.readouterr().err
    whole = metrics(run_eval(tiny_cfg(tmp_path)))
    assert (whole["limit"], whole["n_total"]) == (None, 3) and run_status(whole, {}) == "complete"
    assert "WARNING" not in capsys.readouterr().err


def test_status_is_complete_only_when_the_whole_suite_ran():
    assert run_status(None, {}) == "incomplete" and run_status({"n_samples": 3}, None) == "incomplete"
    assert run_status({"n_samples": 6, "limit": 1, "n_total": 4750}, {}) == "partial (limit=1)"
    assert run_status({"n_samples": 6, "limit": 10, "n_total": 6}, {}) == "complete"  # the limit covered it all
    assert run_status({"n_samples": 6, "limit": 2, "n_total": None}, {}) == "partial (limit=2)"
    assert run_status({"n_samples": 6}, {}, limit=2) == "partial (limit=2)"  # older metrics: the config's limit
    assert run_status({"n_samples": 6}, {}) == "complete"
    assert limit_warning(1, 6, 4750) == "WARNING: limit=1: 6 of 4,750 samples; scores are not comparable to full runs"
    assert "6 samples of a larger suite" in limit_warning(1, 6, None)


# ---------------------------------------------------------------- which samples a limit keeps
def test_spread_keeps_distinct_evenly_spaced_indices_the_middle_one_first():
    assert spread(10, 1) == [5] and spread(3, 1) == [1] and spread(10, 2) == [2, 7]
    assert spread(4, None) == spread(4, 4) == spread(4, 9) == [0, 1, 2, 3]
    for n in range(1, 30):
        for k in range(1, n + 1):
            picked = spread(n, k)
            assert len(set(picked)) == k == len(picked) and picked == sorted(picked) and picked[-1] < n
            assert k == 1 or picked[-1] - picked[0] >= (n - 1) * (k - 1) // k  # spread, not a prefix


@pytest.mark.parametrize("grid", ["linear", "quest"])
def test_passkey_limit_spreads_over_the_depths_never_only_depth_0(grid):
    tok = tiny_tokenizer()
    suite = lambda limit: Passkey(tok, lengths=[128, 256], depths=10, depth_grid=grid, limit=limit)  # noqa: E731
    one = list(suite(1).samples())
    assert {s.meta["length"] for s in one} == {128, 256}  # every length
    assert all(0.4 <= s.meta["depth"] <= 0.6 for s in one)  # the middle depth, not 0 (the sink pages)
    for k in (2, 3, 5, 10):
        samples = list(suite(k).samples())
        for length in (128, 256):
            depths = [s.meta["depth"] for s in samples if s.meta["length"] == length]
            assert len(set(depths)) == k and max(depths) - min(depths) > 0.45
    everything = list(suite(None).samples())
    assert suite(1).n_total() == len(everything) == 20
    keys = {s.id: s.reference for s in everything}  # a limited sample is the whole run's sample of its id
    assert all(keys[s.id] == s.reference for s in one)


def test_ruler_limit_spreads_over_every_task_and_length(tokenizer):  # noqa: F811 (the fixture)
    tasks = ["niah_single_1", "niah_multikey_2", "vt", "fwe"]
    suite = Ruler(tokenizer, lengths=[1024, 2048], num_samples=5, limit=1, tasks=tasks, max_length=4096,
                  model_template="base")
    cells = Counter((s.task, s.meta["length"]) for s in suite.samples())
    assert cells == Counter({(t, n): 1 for t in tasks for n in (1024, 2048)})
    assert suite.n_total() == len(tasks) * 2 * 5


@needs_config
def test_longbench_limit_spreads_over_every_task_and_counts_the_whole_data(tmp_path):
    from test_longbench import _row, _write_data

    _write_data(tmp_path, {"qasper": [_row(_id=f"q{i}") for i in range(5)],
                           "hotpotqa": [_row(_id=f"h{i}") for i in range(3)],
                           "musique": [_row(_id=f"m{i}") for i in range(2)]})
    tasks = ["qasper", "hotpotqa", "musique"]
    suite = LongBench(build_byte_tokenizer(), data_dir=tmp_path, tasks=tasks, limit=1, max_length=1 << 16)
    assert Counter(s.task for s in suite.samples()) == Counter(tasks)
    assert suite.n_total() == 10
    two = LongBench(build_byte_tokenizer(), data_dir=tmp_path, tasks=tasks, limit=2, max_length=1 << 16)
    assert Counter(s.task for s in two.samples()) == Counter({"qasper": 2, "hotpotqa": 2, "musique": 2})


def test_gsm8k_counts_its_whole_test_file(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": f"q{i}?", "answer": f"So {i}.\n#### {i}"} for i in range(7)]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "gsm8k" / "cot_prompt_10shot.txt").write_text("Q: 1+1?\nA: 2\n")
    suite = GSM8K(build_byte_tokenizer(), data_dir=tmp_path, limit=2)
    assert suite.n_total() == 7 and len(list(suite.samples())) == 2


# ---------------------------------------------------------------- summary
def test_summary_marks_limited_runs_and_its_console_shows_n(tmp_path, capsys):
    limited = run_eval(tiny_cfg(tmp_path, limit=1))
    whole = run_eval(tiny_cfg(tmp_path))
    capsys.readouterr()
    frame = summary.collect(tmp_path / "results", draws=20).set_index("run_dir")
    part, full = frame.loc[str(limited)], frame.loc[str(whole)]
    assert part["status"] == "partial (limit=1)" and full["status"] == "complete"
    assert (part["limit"], part["n_total"], part["n_samples"]) == (1, 3, 1)
    assert part["variant"] == "limit=1" and full["variant"] == ""  # never pooled under one label
    summary.main([str(tmp_path / "results"), "--draws", "20"])
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    assert "n" in header and "status" in header
    rows = [line for line in out[1:] if "streaming_llm" in line]
    assert any(" 1/3 " in line and "partial (limit=1)" in line for line in rows), out
    assert any(" 3 " in line and line.rstrip().endswith("complete") for line in rows), out
    assert sample_count(6, 4750) == "6/4750" and sample_count(3, 3) == "3" and sample_count(float("nan"), None) == ""
