"""Level 0 of the M-DCI query and the ranking of pages by their best candidate (official ``src/dci.c``:
``dci_query_single_point_single_level`` on the level-1 nodes kept by the descent, and ``dci_query``'s list of
the ``K`` best). A query's page ranking is ``best [P]`` (a page's best candidate ``q.k``, -inf = not touched)
with the touched pages listed in ``touched [P]``, ``n_touched`` of them."""

from __future__ import annotations

import numpy as np
from numba import njit

from ._walk import child_count, chunk_walk, fill_positions
from .intrinsics import EXACT, dot_key, dot_key3, dot_keys4, prefetch, prefetch_row


@njit(cache=True, nogil=True, inline="always")
def rank(pg, score, best, touched, n_touched):
    """Page ``pg``'s best score becomes at least ``score`` (recorded as touched the first time); returns
    ``n_touched``."""
    if best[pg] == -np.inf:
        touched[n_touched] = pg
        n_touched += 1
    best[pg] = max(best[pg], score)
    return n_touched


@njit(cache=True, nogil=True, inline="always")
def _touch(g, pg, best, touched, n_touched):
    """Records page ``pg`` as touched by query ``g`` the first time it is scored (``best`` still -inf)."""
    if best[g, pg] == -np.inf:
        touched[g, n_touched[g]] = pg
        n_touched[g] += 1


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _score_slots(h, q_group, g, pg, s0, s1, pages, best):
    """``best[g, pg] = max(best[g, pg], max_s q_g.k_s)`` over slots ``s0 .. s1-1`` of page ``pg``."""
    top = best[g, pg]
    for s in range(s0, s1):
        top = max(top, dot_key(q_group[g], pages.keys[h, pg, s]))
    best[g, pg] = top


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _score_slots3(h, q_group, gs, s0s, s1s, k, pg, pages, best):
    """:func:`_score_slots` for the three queries ``gs[k:k+3]``, each over its own slots ``s0s[.] ..
    s1s[.]-1``: every key of the union of their slots is loaded once for the three dot products
    (:func:`~icecache.dci.intrinsics.dot_key3`, the arithmetic of one query's, so the same scores), and each
    maximum takes only its query's slots."""
    g0, g1, g2 = gs[k], gs[k + 1], gs[k + 2]
    a0, a1, a2 = s0s[k], s0s[k + 1], s0s[k + 2]
    b0, b1, b2 = s1s[k], s1s[k + 1], s1s[k + 2]
    t0, t1, t2 = best[g0, pg], best[g1, pg], best[g2, pg]
    for s in range(min(a0, a1, a2), max(b0, b1, b2)):
        d0, d1, d2 = dot_key3(q_group[g0], q_group[g1], q_group[g2], pages.keys[h, pg, s])
        if a0 <= s < b0:
            t0 = max(t0, d0)
        if a1 <= s < b1:
            t1 = max(t1, d1)
        if a2 <= s < b2:
            t2 = max(t2, d2)
    best[g0, pg], best[g1, pg], best[g2, pg] = t0, t1, t2


@njit(cache=True, nogil=True, inline="always")
def _prefetch_page(h, pg, pages):
    """Requests every used key of page ``pg`` (none when ``pg < 0``), so that the next page of a node is
    scored while its keys arrive (a page is 2-4 KB at a place the hardware prefetcher cannot guess)."""
    if pg < 0:
        return
    keys = pages.keys[h, pg]
    for s in range(pages.valid[h, pg]):
        prefetch_row(keys, s)


