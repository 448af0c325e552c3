"""numba kernels of M-DCI: page bulk load, top-down page search, incremental insert (official ``src/dci.c``).

Storage (per layer, all arrays head-major; ``S`` = page size, ``P`` = page capacity):

- ``page_keys [H, P, S, d]`` fp32 keys in page layout (a node's children are scored page by page,
  contiguous in memory), ``page_uk [H, P, S]`` = ``u_{1:d}.k``, ``page_proj [H, P, S]`` = ``p(k)``,
  ``page_loc [H, P, S]`` local token index, ``page_abs [H, P, S]`` absolute token id (-1 = empty).
- ``page_valid [H, P]`` used slots, ``page_next [H, P]`` next page of the same parent (-1 = last),
  ``page_node [H, P]`` the parent node owning the page.
- ``node_first [H, N]``, ``node_npages [H, N]``, ``node_nleaf [H, N]`` (level-0 pages below the node),
  ``node_m2 [H, N]`` (the ``M^2`` its children's projections use, ``src/dci.c``); node 0 = virtual root,
  node ``i + 1`` = token ``i``.
- ``tok_page [H, n]``, ``tok_slot [H, n]``: where each token sits; ``parent [H, n]`` its parent node.

Invariant: a node's pages, followed through ``page_next``, hold its children sorted by projection
(slots sorted inside a page, pages in increasing order), so "the children closest in projection to
``p(q)``" are one contiguous run.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# fastmath without "nnan"/"ninf": the search uses -inf as the "page not touched yet" sentinel
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}


# ----------------------------------------------------------------------------- bulk load (``src/dci.c`` construction)

@njit(cache=True, nogil=True, parallel=True)
def bulk_load(parent, proj, uk, keys, tok_abs, page_size, page_keys, page_uk, page_proj, page_loc,
              page_abs, page_valid, page_next, page_node, node_first, node_npages, tok_page,
              tok_slot, n_pages):
    """Cut every node's children, sorted by projection, into ``ceil(c/S)`` evenly filled pages."""
    heads, n = parent.shape
    n_nodes = n + 1
    for h in prange(heads):  # heads own disjoint slices of every array
        count = np.zeros(n_nodes + 1, dtype=np.int64)
        for i in range(n):
            count[parent[h, i] + 1] += 1
        for v in range(n_nodes):
            count[v + 1] += count[v]
        order = np.empty(n, dtype=np.int64)
        fill = count[:-1].copy()
        for i in range(n):
            v = parent[h, i]
            order[fill[v]] = i
            fill[v] += 1
        pg = 0
        for v in range(n_nodes):
            lo, hi = count[v], count[v + 1]
            c = hi - lo
            if c == 0:
                continue
            seg = order[lo:hi]
            seg = seg[np.argsort(proj[h, seg], kind="mergesort")]
            pages_left = (c + page_size - 1) // page_size
            node_first[h, v] = pg
            node_npages[h, v] = pages_left
            pos = 0
            while pages_left > 0:
                take = (c - pos) // pages_left
                for s in range(take):
                    i = seg[pos + s]
                    page_keys[h, pg, s, :] = keys[h, i, :]
                    page_uk[h, pg, s] = uk[h, i]
                    page_proj[h, pg, s] = proj[h, i]
                    page_loc[h, pg, s] = i
                    page_abs[h, pg, s] = tok_abs[i]
                    tok_page[h, i] = pg
                    tok_slot[h, i] = s
                page_valid[h, pg] = take
                page_node[h, pg] = v
                page_next[h, pg] = pg + 1 if pages_left > 1 else -1
                pos += take
                pages_left -= 1
                pg += 1
        n_pages[h] = pg


