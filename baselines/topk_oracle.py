"""TOP-k oracle: exact top-``budget`` past tokens by ``q . k`` at every step (the upper bound the IceCache
paper reports as "TOP-k"; budget: docs/architecture.md).

At each decode step every head scores all past keys exactly and attends to its ``budget`` best ones plus
the current token; nothing is approximated, evicted or offloaded (every key stays resident, so the
``debug`` check asserts the attended set, not residency). All layers are budgeted.

GQA (``heads``):
- ``"query"`` (default): one exact top-``budget`` set per query head (selection head axis ``H_q``) —
  the best any per-head token selector can do.
- ``"kv"``: one set per KV head shared by its ``G`` query heads (head axis ``H_kv``), ranked by the
  group's ``group_agg``: ``"sum"`` of the softmax probabilities (current token included in the
  normalisation) or ``"max"`` of the logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from icecache.kv import Fetched, KVMethod
from icecache.kv.attention import attention_logits

from .common import AttendedSetState, check_attended

HEAD_MODES = ("query", "kv")
KV_RANKINGS = ("sum", "max")  # heads=kv: sum of the softmax | max of the logits


@dataclass
class TopKOracle(KVMethod):
    """Exact top-k attention.

    Args:
        budget: past tokens attended per head per step.
        heads: "query" (per query head, default) or "kv" (per KV head, shared by the group).
        group_agg: with heads="kv", how the group ranks tokens: "sum" of softmax or "max" of logits.
    """

    heads: str = "query"
    group_agg: str = "sum"
    name: ClassVar[str] = "topk"

    def validate(self) -> None:
        if self.heads not in HEAD_MODES:
            raise ValueError(f"topk: heads must be one of {HEAD_MODES}, got '{self.heads}'")
        if self.group_agg not in KV_RANKINGS:
            raise ValueError(f"topk: group_agg must be one of {KV_RANKINGS}, got '{self.group_agg}'")

    def make_state(self, layer_idx: int) -> AttendedSetState:
        return AttendedSetState(layer_idx)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Ranking scores ``[H, n]`` over all resident tokens (current one last), ``H`` = H_q or H_kv."""
        logits = attention_logits(q, k, self.spec.scaling)[:, 0]  # [H_q, n]
        if self.heads == "query":
            return logits
        grouped = logits.view(self.spec.n_kv_heads, self.spec.group, -1)
        return grouped.softmax(-1).sum(1) if self.group_agg == "sum" else grouped.amax(1)

    def select(self, st: AttendedSetState, q: torch.Tensor) -> torch.Tensor:
        """``[H, min(budget, past) + 1]`` token indices: the top past tokens, then the current token."""
        n = st.k.shape[1]
        top = self.scores(q, st.k)[:, :-1].topk(min(self.budget, n - 1), dim=-1).indices
        return torch.cat([top, top.new_full((top.shape[0], 1), n - 1)], dim=1)

    def fetch(self, st: AttendedSetState, tokens: torch.Tensor) -> Fetched:
        st.max_attended = tokens.shape[1] - 1
        group = tokens.shape[0] // self.spec.n_kv_heads  # 1 for heads="kv", G for heads="query"
        kv_head = (torch.arange(tokens.shape[0], device=tokens.device) // group)[:, None]
        return Fetched(st.k[kv_head, tokens], st.v[kv_head, tokens])

    def attended_positions(self, st: AttendedSetState, tokens: torch.Tensor) -> torch.Tensor:
        """``[H, m]`` positions of the fetched tokens (every key stays resident, in position order)."""
        return st.pos[tokens]

    def check_resident(self, st: AttendedSetState) -> None:
        """Every key stays resident (an oracle); debug mode checks the attended set instead."""
        check_attended(self, st)
