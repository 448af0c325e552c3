"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024, Sec. 4;
official code ``FasterDecoding/SnapKV``, ``snapkv/monkeypatch/snapkv_utils.py`` ``SnapKVCluster.update_kv``).

The last ``window_size`` prompt tokens form the *observation window*. Their queries vote for prefix
tokens: the causal softmax of each window query over the whole prompt, restricted to the prefix
(everything before the window) and summed over the window queries, gives one vote per prefix token and
query head; votes are smoothed by 1-D pooling (``kernel_size``, max by default, avg as an option, stride
1, same length) so the neighbours of a hit are kept too. Compression happens once, right after the exact
prefill; keys keep their original RoPE positions.

Selection (``selection``):

- ``"per_query_head"`` (default, official): the llama/mistral hijacks (``mistral_hijack_4_37.py``,
  "[SnapKV] move to ahead") ``repeat_kv`` the keys and values to the query heads *before* ``update_kv``, so
  every query head keeps its own token set and the cache holds ``[H_q, n, d]``. Memory consequence: the
  resident K/V of a layer is ``G = H_q / H_kv`` times the per-KV-head size (3x on SmolLM2-135M, 4x on
  Llama-3-8B and Mistral-7B), for the whole generation, and decode attention reads ``G`` times more bytes.
  The budget still counts tokens per attention head, so every head attends ``budget`` past tokens.
