"""The decode benchmark script end to end on the tiny model: isolated cells with peak RSS, resume."""
import json

import pytest

from evals.bench import decode, decode_report, floor
from evals.bench.method_options import OptionError, parse_spec, plan, typed_options
from evals.registry import METHODS
from helpers import DATA_DIR, build_tiny
from icecache.kv.compat import model_spec

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
    assert row["numba_threads"] == 1  # numba's pool too: a wider one stalls its loops on the cores given
    assert first["environment"]["prompt_text"].endswith("PaulGrahamEssays.json")  # the essays, not the filler
    assert row["omp_wait"] == "spin 300000"  # libgomp's default spin, set explicitly in the cell
    assert row["warmup_prompt_tokens"] == 96  # min(length, 4 x budget): one untimed generation came first
    capsys.readouterr()
    second = bench(out, "--methods", "full", "streaming_llm:n_sink=8", "--isolate", "--resume")
    printed = capsys.readouterr().out
    assert second["full"] == first["full"] and "streaming_llm[n_sink=8]" in second
    assert "full     96" not in printed and "streaming_llm[n_sink=8]     96" in printed and "ratio to full" in printed
    assert second["streaming_llm[n_sink=8]"]["96"]["method_config"]["n_sink"] == 8  # the option reached the cell
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
    return {decode.TPOT: tpot, "tt2t_s": 1.0, "breakdown": {p: phases.get(p, 0.0) for p in decode_report.BREAKDOWN}}


def test_growth_is_tpot_and_phase_difference_between_the_range_ends(capsys):
    results = {"full": {"2048": _row(0.010, attention=0.001), "4096": _row(0.012, attention=0.002),
                        "32768": _row(0.040, attention=0.025, other=0.005)},
               "icecache": {"4096": _row(0.020, select=0.005), "32768": _row(0.022, select=0.006)},
               "pqcache": {"4096": {"error": "exit 1: boom"}},
               "environment": {}}
    table = decode_report.summary(results, 4096, 32768)
    full = table["full"]["growth"]
    assert (full["from"], full["to"]) == (4096, 32768)
    assert full["growth_s"] == pytest.approx(0.028) and full["growth_x"] == pytest.approx(40 / 12)
    assert full["phase_growth_s"]["attention"] == pytest.approx(0.023)
    assert full["phase_growth_s"]["other"] == pytest.approx(0.005)
    assert table["icecache"]["growth"]["phase_growth_s"]["select"] == pytest.approx(0.001)
    assert "pqcache" not in table  # failed cells are left out of the summary
    decode_report.print_summary(results, 4096, 32768)
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



def test_method_options_parse_as_the_dataclass_fields():
    assert parse_spec("arkvale") == ("arkvale", {})
    assert parse_spec("magicpig:dense_layers=[0,1],n_sink=8") == ("magicpig", {"dense_layers": "[0,1]", "n_sink": "8"})
    typed = typed_options("icecache", {"search_ratio": "1e-3", "prop_to_retrieve": "1", "gqa_merge": "union",
                                       "always_index": "true", "n_dense_layers": "0"}, "--methods icecache")
    assert typed == {"search_ratio": 0.001, "prop_to_retrieve": 1.0, "gqa_merge": "union", "always_index": True,
                     "n_dense_layers": 0}
    assert isinstance(typed["prop_to_retrieve"], float)  # a whole number given to a float field
    assert typed_options("magicpig", {"dense_layers": "[0,1]"}, "")["dense_layers"] == [0, 1]
    for spec in ("arkvale:page_topks", "arkvale:page_topks=1,page_topks=2", ":x=1"):
        with pytest.raises(OptionError):
            parse_spec(spec)


@pytest.mark.parametrize("spec,says", [("nope", "unknown cache method 'nope'"), ("arkvale:foo=1", "no option 'foo'"),
                                       ("arkvale:page_topks=1.5", "page_topks must be a whole number"),
                                       ("icecache:always_index=maybe", "always_index must be true or false"),
                                       ("icecache:gqa_merge=bogus", "gqa_merge must be one of"),
                                       ("magicpig:dense_layers=3", "dense_layers must be a list"),
                                       ("arkvale:page_topks", "expected KEY=VALUE")])
