"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024);
official code ``mit-han-lab/Quest``, ``evaluation/quest_attention.py``. Budget: docs/architecture.md.

The KV cache is cut into pages of ``page_size`` tokens in token order. Per page and KV head the
metadata is the element-wise minimum ``m_P`` and maximum ``M_P`` of its keys; at each decode step the
criticality of a page for query ``q`` is ``sum_i max(q_i m_{P,i}, q_i M_{P,i})``, an upper bound of
``q . k`` over the page. Each head attends to its top ``max(3, budget / page_size)`` pages by criticality
(``evaluation/quest_attention.py`` lines 55-57, ``local_heavy_hitter_mask``), the newest page among them only
if its criticality ranks it there: the current token is attended only when its page is selected, as in the
official evaluation (line 217 masks every key outside the selected pages). ``force_last_page=True`` is the
official kernel path instead (``quest/utils/controller.py`` line 14, "real page budget including the last
page", lines 97-105: the top ``budget / page_size - 1`` pages of all but the last, plus the last one).
Prefill and the first ``n_dense_layers`` layers use full attention (``quest_attention.py`` line 84:
``q_len > 1 or self.layer_id < 2``).

The official evaluation attends at least three pages (``max(3, token_budget // chunk_size)``), so a budget
below ``3 * page_size`` tokens is rejected: it cannot be the official Quest and stay within the budget
(the official scripts run 512-4096 tokens; at this harness's 64-256 with 16-token pages the floor never binds).

GQA: selection is per *query head* (Quest's default; the official kernels are MHA), so the selection's
head axis is ``H_q``; query head ``h`` bounds pages with its own query against the metadata of KV head
``h // G``.

Memory: as in the official Quest, every key and value stays resident (no offload); only the selected
pages are attended (Quest saves bandwidth, not memory). ``resident_tokens`` therefore reports the whole
cache, and the ``debug`` check asserts the *attended* past tokens per head instead (``<= budget``).
Pages attended = ``top``; all of them full but the newest, so the attended past tokens of a head are
``top * page_size`` without the newest page and ``top * page_size - (empty slots of the newest page) - 1``
with it (the current token not counted), at most ``budget``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from icecache.kv import BudgetError, Fetched, KVMethod
from icecache.kv.storage import append_to_buffer

from .common import AttendedSetState, check_attended


class QuestState(AttendedSetState):
    """Resident K/V plus page metadata ``kmin, kmax: [H_kv, n_pages, d]``."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.kmin: torch.Tensor | None = None
        self.kmax: torch.Tensor | None = None


def page_min_max(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of each page: ``k: [H, n, d]`` -> two ``[H, ceil(n/ps), d]``;
    the last page may be partial."""
    pad = (-k.shape[1]) % page_size
    h, d = k.shape[0], k.shape[2]
    lo = F.pad(k, (0, 0, 0, pad), value=float("inf")).view(h, -1, page_size, d).amin(2)
    hi = F.pad(k, (0, 0, 0, pad), value=float("-inf")).view(h, -1, page_size, d).amax(2)
    return lo, hi


def page_upper_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's criticality ``[H_q, P]``: ``sum_i max(q_i min_i, q_i max_i)`` for queries ``q: [H_q, d]`` and
    metadata ``[H_kv, P, d]`` (query head ``h`` reads KV head ``h // G``)."""
    group = q.shape[0] // kmin.shape[0]
    qf = q.float()[:, None, :]
    lo, hi = kmin.float().repeat_interleave(group, 0), kmax.float().repeat_interleave(group, 0)
    return torch.maximum(qf * lo, qf * hi).sum(-1)


@dataclass(frozen=True)
class Quest(KVMethod):
    """Query-aware page selection by min/max key bounds.

    Args:
        budget: past tokens attended per query head per step in a sparse layer at most; a multiple of
            ``page_size`` of at least three pages (``max(3, budget / page_size)`` pages attended).
        page_size: tokens per page (paper: 16).
        n_dense_layers: the first layers that attend to everything (paper: 2; IceCache names it the same).
        force_last_page: ``False`` (official evaluation, ``evaluation/quest_attention.py``): the top
            ``max(3, budget / page_size)`` pages by criticality; ``True`` (official kernels,
            ``quest/utils/controller.py``): the newest page always, plus the top ``budget / page_size - 1``
            of the others.
    """

    page_size: int = 16
    n_dense_layers: int = 2
    force_last_page: bool = False
    name: ClassVar[str] = "quest"
    MIN_PAGES: ClassVar[int] = 3  # evaluation/quest_attention.py line 56: max(3, token_budget // chunk_size)

    @property
    def min_budget(self) -> int:
        """The smallest budget (tokens) the configuration attends within: three pages for the evaluation's rule,
        one for the kernels'."""
        return (1 if self.force_last_page else self.MIN_PAGES) * self.page_size

    @property
    def top_pages(self) -> int:
        """Pages attended per head once the context has that many: ``max(3, budget // page_size)`` (evaluation)
        or ``budget // page_size`` (kernels); within the budget by :meth:`validate`."""
        pages = self.budget // self.page_size
        return pages if self.force_last_page else max(self.MIN_PAGES, pages)

    def validate(self) -> None:
        self.check_whole("page_size", minimum=1)
        self.check_whole("n_dense_layers")
        self.check_choice("force_last_page", (False, True))
        if self.budget % self.page_size or self.budget < self.min_budget:
            lower = max(self.budget // self.page_size * self.page_size, self.min_budget)
            nearest = [lower] if lower >= self.budget else [lower, lower + self.page_size]
            why = (f"is not a multiple of page_size={self.page_size}" if self.budget % self.page_size else
                   f"is below the {self.min_budget // self.page_size} pages of {self.page_size} tokens the official "
                   "evaluation attends at least (max(3, budget // page_size))")
            raise BudgetError(f"quest: budget {self.budget} {why}; nearest valid budgets: "
                              f"{' or '.join(map(str, nearest))}")

    def is_budgeted(self, st: QuestState) -> bool:
        return st.layer_idx >= self.n_dense_layers

    def make_state(self, layer_idx: int) -> QuestState:
        return QuestState(layer_idx)

    def store(self, st: QuestState, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends K/V and refreshes the metadata of the pages the new tokens touched."""
        first_page = st.resident_tokens() // self.page_size
        super().store(st, k, v)
        lo, hi = page_min_max(st.k[:, first_page * self.page_size:], self.page_size)
        if st.kmin is None:
            st.kmin, st.kmax = lo, hi
            return
        st.kmin, st.kmax = st.kmin[:, :first_page], st.kmax[:, :first_page]  # the touched pages are rewritten
        st.buffers["kmin"], st.kmin = append_to_buffer(st.buffers.get("kmin"), st.kmin, lo)
        st.buffers["kmax"], st.kmax = append_to_buffer(st.buffers.get("kmax"), st.kmax, hi)

    def select(self, st: QuestState, q: torch.Tensor) -> torch.Tensor | None:
        """``[H_q, min(top_pages, pages)]`` page ids per query head, or None in a dense layer."""
        if not self.is_budgeted(st):
            return None
        top = min(self.top_pages, st.kmin.shape[1])
        bounds = page_upper_bounds(q[:, 0], st.kmin, st.kmax)
        if self.force_last_page:
            bounds[:, -1] = float("inf")  # the kernels' page budget includes the last page
        return bounds.topk(top, dim=-1).indices

    def fetch(self, st: QuestState, pages: torch.Tensor | None) -> Fetched:
        if pages is None:
            st.max_attended = st.k.shape[1] - 1
            return Fetched(st.k, st.v)
        n = st.k.shape[1]
        tokens, valid = self.page_tokens(pages, n)
        kv_head = (torch.arange(pages.shape[0], device=pages.device) // st.spec.group)[:, None]
        st.max_attended = self.attended_past(n, pages.shape[1])
        return Fetched(st.k[kv_head, tokens], st.v[kv_head, tokens], valid, n_past=self.past_per_head(pages, n))

    def page_tokens(self, pages: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token indices ``[H_q, top * page_size]`` of the selected pages (clamped to the ``n`` resident ones)
        and which of them exist (the newest page may be partial)."""
        tokens = (pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten(1)
        return tokens.clamp(max=n - 1), tokens < n

    def attended_positions(self, st: QuestState, pages: torch.Tensor | None) -> torch.Tensor:
        if pages is None:
            return st.pos
        tokens, valid = self.page_tokens(pages, st.k.shape[1])
        return torch.where(valid, st.pos[tokens], -1)

    def attended_past(self, n: int, top: int) -> int:
        """The most past tokens a head can attend, from shapes (no host sync): ``top`` pages of ``n`` tokens, all
        full but the newest (``ceil(n / page_size) * page_size - n`` empty slots, and the current token, which
        is not counted); a head that leaves the newest page out attends ``top`` full pages (the debug check's
        bound; every head attends the newest page when it is forced or when ``top`` covers the context)."""
        if self.force_last_page or top * self.page_size >= n:
            return top * self.page_size - (-n % self.page_size) - 1
        return top * self.page_size

    def past_per_head(self, pages: torch.Tensor, n: int) -> torch.Tensor | float:
        """Mean past tokens attended per head: ``top`` pages, less the newest page's empty slots and the current
        token for each head that selected it (a 0-d tensor on the pages' device: no host sync)."""
        full = pages.shape[1] * self.page_size
        if self.force_last_page:
            return float(full - (-n % self.page_size) - 1)
        newest = (pages == (n - 1) // self.page_size).any(-1).float()  # [H_q]: the head attends the newest page
        return full - (newest * ((-n % self.page_size) + 1)).mean()

    def check_resident(self, st: QuestState) -> None:
        """All keys stay resident (no offload in Quest); debug mode checks the attended set instead."""
        check_attended(self, st)
