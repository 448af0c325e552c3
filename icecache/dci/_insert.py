"""M-DCI insertion kernels (official ``src/dci.c``: ``dci_add``): the new keys' parents among the level-1
nodes, the lazy re-projection of a node whose ``M`` grew, the insertion into a node's sorted pages with
page splits. Storage layout: :mod:`icecache.dci.intrinsics`."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._build import norms_and_proj
from .intrinsics import FAST


@njit(cache=True, nogil=True, fastmath=FAST)
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
def _node_pages(h, node, pages, nodes):
    """The pages of ``node``, in order (its ``next`` chain)."""
    chain = np.empty(nodes.npages[h, node], dtype=np.int64)
    pg = nodes.first[h, node]
    for a in range(chain.size):
        chain[a] = pg
        pg = pages.next[h, pg]
    return chain


@njit(cache=True, nogil=True)
def _reproject(h, node, m2, u_last, pages, nodes, tokens, changed):
    """Lazy ``M`` correction of one node (``src/dci.c``): re-project its children with the head's new ``M^2``,
    re-sort them and re-pack them evenly into the node's pages; pages whose tokens moved are flagged."""
    chain = _node_pages(h, node, pages, nodes)
    c = 0
    for pg in chain:
        c += pages.valid[h, pg]
    d = pages.keys.shape[3]
    keys = np.empty((c, d), dtype=pages.keys.dtype)  # stored form, moved as it is
    uk = np.empty(c, dtype=np.float32)
    proj = np.empty(c, dtype=np.float32)
    loc = np.empty(c, dtype=np.int64)
    absid = np.empty(c, dtype=np.int64)
    i = 0
    for pg in chain:
        for s in range(pages.valid[h, pg]):
            keys[i] = pages.keys[h, pg, s]
            uk[i] = pages.uk[h, pg, s]
            loc[i] = pages.loc[h, pg, s]
            absid[i] = pages.abs[h, pg, s]
            proj[i] = uk[i] + u_last * math.sqrt(max(m2 - tokens.sq[h, loc[i]], 0.0))
            i += 1
    order = np.argsort(proj, kind="mergesort")
    pos = 0
    left = chain.size
    for pg in chain:
        take = (c - pos) // left
        if take != pages.valid[h, pg]:
            changed[h, pg] = True
        for s in range(take):
            i = order[pos + s]
            if pages.loc[h, pg, s] != loc[i]:
                changed[h, pg] = True
            pages.keys[h, pg, s] = keys[i]
            pages.uk[h, pg, s] = uk[i]
            pages.proj[h, pg, s] = proj[i]
            pages.loc[h, pg, s] = loc[i]
            pages.abs[h, pg, s] = absid[i]
            tokens.page[h, loc[i]] = pg
            tokens.slot[h, loc[i]] = s
        for s in range(take, pages.valid[h, pg]):
            pages.loc[h, pg, s] = -1
            pages.abs[h, pg, s] = -1
        pages.valid[h, pg] = take
        pos += take
        left -= 1
    nodes.m2[h, node] = m2


@njit(cache=True, nogil=True)
def _add_leaf_page(h, node, parent, node_nleaf):
    """A new level-0 page below ``node``: bump ``num_finest_level_nodes`` up to the root."""
    v = node
    while v != 0:
        node_nleaf[h, v] += 1
        v = parent[h, v - 1]
    node_nleaf[h, 0] += 1


@njit(cache=True, nogil=True)
def _split(h, pg, page_size, pages, tokens, changed):
    """Split a full page in half; the upper half moves to a newly allocated page (returned)."""
    new = pages.used[h]
    pages.used[h] += 1
    half = page_size // 2
    for s in range(half, page_size):
        t = s - half
        pages.keys[h, new, t] = pages.keys[h, pg, s]
        pages.uk[h, new, t] = pages.uk[h, pg, s]
        pages.proj[h, new, t] = pages.proj[h, pg, s]
        pages.loc[h, new, t] = pages.loc[h, pg, s]
        pages.abs[h, new, t] = pages.abs[h, pg, s]
        tokens.page[h, pages.loc[h, pg, s]] = new
        tokens.slot[h, pages.loc[h, pg, s]] = t
        pages.loc[h, pg, s] = -1
        pages.abs[h, pg, s] = -1
    pages.valid[h, new] = page_size - half
    pages.valid[h, pg] = half
    pages.next[h, new] = pages.next[h, pg]
    pages.next[h, pg] = new
    pages.node[h, new] = pages.node[h, pg]
    changed[h, pg] = True
    changed[h, new] = True
    return new


