"""The floor of a decode benchmark cell (evals/bench/floor.py) and the TPOT vs context figure
(evals/output/latency_figure.py)."""
import json

import pytest
import torch

from evals.bench import decode, decode_report, floor
from evals.output import latency_figure
from evals.output.plot_style import dodge_factors
from evals.registry import make_method
from helpers import DATA_DIR, build_tiny


def _row(tpot, n_dense, exact_s, n_layers=30, **phases):
    return {decode.TPOT: tpot, "tt2t_s": 1.0, "n_layers": n_layers, "n_dense_layers": n_dense,
            "exact_attention_s": exact_s, "breakdown": {p: phases.get(p, 0.0) for p in decode_report.BREAKDOWN}}


def test_floor_is_fulls_other_plus_its_dense_attention_share_plus_exact_attention_in_budgeted_layers():
    full = _row(0.1134, 30, 4e-5, attention=0.0885, other=0.0244, update=0.0007)
    ice = _row(0.0435, 2, 5e-5, select=0.0106, attention=0.0074, other=0.0232)
    results = {"full": {"32768": full, "4096": {"error": "exit 1"}}, "icecache": {"32768": ice, "4096": _row(0.03, 2, 5e-5)},
               "environment": {}}
    floor.annotate(results, decode.TPOT)
    expected = 0.0244 + 0.0885 * 2 / 30 + 5e-5 * 28
    assert ice["floor_s"] == pytest.approx(expected)
    assert ice["tpot_over_floor"] == pytest.approx(0.0435 / expected)
    assert ice["floor_parts_s"] == pytest.approx({"other": 0.0244, "dense_attention": 0.0885 * 2 / 30,
                                                  "budgeted_attention": 5e-5 * 28})
    assert full["floor_s"] == pytest.approx(0.0244 + 0.0885)  # full: every layer dense, its own other + attention
    assert full["tpot_over_floor"] == pytest.approx(0.1134 / 0.1129)
    assert results["icecache"]["4096"]["floor_s"] is None  # full failed at that length: no floor
    table = decode_report.summary(results, 4096, 32768)
    assert table["icecache"]["floor_s"]["32768"] == pytest.approx(expected)
    assert table["icecache"]["tpot_over_floor"]["4096"] is None


def test_a_row_measured_without_floor_inputs_has_no_floor_and_repeats_keep_no_derived_floor():
    full = _row(0.1, 30, 4e-5, attention=0.05, other=0.02)
    old = {decode.TPOT: 0.05, "breakdown": {"other": 0.02}}
    results = {"full": {"8192": full}, "quest": {"8192": old}}
    floor.annotate(results, decode.TPOT)
    assert old["floor_s"] is None and old["tpot_over_floor"] is None
    assert not set(floor.FLOOR_KEYS) & set(floor.without_floor(full)) and full["floor_s"] is not None


def test_dense_layers_are_those_the_method_bound_to_the_model_leaves_unbudgeted():
    model = build_tiny(n_layers=4)
    spec = floor.model_spec(model)
    assert floor.dense_layers(make_method("icecache", budget=64), spec) == 2  # IceCache's n_dense_layers = 2
    assert floor.dense_layers(make_method("full", budget=None), spec) == 4
    omni = make_method("omnikv", budget=64)  # its layer roles come from the model's depth
    roles = omni.bind(spec).roles
    assert floor.dense_layers(omni, spec) == sum(role != "sparse" for role, _ in roles.values()) > 0


def test_exact_attention_is_timed_over_budget_keys_in_the_models_shape(monkeypatch):
    model = build_tiny(n_kv_heads=2, n_heads=4, n_layers=3).to(torch.bfloat16)
    cfg = model.config
    seen = []

    def recording_attend(q, k, v, scaling):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, scaling))
        return real_attend(q, k, v, scaling)

    real_attend = floor.attend
    monkeypatch.setattr(floor, "attend", recording_attend)
    inputs = floor.floor_inputs(model, make_method("icecache", budget=64), budget=64)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert inputs["exact_attention_s"] > 0
    assert (inputs["n_layers"], inputs["n_dense_layers"]) == (cfg.num_hidden_layers, 2)
    assert inputs["exact_attention_shape"] == {"n_q_heads": cfg.num_attention_heads,
                                               "n_kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
                                               "keys": 64, "dtype": "torch.bfloat16", "device": "cpu"}
    assert len(seen) == floor.WARMUP_CALLS + floor.REPEATS * floor.CALLS
    assert set(seen) == {((4, 1, head_dim), (2, 64, head_dim), (2, 64, head_dim), torch.bfloat16,
                          floor.model_spec(model).scaling)}


