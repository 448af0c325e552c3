"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

Kept set = the first ``n_sink`` tokens (attention sinks) and the most recent ``budget - n_sink``
tokens; everything in between is dropped for good (official ``mit-han-lab/streaming-llm``,
``streaming_llm/kv_cache.py`` ``StartRecentKVCache``). Prefill is exact full
attention, then the cache is cut to the kept set; each decode step appends the new token, attends over
the kept set, and evicts the oldest non-sink token.

Positions (``rerotate``): by default the paper's "position shift" (Section 3.2; official
``streaming_llm/enable_streaming_llm.py`` turns on ``pos_shift`` for every Llama-style model): keys are attended
as if at their index inside the cache and the query at the cache length, obtained by rotating each resident key
by a position delta (a rotation by delta is itself a RoPE rotation). ``rerotate=False`` keeps the original RoPE
positions (what kvpress and KVCache-Factory do for LongBench-style evaluation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from icecache.kv import Bound, BudgetError, Fetched, KVMethod, LayerState, ModelSpec

from icecache.kv.storage import evict_slot, keep_sinks_and_recent


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Applies a RoPE rotation by ``delta`` positions (``[m]``) to post-RoPE vectors ``x: [H, m, d]``."""
    angles = delta.float()[:, None] * inv_freq.to(x.device)[None, :]  # [m, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated_half.float() * sin).to(x.dtype)


@dataclass(frozen=True)
class StreamingLLM(KVMethod):
    """Attention sinks + recent window.

    Args:
        budget: past tokens attended per head per step (sinks included); recent window = budget - n_sink.
        n_sink: number of initial "sink" tokens always kept (paper and official default: 4).
        rerotate: attend with positions inside the cache (paper's and official code's pos-shift, default) instead
            of the original ones (``False``: kvpress' convention).
    """

    n_sink: int = 4
    rerotate: bool = True
    name: ClassVar[str] = "streaming_llm"

    def validate(self) -> None:
        self.check_whole("n_sink")
        self.check_choice("rerotate", (False, True))
        if self.budget <= self.n_sink:
            raise BudgetError(f"streaming_llm: budget {self.budget} must exceed n_sink={self.n_sink} "
                              f"(sinks + at least one recent token); try budget={self.n_sink + 60}")

    def bind(self, spec: ModelSpec) -> Bound:
        if self.rerotate and spec.inv_freq is None:
            raise ValueError("streaming_llm rerotate=True needs a RoPE model (no rotary_emb.inv_freq found)")
        return super().bind(spec)

    def finish_prefill(self, st: LayerState) -> None:
        self.evict(st)

    def observe(self, st: LayerState, q, fetched, selection) -> None:
        """Once the layer holds ``budget + 1`` tokens, the oldest non-sink one leaves, in O(1)
        (:func:`~icecache.kv.storage.evict_slot`: the newest token takes its slot)."""
        if st.k.shape[1] > self.budget:
            oldest = torch.where(st.pos >= self.n_sink, st.pos, st.n_seen).argmin()
            evict_slot(st, oldest)

    def evict(self, st: LayerState) -> None:
        """Keeps the ``n_sink`` first and ``budget - n_sink`` most recent tokens (after prefill, slots in
        position order)."""
        if st.k.shape[1] > self.budget:
            keep_sinks_and_recent(st, self.n_sink, self.budget - self.n_sink)

    def fetch(self, st: LayerState, selection) -> Fetched:
        if not self.rerotate:
            return Fetched(st.k, st.v)
        # a key's cache index is its rank by position (slots are not in position order after an eviction);
        # the query (the last entry, the newest position) sits at index m-1
        m = st.k.shape[1]
        rank = st.pos.argsort().argsort()
        query_shift = (m - 1) - st.pos[-1]
        return Fetched(rotate_by(st.k, (rank - st.pos) - query_shift, st.spec.inv_freq), st.v)