@njit(cache=True, nogil=True, fastmath=EXACT)
def score_level0(h, q_group, runs, n_runs, pages, nodes, best, touched, n_touched):
    """Level 0 of the search for a KV head's query heads together: ``runs [n, 4]`` rows ``(node, query,
    lo, hi)`` sorted by node; each node's pages are read once while every query that kept the node scores
    its run of them, three queries at a time (:func:`_score_slots3`; the page stays in L1 between them, so
    the group reads the keys once instead of once per query head). Updates ``best [G, P]`` and the touched
    lists ``touched [G, P]`` / ``n_touched [G]`` exactly as one search per query head would."""
    n_group = q_group.shape[0]
    gs = np.empty(n_group, dtype=np.int64)
    s0s = np.empty(n_group, dtype=np.int64)
    s1s = np.empty(n_group, dtype=np.int64)
    a = 0
    while a < n_runs:
        node = runs[a, 0]
        b = a
        while b < n_runs and runs[b, 0] == node:
            b += 1
        if b < n_runs:  # the next node's first page
            prefetch(pages.keys, (h, nodes.first[h, runs[b, 0]], 0, 0))
        i = 0  # position of the first slot of page pg in the node's sorted child list
        pg = nodes.first[h, node]
        for _ in range(nodes.npages[h, node]):
            v = pages.valid[h, pg]
            _prefetch_page(h, pages.next[h, pg], pages)
            m = 0  # the queries whose run covers slots of this page
            for e in range(a, b):
                s0 = max(runs[e, 2] - i, 0)
                s1 = min(runs[e, 3] - i, v)
                if s0 < s1:
                    _touch(runs[e, 1], pg, best, touched, n_touched)
                    gs[m], s0s[m], s1s[m] = runs[e, 1], s0, s1
                    m += 1
            k = 0
            while k < m:
                if m - k >= 3:
                    _score_slots3(h, q_group, gs, s0s, s1s, k, pg, pages, best)
                    k += 3
                else:
                    _score_slots(h, q_group, gs[k], pg, s0s[k], s1s[k], pages, best)
                    k += 1
            i += v
            pg = pages.next[h, pg]
        a = b


@njit(cache=True, nogil=True)
def level0_runs(h, runs, n_runs, order, qps, params, pages, nodes, pos):
    """Fills ``lo, hi`` of the level-0 ``runs`` (rows ``(node, query, lo, hi)``, visited in ``order``, sorted by
    node) with each query's visited run (:func:`~icecache.dci._walk.chunk_walk`): each node's children are
    counted, and laid out for the chunk walk, once for all the queries that kept it."""
    a = 0
    while a < n_runs:
        node = runs[order[a], 0]
        b = a
        while b < n_runs and runs[order[b], 0] == node:
            b += 1
        c = child_count(h, node, pages, nodes)
        if c > params.chunk:
            fill_positions(h, node, pages, nodes, pos)
        for e in range(a, b):
            r = order[e]
            if c <= params.chunk:
                runs[r, 2], runs[r, 3] = 0, c
            else:
                runs[r, 2], runs[r, 3] = chunk_walk(h, c, qps[runs[r, 1]], params, False, pages, nodes, pos)
        a = b


@njit(cache=True, nogil=True, inline="always")
def keep_best(score, page, n, k, buf_s, buf_p):
    """Inserts ``(score, page)`` into the descending top-``k`` list ``buf_s[:n], buf_p[:n]`` and returns its new
    length: a score equal to a listed one goes after it, so the list is the first ``k`` of a stable descending
    sort of everything offered, in offering order for ties (``np.argsort(-s, kind="mergesort")[:k]``), at O(k)
    per offer instead of a sort of every child."""
    if n == k and not score > buf_s[k - 1]:
        return n
    j = min(n, k - 1)
    while j > 0 and buf_s[j - 1] < score:
        buf_s[j] = buf_s[j - 1]
        buf_p[j] = buf_p[j - 1]
        j -= 1
    buf_s[j] = score
    buf_p[j] = page
    return min(n + 1, k)


@njit(cache=True, nogil=True, inline="always")
def raise_page(pg, score, best, touched, n_touched, top_s, top_p, n_top):
    """:func:`rank` (page ``pg``'s best becomes at least ``score``), keeping ``top_s[:n_top]`` the highest page
    bests (``C`` = ``top_s.shape[0]`` of them, descending; ``top_p`` their pages). Returns ``(n_touched,
    n_top)``."""
    old = best[pg]
    n_touched = rank(pg, score, best, touched, n_touched)
    new = best[pg]
    if not new > old:
        return n_touched, n_top
    cap = top_s.shape[0]
    if old > -np.inf and (n_top < cap or old >= top_s[n_top - 1]):  # pg may be listed with its old best
        for a in range(n_top):
            if top_p[a] == pg:
                for b in range(a, n_top - 1):
                    top_s[b], top_p[b] = top_s[b + 1], top_p[b + 1]
                n_top -= 1
                break
    return n_touched, keep_best(new, pg, n_top, cap, top_s, top_p)


