"""docs/results.md is what ``python -m evals.output.results_page`` prints from the committed rows, number for
number: a table edited by hand, or rows changed without regenerating the page, fail here."""
from __future__ import annotations

from evals.output import results_page


def test_the_results_page_is_generated_from_the_committed_rows():
    assert results_page.PAGE.read_text() == results_page.page(), (
        "docs/results.md differs from the committed rows: run python -m evals.output.results_page")


def test_a_section_without_rows_says_so(tmp_path):
    section = results_page.Section("Nothing yet", "nowhere", "About it.")
    text = results_page.section_text(section, tmp_path, draws=10)
    assert text.startswith("## Nothing yet") and "No committed rows yet (`reference_results/nowhere`" in text
