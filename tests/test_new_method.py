"""Adding a method is one file and one registry line (docs/architecture.md, "Adding a method"): a toy method
written to a module of its own, registered the way every method is (a ``"name": "module:Class"`` entry of
``evals.registry.METHODS``), gets its contract case derived from its class and passes the contract checks that
tests/test_contract.py runs on every registered method, and the decode benchmark's defaults include it. A
method the derived case does not fit fails with the sentence naming the row to add, and passes with that row."""
from __future__ import annotations

import sys
import textwrap

import pytest
from helpers import (MethodCase, check_covering_equals_full, check_small_budget_holds, check_validate_rejects,
                     method_case, method_cases)

from evals.bench import decode
from evals.registry import METHODS, make_method, method_class
from test_official_defaults import library_methods

pytestmark = pytest.mark.usefixtures("one_thread")

MODULE = "toy_recent_method"

TOY_METHOD = '''
"""Recent tokens only: each layer keeps its ``budget`` most recent tokens and evicts the oldest one at every
decode step (StreamingLLM without sinks, at the original positions)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from icecache.kv import BudgetError, KVMethod, LayerState
from icecache.kv.storage import evict_slot, keep_sinks_and_recent


@dataclass(frozen=True)
class RecentOnly(KVMethod):
    """The most recent ``budget`` past tokens.

    Args:
        budget: past tokens attended per head per step.
    """

    name: ClassVar[str] = "toy_recent"

    def finish_prefill(self, st: LayerState) -> None:
        if st.k.shape[1] > self.budget:
            keep_sinks_and_recent(st, 0, self.budget)

    def observe(self, st: LayerState, q, fetched, selection) -> None:
        if st.k.shape[1] > self.budget:
            evict_slot(st, st.pos.argmin())


@dataclass(frozen=True)
class RecentPages(RecentOnly):
    """Recent tokens in a budget of whole ``page_size``-token pages: no budget covering the contract's short
    context is valid, so its derived case does not fit."""

    page_size: int = 512
    name: ClassVar[str] = "toy_pages"

    def validate(self) -> None:
        self.check_whole("page_size", minimum=1)
        if self.budget % self.page_size:
            raise BudgetError(f"toy_pages: budget {self.budget} is not a whole number of {self.page_size}-token "
                              f"pages")
'''


@pytest.fixture
def register(tmp_path, monkeypatch):
    """Writes the toy module and returns a function that registers one of its classes under a name, as a line
    of ``METHODS`` does; the registry, ``sys.path`` and the imported module are restored afterwards."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(TOY_METHOD))
    monkeypatch.syspath_prepend(str(tmp_path))

    def add(name: str, cls: str) -> None:
        monkeypatch.setitem(METHODS, name, f"{MODULE}:{cls}")

    yield add
    sys.modules.pop(MODULE, None)


def test_a_registered_method_file_passes_the_contract_without_a_row(register):
    register("toy_recent", "RecentOnly")
    case = method_case("toy_recent")
    assert case.derived and case in method_cases()
    assert case.covering == {"budget": case.prompt_len + case.new_tokens}  # the whole context
    assert case.small == {"budget": 1}  # its smallest valid budget
    check_covering_equals_full(case)
    check_small_budget_holds(case)
    assert "toy_recent" in decode.parse_args([]).methods
    assert "toy_recent" not in library_methods()  # a user's own method claims no paper: no official row needed


def test_the_small_check_fails_a_method_over_its_budget(register, monkeypatch):
    register("toy_recent", "RecentOnly")
    monkeypatch.setattr(method_class("toy_recent"), "observe", lambda *args: None)  # never evicts
    with pytest.raises(AssertionError, match="add a MethodCase row for 'toy_recent' .*over the budget of 1"):
        check_small_budget_holds(method_case("toy_recent"))


def test_a_method_the_derived_case_does_not_fit_names_the_row_to_add(register):
    register("toy_pages", "RecentPages")
    case = method_case("toy_pages")
    assert case.derived and not case.small  # no budget below the context is a whole page
    with pytest.raises(AssertionError, match=r"add a MethodCase row for 'toy_pages' to METHOD_ROWS in "
                                             r"tests/helpers.py: a `covering` budget .* not a whole number"):
        check_covering_equals_full(case)
    row = MethodCase("toy_pages", covering=dict(budget=512), small=dict(budget=512), invalid=dict(page_size=0))
    check_covering_equals_full(row)
    check_validate_rejects(row)
    assert make_method("toy_pages", budget=1024).page_size == 512


def test_the_registry_is_restored_after_a_toy_registration():
    assert "toy_recent" not in METHODS and "toy_pages" not in METHODS and MODULE not in sys.modules
