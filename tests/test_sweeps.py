"""Sweeps through Hydra's submitit launcher (local here; the SLURM config up to the sbatch script) and
optional W&B logging in offline mode."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from evals.output import wandb_log
from evals.harness import run_eval

REPO = Path(__file__).resolve().parents[1]
SWEEP = ["cache=full,streaming_llm", "budget=64,256", "eval=passkey", "hydra/launcher=local", "model=tiny-llama",
         "limit=1", "eval.lengths=[256]"]


def run_py(*args, tmp_path, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # concurrent jobs on a small machine
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)


def job_results(sweep_dir: Path) -> dict[str, Path]:
    """Hydra job number -> the run directory that job printed (``results: <dir>`` in its submitit log)."""
    out = {}
    for log in sweep_dir.glob(".submitit/*/*_0_log.out"):
        lines = log.read_text().splitlines()
        run_dir = next(Path(line.split(": ", 1)[1]) for line in lines if line.startswith("results: "))
        out[log.parent.name] = run_dir
    return out


def snapshot(results_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(results_dir)): p.read_bytes() for p in results_dir.rglob("*")
            if p.is_file() and p.name in ("predictions.jsonl", "metrics.json")}


@pytest.mark.slow
def test_local_submitit_sweep_runs_each_job_in_its_own_directory_and_resumes(tmp_path):
    results_dir, first = tmp_path / "results", tmp_path / "sweep1"
    proc = run_py("-m", *SWEEP, f"results_dir={results_dir}", f"hydra.sweep.dir={first}", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # hydra's own outputs: multirun.yaml and one submitit folder per job (no empty per-job folders)
    assert sorted(p.name for p in first.iterdir() if not p.name.startswith(".")) == ["multirun.yaml"]
    runs = job_results(first)
    assert len(runs) == 4 and len(set(runs.values())) == 4, runs
    for run_dir in runs.values():
        assert (run_dir / "metrics.json").exists() and run_dir.parent == results_dir / "passkey" / "tiny-llama"
        assert len((run_dir / "predictions.jsonl").read_text().splitlines()) == 1
    # submitit jobs are not on a TTY: no progress bar in their logs
    assert not any("\r" in log.read_text() for log in first.glob(".submitit/*/*_log.err"))

    out = subprocess.run([sys.executable, "-m", "evals.output.summary", str(results_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = pd.read_csv(results_dir / "summary.csv")
    assert len(summary) == 4 and set(summary["status"]) == {"partial (limit=1)"}  # 1 of 10 depths
    assert sorted(zip(summary["cache"], summary["budget"])) == [("full", 64), ("full", 256),
                                                                ("streaming_llm", 64), ("streaming_llm", 256)]

    before = snapshot(results_dir)
    second = tmp_path / "sweep2"
    proc = run_py("-m", *SWEEP, f"results_dir={results_dir}", f"hydra.sweep.dir={second}", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(job_results(second).values()) == sorted(runs.values())
    assert snapshot(results_dir) == before  # finished samples are skipped, nothing is rewritten


def test_a_sweep_leaves_nothing_in_the_working_directory(tmp_path):
    """The default (basic) launcher: the run directories, and the sweep's multirun.yaml under results_dir."""
    work, results_dir = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), "-m", "cache=full,streaming_llm", "budget=32",
                           "model=tiny-llama", "limit=1", "eval.lengths=[128]", "progress=false",
                           f"results_dir={results_dir}"], cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(work.iterdir()) == []
    (sweep,) = results_dir.glob("sweeps/*/*")
    assert [p.name for p in sweep.iterdir()] == ["multirun.yaml"]
    assert len(list(results_dir.glob("passkey/tiny-llama/*/metrics.json"))) == 2