@njit(cache=True, nogil=True)
def list_touched(best, touched, n_touched, top_s, top_p):
    """The highest bests of the pages touched so far (distinct) into ``top_s``/``top_p`` (see
    :func:`raise_page`); returns their number."""
    n_top = 0
    for a in range(n_touched):
        n_top = keep_best(best[touched[a]], touched[a], n_top, top_s.shape[0], top_s, top_p)
    return n_top


@njit(cache=True, nogil=True, inline="always")
def _offer(score, floor, pg, n, k, buf_s, buf_p):
    """:func:`keep_best` of ``(score, pg)`` if ``score`` reaches ``floor``; returns the list's length."""
    if score >= floor:
        return keep_best(score, pg, n, k, buf_s, buf_p)
    return n


@njit(cache=True, nogil=True, fastmath=EXACT)
def rank_top_children(h, qv, node, lo, hi, k_pages, pages, nodes, best, touched, n_touched, buf_s, buf_p,
                      top_s, top_p, n_top):
    """Level 0 under the C rule (``dci_query_single_point_single_level`` with ``num_neighbours = K`` and
    ``add_to_list``): of the children ``lo .. hi-1`` of ``node`` that the query scores, only the ``K``
    best rank their pages, best first (ties: the earlier child in projection order; :func:`keep_best`).
    ``buf_s``, ``buf_p``: scratch of at least ``K`` entries. Returns ``(n_touched, n_top)``.

    The output floor: ``top_s[:n_top]`` holds the ``C`` highest page bests so far (:func:`raise_page`; ``C``
    = the result's width). Page bests only rise, so once ``C`` pages are listed, a child scoring below the
    ``C``-th can neither enter the result nor change a listed page's best, and it is not offered to the
    node's top-``K``; the children at or above the floor form the same prefix of that top-``K`` as before.
    The result's pages and scores are those of the full ranking. Only the touching order of pages whose
    best is below the floor is not recorded, and it breaks ties: two result pages whose best scores are
    exactly equal (the same fp32 value from two different keys) can come out in the other order."""
    cap = top_s.shape[0]
    floor = top_s[cap - 1] if n_top == cap else -np.inf
    n = 0
    i = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        v = pages.valid[h, pg]
        _prefetch_page(h, pages.next[h, pg], pages)
        keys = pages.keys[h, pg]
        s, end = max(lo - i, 0), min(hi - i, v)
        while s + 4 <= end:  # four children's dot products side by side, offered in child order
            d0, d1, d2, d3 = dot_keys4(qv, keys[s], keys[s + 1], keys[s + 2], keys[s + 3])
            n = _offer(d0, floor, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d1, floor, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d2, floor, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d3, floor, pg, n, k_pages, buf_s, buf_p)
            s += 4
        for t in range(s, end):
            n = _offer(dot_key(qv, keys[t]), floor, pg, n, k_pages, buf_s, buf_p)
        i += v
        pg = pages.next[h, pg]
    for a in range(n):
        n_touched, n_top = raise_page(buf_p[a], buf_s[a], best, touched, n_touched, top_s, top_p, n_top)
    return n_touched, n_top


@njit(cache=True, nogil=True)
def top_pages(best, touched, n_touched, out_row, score_row):
    """The touched pages with the best tokens, best first, ties in touching order (``dci_query``: insertion into a
    sorted top-C, as the C code; :func:`keep_best`); ``-1`` / ``-inf`` padded."""
    n_cap = out_row.shape[0]
    n_out = 0
    for a in range(n_touched):
        n_out = keep_best(best[touched[a]], touched[a], n_out, n_cap, score_row, out_row)
    for a in range(n_out, n_cap):
        out_row[a] = -1
        score_row[a] = -np.inf
