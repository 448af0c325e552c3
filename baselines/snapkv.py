"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024).

The last ``window_size`` prompt tokens form the *observation window*. Their queries vote for prefix
tokens: the causal softmax of each window query over the whole prompt, restricted to the prefix
(everything before the window) and summed over the window queries, gives one vote per prefix token and
query head; votes are smoothed by 1-D pooling (``kernel_size``, max by default, avg as an option, stride
1, same length) so the neighbours of a hit are kept too, then combined over the ``G`` query heads of a
KV head (``group_agg``; sum by default). Each KV head keeps its top ``budget - window_size`` prefix
tokens plus the whole window (per-head token sets, stored ``[H_kv, n, d]`` with per-head positions).
Compression happens once, right after the exact prefill; keys keep their original RoPE positions.

Decoding (``decode_policy``). The paper (and kvpress / KVCache-Factory) append generated tokens and
never evict them, so past tokens grow to ``budget + generated``. Our budget convention counts every
past token, so the default keeps that count fixed with the reading closest to the paper:

- ``"sliding"`` (default): the selected prefix (``budget - window_size`` tokens per head) is fixed and
  the last ``window_size`` tokens form a window that slides over the generated tokens; when a head holds
  ``budget + 1`` tokens after appending, the oldest token of that window leaves. The first decode step
  is exactly the paper's; afterwards the observation-window prompt tokens leave first (they are the
  oldest window tokens), then the oldest generated tokens. With a prompt of ``<= budget`` tokens nothing
  is compressed, and the prompt's first ``budget - window_size`` tokens play the fixed prefix.
- ``"grow"``: the paper's behaviour — nothing is evicted after prefill; the generated tail is a declared
  exemption (resident/attended = budget + generated tokens, logged as effective tokens per layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from icecache.kv import BudgetError, KVMethod, causal_attention
from icecache.kv.attention import attention_logits
from icecache.kv.per_head import GROUP_AGGREGATIONS, PerHeadState, aggregate_group, keep_per_head, store_per_head

POOLINGS = ("max", "avg")
DECODE_POLICIES = ("sliding", "grow")


def window_votes(q: torch.Tensor, k: torch.Tensor, scaling: float, window_size: int) -> torch.Tensor:
    """``[H_q, L - window_size]`` fp32: causal softmax of the last ``window_size`` queries over all ``L``
    keys, restricted to the prefix keys and summed over the window queries."""
    n = k.shape[1]
    start = n - window_size
    logits = attention_logits(q[:, start:], k, scaling)  # [H_q, w, L]
    future = torch.arange(n, device=q.device)[None, :] > torch.arange(start, n, device=q.device)[:, None]
    return logits.masked_fill_(future, float("-inf")).softmax(-1)[..., :start].sum(1)


def pool_votes(votes: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the tokens, stride 1, padding ``kernel_size // 2`` (same length for odd kernels)."""
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(votes[:, None], kernel_size=kernel_size, stride=1, padding=kernel_size // 2)[:, 0]


@dataclass
class SnapKV(KVMethod):
    """Observation-window voting, compressed once at prefill.

    Args:
        budget: past tokens per KV head after compression: ``budget - window_size`` voted + the window.
        window_size: observation window (last prompt tokens whose queries vote); paper: 32.
        kernel_size: pooling kernel over the votes (odd); paper: 7.
        pooling: "max" (paper) or "avg" (the official code's option).
        group_agg: how a KV head's G query heads combine their votes: sum (default), mean, max.
        decode_policy: "sliding" (budget holds while decoding) or "grow" (paper: keep generated tokens).
    """

    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    group_agg: str = "sum"
    decode_policy: str = "sliding"
    name: ClassVar[str] = "snapkv"

    def validate(self) -> None:
        if self.window_size <= 0 or self.budget <= self.window_size:
            raise BudgetError(f"snapkv: budget {self.budget} must exceed window_size={self.window_size} (the "
                              f"observation window plus at least one voted token); try budget="
                              f"{2 * self.window_size} or a smaller window_size")
        if self.kernel_size <= 0 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv: kernel_size must be a positive odd number, got {self.kernel_size}")
        for field_name, value, valid in (("pooling", self.pooling, POOLINGS),
                                         ("group_agg", self.group_agg, GROUP_AGGREGATIONS),
                                         ("decode_policy", self.decode_policy, DECODE_POLICIES)):
            if value not in valid:
                raise ValueError(f"snapkv: {field_name} must be one of {valid}, got '{value}'")

    def make_state(self, layer_idx: int) -> PerHeadState:
        return PerHeadState(layer_idx)

    def store(self, st: PerHeadState, k: torch.Tensor, v: torch.Tensor) -> None:
        store_per_head(st, k, v)

    def votes(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[H_kv, L - window_size]``: pooled window votes per prefix token, combined over the group."""
        per_query_head = window_votes(q, k, self.spec.scaling, self.window_size)
        pooled = pool_votes(per_query_head, self.kernel_size, self.pooling)
        return aggregate_group(pooled, self.spec.n_kv_heads, self.group_agg)

    def prefill(self, st: PerHeadState, q, k, v) -> torch.Tensor:
        """Exact attention, then (prompt longer than the budget) keep the voted prefix + the window."""
        out = causal_attention(q, k, v, self.spec.scaling)
        self.store(st, k, v)
        n = st.n_prompt = k.shape[1]
        if n > self.budget:
            chosen = self.votes(q, k).topk(self.budget - self.window_size, dim=-1).indices.sort(-1).values
            window = torch.arange(n - self.window_size, n, device=k.device).expand(chosen.shape[0], -1)
            keep_per_head(st, torch.cat([chosen, window], dim=1))
        return out

    def observe(self, st: PerHeadState, q, fetched, selection) -> None:
        """``sliding``: once a head holds ``budget + 1`` tokens, the oldest token of the window leaves."""
        m = st.k.shape[1]
        if self.decode_policy == "grow" or m <= self.budget:
            return
        leaving = m - self.window_size - 1
        slots = torch.arange(m, device=st.k.device)
        keep_per_head(st, slots[slots != leaving].expand(st.k.shape[0], -1))

    def check_resident(self, st: PerHeadState) -> None:
        """``grow`` declares the generated tail exempt: budget + generated tokens may be resident."""
        allowed = self.budget + (st.n_seen - st.n_prompt if self.decode_policy == "grow" else 0)
        if self.resident_tokens(st) > allowed:
            raise AssertionError(f"snapkv: layer {st.layer_idx} holds {self.resident_tokens(st)} resident "
                                 f"tokens, over the allowed {allowed} (budget {self.budget})")
