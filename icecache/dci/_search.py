"""The M-DCI query (official ``src/dci.c``: ``dci_query``): the top-down page search of every query head, its
upper levels here, level 0 in ``_level0.py``, a node's visiting order in ``_walk.py``; and the running search
statistics (:func:`tally`). Storage layout: :mod:`icecache.dci.intrinsics`; the query heads and page rankings
the kernels pass along (``Queries``, ``Query``, ``Ranking``): :mod:`icecache.dci._level0`."""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit, prange

from ._level0 import Queries, Query, Ranking, level0, rank, ranking_of, top_pages
from ._walk import visited_run
from .intrinsics import EXACT, dot_key, prefetch

# the scalars that steer one search, passed whole to every level of the kernels (:func:`search`):
# k_pages (K, int), fov (nodes kept per level, int), prop (prop_to_retrieve, float), chunk (visit_chunk, int),
# top_level, n_upper (tokens on levels >= 1), max_children (children of one node, a bound), official (C rule)
SearchParams = namedtuple("SearchParams", "k_pages fov prop chunk top_level n_upper max_children official")
# what the search of a group of query heads writes (:func:`_search_group`): ids [G, C] page ids, scores [G, C] their
# best q.k, counts [G, 2]
Result = namedtuple("Result", "ids scores counts")
# the children one upper level scored, in scoring order: score (q.k), node (the child's node index), page (its page)
Candidates = namedtuple("Candidates", "score node page")


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _score_page(q, pg, s0, s1, pages, cand, nc):
    """Exact scores ``q.k`` of slots ``s0 .. s1-1`` of upper-level page ``pg`` for the :data:`Query` ``q``,
    appended to the :data:`Candidates` ``cand`` from position ``nc``. Returns the new count."""
    h, qv = q.h, q.v
    cand_s, cand_v, cand_p = cand
    for s in range(s0, s1):
        cand_s[nc] = dot_key(qv, pages.keys[h, pg, s])
        cand_v[nc] = pages.loc[h, pg, s] + 1
        cand_p[nc] = pg
        nc += 1
    return nc


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def _expand(q, node, params, pages, nodes, pos, cand, nc):
    """Single-node search of the C code above level 0 (``dci_query_single_point_single_level`` with one
    simple index): score exactly the children :func:`~icecache.dci._walk.chunk_walk` visits (a node with
    ``c <= chunk`` children in full), appending them to ``cand``. Returns the new count of candidates."""
    h = q.h
    lo, hi = visited_run(h, node, q.p, params, pages, nodes, pos)
    if lo >= hi:
        return nc
    i = 0  # position of the first slot of page pg in the node's sorted child list
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        v = pages.valid[h, pg]
        s0 = max(lo - i, 0)
        s1 = min(hi - i, v)
        if s0 < s1:
            nc = _score_page(q, pg, s0, s1, pages, cand, nc)
        i += v
        pg = pages.next[h, pg]
    return nc


@njit(cache=True, nogil=True, inline="always")
def _rank_children(rk, cand, nc):
    """The rule ``"scored"`` on an upper level: every scored child ranks its page in one query's ranking ``rk``
    with the page's best score among them (a page's children are consecutive in ``cand``)."""
    cand_s, cand_p = cand.score, cand.page
    a = 0
    while a < nc:
        pg = cand_p[a]
        top = -np.inf
        while a < nc and cand_p[a] == pg:
            top = max(top, cand_s[a])
            a += 1
        rank(rk, pg, top)


@njit(cache=True, nogil=True)
def _order_desc(scores, n, keys):
    """Positions of ``scores[:n]`` from the highest score to the lowest, ties in position order: each
    score's order-preserving integer image is packed with its position into one int64 key and the keys are
    sorted."""
    # one int64 sort instead of numba's float argsort (the slower of the two on the search's candidate lists)
    for i in range(n):
        bits = np.int64(np.float32(scores[i]).view(np.int32))
        mono = bits ^ 0x7FFFFFFF if bits < 0 else bits  # a larger float has a larger image
        keys[i] = ((-mono - 1) << 32) | i  # descending score, then ascending position
    keys[:n].sort()
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        order[i] = keys[i] & 0xFFFFFFFF
    return order


