"""The contract every registered method keeps, run on every name in ``evals.registry.METHODS`` with its case
(tests/helpers.py :func:`~helpers.method_case`: its row in ``METHOD_ROWS``, else one derived from its class): a
budget covering the context equals full attention, a small budget holds under the debug accounting, and
``validate`` rejects a bad hyperparameter. A new method needs no row unless its derived case does not fit; the
failure then names the row to add."""
from __future__ import annotations

import pytest
from helpers import (METHOD_ROWS, check_covering_equals_full, check_small_budget_holds, check_validate_rejects,
                     method_case, method_cases)

from evals.registry import METHODS

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_row_names_a_registered_method():
    for row in METHOD_ROWS:
        assert row.name in METHODS, (f"the MethodCase row '{row.name}' in tests/helpers.py names no method of "
                                     f"evals.registry.METHODS: register it there or remove the row")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_covering_budget_equals_full_attention(name):
    check_covering_equals_full(method_case(name))


@pytest.mark.parametrize("name", sorted(c.name for c in method_cases() if c.small))
def test_small_budget_holds_under_debug(name):
    check_small_budget_holds(method_case(name))


@pytest.mark.parametrize("name", sorted(c.name for c in method_cases() if c.invalid))
def test_validate_rejects_a_bad_hyperparameter(name):
    check_validate_rejects(method_case(name))
