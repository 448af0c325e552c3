"""GQA merge of per-query-head page lists into per-KV-head lists (official
``infer_state.py`` ``first_k_unique``; the score-based merges are this project's, see ``merge_gqa``)."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

MERGE_MODES = ("interleaved", "union", "mass", "max")
SCORED_MODES = ("mass", "max")


@njit(cache=True, nogil=True, inline="always")
def find(row: np.ndarray, n: int, value) -> int:
    """The first ``i < n`` with ``row[i] == value``, or -1 (a linear scan: these rows hold a few pages)."""
    for i in range(n):
        if row[i] == value:
            return i
    return -1


@njit(cache=True, nogil=True)
def _first_k_unique(pages: np.ndarray, group: int, k: int, out: np.ndarray) -> None:
    """``pages [H_q, K]``; per KV head read the group's ``[r, K]`` block rank-interleaved."""
    n_q, width = pages.shape
    for h in range(n_q // group):
        c = 0
        for rank in range(width):
            for g in range(group):
                p = pages[h * group + g, rank]
                if p < 0 or c >= k:
                    continue
                if find(out[h], c, p) < 0:
                    out[h, c] = p
                    c += 1


@njit(cache=True, nogil=True)
def _top_k_by_group_score(pages: np.ndarray, values: np.ndarray, group: int, k: int, use_sum: bool,
                          out: np.ndarray) -> None:
    """Per KV head: each distinct page of the group's ``[r, C]`` lists gets the sum (``use_sum``) or the
    max of its ``values``; the ``k`` best pages are written best first. Ties keep the page met first in
    rank-interleaved order (rank 1 of every q-head, then rank 2, ...), so ties resolve like
    ``_first_k_unique``."""
    n_q, width = pages.shape
    ids = np.empty(group * width, dtype=np.int64)
    acc = np.empty(group * width, dtype=np.float64)
    for h in range(n_q // group):
        n = 0
        for rank in range(width):
            for g in range(group):
                p = pages[h * group + g, rank]
                if p < 0:
                    continue
                v = values[h * group + g, rank]
                found = find(ids, n, p)
                if found < 0:
                    ids[n] = p
                    acc[n] = v
                    n += 1
                elif use_sum:
                    acc[found] += v
                else:
                    acc[found] = max(acc[found], v)
        for c in range(min(k, n)):
            best = -1
            for a in range(n):
                if ids[a] >= 0 and (best < 0 or acc[a] > acc[best]):
                    best = a
            out[h, c] = ids[best]
            ids[best] = -1


def candidate_values(scores: np.ndarray, mode: str, scaling: float) -> np.ndarray:
    """What each (query head, candidate page) contributes to its page's group score.

    ``"mass"``: the softmax, over the head's candidates, of ``scaling * q.k`` of each page's best token
    -- the share of the head's attention (restricted to what the search scored) that the page's best
    token gets; a page's group score is the sum over the group, i.e. the group's attention mass.
    ``"max"``: the logit ``scaling * q.k`` itself; a page's group score is the best logit any query head
    of the group gave it. (Relative to each head's own best it would tie every head's top page, so at
    one page per KV head it would degenerate to the first query head's choice, like ``interleaved``.)
    """
    scaled = scaling * scores.astype(np.float64)
    if mode == "max":
        return scaled
    top = np.max(scaled, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scaled - top)  # -inf padding -> 0
    return weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-300)


def merge_gqa(pages_per_qhead: torch.Tensor, group: int, k: int | None = None, mode: str = "interleaved",
              scores: torch.Tensor | None = None, scaling: float = 1.0) -> torch.Tensor:
    """Merge the page lists of the ``group`` query heads of each KV head.

    Args:
        pages_per_qhead: ``LongTensor [H_q, C]`` of page ids, -1 padded (output of ``search`` or
            ``search_scored``), best first.
        group: query heads per KV head, ``r = H_q // H_kv``.
        k: pages per KV head (default ``C``).
        mode: ``"interleaved"`` (official ``first_k_unique``): read the ``[r, C]`` stack rank by rank
            (rank 1 of every q-head, then rank 2, ...) and keep the first ``k`` distinct ids; with one
            page per KV head this is the first query head's top page only. ``"union"``: the full
            distinct union in the same order (``k`` is ignored, width ``r*C``; over the budget by
            design). ``"mass"`` / ``"max"``: group-level merges that keep ``k`` pages ranked by a group
            score computed from ``scores`` (see :func:`candidate_values`): the group's summed softmax
            mass over the candidates, or the best logit any query head gave the page.
        scores: ``[H_q, C]`` best-token ``q.k`` of each listed page (-inf padded); needed by the
            score modes.
        scaling: the attention's logit scale (``1/sqrt(d)``), used by ``"mass"`` and ``"max"``.

    Returns:
        ``LongTensor [H_kv, k]`` (``[H_kv, r*C]`` for ``"union"``), -1 padded.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"mode must be one of {MERGE_MODES}, got {mode!r}")
    n_q, width = pages_per_qhead.shape
    if n_q % group:
        raise ValueError(f"H_q={n_q} is not a multiple of group={group}")
    pages = pages_per_qhead.to(torch.int64).contiguous().numpy()
    if mode in SCORED_MODES:
        if scores is None or tuple(scores.shape) != (n_q, width):
            raise ValueError(f"gqa merge '{mode}' needs scores of shape {(n_q, width)}")
        cap = width if k is None else k
        out = np.full((n_q // group, cap), -1, dtype=np.int64)
        values = candidate_values(scores.numpy(), mode, scaling)
        _top_k_by_group_score(pages, values, group, cap, mode == "mass", out)
        return torch.from_numpy(out)
    cap = group * width if mode == "union" else (width if k is None else k)
    out = np.full((n_q // group, cap), -1, dtype=np.int64)
    _first_k_unique(pages, group, cap, out)
    return torch.from_numpy(out)
