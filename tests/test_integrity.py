"""Results you can trust: finished results are never lost or silently changed, figures never mix
experiments, and every user error is one line (tiny in-process models; seconds)."""
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
from helpers import BUDGET_64_HP, DATA_DIR, build_tiny, skip_without_requirement

from evals import harness
from evals.output import plots, results
from evals.task import DataError
from evals.config import ConfigError, check_config, shapes
from evals.harness import USER_ERRORS, run_eval
from evals.tasks.longbench import LongBench
from evals.registry import METHODS, SUITES, make_cache
from evals.output.summary import collect
from evals.models import ModelUnavailableError, resolve_dtype, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
needs_longbench = pytest.mark.skipif(not (DATA_DIR / "longbench_sample").is_dir(), reason="no shared LongBench data")


def tiny_cfg(tmp_path, lengths=(160,), depths=3, **over):
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "streaming_llm"},
           "eval": {"name": "passkey", "lengths": list(lengths), "depths": depths, "question_via_decode": True,
                    "max_new_tokens": 4},
           "budget": 32, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "debug": False, "progress": False}
    cfg.update(over)
    return cfg


def lines(run_dir: Path) -> list[str]:
    return (run_dir / "predictions.jsonl").read_text().splitlines()


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def never(row):
    raise AssertionError(f"sample {row['id']} was computed again")


# ---------------------------------------------------------------- 1. limit: a run of its own (tests/test_limit.py)


# ---------------------------------------------------------------- 3. a corrupt middle line is quarantined
def test_mid_file_garbage_line_is_quarantined_and_the_rows_after_it_survive(tmp_path, capsys):
    run_dir = run_eval(tiny_cfg(tmp_path))
    good = lines(run_dir)
    (run_dir / "predictions.jsonl").write_text(good[0] + "\n{garbage\n" + "\n".join(good[1:]) + "\n")
    (run_dir / "metrics.json").unlink()
    run_eval(tiny_cfg(tmp_path), on_row=never)
    assert lines(run_dir) == good and metrics(run_dir)["n_samples"] == 3
    assert (run_dir / results.QUARANTINE).read_text() == "{garbage\n"
    err = capsys.readouterr().err
    assert "line(s) 2 moved to" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- 5. one process per run directory
RUN = "import json, sys; from evals.harness import run_eval; run_eval(json.loads(sys.argv[1]))"


