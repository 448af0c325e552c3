"""The markdown tables of a results folder (evals/output/tables.py) and the archive copy of run directories
(evals/output/archive.py), on crafted run directories whose scores, misses and search statistics are known."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from evals.output import archive, plan, results, tables, timing
from evals.tasks.passkey import Passkey

IDS = [f"passkey-1024-0.{d}00" for d in range(5)]


def write_run(root: Path, cache: str, budget: int, scores: list[float], stats: dict | None = None,
              limit: int | None = None, tasks: list[str] | None = None, effective: list | None = None,
              **options) -> Path:
    cfg = {"eval": {"name": "passkey", "lengths": [1024], "depths": 5}, "model": {"name": "tiny-llama"},
           "cache": {"name": cache, **options}, "budget": budget, "seed": 0, "results_dir": str(root),
           **({"limit": limit} if limit else {})}
    run_dir = results.run_dir_for(cfg)
    run = results.RunDir(run_dir, cfg, yaml.safe_dump(cfg))
    tasks = tasks or ["passkey_1024"] * len(scores)
    rows = [{"id": i, "task": t, "prediction": "", "reference": "", "scores": {"score": s},
             "meta": {"length": 1024}, "timing": {"tt2t_s": 1.0}} for i, s, t in zip(IDS, scores, tasks)]
    for r in rows:
        run.append(r)
    results.write_json(run_dir / "metrics.json", Passkey.aggregate(None, rows))
    results.write_json(run_dir / "timing.json", {"ttft_s": 0.5, "tt2t_s": 0.6, "tpot_s": 0.01,
                                                 "method_stats": stats or {},
                                                 "effective_tokens_per_layer": effective or []})
    return run_dir


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "results"
    write_run(root, "full", 64, [1, 1, 1, 1, 1])
    write_run(root, "icecache", 64, [1, 0, 1, 1, 0],
              {"search_scored_fraction": [None, 0.2, 0.5], "search_nodes_expanded": [None, 10, 20]})
    write_run(root, "icecache", 128, [1, 1, 1, 1, 1], {"search_scored_fraction": [None, 0.1, 0.1]})
    write_run(root, "streaming_llm", 64, [0, 0, 0, 0, 0])
    write_run(root, "topk", 64, [1, 1, 1, 1, 1], n_dense_layers=2, n_sink=0)  # n_sink=0 is topk's default
    return root


def test_table_has_each_method_budget_score_misses_and_search_fraction(folder):
    text = tables.render(folder, draws=200)
    assert "lengths=[1024]" in text and "depths=5" in text  # the cell's settings in its title
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| method | budget 64"))
    assert header == "| method | budget 64 | budget 128 |"
    ice = next(line for line in lines if line.startswith("| icecache |"))
    assert ice.split(" | ")[1].startswith("60 [")  # 3 of 5 found
    assert "(-40 [" in ice  # paired with full, which found all 5
    full = next(line for line in lines if line.startswith("| full |"))
    assert "(run at 64)" in full  # the full cache ignores the budget: its one run stands for 128 too
    assert "- icecache at 64 (icecache-b64-" in text and f"{IDS[1]}, {IDS[4]}" in text
    assert "- streaming_llm at 64 (" in text and "all 5" in text
    assert not any(line.startswith("- icecache at 128") for line in lines)  # no miss, no line
    search = [line for line in lines[lines.index("IceCache search:"):] if line.startswith("| icecache | 64 |")]
    assert search == ["| icecache | 64 | 0.350 | 15 |"]  # the mean over the layers reporting a value
    assert "| icecache | 128 | 0.100 | - |" in lines
    assert any(line.startswith("| topk[n_dense_layers=2] | 100 [") for line in lines)  # non-default options only


def test_without_intervals_the_table_still_counts_its_samples(folder):
    text = tables.render(folder, draws=0)  # --draws 0: no predictions read, no pairing
    assert "n = 5 samples per run" in text
    assert next(line for line in text.splitlines() if line.startswith("| icecache |")).split(" | ")[1] == "60 [-, -]"


def test_per_task_table_gives_each_task_the_average_and_the_median_layer_attended(tmp_path):
    root, tasks = tmp_path / "results", ["passkey_1024", "passkey_1024", "passkey_2048", "passkey_2048"]
    write_run(root, "full", 64, [1, 1, 1, 1], tasks=tasks, effective=[1000, 1000, 1000])
    write_run(root, "icecache", 64, [1, 0, 0, 0], tasks=tasks, effective=[1000, 30, 34, None])  # a dense layer
    lines = tables.render(root, draws=0).splitlines()
    assert "| method | budget | passkey_1024 | passkey_2048 | Avg. | attended | run directory @ commit |" in lines
    assert any(line.startswith("| full | 64 | 100.0 | 100.0 | 100.0 | 1000 | `full-b64-") for line in lines)
    ice = next(line for line in lines if line.startswith("| icecache | 64 | 50.0 | 0.0 | 25.0 | 34 | "))  # median
    assert ice.split(" | ")[-1].startswith("`icecache-b64-") and " @ " in ice  # the run and its commit
    write_run(tmp_path / "one", "full", 64, [1])
    assert "Avg." not in tables.render(tmp_path / "one", draws=0)  # one task, nothing attended: no table
    write_run(tmp_path / "gsm", "icecache", 64, [1], effective=[500, 40, 40])
    assert "| icecache | 64 | 100.0 | 40 | `icecache-b64-" in tables.render(tmp_path / "gsm", draws=0)


def test_a_plan_lists_the_cells_no_finished_run_holds(folder, tmp_path):
    cells = ("full@64", "icecache@256", "topk[n_dense_layers=2]@64", "icecache@64/3", "topk@64")
    assert plan.missing(folder, cells) == ["icecache@256", "topk@64"]  # topk ran with n_dense_layers=2 only
    write_run(tmp_path / "limited", "pqcache", 64, [1, 1], limit=2)
    assert plan.missing(tmp_path / "limited", ("pqcache@64/2", "pqcache@64/3", "pqcache@64")) == [
        "pqcache@64/3", "pqcache@64"]  # two samples hold a cell of two, not one of three nor the whole suite
    assert plan.missing_text(folder, cells[:1]).startswith("Every cell of this table's plan (1 in all)")
    assert "`icecache@256`, `topk@64`" in plan.missing_text(folder, cells)
    assert plan.missing(tmp_path / "nothing", ("full@64",)) == ["full@64"]


def test_archive_drops_per_sample_timing_and_keeps_every_table_number(folder, tmp_path):
    copy = tmp_path / "archived"
    written = archive.archive(folder, copy)
    assert len(written) == 5
    for run_dir in written:
        rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
        assert rows and all("timing" not in r and "scores" in r for r in rows)
        assert (run_dir / "timing.json").exists() and (run_dir / "config.yaml").exists()
    assert tables.render(copy, draws=200) == tables.render(folder, draws=200)


def test_the_generation_time_is_the_samples_requests_summed_and_the_archive_adds_it_where_missing(tmp_path):
    timings = [{"tt2t_s": 1.0, "ttft_s": 0.4, "intervals_s": [0.1, 0.2]},
               {"tt2t_s": None, "ttft_s": 0.5, "intervals_s": []}]  # stopped after one token: its TTFT
    assert timing.requests_seconds(timings) == pytest.approx(1.0 + 0.1 + 0.2 + 0.5)
    assert timing.requests_seconds([]) is None
    root, tasks = tmp_path / "results", ["passkey_1024", "passkey_2048"]
    run_dir = write_run(root, "full", 64, [1, 1], tasks=tasks, effective=[1000, 1000])
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    for row, t in zip(rows, timings):
        row["timing"] = t
    (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "| min |" not in tables.render(root, draws=0)  # written before the time was recorded: no column
    (copy,) = archive.archive(root, tmp_path / "archived")
    assert json.loads((copy / "timing.json").read_text())["requests_s"] == pytest.approx(1.8)
    assert "| 1000 | 0.0 | `full-b64-" in tables.render(tmp_path / "archived", draws=0)  # 1.8 s = 0.03 min
    recorded = json.loads((run_dir / "timing.json").read_text()) | {"requests_s": 600.0}
    results.write_json(run_dir / "timing.json", recorded)
    (copy,) = archive.archive(root, tmp_path / "again")
    assert json.loads((copy / "timing.json").read_text())["requests_s"] == 600.0  # the run's own record kept
    assert "| 1000 | 10.0 | `full-b64-" in tables.render(tmp_path / "again", draws=0)


def test_archive_partial_keeps_runs_in_progress_whole(folder, tmp_path):
    """A run without ``metrics.json`` (stopped mid-way) is left out by default; ``partial`` copies it with every
    row field, timing included, and no metrics, so a copy back resumes it."""
    stopped = sorted(folder.rglob("metrics.json"))[0].parent
    (stopped / "metrics.json").unlink()
    rows = (stopped / "predictions.jsonl").read_text().splitlines()
    assert len(archive.archive(folder, tmp_path / "complete")) == 4
    written = archive.archive(folder, tmp_path / "all", partial=True)
    copy = tmp_path / "all" / stopped.relative_to(folder)
    assert len(written) == 5 and copy in written and not (copy / "metrics.json").exists()
    assert [json.loads(line) for line in (copy / "predictions.jsonl").read_text().splitlines()] == \
        [json.loads(line) for line in rows]
    assert (copy / "config_hash").read_text() == (stopped / "config_hash").read_text()


def test_limited_runs_are_tabulated_on_request_in_a_cell_of_their_limit(tmp_path):
    root = tmp_path / "results"
    write_run(root, "full", 64, [1, 1, 1, 1, 1], limit=5)
    write_run(root, "icecache", 64, [1, 0, 1, 1, 0], limit=5)
    write_run(root, "full", 64, [1, 1, 1, 1, 1])
    write_run(root, "streaming_llm", 64, [0, 0, 0, 0, 0])
    assert "limit=5" not in tables.render(root, draws=50)
    text = tables.render(root, draws=50, limited=True)
    cells = text.split("### ")[1:]
    assert len(cells) == 2 and sum("limit=5" in cell for cell in cells) == 1
    limited = next(cell for cell in cells if "limit=5" in cell)
    assert "| icecache | 60 [" in limited and "(-40 [" in limited and "streaming_llm" not in limited


def test_a_longer_limited_run_stands_in_a_shorter_limits_cell_on_its_first_samples(tmp_path):
    root = tmp_path / "results"
    write_run(root, "full", 64, [1, 1, 1, 0, 1], limit=5)
    write_run(root, "pqcache", 64, [1, 1, 0, 0, 0], limit=5)
    write_run(root, "icecache", 64, [1, 0, 1], limit=3)
    write_run(root, "icecache", 64, [1, 1, 1, 1, 1], limit=5)  # a run of limit 3 exists: no view of this one there
    cells = tables.render(root, draws=50, limited=True).split("### ")[1:]
    short, whole = (next(cell for cell in cells if f"limit={n}," in cell.split("\n", 1)[0]) for n in (3, 5))
    assert "| full | 100 [100, 100] |" in short and "| pqcache | 67 [" in short and "(-33 [" in short
    assert "| icecache | 67 [" in short and "| icecache | 100 [" not in short
    assert "- pqcache at 64 (" in short and "(first 3 of 5)): passkey-1024-0.200" in short
    assert "| full | 80 [" in whole and "| pqcache | 40 [" in whole and "of 5)" not in whole
    agreement = short[short.index(tables.AGREEMENT_TITLE):]
    assert "| pqcache | 64 | 67 |" in agreement and agreement.split("| pqcache | 64 | 67 |")[1].split("\n")[0].endswith(
        "| 3 |")


def test_missing_folder_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tables.main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert "is not a folder of run directories" in capsys.readouterr().err