def test_a_bad_method_option_is_one_line_and_exit_code_2(spec, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        decode.main(["--model", "tiny-llama", "--methods", "full", spec, "--out", str(tmp_path / "x.json")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --methods {spec}") and says in err
    assert not (tmp_path / "x.json").exists()


def test_every_method_runs_at_its_longbench_setting_unless_told_otherwise():
    cells, conf = plan(["full", "arkvale", "pqcache", "icecache", "arkvale:n_sink_pages=2"], "longbench", [], 256)
    options = {c.label: c.options for c in cells}
    assert options["arkvale"] == {"n_dense_layers": 2, "n_sink_pages": 1, "page_topks": 32}  # the suite file's
    assert options["pqcache"] == {"n_sink": 32} and options["icecache"] == {} and options["full"] == {}
    ark = conf["cells"]["arkvale"]
    assert ark["suite_file"] == "conf/suite_cache/longbench_arkvale.yaml" and ark["from_command_line"] == {}
    assert ark["from_suite"] == options["arkvale"] and "longbench_pred.py" in ark["official_source"]["n_sink_pages"]
    explicit = conf["cells"]["arkvale[n_sink_pages=2]"]  # the command line wins over the suite file
    assert explicit["options"] == {"n_dense_layers": 2, "n_sink_pages": 2, "page_topks": 32}
    assert explicit["from_command_line"] == {"n_sink_pages": 2} and explicit["suite_overridden"] == {"n_sink_pages": 1}
    assert "n_sink_pages" not in explicit["from_suite"]
    built = next(c for c in cells if c.label == "arkvale").build(256)
    assert (built.n_dense_layers, built.n_sink_pages, built.page_topks) == (2, 1, 32)
    cells, conf = plan(["arkvale", "pqcache"], None, [], 256)  # --suite none: the class defaults
    assert all(c.options == {} for c in cells) and conf["cells"]["arkvale"]["suite_file"] is None
    assert cells[0].build(256).n_dense_layers == 0
    assert decode.parse_args([]).suite == "longbench"


def test_equal_dense_keeps_exactly_the_first_n_layers_dense_where_a_method_can():
    methods = ["full", "icecache", "icecache_reuse", "page_oracle", "quest", "arkvale", "topk", "magicpig", "omnikv",
               "h2o", "pqcache"]
    cells, conf = plan(methods, "longbench", [0, 2], 256)
    spec = model_spec(build_tiny(n_layers=6))
    for n in (0, 2):
        row_set = conf["row_sets"][f"dense={n}"]
        assert set(row_set["cells"]) | set(row_set["not_equalised"]) == set(methods) - {"full"}
        assert "omnikv" in row_set["not_equalised"]
        for method, label in row_set["cells"].items():
            cell = next(c for c in cells if c.label == label)
            built = cell.build(256)
            layers = built.new_sequence(built.bind(spec)).layers
            assert floor.dense_layers(built, spec) == n, label
            assert not any(built.is_budgeted(st) for st in layers[:n]), label  # the first n layers, not any n
    zero, two = conf["row_sets"]["dense=0"], conf["row_sets"]["dense=2"]
    assert conf["cells"]["magicpig[dense=2]"]["equal_dense"] == {"dense_layers": [0, 1]}
    assert conf["cells"]["arkvale[dense=0]"]["options"] == {"n_dense_layers": 0, "n_sink_pages": 1, "page_topks": 32}
    assert "h2o" in zero["same_as_default"] and "pqcache" in zero["same_as_default"]  # every layer budgeted already
    assert {"h2o", "pqcache", "omnikv"} == set(two["not_equalised"])
    assert {"icecache", "arkvale", "quest", "page_oracle", "icecache_reuse"} == set(two["same_as_default"])
    assert two["cells"]["topk"] == "topk[dense=2]" and zero["cells"]["icecache"] == "icecache[dense=0]"


def test_equal_dense_rows_run_beside_the_default_ones_and_resume_checks_the_options(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench(out, "--methods", "full", "arkvale:page_size=8", "h2o", "--equal-dense", "0", "--in-process",
                   budget=64)
    assert {"full", "arkvale[page_size=8]", "arkvale[page_size=8,dense=0]", "h2o"} <= set(result)
    default, dense = result["arkvale[page_size=8]"]["96"], result["arkvale[page_size=8,dense=0]"]["96"]
    assert (default["method_config"]["n_dense_layers"], default["method_config"]["n_sink_pages"]) == (2, 1)
    assert (dense["method_config"]["n_dense_layers"], dense["n_dense_layers"]) == (0, 0)
    assert "h2o[dense=0]" not in result  # already on those terms: its default row serves
    conf = result["configurations"]
    assert conf["suite"] == "longbench" and conf["row_sets"]["dense=0"]["cells"]["h2o"] == "h2o"
    ratios = conf["tpot_over_full"]
    assert ratios["dense=0"]["arkvale[page_size=8]"]["96"] == pytest.approx(
        dense[decode.TPOT] / result["full"]["96"][decode.TPOT])
    assert ratios["dense=0"]["h2o"] == ratios["default"]["h2o"]
    printed = capsys.readouterr().out
    assert "row sets side by side: default | dense=0" in printed
    with pytest.raises(SystemExit, match=r"'arkvale\[page_size=8\]' ran .*n_dense_layers.*2"):
        bench(out, "--methods", "full", "arkvale:page_size=8", "--suite", "none", "--in-process", "--resume",
              budget=64)


def test_prefill_cache_replays_one_capture_per_length_and_resume_keeps_the_prefill_mode(tmp_path):
    store, out = tmp_path / "prefills", tmp_path / "bench.json"
    first = bench(out, "--methods", "full", "icecache", "--in-process", "--prefill-cache", str(store),
                  budget=64, length=200)
    assert len(list(store.glob("*.safetensors"))) == 1  # captured once, replayed into both methods
    assert first["environment"]["prefill"] == "replayed"
    assert {first[m]["200"]["prefill"] for m in ("full", "icecache")} == {"replayed"}
    live = bench(tmp_path / "live.json", "--methods", "full", "--in-process", budget=64, length=200)
    assert live["full"]["200"]["prefill"] == "live" and live["environment"]["prefill"] == "live"
    with pytest.raises(SystemExit, match="prefill=replayed"):  # a live run may not extend a replayed file
        bench(out, "--methods", "full", "--in-process", "--resume", budget=64, length=200)