@njit(cache=True, nogil=True)
def leaf_page_counts(parent, level, by_level, node_npages, node_nleaf):
    """``node_nleaf``: number of level-0 pages in each node's subtree (``num_finest_level_nodes``)."""
    heads = parent.shape[0]
    for h in range(heads):
        for i in by_level:
            t = level[i]
            if t == 0:
                continue
            if t == 1:
                node_nleaf[h, i + 1] = node_npages[h, i + 1]
            node_nleaf[h, parent[h, i]] += node_nleaf[h, i + 1]
        if level.size and level.max() == 0:
            node_nleaf[h, 0] = node_npages[h, 0]


# ----------------------------------------------------------------------------- query (``dci_query``)

@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _score_page(h, qv, pg, s0, s1, upper, page_keys, page_loc, best, touched, n_touched, cand_s,
                cand_v, nc):
    """Exact scores ``q.k`` of slots ``s0 .. s1-1`` of page ``pg``: updates the page's best score
    and, above level 0, appends (score, node index) of each child. Returns ``(n_touched, nc)``."""
    d = qv.shape[0]
    top = best[pg]
    if top == -np.inf:
        touched[n_touched] = pg
        n_touched += 1
    for s in range(s0, s1):
        acc = np.float32(0.0)
        for j in range(d):
            acc += qv[j] * page_keys[h, pg, s, j]
        top = max(top, acc)
        if upper:
            cand_s[nc] = acc
            cand_v[nc] = page_loc[h, pg, s] + 1
            nc += 1
    best[pg] = top
    return n_touched, nc


@njit(cache=True, nogil=True)
def _chunk_walk(h, node, c, qp, prop, chunk, need_scored, need_leaves, upper, page_proj, page_loc,
                page_valid, page_next, node_first, node_npages, node_nleaf, pos_pg, pos_sl):
    """The C code's visiting order inside one node (``dci_next_closest_proj``): from the position
    of ``p(q)`` among the ``c`` children (sorted by projection), chunks of up to ``chunk`` children
    (``CLOSEST`` = 128 in the C code),
    each from the side whose next child is closer to ``p(q)`` (topped up from the other side when
    that side runs out); stop after a chunk once at least ``ceil(prop * c)`` children, at least
    ``need_scored`` children and at least ``need_leaves`` level-0 pages below them are visited.

    The visited children always form one contiguous run of the sorted list: returns its bounds
    ``[lo, hi)`` (positions in ``pos_pg``/``pos_sl``, filled here).
    """
    i = 0
    pg = node_first[h, node]
    left = -1  # last child with projection < p(q)
    for _ in range(node_npages[h, node]):
        for s in range(page_valid[h, pg]):
            pos_pg[i] = pg
            pos_sl[i] = s
            if page_proj[h, pg, s] < qp:
                left = i
            i += 1
        pg = page_next[h, pg]
    right = left + 1
    want = max(int(math.ceil(prop * c - 1e-9)), 1)
    scored = 0
    leaves = 0
    while left >= 0 or right < c:
        if left < 0:
            from_right = True
        elif right >= c:
            from_right = False
        else:
            from_right = (page_proj[h, pos_pg[right], pos_sl[right]] - qp
                          < qp - page_proj[h, pos_pg[left], pos_sl[left]])
        take = chunk
        while take > 0 and (left >= 0 or right < c):
            if (from_right and right < c) or left < 0:
                i = right
                right += 1
            else:
                i = left
                left -= 1
            if upper:
                leaves += node_nleaf[h, page_loc[h, pos_pg[i], pos_sl[i]] + 1]
            scored += 1
            take -= 1
        if scored >= want and scored >= need_scored and leaves >= need_leaves:
            break
    return left + 1, right


