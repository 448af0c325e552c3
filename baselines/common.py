"""Configuration helpers and checks shared by the baselines (their storage mechanics are in
:mod:`icecache.kv.storage`).

- :func:`scaled_layers`: an official layer choice for 32-layer Llama scaled to the model's depth
  (OmniKV's filter layers, MagicPIG's dense layers).
- :class:`AttendedSetState` / :func:`check_attended`: methods that keep every key resident but attend a
  subset (Quest, TOP-k) check the attended set against the budget instead of the resident one.
"""
from __future__ import annotations

from typing import Sequence


from icecache.kv import LayerState

OFFICIAL_DEPTH = 32  # the official configurations are for 32-layer Llama models


def scaled_layers(official: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """The layers ``official`` (of a 32-layer model) scaled to ``n_layers``: ``round(l * n_layers / 32)``, at
    most the last layer, sorted and unique (SmolLM2's 30 layers: OmniKV ``2, 8, 18`` -> ``2, 8, 17``)."""
    return tuple(sorted({min(n_layers - 1, round(f * n_layers / OFFICIAL_DEPTH)) for f in official}))


class AttendedSetState(LayerState):
    """A layer whose keys all stay resident; ``max_attended`` = most past tokens any head attended at the
    last step (set by the method's ``fetch``)."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.max_attended = 0


def check_attended(method, st: AttendedSetState) -> None:
    """Debug check of a method that attends a subset of resident keys: the attended set fits the budget."""
    if method.is_budgeted(st) and st.max_attended > method.budget:
        raise AssertionError(f"{method.name}: layer {st.layer_idx} attended {st.max_attended} past tokens in one "
                             f"head, over the budget of {method.budget}")
