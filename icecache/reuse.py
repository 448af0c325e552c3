"""IceCache(reuse) (Mao et al., ICLR 2026, §3.5; official ``--n_reuse_layers``, ``infer_state.check_reuse``):
an anchor layer's page search serves the next ``n_reuse_layers - 1`` layers, which build no index of their own
and load their own K/V of the pages they attend, through the anchor's page layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from icecache.method import IceCache, IceState
from icecache.tuned import IceCacheTuned


class ReuseState(IceState):
    """A layer of IceCache(reuse): :class:`IceState` plus, in a reusing layer with ``own_candidates``, the
    page bounds of its own keys."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.bounds: PageBounds | None = None


class PageBounds:
    """Per-page element-wise min and max of one layer's *own* keys over its anchor's page layout, the
    metadata of Quest (Tang et al., ICML 2024, §3.2, "criticality estimation"), kept up to date page by page:
    a page is recomputed only after the anchor's insert changed it."""

    def __init__(self, heads: int, dim: int):
        self.kmin = torch.empty(heads, 0, dim)
        self.kmax = torch.empty(heads, 0, dim)
        self.stale = np.zeros((heads, 0), dtype=np.bool_)

    def mark_stale(self, changed: np.ndarray) -> None:
        """Pages ``changed [H, P]`` (the anchor's insert flags) are recomputed before the next use."""
        self._grow(changed.shape[1])
        self.stale[:, : changed.shape[1]] |= changed

    def _grow(self, n_pages: int) -> None:
        have = self.stale.shape[1]
        if n_pages <= have:
            return
        heads, _, dim = self.kmin.shape
        self.stale = np.concatenate([self.stale, np.ones((heads, n_pages - have), dtype=np.bool_)], axis=1)
        self.kmin = torch.cat([self.kmin, torch.empty(heads, n_pages - have, dim)], dim=1)
        self.kmax = torch.cat([self.kmax, torch.empty(heads, n_pages - have, dim)], dim=1)

    def refresh(self, page_abs: np.ndarray, n_pages: int, keys: torch.Tensor, first_pos: int) -> None:
        """Recomputes the stale pages of ``page_abs [H, >= n_pages, S]`` (absolute positions, -1 = empty slot)
        from ``keys [H, n, d]``, the layer's own offload store whose row 0 is position ``first_pos``."""
        self._grow(n_pages)
        heads, pages = np.nonzero(self.stale[:, :n_pages])
        if heads.size == 0:
            return
        positions = page_abs[heads, pages]  # [m, S]
        valid = torch.from_numpy(positions >= 0)[..., None]
        rows = torch.from_numpy(np.where(positions >= 0, positions - first_pos, 0))
        k = keys[torch.from_numpy(heads)[:, None], rows].float()  # [m, S, d]
        h, p = torch.from_numpy(heads), torch.from_numpy(pages)
        self.kmin[h, p] = k.masked_fill(~valid, float("inf")).amin(1)
        self.kmax[h, p] = k.masked_fill(~valid, float("-inf")).amax(1)
        self.stale[heads, pages] = False

    def upper_bounds(self, queries: torch.Tensor, page_valid: np.ndarray) -> torch.Tensor:
        """Quest's bound ``sum_j max(q_j min_j, q_j max_j)`` of ``q.k`` over each page, for ``queries [H, G, d]``:
        ``[H, G, P]``, -inf for pages without tokens (``page_valid [H, P]`` = 0)."""
        n_pages = page_valid.shape[1]
        kmin, kmax = self.kmin[:, :n_pages], self.kmax[:, :n_pages]
        bound = (torch.einsum("hgd,hpd->hgp", queries.clamp(min=0), kmax)
                 + torch.einsum("hgd,hpd->hgp", queries.clamp(max=0), kmin))
        return bound.masked_fill(torch.from_numpy(page_valid == 0)[:, None], float("-inf"))