@njit(cache=True, nogil=True)
def insert(batch, m2, u_last, page_size, pages, nodes, tokens, changed):
    """Insert ``m`` new level-0 tokens per head into their parents' pages (``dci_add``). ``batch`` = ``(keys, uk, sq,
    parent, loc, abs)``: ``keys [H, m, d]`` in the page storage's dtype, ``uk [H, m]`` = ``u_{1:d}.k``, ``sq [H, m]``
    = ``|k|^2``, ``parent [H, m]`` their level-1 node (:func:`insert_parents`), ``loc [m]`` their local token
    indices, ``abs [m]`` their absolute token ids (a plain tuple: the cheapest bundle to pass from Python). ``m2
    [H]``: the heads' ``M^2``, already raised by :func:`insert_parents`; ``u_last``: the last coordinate of ``u``.

    Parents are level-1 nodes (or the root of a one-level tree), so a new page is a level-0 page.
    A full page splits in half; every page whose content changed is flagged in ``changed``.
    Returns the largest page count of a node that received a token.
    """
    new_keys, new_uk, new_sq, new_parent, new_loc, new_abs = batch
    heads, m, d = new_keys.shape
    most_pages = 0
    for h in range(heads):
        for a in range(m):
            node = new_parent[h, a]
            i = new_loc[a]
            tokens.sq[h, i] = new_sq[h, a]
            tokens.parent[h, i] = node
            if nodes.npages[h, node] > 0 and nodes.m2[h, node] < m2[h]:
                _reproject(h, node, m2[h], u_last, pages, nodes, tokens, changed)
            nodes.m2[h, node] = m2[h]
            p = new_uk[h, a] + u_last * math.sqrt(max(m2[h] - new_sq[h, a], 0.0))
            if nodes.npages[h, node] == 0:
                pg = pages.used[h]
                pages.used[h] += 1
                pages.next[h, pg] = -1
                pages.node[h, pg] = node
                pages.valid[h, pg] = 0
                nodes.first[h, node] = pg
                nodes.npages[h, node] = 1
                _add_leaf_page(h, node, tokens.parent, nodes.nleaf)
            else:
                pg = nodes.first[h, node]
                nxt = pages.next[h, pg]
                while nxt >= 0 and pages.proj[h, nxt, 0] <= p:
                    pg = nxt
                    nxt = pages.next[h, pg]
                if pages.valid[h, pg] == page_size:
                    new = _split(h, pg, page_size, pages, tokens, changed)
                    nodes.npages[h, node] += 1
                    _add_leaf_page(h, node, tokens.parent, nodes.nleaf)
                    if p >= pages.proj[h, new, 0]:
                        pg = new
            s = pages.valid[h, pg]
            while s > 0 and pages.proj[h, pg, s - 1] > p:
                pages.keys[h, pg, s] = pages.keys[h, pg, s - 1]
                pages.uk[h, pg, s] = pages.uk[h, pg, s - 1]
                pages.proj[h, pg, s] = pages.proj[h, pg, s - 1]
                pages.loc[h, pg, s] = pages.loc[h, pg, s - 1]
                pages.abs[h, pg, s] = pages.abs[h, pg, s - 1]
                tokens.slot[h, pages.loc[h, pg, s]] = s
                s -= 1
            pages.keys[h, pg, s] = new_keys[h, a]
            pages.uk[h, pg, s] = new_uk[h, a]
            pages.proj[h, pg, s] = p
            pages.loc[h, pg, s] = i
            pages.abs[h, pg, s] = new_abs[a]
            tokens.page[h, i] = pg
            tokens.slot[h, i] = s
            pages.valid[h, pg] += 1
            changed[h, pg] = True
            most_pages = max(most_pages, nodes.npages[h, node])
    return most_pages
