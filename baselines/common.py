"""Mechanics shared by the baselines (in the spirit of NVIDIA kvpress' ``ScorerPress``: the policy in each
method's file, the shared slicing and checks here).

- :func:`keep_sinks_and_recent`: the "first ``n_sink`` + last ``n_recent`` tokens" cut (StreamingLLM's kept
  set; the resident part of PQCache and MagicPIG).
- :func:`evict_slot`: an O(1) one-token eviction (the newest token takes the leaving one's slot).
- :func:`scaled_layers`: an official layer choice for 32-layer Llama scaled to the model's depth
  (OmniKV's filter layers, MagicPIG's dense layers).
- :class:`AttendedSetState` / :func:`check_attended`: methods that keep every key resident but attend a
  subset (Quest, TOP-k) check the attended set against the budget instead of the resident one.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from icecache.kv import LayerState

OFFICIAL_DEPTH = 32  # the official configurations are for 32-layer Llama models


def sinks_and_recent(n: int, n_sink: int, n_recent: int, device=None) -> torch.Tensor:
    """Indices ``[0, n_sink) + [n - n_recent, n)`` of ``n`` tokens."""
    return torch.cat([torch.arange(n_sink), torch.arange(n - n_recent, n)]).to(device)


def keep_sinks_and_recent(st: LayerState, n_sink: int, n_recent: int) -> None:
    """Keeps the ``n_sink`` first and ``n_recent`` last resident tokens of ``st`` (``k, v: [H, n, d]``, ``pos: [n]``)."""
    keep = sinks_and_recent(st.k.shape[1], n_sink, n_recent, st.k.device)
    st.k, st.v, st.pos = st.k[:, keep], st.v[:, keep], st.pos[keep]


def evict_slot(st: LayerState, slot: torch.Tensor) -> None:
    """Removes the resident token in ``slot`` (a 0-d index, the same in every head) in O(1): the last resident
    token moves into it and ``k, v: [H, n, d]``, ``pos: [n]`` shrink by one, staying prefix views of their
    buffers (:meth:`~icecache.kv.KVMethod.store` then appends in place). Slots are no longer in position order."""
    last = st.k.shape[1] - 1
    index = slot.view(1)
    for x, dim in ((st.k, 1), (st.v, 1), (st.pos, 0)):
        x.index_copy_(dim, index, x.narrow(dim, last, 1).clone())
    st.k, st.v, st.pos = st.k[:, :last], st.v[:, :last], st.pos[:last]


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
    if method.is_budgeted(st.layer_idx) and st.max_attended > method.budget:
        raise AssertionError(f"{method.name}: layer {st.layer_idx} attended {st.max_attended} past tokens in one "
                             f"head, over the budget of {method.budget}")


def spare_cpu_share(device: torch.device) -> float:
    """Share of the CPU cores the prefill leaves idle, on which the official codes overlap their index builds
    (PQCache's k-means, MagicPIG's tables): all of them when the model runs on a GPU, else the cores beyond
    torch's intra-op threads."""
    if device.type != "cpu":
        return 1.0
    cores = os.cpu_count() or 1
    return max(0, cores - torch.get_num_threads()) / cores