@dataclass(frozen=True)
class IceCacheReuse(IceCache):
    """IceCache(reuse) (official ``--n_reuse_layers``, ``infer_state.check_reuse``): an anchor layer's page
    selection is reused by
    the next ``n_reuse_layers - 1`` layers, which build no index and run no search but load *their own*
    K/V of the anchor's pages (gathered from their own store through the anchor's page table).

    Anchors (official ``check_reuse``, with the first budgeted layer ``n_dense_layers`` in place of the
    hard-coded 2): layers ``<= n_dense_layers``, then every layer with ``(l - n_dense_layers) mod N == 0``.

    Every default is the official configuration (:class:`IceCache`'s, plus the official copy of the anchor's
    pages: ``rerank=0``, ``own_candidates=0``); this project's re-ranking is the registered variant
    ``icecache_reuse_rerank`` (:class:`IceCacheReuseRerank`).

    Re-ranking (``rerank = m >= 2``, this project's extension): the anchor's search hands on ``m * K`` merged
    candidate pages per KV head (its own selection is their first ``K``), and each reusing layer attends the
    ``K`` candidates on which its own queries put the most exact softmax mass (:meth:`rerank_pages`, computed
    from the layer's own keys in its offload store). Only the anchor searches the index; the transfer and the
    budget stay those of ``K`` pages.

    Candidates of its own (``own_candidates = c >= 1``, this project's extension, with ``rerank``): each
    reusing layer also proposes the ``c * K`` pages of the anchor's layout with the highest Quest bound of its
    own keys (:class:`PageBounds`: per-page min/max, the group's best query head), and re-ranks the union. This
    is a linear scan of page metadata (``P`` pages x ``d`` per query head, about ``1 / page_size`` of the keys),
    not a search; the metadata is updated only for pages an insert changed.

    Args:
        n_reuse_layers: ``N``, layers sharing one anchor's selection, the anchor included (scripts: 3).
        rerank: ``0`` (official): reusing layers attend the anchor's selection; ``m >= 2``: they re-rank the
            anchor's ``m * K`` candidates with their own queries.
        own_candidates: ``0`` (official): the candidates are the anchor's; ``c >= 1``: each reusing layer adds
            the ``c * K`` pages with the highest bound of its own keys (needs ``rerank``).
    """

    n_reuse_layers: int = 3
    rerank: int = 0
    own_candidates: int = 0
    name: ClassVar[str] = "icecache_reuse"
    official: ClassVar[dict] = dict(IceCache.official, n_reuse_layers=3, rerank=0, own_candidates=0)

    def validate(self) -> None:
        if self.n_reuse_layers < 1:
            raise ValueError(f"{self.name}: n_reuse_layers must be >= 1, got {self.n_reuse_layers}")
        if self.rerank < 0 or self.rerank == 1:
            raise ValueError(f"{self.name}: rerank must be 0 (official) or >= 2 candidates per page, got {self.rerank}")
        if self.own_candidates < 0 or (self.own_candidates and not self.rerank):
            raise ValueError(f"{self.name}: own_candidates must be >= 0 and needs rerank >= 2 (the pool is "
                             f"re-ranked), got own_candidates={self.own_candidates}, rerank={self.rerank}")
        if self.rerank and self.gqa_merge == "union":
            raise ValueError(f"{self.name}: rerank needs a merge within the budget, not gqa_merge='union'")
        super().validate()

    def candidate_width(self, k: int) -> int:
        return self.rerank * k if self.rerank else k

    def make_state(self, layer_idx: int) -> ReuseState:
        return ReuseState(layer_idx)

    def anchor_of(self, layer_idx: int) -> int:
        first = self.n_dense_layers
        return layer_idx if layer_idx <= first else layer_idx - (layer_idx - first) % self.n_reuse_layers

    def builds_index(self, layer_idx: int) -> bool:
        return self.anchor_of(layer_idx) == layer_idx

    def page_source(self, st: IceState) -> IceState:
        return st.seq.layers[self.anchor_of(st.layer_idx)]

    def insert_evicted(self, st: IceState, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        anchor = self.page_source(st)
        if anchor is st:
            return super().insert_evicted(st, keys, positions)
        if anchor.changed_at != st.n_seen:
            raise RuntimeError(f"{self.name}: layer {st.layer_idx} evicted a window page that its anchor "
                               f"{anchor.layer_idx} did not insert at this step")
        if st.bounds is not None:
            st.bounds.mark_stale(anchor.changed.numpy())
        return anchor.changed

    def select(self, st: IceState, q: torch.Tensor) -> torch.Tensor | None:
        anchor = self.page_source(st)
        if anchor is st or not st.offloaded:
            return super().select(st, q)
        if anchor.selected_at != st.n_seen:
            raise RuntimeError(f"{self.name}: anchor layer {anchor.layer_idx} made no selection at this step")
        if not self.rerank:
            return anchor.selection
        queries = q[:, 0].float().cpu().view(anchor.index.heads, st.spec.group, -1)  # [H_kv, G, d]
        cand = anchor.candidates.numpy()
        if self.own_candidates:
            cand = union_rows(cand, self.own_pages(st, queries, anchor))
        st.selection = self.rerank_pages(st, queries, anchor, cand)
        return st.selection

    def own_pages(self, st: IceState, queries: torch.Tensor, anchor: IceState) -> np.ndarray:
        """The ``own_candidates * K`` pages per KV head of the anchor's layout with the highest bound of this
        layer's own keys for its query group (best query head), best first, -1 padded: ``[H_kv, c * K]``;
        ``queries [H_kv, G, d]``."""
        index = anchor.index
        if st.bounds is None:
            st.bounds = PageBounds(index.heads, index.dim)
        st.bounds.refresh(index.page_positions(), index.n_pages, st.store.keys(), st.store.first_pos)
        bound = st.bounds.upper_bounds(queries, index.page_fill()).amax(1)  # [H_kv, P]
        top = bound.topk(min(self.own_candidates * self.layout()[2], bound.shape[1]), dim=-1)
        return torch.where(torch.isfinite(top.values), top.indices, -1).numpy()

    def rerank_pages(self, st: IceState, queries: torch.Tensor, anchor: IceState, cand: np.ndarray) -> torch.Tensor:
        """The ``K`` of the candidate pages ``cand [H_kv, C]`` (anchor page ids) with the most attention of this
        layer's query group: per query head the exact softmax over every token of the candidates (this layer's
        own keys), summed per page and over the group; -1 candidates are never chosen. ``queries [H_kv, G, d]``."""
        h = cand.shape[0]
        positions = anchor.index.page_positions()[np.arange(h)[:, None], cand.clip(0)]  # [H_kv, C, s]
        valid = torch.from_numpy((positions >= 0) & (cand >= 0)[..., None])
        rows = torch.from_numpy(np.where(valid.numpy(), positions - st.store.first_pos, 0))
        keys = st.store.keys()[torch.arange(h)[:, None, None], rows].float()  # [H_kv, C, s, d]
        logits = torch.einsum("hgd,hcsd->hgcs", queries, keys) * st.spec.scaling
        logits = logits.masked_fill(~valid[:, None], float("-inf"))
        probs = logits.flatten(2).softmax(-1).view(logits.shape).nan_to_num(0.0)
        mass = probs.sum(-1).sum(1).masked_fill(torch.from_numpy(cand < 0), -1.0)  # [H_kv, C]
        best = mass.topk(min(self.layout()[2], cand.shape[1]), dim=-1).indices
        return torch.from_numpy(cand).gather(1, best)


def union_rows(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Row-wise union of two page lists ``[H, C1]``, ``[H, C2]`` (-1 padded): ``first``'s pages, then those of
    ``second`` not in it, -1 padded to ``C1 + C2``."""
    out = np.full((first.shape[0], first.shape[1] + second.shape[1]), -1, dtype=np.int64)
    for h in range(first.shape[0]):
        row = list(dict.fromkeys(p for p in (*first[h], *second[h]) if p >= 0))
        out[h, : len(row)] = row
    return out


@dataclass(frozen=True)
class IceCacheReuseRerank(IceCacheTuned, IceCacheReuse):
    """IceCache(reuse) with this project's extensions (``cache=icecache_reuse_rerank``), a registered variant of
    :class:`IceCacheReuse`: every deviation of :class:`~icecache.tuned.IceCacheTuned` (``page_size`` 8 below 256
    tokens, ``prop_to_retrieve=1``, ``candidate_rule="scored"``, ``short_prompt="offload"``,
    ``prefill_pipeline="overlap"``, ``projection="seeded"``), plus two of its own (the scores behind them:
    docs/fidelity.md, "Why the variants' settings", and the tables of docs/results.md):

    - ``rerank``: 3, each reusing layer re-ranks ``3 K`` of the anchor's candidates by its own exact softmax mass
      instead of copying the anchor's pages.
    - ``own_candidates``: 4 below 256 tokens (0 from 256 on), the ``4 K`` pages of the highest Quest bound of the
      layer's own keys join the pool. The scan is linear in the pages, so its cost grows with the context.
    """

    rerank: int = 3
    own_candidates: int | None = None  # resolved from the budget: 4 below 256 tokens, else 0
    name: ClassVar[str] = "icecache_reuse_rerank"
    extends: ClassVar[str] = "icecache_reuse"  # (the base order lets IceCacheTuned's field defaults win)
    deviations: ClassVar[tuple] = IceCacheTuned.deviations + ("rerank", "own_candidates")

    def __post_init__(self) -> None:
        if self.own_candidates is None and self.budget is not None:
            object.__setattr__(self, "own_candidates", 4 if 0 < self.budget < 256 else 0)  # construction
        super().__post_init__()
