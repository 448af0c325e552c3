"""H2O — Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models", NeurIPS 2023); official code ``FMInference/H2O``,
``h2o_hf/utils_real_drop/modify_llama.py`` (``H2OKVCache_LayerWise``). Budget: docs/architecture.md.

Each KV head keeps ``budget - heavy`` recent tokens and the ``heavy = heavy_ratio * budget`` other tokens
with the largest accumulated attention ``S_j = sum over queries and heads of softmax probabilities``
(no normalisation by how many queries could see ``j``, as the official real-drop code).

- Prefill: exact causal attention; its softmax gives both the output and the scores (the column sums of the
  causal softmax), computed in chunks of ``chunk_size`` queries so no ``L x L`` matrix is ever materialised;
  then the cache is cut to heavy + recent per KV head in one shot.
- Decode: the new token is appended, attention probabilities are computed explicitly (one query, cheap),
  added to the scores, and the lowest-scored non-recent token of each head is dropped (one per step);
  the dropped token's score is discarded.
- GQA: scores are kept per query head (``[H_kv, G, n]``) and aggregated over the ``G`` query heads of a KV
  head only to rank tokens (``group_agg``: mean as kvpress, sum or max). Token sets differ per KV head,
  so keys/values are stored ``[H_kv, n, d]`` with per-head original positions ``pos: [H_kv, n]``.
- Keys keep their original RoPE positions (the real-drop code caches post-RoPE keys, no re-rotation).

The per-head store helpers here are also used by :mod:`baselines.snapkv`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from icecache.kv import Fetched, KVMethod
from icecache.kv.attention import attention_logits, expand_heads
from icecache.kv.storage import (GROUP_AGGREGATIONS, PerHeadState, aggregate_group, append_scores,
                                  evict_one_per_head, keep_per_head, store_per_head)


def attention_with_column_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                               chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention ``[H_q, n, d]`` (in ``q``'s dtype) and, for each key ``j``, the sum over queries
    ``i >= j`` of the causal softmax ``a_{h,i,j}`` (``[H_q, n]`` fp32), from one softmax per chunk of
    ``chunk_size`` queries, as the official eager attention (``h2o_hf/utils_real_drop/modify_llama.py``)
    computes ``attn_weights`` once for both the output and the scores: ``q.k`` and ``a.v`` in the model's
    dtype, the softmax in fp32 (``softmax(..., dtype=float32)``); the column sums are accumulated from the
    fp32 probabilities (the official code sums them after the cast back to fp16). Memory ``H_q x chunk_size x
    n``; the GQA group shares one matmul with its KV head, so keys and values are never repeated per query
    head. Computing the output separately (sdpa) would compute ``q.k`` twice (docs/fidelity.md, "H2O")."""
    (n_q, n, d), n_kv = q.shape, k.shape[0]
    queries = q.view(n_kv, -1, n, d)
    sums = torch.zeros(n_q, n, dtype=torch.float32, device=q.device)
    out = torch.empty(n_q, n, v.shape[-1], dtype=q.dtype, device=q.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        chunk = end - start
        logits = torch.matmul(queries[:, :, start:end].reshape(n_kv, -1, d), k[:, :end].transpose(1, 2))
        logits = logits.view(n_q, chunk, end)
        future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu_(1)
        logits[:, :, start:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(logits.mul_(scaling), -1, dtype=torch.float32)
        sums[:, :end] += probs.sum(1)
        out[:, start:end] = torch.matmul(probs.to(v.dtype).view(n_kv, -1, end), v[:, :end]).view(n_q, chunk, -1)
    return out, sums


@dataclass(frozen=True)
class H2O(KVMethod):
    """Heavy hitters + recent window, evicted per KV head at every step.

    Args:
        budget: resident (and attended) past tokens per KV head: heavy + recent.
        heavy_ratio: share of the budget for heavy hitters (paper: 1:1 heavy:recent, so 0.5);
            heavy = floor(heavy_ratio * budget), recent = budget - heavy.
        group_agg: how the G query heads of a KV head combine their scores: mean (kvpress), sum, max.
        chunk_size: queries per chunk of the prefill attention (64; the timings behind it: docs/fidelity.md,
            "H2O").
    """

    heavy_ratio: float = 0.5
    group_agg: str = "mean"
    chunk_size: int = 64
    name: ClassVar[str] = "h2o"

    def validate(self) -> None:
        if not 0.0 <= self.heavy_ratio < 1.0:
            raise ValueError(f"h2o: heavy_ratio must be in [0, 1) so the recent window is not empty, "
                             f"got {self.heavy_ratio}")
        if self.group_agg not in GROUP_AGGREGATIONS:
            raise ValueError(f"h2o: group_agg must be one of {GROUP_AGGREGATIONS}, got '{self.group_agg}'")
        if self.chunk_size <= 0:
            raise ValueError(f"h2o: chunk_size must be positive, got {self.chunk_size}")

    @property
    def heavy_size(self) -> int:
        return int(self.budget * self.heavy_ratio)

    @property
    def recent_size(self) -> int:
        return self.budget - self.heavy_size

    def make_state(self, layer_idx: int) -> PerHeadState:
        return PerHeadState(layer_idx)

    def store(self, st: PerHeadState, k: torch.Tensor, v: torch.Tensor) -> None:
        store_per_head(st, k, v)

    # ------------------------------------------------------------------ prefill
    def prefill(self, st: PerHeadState, q, k, v) -> torch.Tensor:
        out, sums = attention_with_column_sums(q, k, v, st.spec.scaling, self.chunk_size)
        self.store(st, k, v)
        st.n_prompt = k.shape[1]
        st.score = sums.view(st.spec.n_kv_heads, st.spec.group, -1)
        return out

    def finish_prefill(self, st: PerHeadState) -> None:
        """Cuts the prompt to the ``heavy`` best-scored older tokens + the ``recent`` last ones."""
        n = st.k.shape[1]
        if n <= self.budget:
            return
        older = n - self.recent_size
        ranked = aggregate_group(st.score[..., :older], st.spec.n_kv_heads, self.group_agg)
        heavy = ranked.topk(self.heavy_size, dim=-1).indices.sort(-1).values
        recent = torch.arange(older, n, device=heavy.device).expand(heavy.shape[0], -1)
        keep_per_head(st, torch.cat([heavy, recent], dim=1))

    # ------------------------------------------------------------------ decode
    def attend(self, st: PerHeadState, q: torch.Tensor, fetched: Fetched) -> torch.Tensor:
        """Explicit softmax (H2O needs the probabilities); they are kept for :meth:`observe`."""
        probs = attention_logits(q, fetched.k, st.spec.scaling).softmax(-1)  # [H_q, 1, m]
        st.probs = probs[:, 0]
        return torch.matmul(probs, expand_heads(fetched.v, q.shape[0]).float()).to(q.dtype)

    def observe(self, st: PerHeadState, q, fetched, selection) -> None:
        """Adds this step's probabilities to the scores, then drops each head's lowest-scored
        non-recent token once the head holds more than ``budget`` past tokens (ties: the earliest position,
        as the official ``argmin`` over tokens in order). The ``recent`` newest positions are never dropped,
        so the non-recent tokens are those before position ``n_seen - recent``."""
        h_kv, m = st.k.shape[0], st.k.shape[1]
        append_scores(st, st.score.new_zeros(h_kv, st.score.shape[1], 1))
        st.score += st.probs.view(h_kv, -1, m)
        st.probs = None
        if m <= self.budget:
            return
        ranked = aggregate_group(st.score, h_kv, self.group_agg)
        ranked = ranked.masked_fill(st.pos >= st.n_seen - self.recent_size, float("inf"))
        lowest = ranked == ranked.amin(-1, keepdim=True)
        evict_one_per_head(st, torch.where(lowest, st.pos, st.n_seen).argmin(-1))
