"""Provenance: a run directory and every benchmark row name the code that produced them (commit, dirty flag)
and the method as constructed (every hyperparameter after its presets resolved); the run's identity follows
the resolved method, and the summary never pools two resolved configurations under one label (tiny models,
seconds)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import BUDGET_64_HP, build_tiny

from evals.output import results
from evals.config import method_defaults
from evals.harness import plan, run_eval
from baselines.full import FullCache
from baselines.magicpig import MagicPIG
from baselines.omnikv import OmniKV
from evals.registry import METHODS, method_class
from evals.output.summary import collect

REPO = Path(__file__).resolve().parents[1]
SHA = re.compile(r"[0-9a-f]{40}")

# Fields that hold None after construction by design, not because a preset was left unresolved: the full cache
# has no budget; OmniKV and MagicPIG scale their filter / dense layers to the model's depth when bound to a
# model, and MagicPIG decides where to build its tables from the CPU cores left idle: each row states those
# values under ``method_bound`` (test below).
NONE_BY_DESIGN = {FullCache: {"budget"}, OmniKV: {"filter_layers"}, MagicPIG: {"dense_layers", "background_build"}}


def none_by_design(name: str) -> set[str]:
    return set().union(*(f for cls, f in NONE_BY_DESIGN.items() if issubclass(method_class(name), cls)))


def tiny_cfg(tmp_path, cache="streaming_llm", budget=64, results_dir="results", **options):
    return {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
            "cache": {"name": cache, **options},
            "eval": {"name": "passkey", "lengths": [160], "depths": 1, "question_via_decode": True,
                     "max_new_tokens": 2},
            "budget": budget, "limit": None, "seed": 0, "results_dir": str(tmp_path / results_dir),
            "data_dir": None, "device": "cpu", "debug": False, "progress": False}


def git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True)


@pytest.mark.parametrize("name", [m for m in METHODS if m != "kvpress"])
def test_every_method_is_recorded_with_its_presets_resolved(tmp_path, name):
    method = plan(tiny_cfg(tmp_path, name, **BUDGET_64_HP.get(name, {}))).resolved_method  # what resolved.json holds
    assert method["name"] == name
    unresolved = {k for k, v in method.items() if v is None} - none_by_design(name)
    assert not unresolved, f"{name}: fields left None in its resolved record: {sorted(unresolved)}"


def test_the_run_directory_records_the_resolved_method_suite_and_model(tmp_path):
    cfg = tiny_cfg(tmp_path, "icecache")
    record = results.read_resolved(run_eval(cfg))
    assert record["method"] == plan(cfg).resolved_method
    assert not [k for k, v in record["method"].items() if v is None]
    assert record["suite"]["name"] == "passkey" and record["suite"]["lengths"] == [160]
    assert record["model"]["name"] == "tiny-llama" and record["model"]["checksum"].startswith("config-sha256:")


def test_the_commit_dirty_flag_and_environment_are_recorded(tmp_path):
    run_dir = run_eval(tiny_cfg(tmp_path))
    prov = results.read_resolved(run_dir)["provenance"]
    assert prov == {**results.git_state(), "environment": prov["environment"]}
    assert {"python", "torch", "transformers", "cpu_model", "threads", "device"} <= set(prov["environment"])
    if git("rev-parse", "HEAD").returncode == 0:  # a checkout: the commit is this one's (or an ancestor of it)
        assert SHA.fullmatch(prov["commit"]) and isinstance(prov["dirty"], bool)
        assert git("merge-base", "--is-ancestor", prov["commit"], "HEAD").returncode == 0
    code = prov["commit"] + ("-dirty" if prov["dirty"] is True else "")
    assert json.loads((run_dir / "timing.json").read_text())["commits"] == [code]
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert all((r["timing"]["commit"], r["timing"]["dirty"]) == (prov["commit"], prov["dirty"]) for r in rows)
    assert all("method" not in r for r in rows)  # a whole-number budget: every row ran the recorded method
    sha, sep, rest = code.partition("-")
    assert collect(tmp_path / "results")["commit"].tolist() == [sha[:12] + sep + rest]


def test_git_state_of_a_plain_folder_is_unknown_and_of_a_checkout_its_head(tmp_path):
    state = results.git_state.__wrapped__  # uncached: the folder changes between calls
    assert state(tmp_path) == {"commit": "unknown", "dirty": "unknown"}
    repo = tmp_path / "repo"
    repo.mkdir()
    if git("init", "-q", cwd=repo).returncode != 0:
        pytest.skip("no git")
    (repo / "a.txt").write_text("a\n")
    git("add", "a.txt", cwd=repo)
    git("commit", "-q", "-m", "a", cwd=repo)
    head = git("rev-parse", "HEAD", cwd=repo).stdout.strip()
    (repo / "untracked.txt").write_text("u\n")
    assert state(repo) == {"commit": head, "dirty": False}  # untracked files do not count
    (repo / "a.txt").write_text("b\n")
    assert state(repo) == {"commit": head, "dirty": True}
    (repo / "sub").mkdir()
    assert state(repo / "sub")["commit"] == "unknown"  # a folder inside a checkout is not that checkout


def test_the_run_identity_is_the_resolved_method(tmp_path, monkeypatch):
    base = tiny_cfg(tmp_path, "icecache")
    resolved = plan(base).resolved_method
    spelled = tiny_cfg(tmp_path, "icecache", **{k: v for k, v in resolved.items() if k not in ("name", "budget",
                                                                                                 "debug")})
    assert results.run_dir_for(spelled) == results.run_dir_for(base)
    assert results.config_hash(spelled) == results.config_hash(base)
    other = tiny_cfg(tmp_path, "icecache", n_dense_layers=resolved["n_dense_layers"] + 1)
    assert results.config_hash(other) != results.config_hash(base)
    # a method given by its name alone is the run of its defaults spelled out (run directories of methods
    # without presets keep their names)
    streaming = tiny_cfg(tmp_path, **{k: v for k, v in method_defaults("streaming_llm").items() if k != "name"})
    assert results.run_dir_for(streaming) == results.run_dir_for(tiny_cfg(tmp_path))
    # the same config built differently (a default or preset changed in the code) is another run
    before = results.run_dir_for(base), results.config_hash(base)
    changed = dict(resolved, page_size=2 * resolved["page_size"])
    monkeypatch.setattr(results, "resolved_method", lambda cfg: changed)
    after = results.run_dir_for(base), results.config_hash(base)
    assert after[0] != before[0] and after[1] != before[1]


def _copy_run(run_dir: Path, root: Path, sub: str, budget=None) -> Path:
    """A copy of a run directory under ``root/sub`` (optionally relabelled with another budget)."""
    copy = root / sub / run_dir.relative_to(run_dir.parents[3])
    shutil.copytree(run_dir, copy)
    if budget is not None:
        cfg = yaml.safe_load((copy / "config.yaml").read_text())
        (copy / "config.yaml").write_text(yaml.safe_dump(dict(cfg, budget=budget)))
    return copy


def _set_resolved(run_dir: Path, **fields) -> None:
    record = results.read_resolved(run_dir)
    record["method"].update(fields)
    results.write_json(run_dir / results.RESOLVED, record)


def test_two_resolved_configs_never_share_a_summary_label(tmp_path):
    root = tmp_path / "results"
    a = run_eval(tiny_cfg(tmp_path, results_dir="results/a"))
    n_sink = results.read_resolved(a)["method"]["n_sink"]
    b = _copy_run(a, root, "b")
    _set_resolved(b, n_sink=n_sink + 4)  # the same config.yaml, written by code whose default differed
    c = _copy_run(a, root, "c")
    (c / results.RESOLVED).unlink()  # written before resolved configurations were recorded
    d = _copy_run(a, root, "d")  # the same resolved configuration as a: one label, pooled as before
    labels = dict(zip(collect(root)["run_dir"], collect(root)["variant"]))
    assert labels[str(a)] == labels[str(d)] == f"n_sink={n_sink}"
    assert labels[str(b)] == f"n_sink={n_sink + 4}"
    assert labels[str(c)] == "resolved=unrecorded"
    frame = collect(root)
    assert frame.set_index("run_dir").loc[str(b), "resolved.n_sink"] == n_sink + 4


def test_presets_that_differ_between_budgets_keep_one_label(tmp_path):
    root = tmp_path / "results"
    a = run_eval(tiny_cfg(tmp_path, results_dir="results/a"))
    n_sink = results.read_resolved(a)["method"]["n_sink"]
    other_budget = _copy_run(a, root, "b", budget=128)
    _set_resolved(other_budget, budget=128, n_sink=n_sink + 4)  # as a preset resolving per budget would
    frame = collect(root)
    assert sorted(frame["budget"]) == [64, 128] and set(frame["variant"]) == {""}


def test_decode_benchmark_rows_name_the_commit_and_resolved_method():
    from evals.bench import decode

    model = build_tiny()
    row = decode.measure(model, None, "icecache", 64, list(range(3, 163)), 4)
    assert (row["commit"], row["dirty"]) == (results.git_state()["commit"], results.git_state()["dirty"])
    assert row["method_config"]["name"] == "icecache"
    assert not [k for k, v in row["method_config"].items() if v is None]


def test_a_local_checkpoint_is_identified_by_a_cheap_checksum(tmp_path):
    from evals.harness import model_record

    folder = tmp_path / "m"
    build_tiny().save_pretrained(folder)
    record = model_record({"name": "m", "path": str(folder)})
    assert record["path"] == record["folder"] == str(folder) and record["source"] == "local"
    assert record["checksum"] == model_record({"name": "m", "path": str(folder)})["checksum"]
    weights = next(folder.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten a second later
    assert model_record({"name": "m", "path": str(folder)})["checksum"] != record["checksum"]


@pytest.mark.parametrize("name", ["omnikv", "magicpig", "magicpig_calibrated"])
def test_fields_resolved_from_the_model_are_stated_in_every_row(tmp_path, name):
    """The fields a method resolves when bound to the model are in each row, so no field stays unresolved."""
    run_dir = run_eval(tiny_cfg(tmp_path, name, budget=24))
    row = json.loads((run_dir / "predictions.jsonl").read_text().splitlines()[0])
    assert set(row["method_bound"]) == none_by_design(name) and None not in row["method_bound"].values()
