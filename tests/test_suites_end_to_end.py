"""Every suite end to end through the harness (``run_eval``) with ``limit=2`` on the tiny random model,
for full attention and for IceCache: each run writes one prediction per sample, ``metrics.json`` and
``timing.json`` (issue: evaluation suites). The tiny model's outputs are noise, so only the plumbing and
the budget are checked here; the scores are checked against hand-computed values in each suite's tests."""
from __future__ import annotations

import json

import pytest
from helpers import DATA_DIR

from evals.harness import run_eval

# eval config, expected samples (limit=2 per task), shared-data folder it needs
SUITES = {
    "longbench": ({"name": "longbench", "tasks": ["trec", "qasper"], "chat_format": "none"}, 4, "longbench_sample"),
    "gsm8k": ({"name": "gsm8k"}, 2, "gsm8k"),
    "ruler": ({"name": "ruler", "lengths": [8192], "tasks": ["niah_single_1", "qa_1"]}, 4, "squad"),
    "longgenbench": ({"name": "longgenbench", "types": ["Week"], "max_new_tokens": 24, "judge_model": None},
                     2, "longgenbench"),
    "latency": ({"name": "latency", "lengths": [256, 512], "new_tokens": 6}, 2, None),
}


def suite_cfg(tmp_path, eval_cfg: dict, cache: str) -> dict:
    return {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 16384},
            "cache": {"name": cache}, "eval": eval_cfg, "budget": 64, "limit": 2, "seed": 0,
            "results_dir": str(tmp_path / "results"), "data_dir": str(DATA_DIR), "device": "cpu",
            "debug": True, "progress": False}


@pytest.mark.parametrize("cache", ["full", "icecache"])
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_suite_runs_end_to_end_with_limit_2(tmp_path, suite, cache):
    eval_cfg, n_samples, data = SUITES[suite]
    if data and not (DATA_DIR / data).is_dir():
        pytest.skip(f"shared data not at {DATA_DIR / data}")
    run_dir = run_eval(suite_cfg(tmp_path, dict(eval_cfg), cache))
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == n_samples == len({r["id"] for r in rows})
    assert all(isinstance(r["prediction"], str) and r["timing"]["intervals_s"] for r in rows)
    if suite != "latency":  # latency scores timing only, in aggregate
        assert all("score" in r["scores"] for r in rows)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n_samples"] == n_samples and isinstance(metrics["score"], float)
    timing = json.loads((run_dir / "timing.json").read_text())
    assert timing["n_samples"] == n_samples and timing["tt2t_s"] > 0
    if cache == "icecache":  # the 2 budgeted layers of the tiny model never held more than the budget
        assert 0 < timing["max_resident_tokens"] <= 64
    else:
        assert timing["max_resident_tokens"] == 0


def test_judge_is_the_model_under_test_by_default_else_the_named_model_loaded_once(monkeypatch):
    """LongGenBench's judge (evals.tasks.longgenbench.make_judge): greedy with the full cache, the model under
    test unless ``judge_model`` names another registered model, which is loaded on first use only."""
    from baselines.full import FullCache
    from evals.tasks import longgenbench
    from evals.runner import generate
    from evals.models import load_model, load_tokenizer

    model, tok = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    other = load_model("tiny-qwen3")
    prompt = "Context: Week 3 ...### Instruction: Does this context include the party? Answer 'yes' or 'no'."

    def expected(m):
        return generate(m, tok, FullCache(), tok(prompt)["input_ids"], 7).text

    assert longgenbench.make_judge(model, tok, None, "tiny-llama", "cpu")(prompt, 7) == expected(model)
    assert longgenbench.make_judge(model, tok, "tiny-llama", "tiny-llama", "cpu")(prompt, 7) == expected(model)
    assert expected(other) != expected(model)  # so the next check tells the two judges apart
    loads = []
    monkeypatch.setattr(longgenbench, "load_model", lambda name, device: loads.append((name, device)) or other)
    judge = longgenbench.make_judge(model, tok, "tiny-qwen3", "tiny-llama", "cpu")
    assert judge(prompt, 7) == judge(prompt, 7) == expected(other)
    assert loads == [("tiny-qwen3", "cpu")]


# eval config, samples (limit=1: one per task), shared-data folder, model max_length (LongBench cuts prompts to it)
REPLAYED = {"longbench": ({"name": "longbench", "tasks": ["trec"], "chat_format": "none"}, 1, "longbench_sample", 2048),
            "gsm8k": ({"name": "gsm8k", "max_new_tokens": 24}, 1, "gsm8k", 16384)}


@pytest.mark.parametrize("suite", sorted(REPLAYED))
def test_a_replayed_run_predicts_what_the_live_run_predicts(tmp_path, suite):
    """The paper tables prefill each prompt once and replay it into every method (``prefill_cache``): a run that
    captures the prefills, and one that reads them back from disk, generate IceCache's live predictions (one sample
    per task)."""
    eval_cfg, n_samples, data, max_length = REPLAYED[suite]
    if not (DATA_DIR / data).is_dir():
        pytest.skip(f"shared data not at {DATA_DIR / data}")

    def cfg(name, **more):
        base = suite_cfg(tmp_path / name, dict(eval_cfg), "icecache")
        return {**base, "model": {**base["model"], "max_length": max_length}, "limit": 1, **more}

    live = run_eval(cfg("live"))
    replayed = [run_eval(cfg(name, prefill_cache=str(tmp_path / "prefill"))) for name in ("captured", "read")]

    def rows(run_dir):
        return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]

    expected = [(r["id"], r["prediction"], r["output_ids"]) for r in rows(live)]
    assert len(expected) == n_samples and all(r["timing"]["prefill"] == "live" for r in rows(live))
    for run_dir in replayed:
        assert [(r["id"], r["prediction"], r["output_ids"]) for r in rows(run_dir)] == expected
        assert json.loads((run_dir / "timing.json").read_text())["prefill"] == {"replayed": n_samples, "live": 0}