def test_two_concurrent_runs_on_one_directory_give_one_row_per_sample(tmp_path):
    cfg = tiny_cfg(tmp_path, lengths=(200,), depths=6)
    procs = [subprocess.Popen([sys.executable, "-c", RUN, json.dumps(cfg)], cwd=REPO, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    rows = lines(results.run_dir_for(check_config(cfg)))
    assert len(rows) == len({json.loads(r)["id"] for r in rows}) == 6


def test_a_second_process_waits_for_the_lock_holder(tmp_path):
    cfg = tiny_cfg(tmp_path)
    run_dir = harness.plan(cfg).run_dir
    holder = results.RunDir(run_dir, harness.plan(cfg).cfg, "")
    log = tmp_path / "second.err"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", RUN, json.dumps(cfg)], cwd=REPO, stderr=err)
    deadline = time.time() + 300
    while "waiting" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert "is being written by another process" in log.read_text()
    assert not (run_dir / "predictions.jsonl").exists()
    holder.close()
    assert proc.wait(timeout=600) == 0
    assert len(lines(run_dir)) == 3


# ---------------------------------------------------------------- 6. peak memory over every process
def test_peak_memory_after_a_resume_is_the_maximum_over_processes(tmp_path):
    class Stop(Exception):
        pass

    def stop(row):
        raise Stop

    with pytest.raises(Stop):
        run_eval(tiny_cfg(tmp_path), on_row=stop)
    run_dir = harness.plan(tiny_cfg(tmp_path)).run_dir
    row = json.loads(lines(run_dir)[0])
    row["timing"].update(peak_memory_bytes=10**13, segment="an earlier process")  # an earlier, bigger process segment
    (run_dir / "predictions.jsonl").write_text(json.dumps(row) + "\n")
    run_eval(tiny_cfg(tmp_path))
    timing = json.loads((run_dir / "timing.json").read_text())
    assert timing["peak_memory_bytes"] == 10**13 and timing["n_process_segments"] == 2


# ---------------------------------------------------------------- 7. an empty task file
@needs_longbench
def test_an_empty_task_file_is_an_error(tmp_path):
    data = longbench_data(tmp_path, {"trec": b""})
    cfg = tiny_cfg(tmp_path, data_dir=str(data), eval={"name": "longbench", "tasks": ["trec"], "chat_format": "none"})
    with pytest.raises(DataError, match="has no samples"):
        run_eval(cfg)
    assert not (tmp_path / "results").exists()


def longbench_data(tmp_path, files: dict[str, bytes]) -> Path:
    data = tmp_path / "data"
    (data / "longbench").mkdir(parents=True)
    (data / "longbench_config").symlink_to(DATA_DIR / "longbench_config")
    for task, content in files.items():
        (data / "longbench" / f"{task}.jsonl").write_bytes(content)
    return data


# ---------------------------------------------------------------- 8. type errors: one line, before loading
def corrupt_checkpoint(tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    (folder / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    return folder


BAD = {
    "budget=abc": (dict(budget="abc"), "budget must be positive"),
    "budget=1.5": (dict(budget=1.5), "budget must be positive"),
    "limit=abc": (dict(limit="abc"), "limit must be >= 1"),
    "limit=1.5": (dict(limit=1.5), "limit must be >= 1"),
    "seed=abc": (dict(seed="abc"), "seed must be a whole number"),
    "device=tpu": (dict(device="tpu"), "device must be auto, cpu, cuda"),
    "progress=maybe": (dict(progress="maybe"), "progress must be auto, true or false"),
    "debug=maybe": (dict(debug="maybe"), "debug must be true or false"),
    "model.dtype=float8": ({"model": {"name": "tiny-llama", "dtype": "float8"}}, "model.dtype must be one of"),
    "cache.rerotate=maybe": ({"cache": {"name": "streaming_llm", "rerotate": "maybe"}},
                             "cache.rerotate must be true or false"),
    "eval.depths=1.5": ({"eval": {"name": "passkey", "depths": 1.5, "lengths": [160]}}, "eval.depths must be"),
    "eval.max_new_tokens=0": ({"eval": {"name": "passkey", "max_new_tokens": 0}}, "eval.max_new_tokens must be >= 1"),
    "eval.lengths=1024": ({"eval": {"name": "passkey", "lengths": 1024}},
                          "eval.lengths must be a list, e.g. 'eval.lengths=[1024]'"),
    "eval.lengths=[abc]": ({"eval": {"name": "passkey", "lengths": ["abc"]}}, "eval.lengths must be a list of whole"),
    "eval.tasks=vt": ({"eval": {"name": "ruler", "tasks": "vt"}}, "eval.tasks must be a list, e.g. 'eval.tasks=[vt]'"),
    "cache.dense_layers=3": ({"cache": {"name": "magicpig", "dense_layers": 3}},
                             "cache.dense_layers must be a list, e.g. 'cache.dense_layers=[3]'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_type_errors_are_one_line_before_the_model_loads(tmp_path, monkeypatch, case):
    monkeypatch.setattr(harness, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    over, message = BAD[case]
    with pytest.raises(USER_ERRORS) as err:
        run_eval(tiny_cfg(tmp_path, **over))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "results").exists()


def test_every_list_or_mapping_option_refuses_a_scalar():
    """Each option whose field only takes a list (or a mapping) names itself and the list spelling."""
    found = {}
    for group, names in (("eval", SUITES), ("cache", METHODS)):
        for name in names:
            for option, (kind, _) in shapes(group, name).items():
                found[f"{group}={name} {option}"] = kind
                cfg = tiny_cfg(Path("/tmp"), **{group: {"name": name, option: 7}})
                with pytest.raises(ConfigError, match=f"{group}.{option} must be a {kind}, e.g. '{group}.{option}="):
                    check_config(cfg)
    assert {"eval=passkey lengths", "eval=latency lengths", "eval=ruler lengths", "eval=ruler tasks",
            "eval=longbench tasks", "eval=longgenbench types", "cache=magicpig dense_layers",
            "cache=omnikv filter_layers"} <= {k for k, kind in found.items() if kind == "list"}
    assert check_config(tiny_cfg(Path("/tmp"), eval={"name": "passkey", "lengths": [1024], "depths": [0.5]}))


def test_path_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(USER_ERRORS, match="is a file, not a directory"):
        run_eval(tiny_cfg(tmp_path, results_dir=str(a_file)))
    ckpt = corrupt_checkpoint(tmp_path)
    with pytest.raises(ModelUnavailableError, match="model.safetensors is not a valid safetensors file"):
        run_eval(tiny_cfg(tmp_path, model={"name": "my-llama", "path": str(ckpt), "dtype": "float32"}))
    if not torch.cuda.is_available():
        with pytest.raises(USER_ERRORS, match="torch sees no CUDA device"):
            run_eval(tiny_cfg(tmp_path, device="cuda"))


@needs_longbench
def test_a_non_utf8_data_file_names_the_file_and_line(tmp_path):
    data = longbench_data(tmp_path, {"trec": b'{"input": "\xff\xfe"}\n'})
    cfg = tiny_cfg(tmp_path, data_dir=str(data), eval={"name": "longbench", "tasks": ["trec"], "chat_format": "none"})
    with pytest.raises(DataError, match=r"trec.jsonl, line 1: not UTF-8 text"):
        run_eval(cfg)


def run_cli(tmp_path, *args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "run.py"), "model=tiny-llama", f"results_dir={tmp_path / 'r'}",
                           "progress=false", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["budget=abc"], "budget must be positive"),
    (["cache=streaming_llm", "cache.rerotate=maybe"], "cache.rerotate must be true or false"),
    (["limit=1.5"], "limit must be >= 1"),
    (["model.name=my-llama", "model.path={ckpt}"], "is not a valid safetensors file"),
    # Hydra's own refusals (unknown key or group option), read before it composes: the nearest and the valid names
    (["cache.page_sise=8"], "cache=full has no option 'page_sise' (did you mean cache.page_size=8, an option of "
                            "cache=quest"),
    (["cache=icecache", "cache.page_sise=8"], "cache=icecache has no option 'page_sise' (did you mean "
                                              "cache.page_size=8?); cache=icecache options: always_index, "),
    (["cache=icecahe"], "cache=icecahe is not an option of cache: did you mean cache=icecache? cache options: "
                        "arkvale, full, "),
    (["model=smollm2"], "model=smollm2 is not an option of model: did you mean model=smollm2-135m? model options: "),
    (["eval.lengths=1024"], "eval.lengths must be a list, e.g. 'eval.lengths=[1024]'"),
    (["budget=32,64"], "budget=32,64 lists several values: add -m to sweep over them"),
])
def test_cli_type_errors_exit_2_with_one_line(tmp_path, args, message):
    ckpt = corrupt_checkpoint(tmp_path)
    proc = run_cli(tmp_path, *[a.format(ckpt=ckpt) for a in args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no outputs/, no stub run directory


def test_ctrl_c_is_one_line_exit_2_and_keeps_the_finished_samples(tmp_path):
    proc = subprocess.Popen([sys.executable, str(REPO / "run.py"), "model=tiny-llama", "cache=streaming_llm",
                             "budget=32", "eval.lengths=[256]", "eval.depths=200", "progress=false",
                             f"results_dir={tmp_path / 'r'}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "r").glob("passkey/tiny-llama/*/predictions.jsonl"))
        if found and found[0].read_text().count("\n") >= 1:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    (run_dir,) = (tmp_path / "r").glob("passkey/tiny-llama/*")
    kept = len(results.load_predictions(run_dir / "predictions.jsonl"))
    assert 1 <= kept < 200
    assert err.strip().splitlines() == [f"interrupted: {run_dir} keeps the {kept} finished sample"
                                        f"{'s' if kept > 1 else ''}; rerun the same command to resume (finished "
                                        "samples are skipped)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# ---------------------------------------------------------------- 4. a cache serves one prompt
@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_cache_refuses_a_second_prompt_and_reset_serves_a_new_one(method, one_thread):
    skip_without_requirement(method)
    model = build_tiny(n_layers=4)
    gen = torch.Generator().manual_seed(0)
    long, short = torch.randint(0, 200, (1, 160), generator=gen), torch.randint(0, 200, (1, 100), generator=gen)
    budget = None if method == "full" else 64

    def run(prompt, cache):
        return model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, past_key_values=cache)

    cache = make_cache(method, model, budget=budget, **BUDGET_64_HP.get(method, {}))
    try:
        run(long, cache)
        for prompt in (long, short):
            with pytest.raises(RuntimeError, match=r"call cache.reset\(\)"):
                run(prompt, cache)
        cache.reset()
        again = run(short, cache)
    finally:
        cache.close()
    fresh = make_cache(method, model, budget=budget, **BUDGET_64_HP.get(method, {}))
    try:
        assert torch.equal(again, run(short, fresh))
    finally:
        fresh.close()


# ---------------------------------------------------------------- 2. summary and figures by full config
def test_summary_and_figures_keep_runs_that_differ_only_in_an_eval_option(tmp_path, monkeypatch):
    for via_decode in (True, False):
        cfg = tiny_cfg(tmp_path, depths=2)
        cfg["eval"]["question_via_decode"] = via_decode
        run_eval(cfg)
    frame = collect(tmp_path / "results")
    assert len(frame) == 2 and sorted(frame["eval.question_via_decode"]) == [False, True]
    assert sorted(frame["variant"]) == ["question_via_decode=false", "question_via_decode=true"]
    panels = {}
    monkeypatch.setattr(plots, "passkey_heatmap", lambda runs, out, title="": panels.update(runs) or out)
    plots.figures(frame, tmp_path / "figures")
    assert sorted(panels) == ["streaming_llm b32 [question_via_decode=false]",
                              "streaming_llm b32 [question_via_decode=true]"]


def test_identical_labels_from_two_folders_stay_two_panels(tmp_path, monkeypatch):
    for sub in ("a", "b"):
        run_eval(tiny_cfg(tmp_path, depths=1, results_dir=str(tmp_path / "results" / sub)))
    panels = {}
    monkeypatch.setattr(plots, "passkey_heatmap", lambda runs, out, title="": panels.update(runs) or out)
    plots.figures(collect(tmp_path / "results"), tmp_path / "figures")
    assert len(panels) == 2


def test_committed_results_are_outside_the_default_results_dir():
    assert not (REPO / "results" / "reference").exists()
    assert any((REPO / "tests" / "fixtures" / "results").rglob("metrics.json"))


# ---------------------------------------------------------------- 9. LongBench default on the shared data
@needs_longbench
def test_longbench_default_runs_the_tasks_present_with_a_notice(byte_tokenizer, caplog):
    suite = LongBench(byte_tokenizer, data_dir=DATA_DIR, chat_format="none")
    present = {p.stem for p in (DATA_DIR / "longbench_sample").glob("*.jsonl")}
    assert set(suite.tasks) == present
    notice = [r.getMessage() for r in caplog.records if "running the" in r.getMessage()]
    assert len(notice) == 1 and all(t in notice[0] for t in present)


@needs_longbench
def test_longbench_missing_task_names_the_available_ones_and_a_writable_place(byte_tokenizer):
    with pytest.raises(DataError) as err:
        LongBench(byte_tokenizer, data_dir=DATA_DIR, tasks=["narrativeqa"], chat_format="none")
    message = str(err.value)
    assert "available here: 2wikimqa, lcc" in message and "eval.longbench_dir=" in message


# ---------------------------------------------------------------- 10. custom models, device auto
def test_a_custom_model_name_with_model_path(tmp_path):
    folder = tmp_path / "my-llama"
    build_tiny().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    cfg = tiny_cfg(tmp_path, device="auto", model={"name": "my-llama", "path": str(folder), "dtype": "auto",
                                                   "max_length": 128000})
    run_dir = run_eval(cfg)
    assert run_dir.parent.name == "my-llama"
    assert "max_length: 4096" in (run_dir / "config.yaml").read_text()  # from its config.json
    environment = json.loads((run_dir / "timing.json").read_text())["environment"]
    assert environment["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # auto: bf16 on CUDA; on a CPU bf16 only with native bf16 arithmetic (icecache/hardware.py), else fp32
    assert environment["dtype"] == str(resolve_dtype("auto", environment["device"]))
    assert environment["dtype_requested"] == "auto" and environment["dtype_rule"].startswith(environment["device"])


def test_device_auto_is_the_default_and_resolves():
    import yaml

    assert yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["device"] == "auto"
    assert check_config(tiny_cfg(Path("/tmp"), device="auto"))["device"] == ("cuda" if torch.cuda.is_available()
                                                                           else "cpu")


# ---------------------------------------------------------------- 11. the smaller items
def test_a_failed_run_leaves_no_stub_directory(tmp_path, monkeypatch):
    def unavailable(*a, **k):
        raise ModelUnavailableError("no weights")

    monkeypatch.setattr(harness, "load_model", unavailable)
    with pytest.raises(ModelUnavailableError):
        run_eval(tiny_cfg(tmp_path))
    assert not any((tmp_path / "results").rglob("config_hash"))


def test_result_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        run_dir = run_eval(tiny_cfg(tmp_path))
    finally:
        os.umask(old)
    for name in ("metrics.json", "timing.json", "config.yaml", "config_hash", "predictions.jsonl"):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o644, name


def test_a_converted_checkpoint_follows_the_umask(tmp_path, monkeypatch):
    import transformers

    from evals.models import convert_gguf

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: build_tiny())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    old = os.umask(0o022)
    try:
        target = convert_gguf(tmp_path / "model.gguf", tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes  # safetensors alone writes 0600


def test_a_budget_that_covers_the_whole_context_is_flagged(tmp_path, capsys):
    covered = run_eval(tiny_cfg(tmp_path, budget=4096))  # 160-token prompts
    warnings = [line for line in capsys.readouterr().err.splitlines() if "covers the whole context" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: budget=4096 covers the whole context")
    assert "of 3 of 3 samples" in warnings[0]
    assert json.loads((covered / "timing.json").read_text())["budget_covers_context"] == 3
    assert all(json.loads(line)["timing"]["budget_covers_context"] for line in lines(covered))
    budgeted = run_eval(tiny_cfg(tmp_path, budget=32))
    assert "covers the whole context" not in capsys.readouterr().err
    assert json.loads((budgeted / "timing.json").read_text())["budget_covers_context"] == 0
    frame = collect(tmp_path / "results").set_index("budget")
    assert frame.loc[4096, "budget_covers_context"] == 3 and frame.loc[32, "budget_covers_context"] == 0


def test_wandb_logs_a_rerun_of_a_finished_directory(tmp_path, monkeypatch):
    logged = []
    monkeypatch.setattr(harness.wandb_log, "log_run", lambda cfg, run_dir, run=None: logged.append(run_dir))
    first = run_eval(tiny_cfg(tmp_path))
    assert run_eval(tiny_cfg(tmp_path), on_row=never) == first and logged == [first, first]


def test_summary_survives_empty_missing_and_malformed_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert collect(tmp_path / "empty").empty
    out = subprocess.run([sys.executable, "-m", "evals.output.summary", str(tmp_path / "missing")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()]
    good = run_eval(tiny_cfg(tmp_path))
    bad = good.parent / "broken"
    bad.mkdir()
    (bad / "config_hash").write_text("x\n")
    (bad / "config.yaml").write_text("eval: [unclosed\n")
    frame = collect(tmp_path / "results")
    assert frame["run_dir"].tolist() == [str(good)] and "skipped" in capsys.readouterr().err


def test_latency_tpot_is_not_reported_as_a_score(tmp_path):
    cfg = tiny_cfg(tmp_path, eval={"name": "latency", "lengths": [64], "new_tokens": 4, "repeats": 1})
    run_eval(cfg)
    row = collect(tmp_path / "results").iloc[0]
    assert row["score"] is None or row["score"] != row["score"]  # empty (NaN)
    assert row["tpot_ms"] > 0


def test_whole_float_budget_is_the_same_run():
    a, b = tiny_cfg(Path("/r"), budget=64), tiny_cfg(Path("/r"), budget=64.0)
    assert results.run_dir_for(check_config(a)) == results.run_dir_for(check_config(b))
    assert results.config_hash(check_config(a)) == results.config_hash(check_config(b))


def test_progress_false_silences_the_weight_loading_bar(tmp_path):
    from transformers.utils import logging as hf_logging

    from evals.models import load_model

    folder = tmp_path / "m"
    build_tiny().save_pretrained(folder)
    try:
        load_model("m", str(folder), "float32", "cpu", progress=False)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
