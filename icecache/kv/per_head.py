"""Per-KV-head resident token sets, shared by the eviction methods that keep a different token set in
each KV head (H2O, SnapKV): ``k, v: [H_kv, n, d]`` with per-head positions ``pos: [H_kv, n]``."""
from __future__ import annotations

import torch

from .method import LayerState, append_to_buffer

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
    """Appends ``k, v: [H_kv, n, d]`` to every head, with per-head original positions (amortised O(1) per
    token: prefix views of geometrically grown buffers, as :meth:`~icecache.kv.KVMethod.store`)."""
    pos = torch.arange(st.n_seen - k.shape[1], st.n_seen, device=k.device).expand(k.shape[0], -1)
    st.buffers["k"], st.k = append_to_buffer(st.buffers.get("k"), st.k, k)
    st.buffers["v"], st.v = append_to_buffer(st.buffers.get("v"), st.v, v)
    st.buffers["pos"], st.pos = append_to_buffer(st.buffers.get("pos"), st.pos, pos)


def append_scores(st: PerHeadState, new: torch.Tensor) -> None:
    """Appends H2O score columns ``new: [H_kv, G, m]`` (amortised O(1), like :func:`store_per_head`)."""
    st.buffers["score"], st.score = append_to_buffer(st.buffers.get("score"), st.score, new, dim=2)


def evict_one_per_head(st: PerHeadState, victim: torch.Tensor) -> None:
    """Removes resident entry ``victim[h]`` of every KV head ``h`` (``[H_kv]`` slots) in O(1): the head's last
    entry moves into the freed slot and the resident views shrink by one, staying prefixes of their buffers
    (so the next append writes in place). Slot order is then not position order; attention does not depend
    on it (keys carry their RoPE positions)."""
    last = st.k.shape[1] - 1
    for x, dim in _token_axes(st):
        shape = [x.shape[0]] + [1] * (x.dim() - 1)
        index = victim.view(shape).expand(*x.shape[:dim], 1, *x.shape[dim + 1:])
        x.scatter_(dim, index, x.narrow(dim, last, 1).clone())
    _keep_first(st, last)


def _token_axes(st: PerHeadState) -> list[tuple[torch.Tensor, int]]:
    """The resident per-token arrays and their token axis: K, V, positions and (H2O) scores."""
    return [(st.k, 1), (st.v, 1), (st.pos, 1)] + ([(st.score, 2)] if st.score is not None else [])


def _keep_first(st: PerHeadState, n: int) -> None:
    """Shrinks the resident views to their first ``n`` entries (still prefixes of their buffers)."""
    st.k, st.v, st.pos = st.k[:, :n], st.v[:, :n], st.pos[:, :n]
    if st.score is not None:
        st.score = st.score[..., :n]


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[h, idx[h]]`` for ``x: [H, n, d]`` and ``idx: [H, m]``."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def keep_per_head(st: PerHeadState, idx: torch.Tensor) -> None:
    """Keeps, per KV head ``h``, the resident entries ``idx[h]`` (``[H_kv, m]``, in store order)."""
    st.k, st.v, st.pos = gather_tokens(st.k, idx), gather_tokens(st.v, idx), st.pos.gather(1, idx)
    if st.score is not None:
        st.score = st.score.gather(2, idx[:, None].expand(-1, st.score.shape[1], -1))


def remove_slot(st: PerHeadState, slot: int) -> None:
    """Removes resident entry ``slot`` of every head, keeping the order of the others: the entries after it
    move up by one (a copy of the tail only) and the resident views shrink by one, staying prefixes of their
    buffers (so the next append writes in place) -- what ``keep_per_head`` with every slot but ``slot`` keeps,
    without gathering the whole cache."""
    tail = st.k.shape[1] - 1 - slot
    for x, dim in _token_axes(st):
        if tail:
            x.narrow(dim, slot, tail).copy_(x.narrow(dim, slot + 1, tail).clone())
    _keep_first(st, st.k.shape[1] - 1)


def aggregate_group(scores: torch.Tensor, n_kv_heads: int, how: str) -> torch.Tensor:
    """``[H_q, n]`` (or ``[H_kv, G, n]``) per-query-head scores -> ``[H_kv, n]`` per KV head."""
    grouped = scores.reshape(n_kv_heads, -1, scores.shape[-1])
    if how == "max":
        return grouped.amax(1)
    return grouped.sum(1) if how == "sum" else grouped.mean(1)
