"""Threads and OpenMP waiting chosen from the load (evals/threads.py): the decision on crafted loads and
environments, the start-up reading of the command line, the per-job check, and run.py recording its choice in
timing.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals import threads
from evals.config import ConfigError, check_config
from evals.threads import Choice, Load, check_thread_settings, decide

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
TWO_CORES_ALONE = Load(cores=2, online=2, runnable_others=0)
TWO_CORES_THREE_OTHERS = Load(cores=2, online=2, runnable_others=3)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No start-up or job choice of an earlier test, and no OpenMP settings inherited from the shell."""
    monkeypatch.setattr(threads, "_startup", None)
    monkeypatch.setattr(threads, "_job", None)
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", threads.PLAN_VAR, *threads.WAIT_VARS):
        monkeypatch.delenv(var, raising=False)


def loadavg(tmp_path: Path, running: int) -> Path:
    path = tmp_path / "loadavg"
    path.write_text(f"3.75 2.54 1.68 {running}/117 22286\n")
    return path


def test_alone_keeps_every_core_spinning():
    choice = decide("auto", "auto", TWO_CORES_ALONE, environ={})
    assert (choice.threads, choice.omp_wait, choice.adapted) == (None, "spin", False)


def test_three_competitors_on_two_cores_give_one_passive_thread():
    choice = decide("auto", "auto", TWO_CORES_THREE_OTHERS, environ={})
    assert (choice.threads, choice.omp_wait, choice.threads_by, choice.omp_wait_by) == (1, "passive", "auto", "auto")
    assert choice.adapted and "3 other runnable threads" in threads.describe(choice)


def test_a_share_that_fits_its_cores_keeps_spinning():
    choice = decide("auto", "auto", Load(cores=8, online=8, runnable_others=1), environ={})
    assert (choice.threads, choice.omp_wait) == (4, "spin")


def test_parallel_sweep_jobs_count_as_competitors():
    choice = decide("auto", "auto", Load(cores=2, online=2, runnable_others=0, jobs=4), environ={})
    assert (choice.threads, choice.omp_wait) == (1, "passive")


def test_machine_wide_load_is_scaled_to_the_cores_this_process_may_use():
    assert Load(cores=2, online=64, runnable_others=32).sharers == 2  # 32 busy threads over 64 CPUs: 1 per 2
    assert Load(cores=2, online=64, runnable_others=8).sharers == 1


def test_explicit_environment_wins_over_load_and_config():
    env = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}
    choice = decide(1, "passive", TWO_CORES_THREE_OTHERS, environ=env)
    assert (choice.threads, choice.omp_wait, choice.threads_by, choice.omp_wait_by) == (2, "active", "environment",
                                                                                        "environment")
    choice = decide("auto", "auto", TWO_CORES_THREE_OTHERS, environ={"GOMP_SPINCOUNT": "1000"})
    assert (choice.omp_wait, choice.omp_wait_by, choice.threads) == ("spin 1000", "environment", 1)


def test_explicit_config_wins_over_load():
    choice = decide(2, "spin", TWO_CORES_THREE_OTHERS, environ={})
    assert (choice.threads, choice.omp_wait, choice.threads_by, choice.omp_wait_by) == (2, "spin", "config", "config")
    assert not choice.adapted
    assert decide("auto", "passive", TWO_CORES_ALONE, environ={}).omp_wait == "passive"


def test_runnable_count_is_read_from_loadavg_without_this_process(tmp_path):
    assert threads.runnable_others(loadavg(tmp_path, 4), samples=3, gap_s=0) == 3
    assert threads.runnable_others(loadavg(tmp_path, 1), samples=1) == 0


def test_missing_proc_means_alone(tmp_path):
    load = threads.detect(path=tmp_path / "no-proc" / "loadavg")
    assert load.runnable_others is None and load.sharers == 1
    choice = decide("auto", "auto", load, environ={})
    assert (choice.threads, choice.omp_wait) == (None, "spin")


