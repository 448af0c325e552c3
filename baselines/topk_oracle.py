"""TOP-k oracle: exact top-``budget`` past tokens by ``q . k`` at every step (the upper bound the IceCache
paper, Mao et al. ICLR 2026, reports as "TOP-k" in its accuracy tables; budget: docs/architecture.md).

At each decode step every head scores all past keys exactly and attends to its ``budget`` best ones plus
the current token; nothing is approximated, evicted or offloaded (every key stays resident, so the
``debug`` check asserts the attended set, not residency). With the defaults every layer is budgeted and the
whole budget is exact top-k: ``cache=topk`` is the pure oracle.

The IceCache-like bound: ``cache=topk cache.n_dense_layers=2`` budgets the layers IceCache budgets; add
``cache.n_sink=32 cache.n_window=32`` for its sink/window layout as well (budgets >= 80; ``n_sink=16`` at 64):

- ``n_dense_layers``: layers ``< n_dense_layers`` attend the whole context, declared by :meth:`is_budgeted`
  as IceCache's (official ``n_unlimited_layers = 2``), Quest's and ArkVale's are; their effective tokens per
  layer (``timing.json``) are the whole context.
- ``n_sink`` / ``n_window``: the first ``n_sink`` and the last ``n_window`` past tokens are always attended,
  inside the budget, and the other ``budget - n_sink - n_window`` are the exact top-k of the past tokens
  between them. IceCache's layout (sink pages | retrieved pages | window pages, ``icecache/method.py``) with
  its 16-token pages maps to ``n_sink = 16 * sink pages`` (32 at budgets >= 80, 16 at 64 where its ``auto``
  layout keeps one sink page) and ``n_window = 32``: its two window pages hold 16 to 31 past tokens as the
  last one fills, always the most recent ones, so a 32-token window contains them. The oracle then keeps
  token-exact top-k where IceCache retrieves whole pages found by its index: an upper bound of its layout.

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

from icecache.kv import BudgetError, Fetched, KVMethod
from icecache.kv.attention import attention_logits

from icecache.kv.storage import sinks_and_recent

from .common import AttendedSetState, check_attended

HEAD_MODES = ("query", "kv")
KV_RANKINGS = ("sum", "max")  # heads=kv: sum of the softmax | max of the logits


@dataclass(frozen=True)
class TopKOracle(KVMethod):
    """Exact top-k attention.

    Args:
        budget: past tokens attended per head per step in a budgeted layer (sink and window included).
        heads: "query" (per query head, default) or "kv" (per KV head, shared by the group).
        group_agg: with heads="kv", how the group ranks tokens: "sum" of softmax or "max" of logits.
        n_dense_layers: first layers that attend the whole context (default 0: every layer budgeted; 2 is
            IceCache's ``n_dense_layers``).
        n_sink: first past tokens always attended, counted in the budget (default 0).
        n_window: most recent past tokens always attended, counted in the budget (default 0).
    """

    heads: str = "query"
    group_agg: str = "sum"
    n_dense_layers: int = 0
    n_sink: int = 0
    n_window: int = 0
    name: ClassVar[str] = "topk"

    def validate(self) -> None:
        if self.heads not in HEAD_MODES:
            raise ValueError(f"topk: heads must be one of {HEAD_MODES}, got '{self.heads}'")
        if self.group_agg not in KV_RANKINGS:
            raise ValueError(f"topk: group_agg must be one of {KV_RANKINGS}, got '{self.group_agg}'")
        self.check_whole("n_dense_layers", "n_sink", "n_window")
        if self.n_sink + self.n_window > self.budget:
            raise BudgetError(f"topk: budget {self.budget} is smaller than n_sink + n_window = "
                              f"{self.n_sink + self.n_window} (both are counted in the budget)")

    def is_budgeted(self, st: AttendedSetState) -> bool:
        return st.layer_idx >= self.n_dense_layers

    def make_state(self, layer_idx: int) -> AttendedSetState:
        return AttendedSetState(layer_idx)

    def scores(self, st: AttendedSetState, q: torch.Tensor) -> torch.Tensor:
        """Ranking scores ``[H, n]`` over all resident tokens of ``st`` (current one last), ``H`` = H_q or H_kv."""
        logits = attention_logits(q, st.k, st.spec.scaling)[:, 0]  # [H_q, n]
        if self.heads == "query":
            return logits
        grouped = logits.view(st.spec.n_kv_heads, st.spec.group, -1)
        return grouped.softmax(-1).sum(1) if self.group_agg == "sum" else grouped.amax(1)

    def past_tokens(self, scores: torch.Tensor) -> torch.Tensor:
        """``[H, min(budget, n_past)]`` indices of the past tokens attended, from their scores ``[H, n_past]``:
        the first ``n_sink`` and last ``n_window`` of them, then the exact top ``budget - n_sink - n_window``
        of the rest (all of them when ``n_past <= budget``; with no sink and window, the top ``budget``)."""
        n_past = scores.shape[1]
        if not (self.n_sink or self.n_window) or n_past <= self.budget:
            return scores.topk(min(self.budget, n_past), dim=-1).indices
        lo, hi = self.n_sink, n_past - self.n_window
        top = scores[:, lo:hi].topk(self.budget - self.n_sink - self.n_window, dim=-1).indices + lo
        fixed = sinks_and_recent(n_past, self.n_sink, self.n_window, scores.device)
        return torch.cat([fixed.expand(scores.shape[0], -1), top], dim=1)

    def select(self, st: AttendedSetState, q: torch.Tensor) -> torch.Tensor | None:
        """``[H, min(budget, past) + 1]`` token indices: the past tokens attended, then the current token;
        None in a dense layer (every resident token)."""
        if not self.is_budgeted(st):
            return None
        n = st.k.shape[1]
        past = self.past_tokens(self.scores(st, q)[:, :-1])
        return torch.cat([past, past.new_full((past.shape[0], 1), n - 1)], dim=1)

    def prompt_selection(self, st: AttendedSetState, q: torch.Tensor) -> torch.Tensor | None:
        """:meth:`select` when every resident key is a past one (no current token appended): the offline
        recall of ``evals.bench.ablation --recall`` on captured prompt keys, which attends what a live step
        after that prompt attends among them -- the last prompt key included."""
        if not self.is_budgeted(st):
            return None
        return self.past_tokens(self.scores(st, q))

    def fetch(self, st: AttendedSetState, tokens: torch.Tensor | None) -> Fetched:
        if tokens is None:
            st.max_attended = st.k.shape[1] - 1
            return Fetched(st.k, st.v)
        st.max_attended = tokens.shape[1] - 1
        group = tokens.shape[0] // st.spec.n_kv_heads  # 1 for heads="kv", G for heads="query"
        kv_head = (torch.arange(tokens.shape[0], device=tokens.device) // group)[:, None]
        return Fetched(st.k[kv_head, tokens], st.v[kv_head, tokens])

    def attended_positions(self, st: AttendedSetState, tokens: torch.Tensor | None) -> torch.Tensor:
        """``[H, m]`` positions of the fetched tokens (every key stays resident, in position order), or every
        resident position in a dense layer."""
        return st.pos if tokens is None else st.pos[tokens]

    def check_resident(self, st: AttendedSetState) -> None:
        """Every key stays resident (an oracle); debug mode checks the attended set instead."""
        check_attended(self, st)
