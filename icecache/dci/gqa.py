"""GQA merge of per-query-head page lists into per-KV-head lists (icecache.md §4 step 3)."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit


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
                dup = False
                for a in range(c):
                    if out[h, a] == p:
                        dup = True
                        break
                if not dup:
                    out[h, c] = p
                    c += 1


def merge_gqa(pages_per_qhead: torch.Tensor, group: int, k: int | None = None,
              mode: str = "interleaved") -> torch.Tensor:
    """Merge the page lists of the ``group`` query heads of each KV head.

    Args:
        pages_per_qhead: ``LongTensor [H_q, K]`` of page ids, -1 padded (output of ``search``).
        group: query heads per KV head, ``r = H_q // H_kv``.
        k: cap on pages per KV head (default ``K``).
        mode: ``"interleaved"`` (official ``first_k_unique``): read the ``[r, K]`` stack rank by rank
            (rank 1 of every q-head, then rank 2, ...) and keep the first ``k`` distinct ids;
            ``"union"``: the full distinct union in the same order (``k`` is ignored, width ``r*K``).

    Returns:
        ``LongTensor [H_kv, k]`` (``[H_kv, r*K]`` for ``"union"``), -1 padded.
    """
    if mode not in ("interleaved", "union"):
        raise ValueError(f"mode must be 'interleaved' or 'union', got {mode!r}")
    n_q, width = pages_per_qhead.shape
    if n_q % group:
        raise ValueError(f"H_q={n_q} is not a multiple of group={group}")
    cap = group * width if mode == "union" else (width if k is None else k)
    out = np.full((n_q // group, cap), -1, dtype=np.int64)
    _first_k_unique(pages_per_qhead.to(torch.int64).contiguous().numpy(), group, cap, out)
    return torch.from_numpy(out)
