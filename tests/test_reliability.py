"""Reliability: kill-and-resume, determinism, resident budgets for every method, bad inputs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BUDGET_64_HP, build_tiny, generate_twice, skip_without_requirement

from evals.registry import METHODS, make_cache
from evals.models import ModelUnavailableError, load_model

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "run.py", "model=tiny-llama", "cache=streaming_llm", "budget=32", "eval.lengths=[200]",
       "eval.depths=6", "eval.max_new_tokens=6", "progress=false"]

# Budgets that are valid for every method's own constraints (pages of 16, SnapKV's 32-token window...).
SMALL_BUDGET = 64


def predictions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def run_to_end(results_dir: Path) -> Path:
    proc = subprocess.run(CLI + [f"results_dir={results_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])


def test_sigkill_mid_run_then_resume_loses_nothing(tmp_path):
    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen(CLI + [f"results_dir={killed_dir}"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    files = []
    while time.time() < deadline and proc.poll() is None:
        files = list(killed_dir.rglob("predictions.jsonl"))
        if files and files[0].read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert files, "the run never wrote a prediction"
    resumed = predictions(run_to_end(killed_dir))
    clean = predictions(run_to_end(tmp_path / "clean"))
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in clean)
    assert len({r["id"] for r in resumed}) == len(resumed) == 6
    strip = lambda rows: sorted((r["id"], r["prediction"], r["scores"]["score"]) for r in rows)  # noqa: E731
    assert strip(resumed) == strip(clean)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_resident_set_never_exceeds_the_budget(method):
    skip_without_requirement(method)
    model = build_tiny(n_kv_heads=2, n_heads=4, n_layers=8)
    ids = torch.randint(0, 200, (1, 160), generator=torch.Generator().manual_seed(0))
    budget = None if method == "full" else SMALL_BUDGET
    cache = make_cache(method, model, budget=budget, debug=True, **BUDGET_64_HP.get(method, {}))  # debug asserts the budget every step
    try:
        model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, past_key_values=cache)
    finally:
        cache.close()
    if method != "full":
        layers = cache.budgeted_layers()
        effective = cache.effective_tokens()
        assert layers, f"{method} budgets no layer"
        assert all(effective[i] <= SMALL_BUDGET + 40 for i in layers)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_seed_gives_identical_outputs(method):
    skip_without_requirement(method)
    model = build_tiny(n_kv_heads=2, n_heads=4, n_layers=8)
    ids = torch.randint(0, 200, (1, 160), generator=torch.Generator().manual_seed(0))
    budget = None if method == "full" else SMALL_BUDGET
    outs = generate_twice(model, ids, method, budget=budget, **BUDGET_64_HP.get(method, {}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_model_path_without_weights_is_a_clear_error(tmp_path):
    with pytest.raises(ModelUnavailableError, match="no weights"):
        load_model("llama-3.1-8b-instruct", path=str(tmp_path))


def test_cli_missing_data_dir_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "run.py", "model=tiny-llama", "eval=longbench",
                           f"data_dir={tmp_path / 'nowhere'}", f"results_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr
