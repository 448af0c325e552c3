"""docs/results.md is what ``python -m evals.output.results_page`` prints from the committed rows, number for
number: a table edited by hand, or rows changed without regenerating the page, fail here."""
from __future__ import annotations

import pytest

from evals.output import results_page


def test_the_results_page_is_generated_from_the_committed_rows():
    assert results_page.PAGE.read_text() == results_page.page(), (
        "docs/results.md differs from the committed rows: run python -m evals.output.results_page")
    for path, text in results_page.mirrored().items():
        assert path.read_text() == text, f"{path} differs from the committed rows: run python -m evals.output.results_page"


def test_a_mirrored_section_is_written_between_its_markers_and_a_doc_without_them_is_refused(tmp_path, monkeypatch):
    section = results_page.Rows("Latency", ("bench/none.json",), "About it.", kind="decode", mirror="doc.md")
    monkeypatch.setattr(results_page, "SECTIONS", (section,))
    begin, end = results_page.markers("Latency")
    (tmp_path / "doc.md").write_text(f"# Doc\n\n{begin}\nold table\n{end}\n\nmore\n")
    text = results_page.mirrored(tmp_path, draws=10)[tmp_path / "doc.md"]
    assert text.startswith(f"# Doc\n\n{begin}\nAbout it.\n") and text.endswith(f"is missing).\n{end}\n\nmore\n")
    assert "old table" not in text and "## Latency" not in text
    (tmp_path / "doc.md").write_text("# Doc\n")
    with pytest.raises(SystemExit, match="no place for the section 'Latency'"):
        results_page.mirrored(tmp_path, draws=10)


def test_a_section_without_rows_says_so(tmp_path):
    section = results_page.Section("Nothing yet", "nowhere", "About it.")
    text = results_page.section_text(section, tmp_path, draws=10)
    assert text.startswith("## Nothing yet") and "No committed rows yet (`reference_results/nowhere`" in text


def test_a_rows_section_without_its_file_says_so(tmp_path):
    section = results_page.Rows("Nothing yet", ("bench/none.json",), "About it.", kind="decode")
    text = results_page.rows_text(section, tmp_path, draws=10)
    assert text.startswith("## Nothing yet") and "(`reference_results/bench/none.json` is missing)" in text


def test_a_decode_cell_is_read_against_full_at_its_length():
    from evals.output.row_tables import decode_markdown

    def cell(tt2t, tpot):
        return {"tt2t_s": tt2t, "tpot_p50_s": tpot, "breakdown": {"select": 0.001, "other": 0.02}}
    data = {"full": {"4096": cell(2.0, 0.05)}, "icecache": {"4096": cell(3.0, 0.04), "8192": {"error": "x"}},
            "environment": {}, "summary": {}}
    row = next(line for line in decode_markdown(data).splitlines() if line.startswith("| icecache | 4k"))
    assert "| 40.0 | 1.0 |" in row and "| 0.80 | 1.50 |" in row
    assert "Failed cells: icecache at 8192." in decode_markdown(data)


def test_a_replayed_cell_shows_no_tt2t_and_the_row_sets_sit_side_by_side():
    from evals.output.row_tables import decode_markdown

    def cell(tpot, dense, prefill="replayed"):
        return {"tt2t_s": 1.0, "tpot_p50_s": tpot, "breakdown": {"other": 0.02}, "prefill": prefill,
                "n_dense_layers": dense}
    configurations = {
        "row_sets": {"default": {"cells": {"full": "full", "arkvale": "arkvale", "omnikv": "omnikv"}},
                     "dense=0": {"cells": {"full": "full", "arkvale": "arkvale[dense=0]"},
                                 "not_equalised": {"omnikv": "its dense layers are its layer roles"}}},
        "tpot_over_full": {"default": {"arkvale": {"4096": 0.8}, "omnikv": {"4096": 0.9}},
                           "dense=0": {"arkvale": {"4096": 0.5}}}}
    data = {"full": {"4096": cell(0.1, 24)}, "arkvale": {"4096": cell(0.08, 2)},
            "arkvale[dense=0]": {"4096": cell(0.05, 0)}, "omnikv": {"4096": cell(0.09, 5)},
            "configurations": configurations, "environment": {}, "summary": {}}
    text = decode_markdown(data)
    assert text.splitlines()[2].startswith("| full | 4k |  | 100.0 |")  # no TT2T over a replayed prefill
    assert "| arkvale | dense=0 | `arkvale[dense=0]` | 0 | 0.50 |" in text
    assert "| arkvale | default | `arkvale` | 2 | 0.80 |" in text
    assert "| omnikv | dense=0 | cannot be put on these terms: its dense layers are its layer roles |" in text