@njit(cache=True, nogil=True, fastmath=EXACT)
def _descend(q, params, pages, nodes, pos, rk, kept, counts):
    """The upper levels of one :data:`Query` ``q``'s top-down search (``dci_query_single_point``, see
    :func:`search`): from the virtual root, expand the kept nodes of a level, sort the children found by score
    and keep the smallest prefix whose level-0 pages reach ``k_pages``, but at least ``min(fov, found)``. Every
    scored child ranks its page in the query's ranking ``rk``, or (``official``, the C rule) only the kept
    prefix. Stops at the nodes whose children are level-0 pages, written to ``kept``. Returns their number,
    0 when a level has no children (nothing left to expand). Adds the keys scored on these levels to
    ``counts[0]`` and the nodes expanded (virtual root included) to ``counts[1]``."""
    h, n_upper, k_pages, fov = q.h, params.n_upper, params.k_pages, params.fov
    cand = Candidates(np.empty(n_upper + 1, dtype=np.float32), np.empty(n_upper + 1, dtype=np.int64),
                      np.empty(n_upper + 1, dtype=np.int64))
    cand_s, cand_v, cand_p = cand
    sort_keys = np.empty(n_upper + 1, dtype=np.int64)
    kept[0] = 0
    n_kept = 1
    child_level = params.top_level
    while child_level > 0:
        for a in range(n_kept):  # the first page of every node about to be expanded, requested at once
            pg = nodes.first[h, kept[a]]
            prefetch(pages.valid, (h, pg))
            prefetch(pages.next, (h, pg))
            prefetch(pages.keys, (h, pg, 0, 0))
            prefetch(pages.keys, (h, pg, 1, 0))
        nc = 0
        counts[1] += n_kept
        for a in range(n_kept):
            nc = _expand(q, kept[a], params, pages, nodes, pos, cand, nc)
        counts[0] += nc  # one candidate per scored child
        if nc == 0:
            return 0
        for a in range(nc):  # what the next level reads of each candidate, requested before the sort
            prefetch(nodes.nleaf, (h, cand_v[a]))
            prefetch(nodes.first, (h, cand_v[a]))
            prefetch(nodes.npages, (h, cand_v[a]))
        if not params.official:
            _rank_children(rk, cand, nc)
        order = _order_desc(cand_s, nc, sort_keys)
        n_kept = min(fov, nc)
        leaves = 0
        for a in range(n_kept):
            leaves += nodes.nleaf[h, cand_v[order[a]]]
        while leaves < k_pages and n_kept < nc:
            leaves += nodes.nleaf[h, cand_v[order[n_kept]]]
            n_kept += 1
        for a in range(n_kept):
            kept[a] = cand_v[order[a]]
            if params.official:
                rank(rk, cand_p[order[a]], cand_s[order[a]])
        child_level -= 1
    return n_kept


@njit(cache=True, nogil=True, fastmath=EXACT)
def _search_group(qs, params, pages, nodes, res):
    """Searches of the ``G`` query heads ``qs`` of one KV head (:data:`Queries`; see :func:`search`): each
    descends the upper levels alone (:func:`_descend`), then level 0, where nearly all the scoring is, is ranked
    for the group by :func:`~icecache.dci._level0.level0` under the search's candidate rule. Writes the group's
    rows of the :data:`Result` ``res`` (page ids, scores, and the counts [G, 2]: keys scored, nodes expanded)."""
    h, n_group = qs.h, qs.v.shape[0]
    n_pages_h = pages.used[h]
    n_upper, max_children = params.n_upper, params.max_children
    rk = Ranking(np.full((n_group, n_pages_h), -np.inf, dtype=np.float32),
                 np.empty((n_group, n_pages_h), dtype=np.int64), np.zeros(n_group, dtype=np.int64))
    pos = (np.empty(max_children, dtype=np.int64), np.empty(max_children, dtype=np.int64))
    kept = np.empty(n_upper + 1, dtype=np.int64)
    runs = np.empty((n_group * (n_upper + 1), 4), dtype=np.int64)
    n_runs = 0
    counts = res.counts
    for g in range(n_group):
        counts[g, 0] = 0
        counts[g, 1] = 0
        n_kept = _descend(Query(h, qs.v[g], qs.p[g]), params, pages, nodes, pos, ranking_of(rk, g), kept, counts[g])
        for a in range(n_kept):
            runs[n_runs, 0] = kept[a]
            runs[n_runs, 1] = g
            n_runs += 1
    level0(qs, runs[:n_runs], params, pages, nodes, pos, rk, res.ids.shape[1])
    for r in range(n_runs):  # level 0: each run is one expanded node and the children its query scores
        counts[runs[r, 1], 0] += runs[r, 3] - runs[r, 2]
        counts[runs[r, 1], 1] += 1
    for g in range(n_group):
        top_pages(ranking_of(rk, g), res.ids[g], res.scores[g])