@njit(cache=True, nogil=True, fastmath=_FAST)
def _expand(h, node, qv, qp, prop, chunk, need_scored, need_leaves, upper, page_keys, page_proj, page_loc,
            page_valid, page_next, node_first, node_npages, node_nleaf, pos_pg, pos_sl, best,
            touched, n_touched, cand_s, cand_v, nc):
    """Single-node search of the C code (``dci_query_single_point_single_level`` with one simple
    index): score exactly the children :func:`_chunk_walk` visits. A node with ``c <= chunk``
    children is scored in full (the first chunk takes them all). Returns ``(n_touched, nc)``."""
    c = 0
    pg = node_first[h, node]
    for _ in range(node_npages[h, node]):
        c += page_valid[h, pg]
        pg = page_next[h, pg]
    if c == 0:
        return n_touched, nc
    lo, hi = 0, c
    if c > chunk:
        lo, hi = _chunk_walk(h, node, c, qp, prop, chunk, need_scored, need_leaves, upper, page_proj,
                             page_loc, page_valid, page_next, node_first, node_npages, node_nleaf,
                             pos_pg, pos_sl)
    i = 0  # position of the first slot of page pg in the node's sorted child list
    pg = node_first[h, node]
    for _ in range(node_npages[h, node]):
        v = page_valid[h, pg]
        s0 = max(lo - i, 0)
        s1 = min(hi - i, v)
        if s0 < s1:
            n_touched, nc = _score_page(h, qv, pg, s0, s1, upper, page_keys, page_loc, best,
                                        touched, n_touched, cand_s, cand_v, nc)
        i += v
        pg = page_next[h, pg]
    return n_touched, nc


@njit(cache=True, nogil=True, fastmath=_FAST)
def _search_one(qv, qp, h, k_pages, fov, prop, chunk, top_level, n_pages_h, n_upper, max_children,
                page_keys, page_proj, page_loc, page_valid, page_next, node_first, node_npages,
                node_nleaf, out_row, score_row):
    """Top-down search of one query head (see :func:`search`); writes the ``C = len(out_row)`` best
    pages into ``out_row`` and their best token's ``q.k`` into ``score_row`` (the descent itself is
    steered by ``k_pages``, so ``C`` only widens what is reported)."""
    best = np.full(n_pages_h, -np.inf, dtype=np.float32)
    touched = np.empty(n_pages_h, dtype=np.int64)
    pos_pg = np.empty(max_children, dtype=np.int64)
    pos_sl = np.empty(max_children, dtype=np.int64)
    cand_s = np.empty(n_upper + 1, dtype=np.float32)
    cand_v = np.empty(n_upper + 1, dtype=np.int64)
    kept = np.empty(n_upper + 1, dtype=np.int64)
    kept[0] = 0
    n_kept = 1
    n_touched = 0
    child_level = top_level
    while True:
        upper = child_level > 0
        need_scored = fov if upper else k_pages
        need_leaves = k_pages if upper else 0
        nc = 0
        for a in range(n_kept):
            n_touched, nc = _expand(h, kept[a], qv, qp, prop, chunk, need_scored, need_leaves, upper,
                                    page_keys, page_proj, page_loc, page_valid, page_next,
                                    node_first, node_npages, node_nleaf, pos_pg, pos_sl, best,
                                    touched, n_touched, cand_s, cand_v, nc)
        if not upper or nc == 0:
            break
        order = np.argsort(-cand_s[:nc])
        n_kept = min(fov, nc)
        leaves = 0
        for a in range(n_kept):
            leaves += node_nleaf[h, cand_v[order[a]]]
        while leaves < k_pages and n_kept < nc:
            leaves += node_nleaf[h, cand_v[order[n_kept]]]
            n_kept += 1
        for a in range(n_kept):
            kept[a] = cand_v[order[a]]
        child_level -= 1
    # the C touched pages with the best tokens, best first (insertion into a sorted top-C)
    n_cap = out_row.shape[0]
    n_out = 0
    for a in range(n_touched):
        pg = touched[a]
        s = best[pg]
        if n_out == n_cap and s <= score_row[n_cap - 1]:
            continue
        j = min(n_out, n_cap - 1)
        while j > 0 and score_row[j - 1] < s:
            score_row[j] = score_row[j - 1]
            out_row[j] = out_row[j - 1]
            j -= 1
        score_row[j] = s
        out_row[j] = pg
        if n_out < n_cap:
            n_out += 1
    for a in range(n_out, n_cap):
        out_row[a] = -1
        score_row[a] = -np.inf


