"""The repository's layout rules (docs/architecture.md): imports run one way, modules stay small, and the
code cites nothing outside the repository."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("icecache", "baselines", "evals")
MAX_LINES = 450
OUTSIDE = re.compile(r"reference/\w+\.md|DESIGN\.md|(?:evals|baselines|icecache)\.md\b|\.\./shared/(?!data\b)")


def sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


EVALS_CORE = 10  # evals/: __init__ + at most 9 modules; suites in evals/tasks/, outputs in evals/output/


@pytest.mark.parametrize("package,forbidden", [("icecache", {"baselines", "evals"}), ("baselines", {"evals"})])
def test_imports_run_one_way(package, forbidden):
    bad = {str(p.relative_to(REPO)): sorted(imported_packages(p) & forbidden) for p in sources(package)}
    assert not {k: v for k, v in bad.items() if v}


def test_no_source_module_exceeds_the_size_limit():
    too_long = {str(p.relative_to(REPO)): n for p in [*sources(*PACKAGES, "scripts"), REPO / "run.py"]
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long


def test_code_cites_no_file_outside_the_repository():
    files = [*sources(*PACKAGES, "scripts", "tests"), REPO / "run.py", *REPO.glob("conf/**/*.yaml"),
             *REPO.glob("docs/*.md"), REPO / "README.md", REPO / "Makefile"]
    cited = {str(p.relative_to(REPO)): OUTSIDE.findall(p.read_text()) for p in files}
    assert not {k: v for k, v in cited.items() if v}


def test_evals_keeps_a_small_core_beside_tasks_output_and_bench():
    top = sorted(p.name for p in (REPO / "evals").glob("*.py"))
    assert len(top) <= EVALS_CORE, top
    assert {p.name for p in (REPO / "evals").iterdir() if p.is_dir() and p.name != "__pycache__"} == \
        {"tasks", "output", "bench"}


def test_the_library_loads_no_model_and_the_harness_needs_no_benchmark():
    """Model loading and installation live in evals/models.py; suites and outputs never import a benchmark."""
    assert not {p for p in sources("icecache") if imported_packages(p) & {"gguf", "huggingface_hub"}}
    def imports_bench(path: Path) -> bool:
        return any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("evals.bench", "bench"))
                   or isinstance(n, ast.Import) and any(a.name.startswith("evals.bench") for a in n.names)
                   for n in ast.walk(ast.parse(path.read_text())))
    assert not [str(p.relative_to(REPO)) for p in sources("evals") if "bench" not in p.parts and imports_bench(p)]