@njit(cache=True, nogil=True, fastmath=EXACT, parallel=True)
def search(queries, u, group, params, pages, nodes, res, n_threads):
    """Top-down page search of every query head (``dci_query``), in parallel on ``n_threads`` threads;
    ``params`` a :data:`SearchParams`, ``group`` query heads per KV head. Writes ``res`` = ``(ids, scores,
    counts)`` (a plain tuple: the cheapest bundle to pass from Python): ``ids [H_q, C]`` (page ids, -1 padded),
    ``scores [H_q, C]`` (best token's ``q.k``, -inf padded), ``C >= k_pages``, and ``counts [H_q, 2]`` (int64), how
    much of the index each query head's search touched:

    - ``counts[:, 0]``, keys scored: the keys whose ``q.k`` the search computed for that query head, i.e. the
      children of every node it expanded that the chunk walk visited (``_walk.chunk_walk``; all of them when
      ``c <= visit_chunk`` or ``prop_to_retrieve = 1``), upper levels and level 0 together. Each key has one
      parent, so it is counted at most once and ``counts[:, 0] <= n`` (the keys in the index). Under the C
      rule the level-0 keys are scored and then only the ``K`` best rank pages: still counted. Keys whose
      dot product the group's level-0 pass computes for another query head of the group only (the union of
      three runs is read once) are not counted for this one: the count is the search's, not the loop's.
    - ``counts[:, 1]``, nodes expanded: the nodes whose children the search visited, the virtual root
      included (1 for a one-level tree): the root, then the kept nodes of every upper level.

    The counters cost at most two additions per expanded node, nothing per key.

    From the virtual root, expand the kept nodes of a level (:func:`_expand`), sort the children
    found by score and keep the smallest prefix whose level-0 pages reach ``k_pages``, but at least
    ``min(fov, found)``. The result is the distinct pages in order of their best candidate token's score.
    The candidates: every scored token, upper levels included (``official=False``, this project's
    default), or the C rule (``official``, ``dci_query_single_point`` with ``add_to_list``): the kept
    prefix of each upper level and the ``K`` best scored children of each expanded level-1 node (a subset
    of the default's candidates). ``n_upper`` bounds the number of upper-level (level >= 1) tokens,
    ``max_children`` the children of one node. The ``group`` query heads of a KV head search together
    (:func:`_search_group`): same pages and scores as one search per query head, with the level-0 keys read
    once per group. Each thread takes an equal share of the query heads, cut at query heads rather than KV
    heads (SmolLM2's 3 KV heads on 2 threads: 5 and 4 query heads instead of 2 KV heads and 1; the split KV
    head's level-0 keys are read by both threads).

    The search is bound by memory latency, not arithmetic: every step reads each layer's index cold, and a
    top-down walk chases pointers (node -> first page -> next page). So the records a level will read are
    requested together before it reads them (:func:`~icecache.dci.intrinsics.prefetch`: the kept nodes'
    first pages, the candidates' node records before their sort, a node's next page while one is scored).
    """
    ids, scores, counts = res
    n_q, d = queries.shape
    qv = np.empty((n_q, d), dtype=np.float32)
    qps = np.empty(n_q, dtype=np.float32)
    for qh in range(n_q):
        norm = 0.0
        qp = 0.0
        for j in range(d):
            qv[qh, j] = queries[qh, j]
            norm += qv[qh, j] * qv[qh, j]
            qp += u[j] * qv[qh, j]
        qps[qh] = qp / max(math.sqrt(norm), 1e-30)
    n_threads = max(1, min(n_threads, n_q))
    for t in prange(n_threads):  # one share of the query heads per thread, cut at the query head, not the KV head
        q0, end = t * n_q // n_threads, (t + 1) * n_q // n_threads
        while q0 < end:  # the share's pieces of consecutive KV heads, in turn
            h = q0 // group
            q1 = min(end, (h + 1) * group)
            _search_group(Queries(h, qv[q0:q1], qps[q0:q1]), params, pages, nodes,
                          Result(ids[q0:q1], scores[q0:q1], counts[q0:q1]))
            q0 = q1


# fields of the running totals :func:`tally` keeps (``MDCIIndex.search_stats`` reports them)
TALLY = ("searches", "indexed_keys", "scored_keys", "scored_fraction", "scored_fraction_min", "scored_fraction_max",
         "nodes_expanded")


def new_tally():
    """Empty running totals of :func:`tally` (float64, fields :data:`TALLY`; the minimum starts at +inf)."""
    totals = np.zeros(len(TALLY), dtype=np.float64)
    totals[4] = np.inf
    return totals


@njit(cache=True, nogil=True)
def tally(counts, n_keys, totals):
    """Adds one search's ``counts [H_q, 2]`` (:func:`search`) over an index of ``n_keys`` keys to ``totals``:
    searches, sum of ``n_keys``, sum of the mean keys scored per query head, sum of the mean fraction scored
    per query head (keys scored / ``n_keys``), the least and the largest fraction of one query head, sum of
    the mean nodes expanded per query head. A search of no query head adds nothing."""
    n_q = counts.shape[0]
    if n_q == 0:
        return
    scored, nodes, lo, hi = 0, 0, counts[0, 0], counts[0, 0]
    for qh in range(n_q):
        scored += counts[qh, 0]
        nodes += counts[qh, 1]
        lo = min(lo, counts[qh, 0])
        hi = max(hi, counts[qh, 0])
    totals[0] += 1.0
    totals[1] += n_keys
    totals[2] += scored / n_q
    totals[3] += scored / (n_q * n_keys)
    totals[4] = min(totals[4], lo / n_keys)
    totals[5] = max(totals[5], hi / n_keys)
    totals[6] += nodes / n_q
