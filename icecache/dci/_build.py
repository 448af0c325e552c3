"""M-DCI construction kernels (Li & Malik's multi-level DCI, official ``src/dci.c`` construction): key norms
and projections, the page bulk load of every node's children, the level-0 page counts of every subtree.
Storage layout: :mod:`icecache.dci.intrinsics`."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .intrinsics import FAST


@njit(cache=True, nogil=True, fastmath=FAST)
def norms_and_proj(keys, u):
    """Squared norms ``|k|^2`` and ``u_{1:d}.k`` of ``keys [H, n, d]`` (fp32), in one pass: the pieces of the
    lifted key ``T_K(k) = [k; sqrt(M^2 - |k|^2)]`` and of its projection ``p(k) = u.T_K(k)`` that do not
    depend on ``M``."""
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


@njit(cache=True, nogil=True, parallel=True)
def bulk_load(points, page_size, pages, nodes, tokens):
    """Construction, last step (``src/dci.c``: every node's children in a B+-tree keyed by projection):
    cut every node's children, sorted by projection, into ``ceil(c/S)`` evenly filled pages (fills ``pages``,
    ``nodes.first``, ``nodes.npages``, ``tokens.page`` and ``tokens.slot``). ``points`` = ``(keys, uk, proj,
    parent, abs)``: ``keys [H, n, d]`` in the page storage's dtype, ``uk [H, n]`` = ``u_{1:d}.k``, ``proj [H, n]`` =
    ``p(k)``, ``parent [H, n]`` each point's node (0 = virtual root), ``abs [n]`` absolute token ids."""
    heads = points[0].shape[0]
    for h in prange(heads):  # heads own disjoint slices of every array
        # one call per head: numba (0.68) can lose stores through a tuple's fields made directly
        # in a prange body (seen on ``pages.used``), not those made in a called function
        _load_head(h, points, page_size, pages, nodes, tokens)


@njit(cache=True, nogil=True)
def _load_head(h, points, page_size, pages, nodes, tokens):
    """:func:`bulk_load` of head ``h``."""
    keys, uk, proj, parent, tok_abs = points
    n = parent.shape[1]
    n_nodes = n + 1
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
        nodes.first[h, v] = pg
        nodes.npages[h, v] = pages_left
        pos = 0
        while pages_left > 0:
            take = (c - pos) // pages_left
            for s in range(take):
                i = seg[pos + s]
                pages.keys[h, pg, s, :] = keys[h, i, :]
                pages.uk[h, pg, s] = uk[h, i]
                pages.proj[h, pg, s] = proj[h, i]
                pages.loc[h, pg, s] = i
                pages.abs[h, pg, s] = tok_abs[i]
                tokens.page[h, i] = pg
                tokens.slot[h, i] = s
            pages.valid[h, pg] = take
            pages.node[h, pg] = v
            pages.next[h, pg] = pg + 1 if pages_left > 1 else -1
            pos += take
            pages_left -= 1
            pg += 1
    pages.used[h] = pg


@njit(cache=True, nogil=True)
def leaf_page_counts(parent, level, by_level, nodes):
    """``nodes.nleaf``: number of level-0 pages in each node's subtree (``src/dci.c``
    ``num_finest_level_nodes``, which the query's stopping rule counts)."""
    heads = parent.shape[0]
    for h in range(heads):
        for i in by_level:
            t = level[i]
            if t == 0:
                continue
            if t == 1:
                nodes.nleaf[h, i + 1] = nodes.npages[h, i + 1]
            nodes.nleaf[h, parent[h, i]] += nodes.nleaf[h, i + 1]
        if level.size and level.max() == 0:
            nodes.nleaf[h, 0] = nodes.npages[h, 0]
