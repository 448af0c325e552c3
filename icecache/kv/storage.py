"""Storage mechanics shared by the methods: growable device buffers, the resident-set cuts and evictions (one
token set for every head, or one per KV head), and the host-memory offload store.

- :func:`grown_capacity` / :func:`append_to_buffer`: amortised O(1) appends into geometrically grown buffers.
- :func:`keep_sinks_and_recent` / :func:`evict_slot`: the "first ``n_sink`` + last ``n_recent`` tokens" cut
  (StreamingLLM's kept set; the resident part of PQCache and MagicPIG) and an O(1) one-token eviction.
- :class:`PerHeadState` and its functions: a resident token set per KV head (H2O, SnapKV, the kvpress adapter).
- :class:`HostKV` / :func:`to_store`: K/V in host memory (pinned on CUDA) for every offloading method.
"""
from __future__ import annotations

import numpy as np
import torch

from .state import LayerState


def grown_capacity(needed: int, minimum: int = 64) -> int:
    """Capacity for a growable buffer that must hold ``needed`` entries: ``needed`` plus 1/8 slack.
    Prefill buffers are thus sized to the prompt (not twice it), and since every growth multiplies the
    capacity by at least 9/8, appending ``n`` entries one at a time allocates O(log n) times (amortised
    O(1) per entry, as transformers' and vLLM's preallocated caches)."""
    return max(minimum, needed + needed // 8)


def append_to_buffer(buffer: torch.Tensor | None, view: torch.Tensor | None,
                     new: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends ``new`` after ``view`` along ``dim`` (1 for ``[H, n, d]`` K/V, 0 for ``[n]`` positions).
    ``view`` is kept in place when it is the prefix of ``buffer`` with room left; otherwise (first call,
    full buffer, or a method replaced the view by another tensor, e.g. after an eviction) a buffer of
    :func:`grown_capacity` entries is allocated. Returns ``(buffer, view of the filled prefix)``."""
    n, m = (0 if view is None else view.shape[dim]), new.shape[dim]
    in_place = (buffer is not None and view is not None and view.data_ptr() == buffer.data_ptr()
                and view.stride() == buffer.stride() and n + m <= buffer.shape[dim])
    if not in_place:
        shape = list(new.shape)
        shape[dim] = grown_capacity(n + m)
        grown = new.new_empty(shape)
        if n:
            grown.narrow(dim, 0, n).copy_(view)
        buffer = grown
    buffer.narrow(dim, n, m).copy_(new)
    return buffer, buffer.narrow(dim, 0, n + m)


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


# ---------------------------------------------------------------- a resident token set per KV head
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


# ---------------------------------------------------------------- host offload store
def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer, page-locked (pinned) when ``pin`` (the model runs on CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def to_store(x: torch.Tensor) -> torch.Tensor:
    """``x`` in host memory for a baseline's (append-free) offload store: one copy, straight into pinned
    memory, when ``x`` is on CUDA; ``x`` itself (no copy) when it is already on the host, so the caller must
    not write into ``x``'s storage afterwards (drop the resident buffers it came from: ``st.buffers.clear()``).
    On CPU this saves one copy of the offloaded K/V."""
    return host_empty(x.shape, x.dtype, pin=True).copy_(x.detach()) if x.is_cuda else x.detach()


class HostKV:
    """Growable host-memory K/V ``k_data, v_data: [H, capacity, d]`` of one layer, shared by every
    offloading method; row ``r`` holds position ``base_pos + r``, and positions ``first_pos .. end_pos - 1``
    are the stored ones. :meth:`append` writes the new rows in place and grows the capacity geometrically
    (:func:`grown_capacity`), so a decode step copies one token, not the store (the
    official PQCache writes one row into a preallocated buffer: ``vq_method/retrieval_based/pq_search.py``).
    Memory is pinned when the model runs on CUDA, so the device copies to and from it are asynchronous."""

    def __init__(self, k_data: torch.Tensor, v_data: torch.Tensor, base_pos: int, first_pos: int, end_pos: int,
                 pin: bool):
        """Use :meth:`copy_of` (or :meth:`OffloadStore.adopt`). ``k_data, v_data`` are contiguous host buffers."""
        self.pin = pin
        self.k_data, self.v_data = k_data, v_data
        self.base_pos, self.first_pos, self.end_pos = base_pos, first_pos, end_pos

    @staticmethod
    def _host_copy(k: torch.Tensor, v: torch.Tensor, pin: bool):
        """Host buffers of :func:`grown_capacity` rows holding ``k, v: [H, n, d]`` in their first ``n`` rows."""
        h, n, d = k.shape
        k_data, v_data = (host_empty((h, grown_capacity(n), d), k.dtype, pin) for _ in range(2))
        k_data[:, :n], v_data[:, :n] = k.detach(), v.detach()
        return k_data, v_data

    @classmethod
    def copy_of(cls, k: torch.Tensor, v: torch.Tensor, first_pos: int = 0, pin: bool | None = None) -> "HostKV":
        """A store holding a host copy of ``k, v: [H, n, d]`` (any device) = positions ``first_pos ..``;
        pinned when ``pin`` (default: when ``k`` is on CUDA)."""
        pin = k.is_cuda if pin is None else pin
        k_data, v_data = cls._host_copy(k, v, pin)
        return cls(k_data, v_data, first_pos, first_pos, first_pos + k.shape[1], pin)

    @property
    def n(self) -> int:
        """Stored positions."""
        return self.end_pos - self.first_pos

    def keys(self) -> torch.Tensor:
        """``[H, n, d]`` view of the stored keys (positions ``first_pos .. end_pos - 1``)."""
        return self.k_data[:, self.first_pos - self.base_pos: self.end_pos - self.base_pos]

    def values(self) -> torch.Tensor:
        """``[H, n, d]`` view of the stored values."""
        return self.v_data[:, self.first_pos - self.base_pos: self.end_pos - self.base_pos]

    def host_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole host buffers ``k_data, v_data: [H, capacity, d]``, for code that reads rows by position: row
        ``r`` holds position ``base_pos + r``, the stored ones are ``first_pos .. end_pos - 1``."""
        return self.k_data, self.v_data

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k, v: [H, m, d]`` (host or device) at the next ``m`` positions. A device source is copied
        asynchronously into pinned memory (ordered on the current stream: a later blocking device-to-host
        read, such as the selection's ``.cpu()``, completes it before the host reads these rows)."""
        m, row = k.shape[1], self.end_pos - self.base_pos
        if row + m > self.k_data.shape[1]:
            h, _, d = self.k_data.shape
            grown = [host_empty((h, grown_capacity(row + m), d), self.k_data.dtype, self.pin) for _ in range(2)]
            grown[0][:, :row], grown[1][:, :row] = self.k_data[:, :row], self.v_data[:, :row]
            self.k_data, self.v_data = grown
        self.k_data[:, row: row + m].copy_(k.detach(), non_blocking=self.pin)
        self.v_data[:, row: row + m].copy_(v.detach(), non_blocking=self.pin)
        self.end_pos += m

    def _rows(self, heads: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Row ids into the ``[H * capacity]`` flattening of the store (empty slots, -1, read row 0); index
        arithmetic in numpy, whose per-call cost on these few hundred ids is far below torch's."""
        used = positions[positions >= 0]
        if used.size and (used.min() < self.first_pos or used.max() >= self.end_pos):
            raise IndexError(f"positions {used.min()}..{used.max()} are not all in the offload store "
                             f"({self.first_pos}..{self.end_pos - 1})")
        local = np.maximum(positions - self.base_pos, 0)
        return torch.from_numpy((heads[:, None] * self.k_data.shape[1] + local).ravel())

    def gather(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Host K/V ``[H, m, d]`` of the absolute ``positions [H, m]`` (one row of positions per head)."""
        positions = np.asarray(positions, dtype=np.int64)
        h, d = positions.shape[0], self.k_data.shape[2]
        rows = self._rows(np.arange(h), positions)
        return tuple(torch.index_select(data.view(-1, d), 0, rows).view(h, -1, d)
                     for data in (self.k_data, self.v_data))
