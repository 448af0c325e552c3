"""Per-KV-head resident token sets, shared by the eviction methods that keep a different token set in
each KV head (H2O, SnapKV): ``k, v: [H_kv, n, d]`` with per-head positions ``pos: [H_kv, n]``."""
from __future__ import annotations

import torch

from .method import LayerState

GROUP_AGGREGATIONS = ("mean", "sum", "max")


class PerHeadState(LayerState):
    """A layer whose resident token set differs per KV head: ``k, v: [H_kv, n, d]``, ``pos: [H_kv, n]``.
    ``score`` holds H2O's accumulated attention ``[H_kv, G, n]`` (unused by SnapKV); ``n_prompt`` the
    prompt length."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.score: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None  # last decode step's probabilities [H_q, m]
        self.n_prompt = 0


def store_per_head(st: PerHeadState, k: torch.Tensor, v: torch.Tensor) -> None:
    """Appends ``k, v: [H_kv, n, d]`` to every head, with per-head original positions."""
    pos = torch.arange(st.n_seen - k.shape[1], st.n_seen, device=k.device).expand(k.shape[0], -1)
    if st.k is None:
        st.k, st.v, st.pos = k, v, pos
    else:
        st.k, st.v = torch.cat([st.k, k], dim=1), torch.cat([st.v, v], dim=1)
        st.pos = torch.cat([st.pos, pos], dim=1)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[h, idx[h]]`` for ``x: [H, n, d]`` and ``idx: [H, m]``."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def keep_per_head(st: PerHeadState, idx: torch.Tensor) -> None:
    """Keeps, per KV head ``h``, the resident entries ``idx[h]`` (``[H_kv, m]``, in store order)."""
    st.k, st.v, st.pos = gather_tokens(st.k, idx), gather_tokens(st.v, idx), st.pos.gather(1, idx)
    if st.score is not None:
        st.score = st.score.gather(2, idx[:, None].expand(-1, st.score.shape[1], -1))


def aggregate_group(scores: torch.Tensor, n_kv_heads: int, how: str) -> torch.Tensor:
    """``[H_q, n]`` (or ``[H_kv, G, n]``) per-query-head scores -> ``[H_kv, n]`` per KV head."""
    grouped = scores.reshape(n_kv_heads, -1, scores.shape[-1])
    if how == "max":
        return grouped.amax(1)
    return grouped.sum(1) if how == "sum" else grouped.mean(1)
