"""Runner, results directories, resume, summary and the command line (tiny model, seconds)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evals.output import results
from evals.harness import ConfigError, run_eval
from evals.output.summary import collect

REPO = Path(__file__).resolve().parents[1]


def tiny_cfg(tmp_path, cache="streaming_llm", budget=32, **over):
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": cache}, "eval": {"name": "passkey", "lengths": [160], "depths": 3,
                                              "question_via_decode": True, "max_new_tokens": 4},
           "budget": budget, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"),
           "data_dir": None, "device": "cpu", "debug": True, "progress": False}
    cfg.update(over)
    return cfg


def read_rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "predictions.jsonl").read_text().splitlines()]


def test_run_writes_predictions_metrics_and_timing(tmp_path):
    run_dir = run_eval(tiny_cfg(tmp_path))
    rows = read_rows(run_dir)
    assert [r["id"] for r in rows] == ["passkey-160-0.000", "passkey-160-0.333", "passkey-160-0.667"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= metrics["score"] <= 100 and set(metrics["tasks"]) == {"passkey_160"}
    timing = json.loads((run_dir / "timing.json").read_text())
    for key in ("tt2t_s", "tpot_s", "ttft_s", "tpot_p50_s", "tpot_p90_s", "breakdown", "peak_memory_bytes"):
        assert key in timing
    assert set(timing["breakdown"]) == {"select", "transfer", "attention", "update", "other"}
    assert timing["effective_tokens_per_layer"] == [32.0] * 4
    assert timing["max_resident_tokens"] <= 32
    assert (run_dir / "config.yaml").exists()
    assert run_dir.name.startswith("streaming_llm-b32-")


def test_interrupted_run_resumes_with_one_prediction_per_sample(tmp_path):
    class Interrupt(Exception):
        pass

    seen = []

    def stop_after_two(row):
        seen.append(row["id"])
        if len(seen) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_eval(tiny_cfg(tmp_path), on_row=stop_after_two)
    resumed = []
    run_dir = run_eval(tiny_cfg(tmp_path), on_row=lambda r: resumed.append(r["id"]))
    ids = [r["id"] for r in read_rows(run_dir)]
    assert len(resumed) == 1 and len(ids) == len(set(ids)) == 3


def test_torn_last_line_is_repaired(tmp_path):
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n{"id": "c", "x"')
    rows = results.load_predictions(path, repair=True)
    assert [r["id"] for r in rows] == ["a", "b"]
    assert path.read_text() == '{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n'


def test_run_directory_of_another_config_is_never_reused(tmp_path):
    cfg = tiny_cfg(tmp_path)
    run_dir = results.run_dir_for(cfg)
    results.RunDir(run_dir, cfg, "")
    other = dict(cfg, seed=1)
    with pytest.raises(results.RunDirError, match="different configuration"):
        results.RunDir(run_dir, other, "")


def test_limit_is_validated_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="limit must be >= 1"):
        run_eval(tiny_cfg(tmp_path, limit=0))


def test_summary_has_one_row_per_run(tmp_path):
    run_eval(tiny_cfg(tmp_path, cache="full", budget=None))
    run_eval(tiny_cfg(tmp_path, cache="streaming_llm", budget=32))
    partial = tmp_path / "results" / "passkey" / "tiny-llama" / "h2o-b32-partial"
    results.RunDir(partial, tiny_cfg(tmp_path, cache="h2o"), "cache:\n  name: h2o\n")  # no metrics yet
    frame = collect(tmp_path / "results")
    assert sorted(frame["cache"]) == ["full", "h2o", "streaming_llm"]
    assert dict(zip(frame["cache"], frame["status"])) == {"full": "complete", "h2o": "incomplete",
                                                          "streaming_llm": "complete"}


def run_cli(*args, tmp_path):
    return subprocess.run([sys.executable, "run.py", "model=tiny-llama", f"results_dir={tmp_path}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["cache=nope"], "cache=nope is not an option of cache"),
    (["cache=streaming_llm", "budget=2"], "budget 2 must exceed n_sink=4"),
    (["budget=-1", "cache=streaming_llm"], "budget must be positive"),
    (["limit=0"], "limit must be >= 1"),
    (["eval.lengths=[99999]"], "exceeds the model's maximum"),
])
def test_cli_user_errors_are_one_clear_line(tmp_path, args, message):
    proc = run_cli(*args, tmp_path=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_cli_prints_results_dir_last(tmp_path):
    proc = run_cli("cache=streaming_llm", "budget=32", "eval.lengths=[128]", "eval.depths=1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("results: ") and Path(last.split(": ", 1)[1], "metrics.json").exists()


def test_timing_json_records_the_method_stats_per_layer(tmp_path):
    """MagicPIG's chosen K, expected sample size and (calibrated) target per sparse layer reach timing.json; the
    dense layers 0 and 2 of the 4-layer model have none."""
    run_dir = run_eval(tiny_cfg(tmp_path, cache="magicpig_calibrated", budget=24))
    timing = json.loads((run_dir / "timing.json").read_text())
    stats = timing["method_stats"]
    assert set(stats) == {"lsh_bits", "expected_samples", "sample_target"}
    assert stats["lsh_bits"][0] is None and stats["lsh_bits"][2] is None
    assert all(stats["lsh_bits"][i] > 0 and stats["sample_target"][i] == 10 for i in (1, 3))
    per_sample = [r["timing"]["method_stats"]["lsh_bits"][1] for r in read_rows(run_dir)]
    assert stats["lsh_bits"][1] == pytest.approx(sum(per_sample) / len(per_sample))
    plain = json.loads((run_eval(tiny_cfg(tmp_path)) / "timing.json").read_text())
    assert plain["method_stats"] == {}