@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def search(queries, u, group, k_pages, fov, prop, chunk, top_level, n_pages_h, n_upper, max_children,
           page_keys, page_proj, page_loc, page_valid, page_next, node_first, node_npages,
           node_nleaf, out, out_scores):
    """Top-down page search of every query head (``dci_query``), in parallel over query heads; writes
    ``out [H_q, C]`` (page ids, -1 padded) and ``out_scores [H_q, C]`` (best token's ``q.k``, -inf
    padded), ``C >= k_pages``.

    From the virtual root, expand the kept nodes of a level (:func:`_expand`), sort the children
    found by score and keep the smallest prefix whose level-0 pages reach ``k_pages``, but at least
    ``min(fov, found)``. Every scored token (upper levels included) is a candidate; the result is
    the distinct pages in order of their best token's score. ``n_upper`` bounds the number of
    upper-level (level >= 1) tokens, ``max_children`` the children of one node.
    """
    n_q, d = queries.shape
    for qh in prange(n_q):
        h = qh // group
        qv = np.empty(d, dtype=np.float32)
        norm = 0.0
        qp = 0.0
        for j in range(d):
            qv[j] = queries[qh, j]
            norm += qv[j] * qv[j]
            qp += u[j] * qv[j]
        qp /= max(math.sqrt(norm), 1e-30)
        _search_one(qv, np.float32(qp), h, k_pages, fov, prop, chunk, top_level, n_pages_h[h], n_upper,
                    max_children, page_keys, page_proj, page_loc, page_valid, page_next,
                    node_first, node_npages, node_nleaf, out[qh], out_scores[qh])


# ----------------------------------------------------------------------------- insert (``dci_add``)

@njit(cache=True, nogil=True, fastmath=_FAST)
def norms_and_proj(keys, u):
    """Squared norms ``|k|^2`` and ``u_{1:d}.k`` of ``keys [H, n, d]`` (fp32), in one pass."""
    heads, n, d = keys.shape
    sq = np.empty((heads, n), dtype=np.float32)
    uk = np.empty((heads, n), dtype=np.float32)
    for h in range(heads):
        for i in range(n):
            acc = np.float32(0.0)
            proj = np.float32(0.0)
            for j in range(d):
                acc += keys[h, i, j] * keys[h, i, j]
                proj += u[j] * keys[h, i, j]
            sq[h, i] = acc
            uk[h, i] = proj
    return sq, uk


@njit(cache=True, nogil=True, fastmath=_FAST)
def insert_parents(new_keys, u, m2, sim, l1_sq, l1_loc):
    """Squared norms, ``u_{1:d}.k`` and parent node of new keys; updates ``m2`` (running max, ``src/dci.c``).

    ``sim [H, m, n1]`` holds the plain inner products with the level-1 keys; the parent is the
    nearest level-1 node under ``D`` (exact, ``dci_add``), i.e. the largest
    ``a.b + sqrt(M^2-|a|^2) sqrt(M^2-|b|^2)`` with the updated ``M``; node 0 (root) without a level 1.
    """
    sq, uk = norms_and_proj(new_keys, u)
    heads, m = sq.shape
    n1 = l1_loc.shape[0]
    parent = np.zeros((heads, m), dtype=np.int64)
    for h in range(heads):
        for a in range(m):
            m2[h] = max(m2[h], sq[h, a])
        height = np.empty(n1, dtype=np.float32)
        for b in range(n1):
            height[b] = math.sqrt(max(m2[h] - l1_sq[h, b], 0.0))
        for a in range(m):
            ha = math.sqrt(max(m2[h] - sq[h, a], 0.0))
            best = -np.inf
            for b in range(n1):
                s = sim[h, a, b] + ha * height[b]
                if s > best:
                    best = s
                    parent[h, a] = l1_loc[b] + 1
    return sq, uk, parent


