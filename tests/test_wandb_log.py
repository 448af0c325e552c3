"""What a run directory logs to W&B: a run name per resolved configuration, numbers in the run summary only
(no one-point history charts), references in the predictions table encoded once. A stand-in ``wandb``
module records the calls; one test reads a real offline run's transaction log."""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import yaml
from test_sweeps import wandb_records

from evals.config import compose_config
from evals.output import results, wandb_log

FIXTURE = Path(__file__).parent / "fixtures" / "results" / "passkey" / "smollm2-135m" / "icecache-b64-5007517c"


class StandInRun:
    """The parts of a W&B run that ``log_run`` uses: ``summary`` and ``log``."""

    def __init__(self):
        self.summary: dict = {}
        self.steps: list[dict] = []

    def log(self, data: dict) -> None:
        self.steps.append(data)

    def finish(self, exit_code: int | None = None) -> None:
        print("wandb: Run history: ...", file=sys.stderr)  # W&B's footer
        self.exit_code = exit_code


class StandInTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


@pytest.fixture
def stand_in_wandb(monkeypatch):
    plot = types.SimpleNamespace(line=lambda table, x, y, title: ("line", title),
                                 bar=lambda table, x, y, title: ("bar", title))
    module = types.SimpleNamespace(Table=StandInTable, plot=plot, Settings=dict, opened=[])
    module.init = lambda **kwargs: module.opened.append((kwargs, StandInRun())) or module.opened[-1][1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def fixture_run(tmp_path: Path) -> tuple[dict, Path]:
    """A copy of a finished fixture run directory and its config with W&B enabled."""
    run_dir = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return dict(cfg, wandb={"enabled": True, "project": "kv-test", "entity": None, "mode": "offline"}), run_dir


def composed(*overrides: str, tmp_path: Path) -> tuple[dict, Path]:
    cfg = compose_config(["model=tiny-llama", f"results_dir={tmp_path}", *overrides])
    return cfg, results.run_dir_for(cfg)


def test_run_names_differ_per_configuration_and_name_the_changed_cache_options(tmp_path):
    variants = {
        "default": composed("cache=icecache", tmp_path=tmp_path),
        "page_size": composed("cache=icecache", "cache.page_size=8", tmp_path=tmp_path),
        "two options": composed("cache=icecache", "cache.page_size=8", "cache.always_index=true", tmp_path=tmp_path),
        "other eval option": composed("cache=icecache", "eval.lengths=[512]", tmp_path=tmp_path),
        "suite preset": composed("cache=icecache", "eval=gsm8k", tmp_path=tmp_path),
    }
    names = {key: wandb_log.run_names(cfg, run_dir)["name"] for key, (cfg, run_dir) in variants.items()}
    assert len(set(names.values())) == len(names), names
    for key, (_, run_dir) in variants.items():
        assert names[key].startswith(run_dir.name) and run_dir.name.startswith("icecache-b64-")
    assert names["default"] == variants["default"][1].name
    assert names["page_size"].endswith(" (page_size=8)")
    assert names["two options"].endswith(" (page_size=8, always_index=true)")
    assert names["other eval option"] == variants["other eval option"][1].name  # the hash tells it apart
    assert names["suite preset"].endswith(" (ratio_1=0.03)")  # conf/suite_cache/gsm8k_icecache.yaml


def test_a_run_name_counts_the_changed_options_past_three(tmp_path):
    cfg, run_dir = composed("cache=icecache", "cache.page_size=8", "cache.always_index=true", "cache.min_fov=10",
                            "cache.ratio_2=0.5", tmp_path=tmp_path)
    names = wandb_log.run_names(cfg, run_dir)
    assert names["name"] == f"{run_dir.name} (page_size=8, always_index=true, ratio_2=0.5, +1 more)"
    assert (names["group"], names["tags"]) == ("passkey/tiny-llama", ["passkey", "tiny-llama", "icecache", "budget=64"])


def test_numbers_go_to_the_summary_and_charts_and_tables_to_one_step(tmp_path, stand_in_wandb):
    cfg, run_dir = fixture_run(tmp_path)
    run = StandInRun()
    assert wandb_log.log_run(cfg, run_dir, run) == wandb_log.run_id(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert run.summary["score"] == metrics["score"] and "tpot_s" in run.summary and "task/passkey_256" in run.summary
    (step,) = run.steps
    assert set(step) == {"effective_tokens_per_layer", "tpot_breakdown", "predictions"}
    assert not any(isinstance(v, (int, float)) for v in step.values())


@pytest.mark.parametrize("error,exit_code", [(KeyboardInterrupt, 2), (ValueError, 1), (None, None)])
def test_an_interrupted_run_is_marked_failed_without_w_and_b_output(tmp_path, stand_in_wandb, monkeypatch, capsys,
                                                                     error, exit_code):
    """``log_run`` with no open W&B run opens its own; an exception inside it finishes that run as failed."""
    cfg, run_dir = fixture_run(tmp_path)
    if error:
        monkeypatch.setattr(wandb_log, "read_results", lambda run_dir: (_ for _ in ()).throw(error()))
    with pytest.raises(error) if error else contextlib.nullcontext():
        wandb_log.log_run(cfg, run_dir)
    (kwargs, opened), = stand_in_wandb.opened
    assert opened.exit_code == exit_code and kwargs["name"] == run_dir.name
    assert (capsys.readouterr().err == "") == (error is not None)


def test_live_sample_steps_stay_in_the_history():
    row = {"scores": {"score": 1.0}, "timing": {"tt2t_s": 0.5, "intervals_s": [0.1, 0.3]}}
    assert wandb_log.sample_scalars(row, 3) == {"sample/score": 1.0, "sample/tt2t_s": 0.5, "samples_done": 3,
                                                "sample/tpot_s": pytest.approx(0.2)}


@pytest.mark.parametrize("reference,shown", [
    ("25248", "25248"),
    (["25248"], "25248"),
    (["Paris", "paris, France"], "Paris | paris, France"),
    ([7, 8.5], "7 | 8.5"),
    ({"answers": ["ä"], "all_classes": None}, '{"answers": ["ä"], "all_classes": null}'),
    (None, None),
])
def test_references_show_as_plain_text_or_json_once(reference, shown):
    assert wandb_log.reference_text(reference) == shown
    row = {"id": "s", "task": "t", "reference": reference, "prediction": "p", "scores": {"score": 1.0}}
    columns, (data,) = wandb_log.prediction_rows([row])
    assert data[columns.index("reference")] == shown


def test_an_offline_run_keeps_numbers_out_of_the_history(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, run_dir = fixture_run(tmp_path)
    rid = wandb_log.log_run(cfg, run_dir)
    wandb.teardown()  # flushes the transaction log
    (offline,) = (tmp_path / "wandb").glob(f"offline-run-*-{rid}")
    records = list(wandb_records(offline / f"run-{rid}.wandb"))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == run_dir.name
    summary = {item.key for r in records if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert {"score", "tpot_s", "task/passkey_256", "effective_tokens_mean"} <= summary
    history = {item.key for r in records if r.WhichOneof("record_type") == "history" for item in r.history.item}
    assert history and not history & {"score", "tpot_s", "task/passkey_256", "effective_tokens_mean"}
    (table,) = (offline / "files" / "media" / "table").glob("predictions_*.table.json")
    predictions = json.loads(table.read_text())
    references = [row[predictions["columns"].index("reference")] for row in predictions["data"]]
    expected = [json.loads(line)["reference"] for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert references == expected and all(not r.startswith('"') for r in references)