@pytest.mark.slow
def test_user_error_in_a_submitit_sweep_fails_only_that_job(tmp_path):
    results_dir = tmp_path / "results"
    proc = run_py("-m", "cache=streaming_llm", "budget=2,32", "hydra/launcher=local", "model=tiny-llama",
                  "limit=1", "eval.lengths=[128]", f"results_dir={results_dir}", f"hydra.sweep.dir={tmp_path / 'sw'}",
                  tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "Error executing job with overrides: ['cache=streaming_llm', 'budget=2'" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("budget 2 must exceed n_sink=4 (sinks + at least one "
                                                         "recent token); try budget=64")
    finished = list(results_dir.glob("passkey/tiny-llama/*/metrics.json"))
    assert [p.parent.name.split("-")[1] for p in finished] == ["b32"]


def test_slurm_launcher_settings_reach_the_sbatch_script(tmp_path):
    """The real launcher code path up to submission: a stand-in ``sbatch`` keeps the script and refuses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/job.sh\necho refused >&2\nexit 1\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    proc = run_py("-m", "cache=full,streaming_llm", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                  "hydra.launcher.timeout_min=90", "model=tiny-llama", f"results_dir={tmp_path / 'results'}",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", tmp_path=tmp_path,
                  env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode != 0 and "refused" in proc.stderr
    script = (tmp_path / "job.sh").read_text()
    for line in ("--array=0-1%2", "--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--mem=64GB",
                 "--time=90"):
        assert f"#SBATCH {line}\n" in script
    assert f"{tmp_path / 'sweep'}/.submitit/%A_%a/" in script  # logs per array task, inside the sweep dir


# ----------------------------------------------------------------------------------------------- W&B
def wandb_records(path: Path):
    """Records of a ``.wandb`` transaction log (LevelDB log format after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk = path.read_bytes()[7:], 32768, 0, b""
    while pos + 7 <= len(data):
        if block - (pos + 7) % block < 7:  # block trailer padding
            pos += block - (pos + 7) % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def tiny_cfg(tmp_path, **over):
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "streaming_llm"}, "eval": {"name": "passkey", "lengths": [128], "depths": 2,
                                                        "question_via_decode": True, "max_new_tokens": 4},
           "budget": 32, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "progress": False}
    return {**cfg, **over}


def test_wandb_offline_run_has_names_summary_and_predictions(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_cfg(tmp_path, wandb={"enabled": True, "project": "kv-test", "entity": None, "mode": "offline"})
    run_dir = run_eval(cfg)
    wandb.teardown()  # the W&B service writes the transaction log asynchronously; flushed at exit/teardown
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    rid = wandb_log.run_id(run_dir)
    assert offline.name.endswith(rid)
    records = list(wandb_records(offline / f"run-{rid}.wandb"))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.display_name) == ("kv-test", "passkey/tiny-llama", run_dir.name)
    assert set(run.tags) == {"passkey", "tiny-llama", "streaming_llm", "budget=32"}
    assert {"model", "cache", "eval", "budget"} <= {item.key for item in run.config.update}
    summary = {item.key or "/".join(item.nested_key): item.value_json for r in records
               if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    expected = {"score", "task/passkey_128", "n_samples", "ttft_s", "tt2t_s", "tpot_s", "tpot_p50_s", "tpot_p90_s",
                "breakdown/select", "breakdown/transfer", "breakdown/attention", "breakdown/update",
                "breakdown/other", "peak_memory_bytes", "effective_tokens_mean", "max_resident_tokens",
                "predictions", "effective_tokens_per_layer_table", "tpot_breakdown_table"}
    assert expected <= {k.split("/")[0] if k.startswith(("predictions/", "effective_tokens_per_layer_table/",
                                                         "tpot_breakdown_table/")) else k for k in summary}
    assert json.loads(summary["effective_tokens_mean"]) == 32
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert json.loads(summary["score"]) == pytest.approx(metrics["score"])
    (table,) = (offline / "files" / "media" / "table").glob("predictions_*.table.json")
    predictions = json.loads(table.read_text())
    assert predictions["columns"][:5] == ["id", "task", "reference", "prediction", "score"]
    assert [row[0] for row in predictions["data"]] == ["passkey-128-0.000", "passkey-128-0.500"]
    # each sample logged a step while the run was going, before the summary
    steps = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
             for r in records if r.WhichOneof("record_type") == "history"]
    live = [step for step in steps if "samples_done" in step]
    assert [step["samples_done"] for step in live] == [1, 2]
    assert all({"sample/score", "sample/tt2t_s"} <= set(step) for step in live)


def test_wandb_is_not_imported_when_disabled():
    code = ("import sys; from evals import harness; from evals.output import wandb_log; "
            "assert wandb_log.log_run({'wandb': {'enabled': False}}, None) is None; "
            "assert 'wandb' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
