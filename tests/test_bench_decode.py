"""The decode benchmark script end to end on the tiny model: isolated cells with peak RSS, resume."""
import json

import pytest

from evals.bench import decode
from evals.registry import METHODS
from helpers import DATA_DIR

pytestmark = pytest.mark.skipif(not (DATA_DIR / "pg_essays").is_dir(), reason=f"no essays under {DATA_DIR}")


def bench(out, *extra, budget=32, length=96):
    decode.main(["--model", "tiny-llama", "--lengths", str(length), "--new-tokens", "4", "--budget", str(budget),
                 "--threads", "1",
                 "--data-dir", str(DATA_DIR), "--out", str(out), *extra])
    return json.loads(out.read_text())


def test_isolated_cells_record_peak_rss_and_resume_skips_finished_cells(tmp_path, capsys):
    out = tmp_path / "bench.json"
    first = bench(out, "--methods", "full", "--isolate")
    row = first["full"]["96"]
    assert row["peak_rss_bytes"] > 50 * 2**20 and row["tpot_s"] > 0 and row["tt2t_s"] >= row["ttft_s"]
    assert set(row["breakdown"]) == {"select", "transfer", "attention", "update", "other"}
    assert first["environment"]["isolate"] and first["environment"]["threads"] == 1
    assert first["environment"]["prompt_text"].endswith("PaulGrahamEssays.json")  # the essays, not the filler
    assert row["omp_wait"] == "spin 300000"  # libgomp's default spin, set explicitly in the cell
    assert row["warmup_prompt_tokens"] == 96  # min(length, 4 x budget): one untimed generation came first
    capsys.readouterr()
    second = bench(out, "--methods", "full", "streaming_llm", "--isolate", "--resume")
    printed = capsys.readouterr().out
    assert second["full"] == first["full"] and "streaming_llm" in second
    assert "full     96" not in printed and "streaming_llm     96" in printed and "ratio to full" in printed
    with pytest.raises(SystemExit, match="budget=32"):
        decode.main(["--model", "tiny-llama", "--lengths", "96", "--budget", "64", "--new-tokens", "4",
                     "--out", str(out), "--resume"])


def test_in_process_run_writes_every_method(tmp_path):
    result = bench(tmp_path / "bench.json", "--methods", "full", "icecache", "--in-process", budget=64, length=200)
    assert {"full", "icecache", "environment"} <= set(result)
    assert "peak_rss_bytes" not in result["icecache"]["200"]


def test_every_cell_waits_by_one_rule_libgomps_default_spin_unless_asked():
    assert decode.parse_args([]).omp_wait == "spin"
    assert decode.OMP_WAIT["spin"] == {"GOMP_SPINCOUNT": "300000"}
    assert decode.OMP_WAIT["passive"] == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_defaults_cover_every_method_in_fresh_processes():
    args = decode.parse_args([])
    assert set(args.methods) == set(METHODS) - set(decode.OPTIONAL_METHODS)  # every registered method
    assert args.isolate and not decode.parse_args(["--in-process"]).isolate
    assert (args.growth_from, args.growth_to) == (4096, 32768)


def _row(tpot, **phases):
    return {decode.TPOT: tpot, "tt2t_s": 1.0, "breakdown": {p: phases.get(p, 0.0) for p in decode.BREAKDOWN}}


def test_growth_is_tpot_and_phase_difference_between_the_range_ends(capsys):
    results = {"full": {"2048": _row(0.010, attention=0.001), "4096": _row(0.012, attention=0.002),
                        "32768": _row(0.040, attention=0.025, other=0.005)},
               "icecache": {"4096": _row(0.020, select=0.005), "32768": _row(0.022, select=0.006)},
               "pqcache": {"4096": {"error": "exit 1: boom"}},
               "environment": {}}
    table = decode.summary(results, 4096, 32768)
    full = table["full"]["growth"]
    assert (full["from"], full["to"]) == (4096, 32768)
    assert full["growth_s"] == pytest.approx(0.028) and full["growth_x"] == pytest.approx(40 / 12)
    assert full["phase_growth_s"]["attention"] == pytest.approx(0.023)
    assert full["phase_growth_s"]["other"] == pytest.approx(0.005)
    assert table["icecache"]["growth"]["phase_growth_s"]["select"] == pytest.approx(0.001)
    assert "pqcache" not in table  # failed cells are left out of the summary
    decode.print_summary(results, 4096, 32768)
    printed = capsys.readouterr().out
    assert "+28.00  3.33x" in printed and "growth from 4096 to 32768" in printed


def test_omp_wait_record_names_how_idle_threads_wait(monkeypatch):
    from evals.output.timing import omp_wait_record
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_wait_record() == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_wait_record() == "passive"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # overrides the policy in libgomp
    assert omp_wait_record() == "spin 300000"


def test_repeats_run_in_rounds_and_report_each_cells_medians(tmp_path, capsys):
    """``--repeats 3``: every cell measured three times, round by round (full, topk, full, topk, ...), its row the
    median of every timing and phase with the repeats under ``runs``; resume counts the finished repeats."""
    out = tmp_path / "bench.json"
    result = bench(out, "--methods", "full", "topk", "--in-process", "--repeats", "3")
    order = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " 96: TT2T" in line]
    assert order == ["full", "topk"] * 3
    for method in ("full", "topk"):
        row = result[method]["96"]
        runs = row["runs"]
        assert len(runs) == 3
        assert row[decode.TPOT] == sorted(r[decode.TPOT] for r in runs)[1]
        assert row["breakdown"]["other"] == sorted(r["breakdown"]["other"] for r in runs)[1]
    bench(out, "--methods", "full", "topk", "--in-process", "--repeats", "3", "--resume")
    assert " 96: TT2T" not in capsys.readouterr().out


def test_median_row_of_one_run_is_that_run_and_failed_repeats_are_left_out():
    one = _row(0.5)
    assert decode.median_row([one]) is one
    rows = [_row(0.3, other=0.1), {"error": "exit 1"}, _row(0.5, other=0.3)]
    merged = decode.median_row(rows)
    assert merged[decode.TPOT] == 0.4 and merged["breakdown"]["other"] == 0.2 and merged["runs"] == rows

