"""The contract every registered method keeps, driven by one table (tests/helpers.py ``METHOD_CASES``): a
budget covering the context equals full attention, a small budget holds under the debug accounting, and
``validate`` rejects a bad hyperparameter. A new method adds one row."""
from __future__ import annotations

import pytest
import torch
from helpers import METHOD_CASES, assert_matches_full, build_tiny, generate_with, skip_without_requirement

from evals.registry import METHODS, make_method

CASES = {case.name: case for case in METHOD_CASES}
pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_registered_method_has_a_case():
    assert set(CASES) == set(METHODS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_covering_budget_equals_full_attention(name):
    case = CASES[name]
    skip_without_requirement(name)
    assert_matches_full(build_tiny("tiny-llama", 2, 4), name, prompt_len=case.prompt_len,
                        new_tokens=case.new_tokens, debug=True, **case.covering)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.small))
def test_small_budget_holds_under_debug(name):
    case = CASES[name]
    skip_without_requirement(name)
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, case.prompt_len), generator=torch.Generator().manual_seed(0))
    out, cache = generate_with(model, ids, case.new_tokens, name, debug=True, **case.small)  # asserts every step
    assert out.sequences.shape[1] == case.prompt_len + case.new_tokens
    budgeted = [s.layer_idx for s in cache.states if cache.method.is_budgeted(s.layer_idx)]
    assert budgeted, f"{name}: the small case must exercise budgeted layers"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.invalid))
def test_validate_rejects_a_bad_hyperparameter(name):
    case = CASES[name]
    skip_without_requirement(name)
    budget = case.small.get("budget", 64)
    make_method(name, budget=budget, **{k: v for k, v in case.small.items() if k != "budget"})  # valid
    with pytest.raises(ValueError, match=next(iter(case.invalid))):
        make_method(name, budget=budget, **case.invalid)