@njit(cache=True, nogil=True)
def _node_pages(h, node, page_next, node_first, node_npages):
    pages = np.empty(node_npages[h, node], dtype=np.int64)
    pg = node_first[h, node]
    for a in range(pages.size):
        pages[a] = pg
        pg = page_next[h, pg]
    return pages


@njit(cache=True, nogil=True)
def _reproject(h, node, m2, u_last, sq, page_keys, page_uk, page_proj, page_loc, page_abs,
               page_valid, page_next, node_first, node_npages, node_m2, tok_page, tok_slot, changed):
    """Lazy ``M`` correction of one node (``src/dci.c``): re-project its children with the head's new ``M^2``,
    re-sort them and re-pack them evenly into the node's pages; pages whose tokens moved are flagged."""
    pages = _node_pages(h, node, page_next, node_first, node_npages)
    c = 0
    for pg in pages:
        c += page_valid[h, pg]
    d = page_keys.shape[3]
    keys = np.empty((c, d), dtype=np.float32)
    uk = np.empty(c, dtype=np.float32)
    proj = np.empty(c, dtype=np.float32)
    loc = np.empty(c, dtype=np.int64)
    absid = np.empty(c, dtype=np.int64)
    i = 0
    for pg in pages:
        for s in range(page_valid[h, pg]):
            keys[i] = page_keys[h, pg, s]
            uk[i] = page_uk[h, pg, s]
            loc[i] = page_loc[h, pg, s]
            absid[i] = page_abs[h, pg, s]
            proj[i] = uk[i] + u_last * math.sqrt(max(m2 - sq[h, loc[i]], 0.0))
            i += 1
    order = np.argsort(proj, kind="mergesort")
    pos = 0
    left = pages.size
    for pg in pages:
        take = (c - pos) // left
        if take != page_valid[h, pg]:
            changed[h, pg] = True
        for s in range(take):
            i = order[pos + s]
            if page_loc[h, pg, s] != loc[i]:
                changed[h, pg] = True
            page_keys[h, pg, s] = keys[i]
            page_uk[h, pg, s] = uk[i]
            page_proj[h, pg, s] = proj[i]
            page_loc[h, pg, s] = loc[i]
            page_abs[h, pg, s] = absid[i]
            tok_page[h, loc[i]] = pg
            tok_slot[h, loc[i]] = s
        for s in range(take, page_valid[h, pg]):
            page_loc[h, pg, s] = -1
            page_abs[h, pg, s] = -1
        page_valid[h, pg] = take
        pos += take
        left -= 1
    node_m2[h, node] = m2


@njit(cache=True, nogil=True)
def _add_leaf_page(h, node, parent, node_nleaf):
    """A new level-0 page below ``node``: bump ``num_finest_level_nodes`` up to the root."""
    v = node
    while v != 0:
        node_nleaf[h, v] += 1
        v = parent[h, v - 1]
    node_nleaf[h, 0] += 1


@njit(cache=True, nogil=True)
def _split(h, pg, page_size, page_keys, page_uk, page_proj, page_loc, page_abs, page_valid,
           page_next, page_node, tok_page, tok_slot, n_pages, changed):
    """Split a full page in half; the upper half moves to a newly allocated page (returned)."""
    new = n_pages[h]
    n_pages[h] += 1
    half = page_size // 2
    for s in range(half, page_size):
        t = s - half
        page_keys[h, new, t] = page_keys[h, pg, s]
        page_uk[h, new, t] = page_uk[h, pg, s]
        page_proj[h, new, t] = page_proj[h, pg, s]
        page_loc[h, new, t] = page_loc[h, pg, s]
        page_abs[h, new, t] = page_abs[h, pg, s]
        tok_page[h, page_loc[h, pg, s]] = new
        tok_slot[h, page_loc[h, pg, s]] = t
        page_loc[h, pg, s] = -1
        page_abs[h, pg, s] = -1
    page_valid[h, new] = page_size - half
    page_valid[h, pg] = half
    page_next[h, new] = page_next[h, pg]
    page_next[h, pg] = new
    page_node[h, new] = page_node[h, pg]
    changed[h, pg] = True
    changed[h, new] = True
    return new


