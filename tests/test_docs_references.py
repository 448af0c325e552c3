"""Every option, module, make target and registered name the docs (README.md, docs/*.md) write in code exists.

Only code is read: fenced blocks and inline backtick spans. In them:

- ``cache.<field>=``: a field of some registered method's dataclass (the ``cache`` group, :mod:`evals.config`);
- ``eval.<field>=``: a field of some suite's ``Options`` dataclass or one of its ``model_links``;
- ``cache=<name>`` / ``eval=<name>`` (also a sweep's ``a,b,c``): a registered method / a suite or a preset in
  ``conf/eval/`` (placeholders such as ``<name>``, ``$OTHERS`` or ``...`` are skipped);
- ``python -m <module>``: a module Python can find (:func:`importlib.util.find_spec`; nothing is run);
- ``make <target>``: a target of the Makefile.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from evals.config import method_defaults, suite_defaults
from evals.registry import METHODS, SUITES, suite_class

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # may wrap lines, never a paragraph
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
PATTERNS = {
    "cache option": re.compile(rf"(?<![\w.])cache\.({NAME})="),
    "eval option": re.compile(rf"(?<![\w.])eval\.({NAME})="),
    "cache name": re.compile(r"(?<![\w.])cache=([^\s`'\";)]+)"),
    "eval name": re.compile(r"(?<![\w.])eval=([^\s`'\";)]+)"),
    "module": re.compile(r"\bpython3? -m ([\w.]+)"),
    "make target": re.compile(r"(?<![\w$(-])make ([A-Za-z0-9_.-]+)(?![\w=])"),
}


def code_spans(text: str) -> list[str]:
    """The fenced blocks of ``text`` and the inline code spans outside them (a wrapped span joined by a space)."""
    blocks = FENCE.findall(text)
    return blocks + [re.sub(r"\s*\n\s*", " ", span) for span in INLINE.findall(FENCE.sub("", text))]


def known() -> dict[str, set[str]]:
    methods = {k for name in METHODS for k in method_defaults(name)} - {"name"}
    suites = {k for name in SUITES for k in (*suite_defaults(name), *suite_class(name).model_links)} - {"name"}
    presets = {p.stem for p in (REPO / "conf" / "eval").glob("*.yaml")}
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", (REPO / "Makefile").read_text(), re.M))
    return {"cache option": methods, "eval option": suites, "cache name": set(METHODS),
            "eval name": set(SUITES) | presets, "make target": targets}


def exists(kind: str, value: str, table: dict[str, set[str]]) -> bool:
    if kind == "module":
        try:
            return importlib.util.find_spec(value) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False
    return value in table[kind]


def references(path: Path) -> list[tuple[str, str]]:
    """``(kind, value)`` of every reference in ``path``'s code, a sweep's names one by one."""
    found = []
    for span in code_spans(path.read_text()):
        for kind, pattern in PATTERNS.items():
            for value in pattern.findall(span):
                parts = value.split(",") if kind.endswith("name") else [value]
                found += [(kind, p) for p in parts if p and not p.startswith(("<", "$", "..."))]
    return found


def test_the_scanner_reads_code_only_and_splits_sweeps(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("To make a change, set cache.x=1 in prose.\n\n```bash\nmake demo\npython run.py -m "
                   "cache=full,icecache eval=<suite> cache.page_size=8\n```\nand `python -m\nevals.bench.decode`.\n")
    assert sorted(references(doc)) == [("cache name", "full"), ("cache name", "icecache"),
                                       ("cache option", "page_size"), ("make target", "demo"),
                                       ("module", "evals.bench.decode")]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_reference_in_the_docs_exists(path):
    table = known()
    missing = sorted({f"{kind} {value!r}" for kind, value in references(path) if not exists(kind, value, table)})
    assert not missing, f"{path.relative_to(REPO)} names what does not exist: " + ", ".join(missing)