- ``"per_kv_head"`` (kvpress' ``SnapKVPress``): the votes of the ``G`` query heads of a KV head are combined
  (``group_agg``; sum by default) and each KV head keeps one set shared by its group (``[H_kv, n, d]``).

Decoding (``decode_policy``). The paper and the official code append generated tokens and never evict
them, so past tokens grow to ``budget + generated``. Our budget convention counts every past token:

- ``"pinned"`` (this project's, the registered variant ``snapkv_pinned``): keeps the budget and never evicts the prefill selection. The selection is the
  top ``budget - window_size - room`` voted prefix tokens plus the whole observation window (in LongBench,
  the question), with ``room = min(decode_window, (budget - window_size) // 2)`` slots left for generated
  tokens, which slide in that room (the oldest generated token leaves once it is full). Until generated
  tokens need the room, it holds the next-best voted prefix tokens ("lent"; the lowest-voted leaves first),
  so the first decode step attends exactly what the paper's does. A prompt of ``<= budget`` tokens is
  kept whole; if the generation then overflows the budget, its non-pinned prefix tokens leave first
  (lowest vote first), then the oldest generated tokens.
- ``"sliding"``: the selected prefix (``budget - window_size`` tokens per head) is fixed and the last
  ``window_size`` tokens form a window that slides over the generated tokens, so the observation window
  leaves during the first ``window_size`` generated tokens. With a prompt of ``<= budget`` tokens nothing
  is compressed, and the prompt's first ``budget - window_size`` tokens play the fixed prefix.
- ``"grow"`` (default): the paper's behaviour -- nothing is evicted after prefill; the generated tail is a declared
  exemption (resident/attended = budget + generated tokens, logged as effective tokens per layer).

On SmolLM2-135M the three policies score alike within sample noise, while grow attends well over the budget
(docs/fidelity.md, "SnapKV", the policy table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from icecache.kv import BudgetError, KVMethod, causal_attention
from icecache.kv.attention import attention_logits, expand_heads
from icecache.kv.storage import (GROUP_AGGREGATIONS, PerHeadState, aggregate_group, keep_per_head, remove_slot,
                                  store_per_head)

POOLINGS = ("max", "avg")
DECODE_POLICIES = ("pinned", "sliding", "grow")
SELECTIONS = ("per_query_head", "per_kv_head")


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


class SnapState(PerHeadState):
    """Per-head token sets; under ``pinned`` the resident slots of every head are laid out as
    ``[n_pinned pinned voted | n_lent lent voted (best first) | pinned window | generated]`` and
    ``first_generated`` is the slot of the oldest resident generated token."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.n_pinned = 0
        self.n_lent = 0
        self.first_generated = 0


@dataclass(frozen=True)
class SnapKV(KVMethod):
    """Observation-window voting, compressed once at prefill.

    Args:
        budget: past tokens per head: voted prefix tokens + the window (+ ``pinned``'s generated room).
        window_size: observation window (last prompt tokens whose queries vote); paper: 32.
        kernel_size: pooling kernel over the votes (odd); paper: 7.
        pooling: "max" (paper) or "avg" (the official code's option).
        selection: "per_query_head" (official: one token set per query head, G x the K/V memory) or
            "per_kv_head" (kvpress: one set per KV head from the group's combined votes).
        group_agg: with per_kv_head, how the G query heads combine their votes: sum (default), mean, max.
        decode_policy: "grow" (paper and official code: keep every generated token, past tokens grow to
            budget + generated), "pinned" (budget holds, prefill selection kept; :class:`SnapKVPinned`) or
            "sliding" (budget holds, window slides).
        decode_window: with "pinned", the slots kept for generated tokens (at most (budget - window_size) // 2).
    """

    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    selection: str = "per_query_head"
    group_agg: str = "sum"
    decode_policy: str = "grow"
    decode_window: int = 32
    name: ClassVar[str] = "snapkv"

    @property
    def room(self) -> int:
        """Slots ``pinned`` reserves for generated tokens: ``min(decode_window, (budget - window_size) // 2)``."""
        return min(self.decode_window, (self.budget - self.window_size) // 2)

    def validate(self) -> None:
        if self.window_size <= 0 or self.budget <= self.window_size:
            raise BudgetError(f"snapkv: budget {self.budget} must exceed window_size={self.window_size} (the "
                              f"observation window plus at least one voted token); try budget="
                              f"{2 * self.window_size} or a smaller window_size")
        if self.kernel_size <= 0 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv: kernel_size must be a positive odd number, got {self.kernel_size}")
        for field_name, value, valid in (("pooling", self.pooling, POOLINGS),
                                         ("selection", self.selection, SELECTIONS),
                                         ("group_agg", self.group_agg, GROUP_AGGREGATIONS),
                                         ("decode_policy", self.decode_policy, DECODE_POLICIES)):
            if value not in valid:
                raise ValueError(f"snapkv: {field_name} must be one of {valid}, got '{value}'")
        self.check_whole("decode_window", minimum=1)
        if self.decode_policy == "pinned" and self.room < 1:
            raise BudgetError(f"snapkv: budget {self.budget} leaves decode_policy=pinned no room for generated "
                              f"tokens after window_size={self.window_size} and one voted token; use budget >= "
                              f"{self.window_size + 2}")

    def make_state(self, layer_idx: int) -> SnapState:
        return SnapState(layer_idx)

    def store(self, st: SnapState, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.selection == "per_query_head":  # the official repeat_kv before the cache update
            k, v = expand_heads(k, st.spec.n_q_heads), expand_heads(v, st.spec.n_q_heads)
        store_per_head(st, k, v)

    def votes(self, st: SnapState, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[H, L - window_size]``: pooled window votes per prefix token, per query head (``per_query_head``)
        or combined over the group (``per_kv_head``)."""
        pooled = pool_votes(window_votes(q, k, st.spec.scaling, self.window_size), self.kernel_size, self.pooling)
        if self.selection == "per_query_head":
            return pooled
        return aggregate_group(pooled, st.spec.n_kv_heads, self.group_agg)

    def prefill(self, st: SnapState, q, k, v) -> torch.Tensor:
        """Exact attention, then keep the voted prefix + the window (``pinned``: see the module doc)."""
        out = causal_attention(q, k, v, st.spec.scaling)
        self.store(st, k, v)
        n = st.n_prompt = st.first_generated = k.shape[1]
        st.n_pinned = n
        n_prefix = n - self.window_size
        if self.decode_policy == "pinned":
            n_pinned = self.budget - self.window_size - self.room
            if n_prefix > n_pinned:
                n_keep = min(n_prefix, self.budget - self.window_size)
                ranked = self.votes(st, q, k).topk(n_keep, dim=-1).indices  # best first
                self.keep(st, torch.cat([ranked[:, :n_pinned].sort(-1).values, ranked[:, n_pinned:]], dim=1))
                st.n_pinned, st.n_lent = n_pinned, n_keep - n_pinned
                st.first_generated = n_keep + self.window_size
        elif n > self.budget:
            self.keep(st, self.votes(st, q, k).topk(self.budget - self.window_size, dim=-1).indices.sort(-1).values)
        return out

    def keep(self, st: SnapState, prefix: torch.Tensor) -> None:
        """Keeps, per head, the prefix slots ``prefix`` (``[H, m]``) followed by the observation window."""
        n = st.k.shape[1]
        window = torch.arange(n - self.window_size, n, device=st.k.device).expand(prefix.shape[0], -1)
        keep_per_head(st, torch.cat([prefix, window], dim=1))

    def observe(self, st: SnapState, q, fetched, selection) -> None:
        """Once a head holds ``budget + 1`` tokens, one leaves: ``sliding``: the oldest token of the window;
        ``pinned``: the lowest-voted lent prefix token, else the oldest generated token."""
        m = st.k.shape[1]
        if self.decode_policy == "grow" or m <= self.budget:
            return
        if self.decode_policy == "sliding":
            leaving = m - self.window_size - 1
        elif st.n_lent:
            leaving = st.n_pinned + st.n_lent - 1
            st.n_lent -= 1
            st.first_generated -= 1
        else:
            leaving = st.first_generated
        remove_slot(st, leaving)

    def check_resident(self, st: SnapState) -> None:
        """``grow`` declares the generated tail exempt: budget + generated tokens may be resident."""
        allowed = self.budget + (st.n_seen - st.n_prompt if self.decode_policy == "grow" else 0)
        if self.resident_tokens(st) > allowed:
            raise AssertionError(f"snapkv: layer {st.layer_idx} holds {self.resident_tokens(st)} resident "
                                 f"tokens, over the allowed {allowed} (budget {self.budget})")


@dataclass(frozen=True)
class SnapKVPinned(SnapKV):
    """SnapKV under this project's budget convention (``cache=snapkv_pinned``), a registered variant of
    :class:`SnapKV` whose one deviation is ``decode_policy="pinned"``: the past tokens stay within the budget
    during decoding (the paper's ``grow`` attends ``budget + generated``), the prefill selection and the
    observation window are never evicted, and generated tokens slide in ``decode_window`` slots. On SmolLM2-135M
    pinned and grow score alike within sample noise (docs/fidelity.md, "SnapKV", the policy table)."""

    decode_policy: str = "pinned"
    name: ClassVar[str] = "snapkv_pinned"
    extends: ClassVar[str] = "snapkv"  # the registered method whose official configuration this varies
    deviations: ClassVar[tuple] = ("decode_policy",)

