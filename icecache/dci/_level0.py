"""Level 0 of the M-DCI query and the ranking of pages by their best candidate (official ``src/dci.c``:
``dci_query_single_point_single_level`` on the level-1 nodes kept by the descent, and ``dci_query``'s list of
the ``K`` best). :func:`level0` is level 0's one entry point, in front of the two candidate rules: every
scored child ranks its page (``"scored"``, :func:`score_level0`, a KV head's query heads together) or only the
``K`` best children of each expanded node do (``"official"``, the C rule, :func:`rank_top_children`, query by
query).

The kernels receive the search's working arrays as named tuples (a namedtuple of arrays holds references:
a kernel writes through them in place):

- :data:`Queries`: the query heads of KV head ``h`` searched together, ``v [G, d]`` their fp32 rows, ``p [G]``
  their projections ``p(q)``; :data:`Query` is one of them (``v [d]``, ``p`` a float).
- :data:`Ranking`: the group's page rankings, ``best [G, P]`` (a page's best candidate ``q.k``, -inf = not
  touched), ``touched [G, P]`` (the touched pages in touching order) and ``n_touched [G]`` (their number);
  :func:`ranking_of` is query ``g``'s (its rows; ``n_touched`` a one-entry view).
- :data:`Floor`, the C rule's output floor: ``score [G, C]``, ``page [G, C]`` each query's ``C`` highest page
  bests so far, descending (``C`` = the result's width), ``n [G]`` how many are listed; :func:`floor_of` is
  query ``g``'s.
- ``runs [R, 4]``: rows ``(node, query, lo, hi)``, a level-1 node a query kept and the run ``[lo, hi)`` of its
  sorted children that the query scores (:func:`level0_runs`).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from ._walk import child_count, chunk_walk, fill_positions
from .intrinsics import EXACT, dot_key, dot_key3, dot_keys4, prefetch, prefetch_row

Queries = namedtuple("Queries", "h v p")
Query = namedtuple("Query", "h v p")
Ranking = namedtuple("Ranking", "best touched n_touched")
Floor = namedtuple("Floor", "score page n")


@njit(cache=True, nogil=True, inline="always")
def ranking_of(rk, g):
    """Query ``g``'s :data:`Ranking` (views of the group's)."""
    return Ranking(rk.best[g], rk.touched[g], rk.n_touched[g:g + 1])


@njit(cache=True, nogil=True, inline="always")
def floor_of(floor, g):
    """Query ``g``'s :data:`Floor` (views of the group's)."""
    return Floor(floor.score[g], floor.page[g], floor.n[g:g + 1])


@njit(cache=True, nogil=True, inline="always")
def rank(rk, pg, score):
    """Page ``pg``'s best score in one query's ranking ``rk`` becomes at least ``score`` (recorded as touched the
    first time)."""
    if rk.best[pg] == -np.inf:
        rk.touched[rk.n_touched[0]] = pg
        rk.n_touched[0] += 1
    rk.best[pg] = max(rk.best[pg], score)


@njit(cache=True, nogil=True, inline="always")
def _touch(g, pg, best, touched, n_touched):
    """Records page ``pg`` as touched by query ``g`` (the fields of the group's :data:`Ranking`) the first time
    it is scored (``best`` still -inf)."""
    if best[g, pg] == -np.inf:
        touched[g, n_touched[g]] = pg
        n_touched[g] += 1


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _score_slots(qs, g, pg, s0, s1, pages, best):
    """``best[g, pg] = max(best[g, pg], max_s q_g.k_s)`` over slots ``s0 .. s1-1`` of page ``pg`` (``qs`` the
    group's :data:`Queries`)."""
    h, qv = qs.h, qs.v
    top = best[g, pg]
    for s in range(s0, s1):
        top = max(top, dot_key(qv[g], pages.keys[h, pg, s]))
    best[g, pg] = top


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _score_slots3(qs, sel, k, pg, pages, best):
    """:func:`_score_slots` for the three queries ``sel[0][k:k+3]``, each over its own slots ``sel[1][.] ..
    sel[2][.]-1``: every key of the union of their slots is loaded once for the three dot products
    (:func:`~icecache.dci.intrinsics.dot_key3`, the arithmetic of one query's, so the same scores), and each
    maximum takes only its query's slots."""
    h, qv = qs.h, qs.v
    gs, s0s, s1s = sel
    g0, g1, g2 = gs[k], gs[k + 1], gs[k + 2]
    a0, a1, a2 = s0s[k], s0s[k + 1], s0s[k + 2]
    b0, b1, b2 = s1s[k], s1s[k + 1], s1s[k + 2]
    t0, t1, t2 = best[g0, pg], best[g1, pg], best[g2, pg]
    for s in range(min(a0, a1, a2), max(b0, b1, b2)):
        d0, d1, d2 = dot_key3(qv[g0], qv[g1], qv[g2], pages.keys[h, pg, s])
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
def score_level0(qs, runs, pages, nodes, rk):
    """Level 0 under the rule ``"scored"``, for a KV head's query heads ``qs`` together: ``runs [R, 4]`` sorted
    by node; each node's pages are read once while every query that kept the node scores its run of them,
    three queries at a time (:func:`_score_slots3`; the page stays in L1 between them, so the group reads the
    keys once instead of once per query head). Updates the group's :data:`Ranking` ``rk`` exactly as one
    search per query head would."""
    h, n_runs = qs.h, runs.shape[0]
    n_group = qs.v.shape[0]
    best, touched, n_touched = rk
    sel = (np.empty(n_group, dtype=np.int64), np.empty(n_group, dtype=np.int64), np.empty(n_group, dtype=np.int64))
    gs, s0s, s1s = sel
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
                    _score_slots3(qs, sel, k, pg, pages, best)
                    k += 3
                else:
                    _score_slots(qs, gs[k], pg, s0s[k], s1s[k], pages, best)
                    k += 1
            i += v
            pg = pages.next[h, pg]
        a = b


@njit(cache=True, nogil=True)
def level0_runs(qs, runs, order, params, pages, nodes, pos):
    """Fills ``lo, hi`` of the level-0 ``runs`` (visited in ``order``, sorted by node) with each query's visited
    run (:func:`~icecache.dci._walk.chunk_walk`): each node's children are counted, and laid out for the chunk
    walk, once for all the queries that kept it."""
    h, n_runs = qs.h, runs.shape[0]
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
                runs[r, 2], runs[r, 3] = chunk_walk(h, c, qs.p[runs[r, 1]], params, False, pages, nodes, pos)
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
def raise_page(rk, floor, pg, score):
    """:func:`rank` (page ``pg``'s best in one query's ranking ``rk`` becomes at least ``score``), keeping the
    query's :data:`Floor` ``floor`` the highest page bests (``C`` = ``floor.score.shape[0]`` of them)."""
    old = rk.best[pg]
    rank(rk, pg, score)
    new = rk.best[pg]
    if not new > old:
        return
    cap = floor.score.shape[0]
    n_top = floor.n[0]
    if old > -np.inf and (n_top < cap or old >= floor.score[n_top - 1]):  # pg may be listed with its old best
        for a in range(n_top):
            if floor.page[a] == pg:
                for b in range(a, n_top - 1):
                    floor.score[b], floor.page[b] = floor.score[b + 1], floor.page[b + 1]
                n_top -= 1
                break
    floor.n[0] = keep_best(new, pg, n_top, cap, floor.score, floor.page)


@njit(cache=True, nogil=True)
def list_touched(rk, floor):
    """One query's :data:`Floor` ``floor`` from its ranking ``rk``: the highest bests of the pages touched so far
    (distinct; see :func:`raise_page`)."""
    best, touched, n_touched = rk
    top_s, top_p = floor.score, floor.page
    n_top = 0
    for a in range(n_touched[0]):
        n_top = keep_best(best[touched[a]], touched[a], n_top, top_s.shape[0], top_s, top_p)
    floor.n[0] = n_top


@njit(cache=True, nogil=True, inline="always")
def _offer(score, bar, pg, n, k, buf_s, buf_p):
    """:func:`keep_best` of ``(score, pg)`` if ``score`` reaches ``bar``; returns the list's length."""
    if score >= bar:
        return keep_best(score, pg, n, k, buf_s, buf_p)
    return n


@njit(cache=True, nogil=True, fastmath=EXACT)
def rank_top_children(q, run, params, pages, nodes, rk, floor, buf):
    """Level 0 under the C rule (``dci_query_single_point_single_level`` with ``num_neighbours = K`` and
    ``add_to_list``) for one :data:`Query` ``q``: of the children ``lo .. hi-1`` of ``node`` that it scores
    (``run`` = ``(node, query, lo, hi)``), only the ``K`` best rank their pages in its ranking ``rk``, best first
    (ties: the earlier child in projection order; :func:`keep_best`). ``buf``: a pair of scratch arrays (scores,
    pages) of at least ``K`` entries.

    The output floor: ``floor`` (the query's :data:`Floor`) holds the ``C`` highest page bests so far
    (:func:`raise_page`; ``C`` = the result's width). Page bests only rise, so once ``C`` pages are listed, a
    child scoring below the ``C``-th can neither enter the result nor change a listed page's best, and it is
    not offered to the node's top-``K``; the children at or above the floor form the same prefix of that
    top-``K`` as before. The result's pages and scores are those of the full ranking. Only the touching order
    of pages whose best is below the floor is not recorded, and it breaks ties: two result pages whose best
    scores are exactly equal (the same fp32 value from two different keys) can come out in the other order."""
    h, qv, k_pages = q.h, q.v, params.k_pages
    node, lo, hi = run[0], run[2], run[3]
    buf_s, buf_p = buf
    cap = floor.score.shape[0]
    bar = floor.score[cap - 1] if floor.n[0] == cap else -np.inf
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
            n = _offer(d0, bar, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d1, bar, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d2, bar, pg, n, k_pages, buf_s, buf_p)
            n = _offer(d3, bar, pg, n, k_pages, buf_s, buf_p)
            s += 4
        for t in range(s, end):
            n = _offer(dot_key(qv, keys[t]), bar, pg, n, k_pages, buf_s, buf_p)
        i += v
        pg = pages.next[h, pg]
    for a in range(n):
        raise_page(rk, floor, buf_p[a], buf_s[a])


@njit(cache=True, nogil=True)
def _level0_official(qs, runs, params, pages, nodes, rk, width):
    """Level 0 under the C rule: every run, in the order the queries kept their nodes, ranks its ``K`` best
    children (:func:`rank_top_children`), each query's output floor of ``width`` pages seeded with the pages its
    upper levels ranked (:func:`list_touched`)."""
    n_group = qs.v.shape[0]
    buf = (np.empty(max(params.k_pages, 1), dtype=np.float32), np.empty(max(params.k_pages, 1), dtype=np.int64))
    floor = Floor(np.empty((n_group, width), dtype=np.float32), np.empty((n_group, width), dtype=np.int64),
                  np.empty(n_group, dtype=np.int64))
    for g in range(n_group):
        list_touched(ranking_of(rk, g), floor_of(floor, g))
    for r in range(runs.shape[0]):
        g = runs[r, 1]
        rank_top_children(Query(qs.h, qs.v[g], qs.p[g]), runs[r], params, pages, nodes, ranking_of(rk, g),
                          floor_of(floor, g), buf)


@njit(cache=True, nogil=True)
def level0(qs, runs, params, pages, nodes, pos, rk, width):
    """Level 0 of the search of the query heads ``qs`` (:data:`Queries`), the one entry point of both candidate
    rules: fills each run's ``lo, hi`` (:func:`level0_runs`; ``runs`` as the descents kept the nodes, ``pos``
    the chunk walk's scratch), then ranks the scored children's pages in the group's :data:`Ranking` ``rk``:
    all of them for the rule ``"scored"`` (:func:`score_level0`, the runs sorted by node so that a node's keys
    are read once for the group), or each run's ``K`` best for the C rule (``params.official``;
    :func:`rank_top_children`, which skips the children below each query's output floor, the ``width``-th best
    page so far, ``width`` = the result's columns)."""
    order = np.argsort(runs[:, 0], kind="mergesort")
    level0_runs(qs, runs, order, params, pages, nodes, pos)
    if params.official:
        _level0_official(qs, runs, params, pages, nodes, rk, width)
    else:
        score_level0(qs, runs[order], pages, nodes, rk)


@njit(cache=True, nogil=True)
def top_pages(rk, out_row, score_row):
    """The pages of one query's ranking ``rk`` with the best tokens, best first, ties in touching order
    (``dci_query``: insertion into a sorted top-C, as the C code; :func:`keep_best`); ``-1`` / ``-inf``
    padded."""
    best, touched, n_touched = rk
    n_cap = out_row.shape[0]
    n_out = 0
    for a in range(n_touched[0]):
        n_out = keep_best(best[touched[a]], touched[a], n_out, n_cap, score_row, out_row)
    for a in range(n_out, n_cap):
        out_row[a] = -1
        score_row[a] = -np.inf
