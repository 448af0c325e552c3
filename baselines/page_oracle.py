"""Page oracle: IceCache with its index search replaced by an exact ranking of the index's pages
(``cache=page_oracle``), the bound that separates IceCache's search loss from its page granularity.

IceCache (Mao et al., "IceCache", ICLR 2026; ``icecache/method.py``) attends, in each budgeted layer, sink pages
+ ``K`` retrieved pages per KV head + window pages of ``page_size`` tokens. Its retrieved pages are pages of the
layer's M-DCI index (sibling groups of semantically close keys), found per query head by an approximate top-down
search that ranks a page by the best ``q.k`` of the keys it scored in it (``icecache/dci/_level0.py``
``top_pages``: a page's score is the maximum over its candidate keys), and merged across a KV head's query heads
(``gqa_merge``, official ``first_k_unique``). :class:`PageOracle` keeps all of that -- layout, dense layers,
offload, the same M-DCI build (the same pages, the same page membership after every insert), the same number
of pages each query head hands to the merge, the same merge code -- and replaces only the search
(:meth:`~icecache.method.IceCache.search_pages`): every query head scores every indexed key exactly, ``q.k``,
a page's score is the maximum over its keys, and the head's best pages by that score go to the merge.

Reading the columns (one budget, one layout):

- ``page_oracle`` vs ``icecache``: the search loss. Both attend pages of the same index in the same layout,
  with the same GQA rule; the oracle's pages are each query head's exact best ones, IceCache's what its search
  found. Per query head the oracle's ``i``-th page score is at least the search's ``i``-th, and a KV head
  attends at least as many retrieved pages (the capped merges; ``union`` attends the distinct union of either).
- ``topk`` vs ``page_oracle``: the granularity loss, what attending whole index pages shared by a KV head's
  query heads costs against attending single tokens per query head. ``topk`` with IceCache's layout is
  ``cache=topk cache.n_dense_layers=2 cache.n_sink=32 cache.n_window=32`` (``n_sink=16`` at budget 64;
  baselines/topk_oracle.py).
- ``full`` vs ``topk``: what any selection of ``budget`` tokens loses.

It bounds IceCache's search, not every page selector: the page score is IceCache's (the best key's ``q.k``),
not the attention mass a page carries, so another ranking of the same pages can attend more mass. The exact
scores are computed in fp32 (the search's arithmetic), in another summation order than the search's
``dot_key``, so two pages whose best keys score within an ulp may rank in the other order; ties rank the
lower page id first. The search-only options (``search_ratio``, ``min_fov``, ``prop_to_retrieve``,
``candidate_rule``) have no effect; the build's (``page_size``, ``ratio_1``, ``ratio_2``, ``seed``,
``projection``, ``key_storage``) and the layout's are IceCache's, and so are the defaults. With every key
scored and every scored key ranking its page (``cache=icecache cache.min_fov=1000000 cache.prop_to_retrieve=1.0
cache.candidate_rule=scored``) IceCache selects the oracle's pages; under the official candidate rule
(``add_to_list``) the same exhaustive search ranks a page only when one of its keys is among the ``K`` best
children of its level-1 node, so a page whose node's ``K`` best keys all lie in fewer than ``K`` other pages can
be missed although its best key beats the ``K``-th page's. A bound, not a paper's method: its TPOT (one exact
scoring of every indexed key per query head and step) is not a method's cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from icecache.method import IceCache, IceState


def exact_page_scores(queries: torch.Tensor, page_positions: np.ndarray, keys: torch.Tensor,
                      first_pos: int) -> torch.Tensor:
    """Every page's score for every query head: ``[H_q, P]`` fp32, the maximum of ``q.k`` over the page's keys,
    -inf for an empty page. ``queries [H_q, d]`` (query head ``i`` reads KV head ``i // (H_q / H_kv)``),
    ``page_positions [H_kv, P, s]`` the index's pages (absolute positions, -1 = empty slot), ``keys [H_kv, n,
    d]`` the stored keys of positions ``first_pos ..``."""
    heads, n_pages, size = page_positions.shape
    group = queries.shape[0] // heads
    logits = torch.einsum("hgd,hnd->hgn", queries.float().view(heads, group, -1), keys.float())  # [H_kv, G, n]
    positions = torch.from_numpy(np.ascontiguousarray(page_positions)).reshape(heads, 1, n_pages * size)
    rows = (positions - first_pos).clamp_min(0).expand(heads, group, -1)
    scores = logits.gather(2, rows).view(heads, group, n_pages, size)
    scores = scores.masked_fill((positions < 0).view(heads, 1, n_pages, size), float("-inf"))
    return scores.amax(-1).reshape(heads * group, n_pages)


def top_pages(page_scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``width`` best pages, best first, ties by lower page id: ``(LongTensor [H_q, width], FloatTensor
    [H_q, width])``, -1 / -inf padded (empty pages never listed)."""
    values, pages = page_scores.sort(dim=-1, descending=True, stable=True)
    values, pages = values[:, :width], pages[:, :width]
    pages = torch.where(torch.isfinite(values), pages, -1)
    pad = width - values.shape[1]
    if pad > 0:
        values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], dim=1)
        pages = torch.cat([pages, pages.new_full((pages.shape[0], pad), -1)], dim=1)
    return pages.contiguous(), values.contiguous()


@dataclass(frozen=True)
class PageOracle(IceCache):
    """IceCache whose retrieved pages are each query head's exact best pages of the same M-DCI index (a bound:
    see the module docstring for what it bounds and how to read it beside ``icecache`` and ``topk``).

    Args: those of :class:`~icecache.method.IceCache`, with its defaults; the search's (``search_ratio``,
    ``min_fov``, ``prop_to_retrieve``, ``candidate_rule``) have no effect.
    """

    name: ClassVar[str] = "page_oracle"

    def search_pages(self, st: IceState, queries: torch.Tensor, k: int, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's ``width`` best pages of the layer's index by the exact best ``q.k`` of their keys,
        with those scores (what :meth:`IceCache.search_pages` returns, exactly): ``([H_q, width], [H_q, width])``,
        -1 / -inf padded. ``k`` steers only the search it replaces."""
        scores = exact_page_scores(queries, st.index.page_positions(), st.store.keys(), st.store.first_pos)
        return top_pages(scores, width)