@njit(cache=True, nogil=True)
def insert(new_keys, new_uk, new_sq, new_parent, new_loc, new_abs, m2, u_last, page_size, sq, parent, page_keys, page_uk, page_proj, page_loc, page_abs, page_valid,
           page_next, page_node, node_first, node_npages, node_nleaf, node_m2, tok_page, tok_slot,
           n_pages, changed):
    """Insert ``m`` new level-0 tokens per head into their parents' pages (``dci_add``).

    Parents are level-1 nodes (or the root of a one-level tree), so a new page is a level-0 page.
    A full page splits in half; every page whose content changed is flagged in ``changed``.
    Returns the largest page count of a node that received a token.
    """
    heads, m, d = new_keys.shape
    most_pages = 0
    for h in range(heads):
        for a in range(m):
            node = new_parent[h, a]
            i = new_loc[a]
            sq[h, i] = new_sq[h, a]
            parent[h, i] = node
            if node_npages[h, node] > 0 and node_m2[h, node] < m2[h]:
                _reproject(h, node, m2[h], u_last, sq, page_keys, page_uk, page_proj, page_loc,
                           page_abs, page_valid, page_next, node_first, node_npages, node_m2,
                           tok_page, tok_slot, changed)
            node_m2[h, node] = m2[h]
            p = new_uk[h, a] + u_last * math.sqrt(max(m2[h] - new_sq[h, a], 0.0))
            if node_npages[h, node] == 0:
                pg = n_pages[h]
                n_pages[h] += 1
                page_next[h, pg] = -1
                page_node[h, pg] = node
                page_valid[h, pg] = 0
                node_first[h, node] = pg
                node_npages[h, node] = 1
                _add_leaf_page(h, node, parent, node_nleaf)
            else:
                pg = node_first[h, node]
                nxt = page_next[h, pg]
                while nxt >= 0 and page_proj[h, nxt, 0] <= p:
                    pg = nxt
                    nxt = page_next[h, pg]
                if page_valid[h, pg] == page_size:
                    new = _split(h, pg, page_size, page_keys, page_uk, page_proj, page_loc,
                                 page_abs, page_valid, page_next, page_node, tok_page, tok_slot,
                                 n_pages, changed)
                    node_npages[h, node] += 1
                    _add_leaf_page(h, node, parent, node_nleaf)
                    if p >= page_proj[h, new, 0]:
                        pg = new
            s = page_valid[h, pg]
            while s > 0 and page_proj[h, pg, s - 1] > p:
                page_keys[h, pg, s] = page_keys[h, pg, s - 1]
                page_uk[h, pg, s] = page_uk[h, pg, s - 1]
                page_proj[h, pg, s] = page_proj[h, pg, s - 1]
                page_loc[h, pg, s] = page_loc[h, pg, s - 1]
                page_abs[h, pg, s] = page_abs[h, pg, s - 1]
                tok_slot[h, page_loc[h, pg, s]] = s
                s -= 1
            page_keys[h, pg, s] = new_keys[h, a]
            page_uk[h, pg, s] = new_uk[h, a]
            page_proj[h, pg, s] = p
            page_loc[h, pg, s] = i
            page_abs[h, pg, s] = new_abs[a]
            tok_page[h, i] = pg
            tok_slot[h, i] = s
            page_valid[h, pg] += 1
            changed[h, pg] = True
            most_pages = max(most_pages, node_npages[h, node])
    return most_pages
