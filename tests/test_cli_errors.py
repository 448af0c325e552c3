"""Command-line mistakes are one line on stderr and exit status 2, with no traceback or usage text; flags may
come after the settings. (Unknown keys and group options, list-typed options, bad values and Ctrl-C are
tested in tests/test_integrity.py, the sweep folders in tests/test_sweeps.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from run import options_of_swept_groups, settings_first

REPO = Path(__file__).resolve().parents[1]


def run_py(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python run.py model=tiny-llama <args>`` in ``cwd``, results under ``cwd/r``."""
    return subprocess.run([sys.executable, str(REPO / "run.py"), "model=tiny-llama", f"results_dir={cwd / 'r'}",
                           "progress=false", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args,message", [
    (["eval=passkeyy"], "error: eval=passkeyy is not an option of eval: did you mean eval=passkey? eval options: "
                        "gsm8k, latency, longbench, "),
    (["budget=32,64", "-m", "cache=full,icecahe"], "error: cache=icecahe is not an option of cache: did you mean "
                                                   "cache=icecache?"),
    (["--foo"], "error: unknown flag --foo: settings are key=value"),
    (["-c"], "error: argument --cfg/-c: expected one argument"),
    (["--info", "bad"], "error: argument --info/-i: invalid choice: 'bad'"),
    (["--cfg", "job", "-m", "budget=32,64"], "error: --multirun and --cfg exclude each other"),
])
def test_a_cli_mistake_is_one_line_and_exit_2(tmp_path, args, message):
    proc = run_py(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_settings_come_before_the_flags_and_their_values():
    argv = ["eval=passkey", "-m", "budget=32,64", "--cfg", "job", "cache=full", "--info", "-p", "cache", "seed=1"]
    assert settings_first(argv) == ["eval=passkey", "budget=32,64", "cache=full", "seed=1",
                                    "-m", "--cfg", "job", "--info", "-p", "cache"]
    assert settings_first(["--info", "defaults", "cache=full"]) == ["cache=full", "--info", "defaults"]


def test_a_sweep_with_m_after_the_settings_runs_and_leaves_no_folder(tmp_path):
    proc = run_py(tmp_path, "cache=streaming_llm", "-m", "budget=32,64", "limit=1", "eval.lengths=[128]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # no multirun/<date>/<time>/, no outputs/
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "r" / "passkey" / "tiny-llama").iterdir()) == ["b32", "b64"]


def test_a_sweep_over_methods_takes_an_option_they_share(tmp_path):
    """Hydra composes a multirun's first config with the default cache (full), which has no budget_layout: the
    option reaches both jobs, and a swept method that lacks it is still refused before anything runs."""
    argv = ["cache=icecache,page_oracle", "cache.budget_layout=fixed", "cache.n_sink_pages=0", "budget=64", "-m"]
    assert options_of_swept_groups(argv) == ["cache=icecache,page_oracle", "++cache.budget_layout=fixed",
                                             "++cache.n_sink_pages=0", "budget=64", "-m"]
    assert options_of_swept_groups(argv[:3]) == argv[:3]  # one run: written as given
    proc = run_py(tmp_path, *argv, "limit=1", "eval.depths=1", "eval.lengths=[128]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((tmp_path / "r" / "passkey" / "tiny-llama").iterdir())
    assert [p.name.split("-")[0] for p in runs] == ["icecache", "page_oracle"]
    assert all("budget_layout: fixed" in (p / "config.yaml").read_text() for p in runs)
    refused = run_py(tmp_path / "r", "-m", "cache=icecache,full", "cache.budget_layout=fixed")
    assert refused.returncode == 2 and "budget_layout" in refused.stderr and "cache=full" in refused.stderr


def test_a_budget_covering_a_1k_prompt_warns_in_one_line_and_is_flagged(tmp_path):
    proc = run_py(tmp_path, "cache=streaming_llm", "budget=4096", "eval.lengths=[1024]", "eval.depths=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("warning: budget=4096 covers the whole context (prompt + generated tokens) of 1 of 1 "
                           "samples, which ran as full attention (timing.json: budget_covers_context)")
    (run_dir,) = (tmp_path / "r" / "passkey" / "tiny-llama").iterdir()
    assert json.loads((run_dir / "timing.json").read_text())["budget_covers_context"] == 1
    assert proc.stdout.strip().splitlines()[-1] == f"results: {run_dir}"