def test_startup_reads_settings_and_parallel_jobs_from_the_command_line():
    assert threads.startup_settings([], CONF) == ("auto", "auto", 1)
    assert threads.startup_settings(["threads=3", "omp_wait=passive"], CONF) == (3, "passive", 1)
    local = ["-m", "cache=full,icecache", "budget=32,64", "hydra/launcher=local"]
    assert threads.startup_settings(local, CONF)[2] == 4
    assert threads.startup_settings([*local, "hydra.sweeper.max_batch_size=1"], CONF)[2] == 1
    assert threads.startup_settings(local[:-1], CONF)[2] == 1  # the basic launcher runs one job at a time
    assert threads.startup_settings(["-m", "threads=1,2", "omp_wait=spin,passive"], CONF)[:2] == ("auto", "auto")


def test_startup_exports_a_busy_choice_but_never_overwrites_the_environment(tmp_path):
    env = {}
    choice = threads.at_startup(["budget=64"], CONF, environ=env, loadavg=loadavg(tmp_path, 4))
    assert (choice.threads, choice.omp_wait) == (1, "passive")
    assert (env["OMP_WAIT_POLICY"], env["OMP_NUM_THREADS"], env["NUMBA_NUM_THREADS"]) == ("PASSIVE", "1", "1")
    assert Choice.from_record(json.loads(env[threads.PLAN_VAR])) == choice  # what a sweep's job process reads
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2"}
    threads.at_startup([], CONF, environ=env, loadavg=loadavg(tmp_path, 4))
    assert (env["OMP_WAIT_POLICY"], env["OMP_NUM_THREADS"], "NUMBA_NUM_THREADS" in env) == ("ACTIVE", "2", False)
    env = {}
    threads.at_startup([], CONF, environ=env, loadavg=loadavg(tmp_path, 1))  # alone: nothing changes
    assert list(env) == [threads.PLAN_VAR]


def test_each_job_applies_its_threads_and_refuses_another_wait(tmp_path, monkeypatch):
    applied = []
    monkeypatch.setattr(threads, "set_threads", applied.append)
    threads.at_startup([], CONF, environ={}, loadavg=loadavg(tmp_path, 4))
    assert threads.for_job({"threads": "auto", "omp_wait": "auto"}, environ={}).startswith("threads: 1 per pool")
    assert threads.for_job({"threads": 2, "omp_wait": "passive"}, environ={}).startswith(
        "threads: 2 per pool, OpenMP waiting passive (3 other runnable threads on 2 cores")  # the load chose passive
    assert applied == [1, 2] and threads.record()["threads_by"] == "config"
    with pytest.raises(ConfigError, match="omp_wait=spin, but this process's OpenMP waiting is passive"):
        threads.for_job({"threads": "auto", "omp_wait": "spin"}, environ={})


@pytest.mark.parametrize("settings,message", [
    ({"threads": 0}, "threads must be auto or a whole number >= 1, got 0"),
    ({"threads": "many"}, "threads must be auto or a whole number >= 1, got 'many'"),
    ({"threads": True}, "threads must be auto or a whole number >= 1"),
    ({"omp_wait": "active"}, "omp_wait must be auto, spin or passive, got 'active'"),
])
def test_bad_settings_are_one_config_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_thread_settings(settings)
    with pytest.raises(ConfigError, match=message):
        check_config({"model": {"name": "tiny-llama"}, "cache": {"name": "full"}, "eval": {"name": "passkey"},
                      "device": "cpu", **settings})


def test_run_py_records_a_forced_choice_in_timing_json(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", threads.PLAN_VAR, *threads.WAIT_VARS)}
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), "model=tiny-llama", f"results_dir={tmp_path / 'r'}",
                           "progress=false", "cache=streaming_llm", "limit=1", "eval.lengths=[128]",
                           "eval.depths=1", "threads=1", "omp_wait=passive"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "r" / "passkey" / "tiny-llama").iterdir()
    environment = json.loads((run_dir / "timing.json").read_text())["environment"]
    assert (environment["threads"], environment["omp_wait"]) == (1, "passive")
    choice = environment["thread_choice"]
    assert (choice["threads"], choice["omp_wait"], choice["threads_by"], choice["omp_wait_by"]) == (
        1, "passive", "config", "config")
    assert choice["cores"] >= 1 and choice["jobs"] == 1 and "runnable_others" in choice
    assert "threads: 1 per pool" not in proc.stdout  # forced, not adapted: no line
