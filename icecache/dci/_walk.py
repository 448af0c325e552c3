"""One node's visiting order in the M-DCI query (official ``src/dci.c``: ``dci_next_closest_proj`` inside
``dci_query_single_point_single_level``): which of a node's children, sorted by projection, a query scores.
``pos`` is a pair of scratch arrays ``(page, slot)`` large enough for one node's children; ``params`` the
search's :class:`~icecache.dci._search.SearchParams`."""

from __future__ import annotations

import math

from numba import njit


@njit(cache=True, nogil=True, inline="always")
def child_count(h, node, pages, nodes):
    """Number of children of ``node`` (the used slots of its pages)."""
    c = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        c += pages.valid[h, pg]
        pg = pages.next[h, pg]
    return c


@njit(cache=True, nogil=True, inline="always")
def fill_positions(h, node, pages, nodes, pos):
    """``pos[0][i], pos[1][i]``: the page and slot of ``node``'s ``i``-th child in projection order."""
    pos_pg, pos_sl = pos
    i = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        for s in range(pages.valid[h, pg]):
            pos_pg[i] = pg
            pos_sl[i] = s
            i += 1
        pg = pages.next[h, pg]


@njit(cache=True, nogil=True, inline="always")
def _proj_at(h, i, pages, pos):
    """Projection of the child at position ``i`` (:func:`fill_positions`)."""
    return pages.proj[h, pos[0][i], pos[1][i]]


@njit(cache=True, nogil=True, inline="always")
def _leaves_at(h, i0, i1, pages, nodes, pos):
    """Level-0 pages below the children at positions ``i0 .. i1-1``."""
    leaves = 0
    for i in range(i0, i1):
        leaves += nodes.nleaf[h, pages.loc[h, pos[0][i], pos[1][i]] + 1]
    return leaves


@njit(cache=True, nogil=True, inline="always")
def chunk_walk(h, c, qp, params, upper, pages, nodes, pos):
    """The C code's visiting order inside one node (``dci_next_closest_proj``) over its ``c`` children, whose
    positions :func:`fill_positions` wrote: from the position of ``p(q)`` among them (sorted by
    projection), chunks of up to ``params.chunk`` children (``CLOSEST`` = 128 in the C code), each from the
    side whose next child is closer to ``p(q)`` (topped up from the other side when that side runs out);
    stop after a chunk once at least ``ceil(params.prop * c)`` children and at least ``num_neighbours``
    children are visited (``fov`` on an ``upper`` level, ``k_pages`` at level 0), and, on an upper level,
    at least ``k_pages`` level-0 pages below them.

    The visited children always form one contiguous run of the sorted list: returns its bounds ``[lo, hi)``.
    ``p(q)``'s position is found by bisection and each chunk is taken as two index ranges, so the walk costs
    O(log c + chunks), not O(c) (level-0 pages are counted child by child only for upper levels).
    """
    chunk = params.chunk
    if upper:
        need_scored, need_leaves = params.fov, params.k_pages
    else:
        need_scored, need_leaves = params.k_pages, 0
    lo, hi = 0, c
    while lo < hi:  # left = last child with projection < p(q)
        mid = (lo + hi) // 2
        if _proj_at(h, mid, pages, pos) < qp:
            lo = mid + 1
        else:
            hi = mid
    left = lo - 1
    right = left + 1
    want = max(int(math.ceil(params.prop * c - 1e-9)), 1)
    scored = 0
    leaves = 0
    while left >= 0 or right < c:
        if left < 0:
            from_right = True
        elif right >= c:
            from_right = False
        else:
            from_right = _proj_at(h, right, pages, pos) - qp < qp - _proj_at(h, left, pages, pos)
        if from_right:
            n_right = min(chunk, c - right)
            n_left = min(chunk - n_right, left + 1)
        else:
            n_left = min(chunk, left + 1)
            n_right = min(chunk - n_left, c - right)
        if upper:
            leaves += (_leaves_at(h, right, right + n_right, pages, nodes, pos)
                       + _leaves_at(h, left + 1 - n_left, left + 1, pages, nodes, pos))
        right += n_right
        left -= n_left
        scored += n_right + n_left
        if scored >= want and scored >= need_scored and leaves >= need_leaves:
            break
    return left + 1, right


@njit(cache=True, nogil=True, inline="always")
def visited_run(h, node, qp, params, pages, nodes, pos):
    """The run ``[lo, hi)`` of upper-level ``node``'s sorted children that one query scores
    (:func:`chunk_walk`; a node of at most ``params.chunk`` children is scored in full)."""
    c = child_count(h, node, pages, nodes)
    if c <= params.chunk:
        return 0, c
    fill_positions(h, node, pages, nodes, pos)
    return chunk_walk(h, c, qp, params, True, pages, nodes, pos)