LENGTHS = (2048, 4096, 8192, 16384, 32768)


def crafted_bench() -> dict:
    """A decode benchmark file: full and IceCache at 2k-32k (IceCache with three repeats), a failed cell."""
    def cell(tpot, floor_s, runs=1):
        row = {decode.TPOT: tpot, "floor_s": floor_s, "tpot_over_floor": tpot / floor_s}
        return {**row, "runs": [dict(row) for _ in range(runs)]} if runs > 1 else row
    return {"full": {str(L): cell(0.02 + L * 3e-6, 0.019 + L * 3e-6) for L in LENGTHS},
            "icecache": {str(L): cell(0.03 + L * 4e-7, 0.021 + L * 1e-7, runs=3) for L in LENGTHS},
            "pqcache": {"4096": {"error": "exit 1: boom"}},
            "summary": {}, "environment": {"model": "smollm2-135m", "budget": 256, "new_tokens": 64,
                                           "cpu_model": "AMD EPYC 9B45", "threads": 2, "dtype": "torch.bfloat16",
                                           "gpu": None}}


def lines_by_gid(fig) -> dict:
    return {line.get_gid(): line for line in fig.axes[0].get_lines() if line.get_gid()}


def test_figure_draws_each_methods_tpot_and_floor_from_the_file(tmp_path, capsys):
    bench = crafted_bench()
    path = tmp_path / "bench_decode.json"
    path.write_text(json.dumps(bench))
    out = tmp_path / "figures" / "tpot_vs_context.png"
    latency_figure.main([str(path), "-o", str(out)])
    assert out.is_file() and out.stat().st_size > 10_000 and str(out) in capsys.readouterr().out
    fig = latency_figure.draw_tpot_vs_context(json.loads(path.read_text()))
    lines = lines_by_gid(fig)
    assert set(lines) == {"tpot:full", "floor:full", "tpot:icecache", "floor:icecache"}  # no line for a failed cell
    for method, factor in zip(("full", "icecache"), dodge_factors(2, 0.2)):
        for kind, key in (("tpot", decode.TPOT), ("floor", "floor_s")):
            line = lines[f"{kind}:{method}"]
            assert list(line.get_xdata()) == pytest.approx([L * factor for L in LENGTHS])
            assert list(line.get_ydata()) == pytest.approx([1000 * bench[method][str(L)][key] for L in LENGTHS])
        assert lines[f"floor:{method}"].get_linestyle() == "--"
        assert lines[f"floor:{method}"].get_color() == lines[f"tpot:{method}"].get_color()
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xaxis().get_scale() == "log"
    title = ax.get_title()
    for text in ("smollm2-135m", "budget 256", "AMD EPYC 9B45", "2 threads", "bfloat16", "1-3 repeats per cell"):
        assert text in title
    labels = ax.get_legend_handles_labels()[1]
    assert "icecache (n=3)" in labels and "full (n=1)" in labels


def test_figure_draws_only_the_named_methods_floors():
    lines = lines_by_gid(latency_figure.draw_tpot_vs_context(crafted_bench(), floors=["icecache"]))
    assert set(lines) == {"tpot:full", "tpot:icecache", "floor:icecache"}
    assert latency_figure.TPOT == decode.TPOT


@pytest.mark.skipif(not (DATA_DIR / "pg_essays").is_dir(), reason=f"no essays under {DATA_DIR}")
def test_the_benchmark_writes_each_cells_floor_and_its_inputs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    decode.main(["--model", "tiny-llama", "--lengths", "200", "--new-tokens", "4", "--budget", "64", "--threads", "1",
                 "--data-dir", str(DATA_DIR), "--out", str(out), "--methods", "full", "icecache", "--in-process"])
    result = json.loads(out.read_text())
    full, ice = result["full"]["200"], result["icecache"]["200"]
    assert (full["n_dense_layers"], ice["n_dense_layers"], ice["n_layers"]) == (4, 2, 4)
    assert ice["exact_attention_s"] > 0
    assert ice["floor_s"] == pytest.approx(full["breakdown"]["other"] + full["breakdown"]["attention"] / 2
                                           + 2 * ice["exact_attention_s"])
    assert full["floor_s"] == pytest.approx(full["breakdown"]["other"] + full["breakdown"]["attention"])
    assert result["summary"]["icecache"]["tpot_over_floor"]["200"] == pytest.approx(ice[decode.TPOT] / ice["floor_s"])
    assert "floor ms (TPOT / floor)" in capsys.readouterr().out
