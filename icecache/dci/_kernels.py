"""numba kernels of M-DCI: page bulk load, top-down page search, incremental insert (official ``src/dci.c``).

Storage (per layer, all arrays head-major; ``S`` = page size, ``P`` = page capacity), passed to the
kernels as three named tuples of arrays (:class:`Pages`, :class:`Nodes`, :class:`Tokens`; the
``MDCIIndex`` attribute of each field is in brackets):

- ``Pages``: ``keys [H, P, S, d]`` keys in page layout (a node's children are scored page by
  page, contiguous in memory) (``page_keys``): fp32, or the raw bits of bf16 keys as uint16 (read
  through :func:`key_f32`: exactly the fp32 value of the bf16 key, half the bytes),
  ``uk [H, P, S]`` = ``u_{1:d}.k`` (``page_uk``),
  ``proj [H, P, S]`` = ``p(k)`` (``page_proj``), ``loc [H, P, S]`` local token index (``page_loc``),
  ``abs [H, P, S]`` absolute token id, -1 = empty (``page_abs``); ``valid [H, P]`` used slots
  (``page_valid_np``), ``next [H, P]`` next page of the same parent, -1 = last (``page_next``),
  ``node [H, P]`` the parent node owning the page (``page_node``); ``used [H]`` pages in use
  per head (``n_pages_h``).
- ``Nodes``: ``first [H, N]``, ``npages [H, N]`` (``node_first``, ``node_npages``), ``nleaf [H, N]``
  level-0 pages below the node (``node_nleaf``), ``m2 [H, N]`` the ``M^2`` its children's projections
  use, ``src/dci.c`` (``node_m2``); node 0 = virtual root, node ``i + 1`` = token ``i``.
- ``Tokens``: ``sq [H, n]`` squared key norms (``sq``), ``parent [H, n]`` parent node (``parent``),
  ``page [H, n]``, ``slot [H, n]`` where each token sits (``tok_page``, ``tok_slot``).

Invariant: a node's pages, followed through ``Pages.next``, hold its children sorted by projection
(slots sorted inside a page, pages in increasing order), so "the children closest in projection to
``p(q)``" are one contiguous run.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# fastmath without "nnan"/"ninf": the search uses -inf as the "page not touched yet" sentinel
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}


@intrinsic
def key_f32(typingctx, x):
    """A stored key element as fp32: a float32 as it is, a uint16 as the bf16 number whose bits it holds
    (``bits << 16`` reinterpreted as fp32: exact, and it vectorises). Every kernel reads ``Pages.keys``
    through this, so one kernel body serves fp32 and bf16 key storage (``DCIConfig.key_storage``)."""
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return types.float32(x), lambda context, builder, sig, args: args[0]
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        def codegen(context, builder, sig, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())
        return types.float32(x), codegen
    return None


# LLVM >= 16 (llvmlite >= 0.45) names the intrinsic after an opaque pointer, older ones after i8*
_PREFETCH = "llvm.prefetch.p0" if binding.llvm_version_info >= (16,) else "llvm.prefetch.p0i8"


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint that ``arr[idx]`` (``idx`` a tuple of indices) will be read soon: its cache line is requested
    now (``llvm.prefetch``, read, high locality), so that reads known in advance overlap instead of each
    waiting for memory in turn. The search is bound by such waits: at 32k tokens a query chases ~65 nodes
    and ~70 pages through arrays of ~3 MB per layer that are cold at every step."""
    def codegen(context, builder, sig, args):
        aryty, idxty = sig.args
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = cgutils.unpack_tuple(builder, args[1], len(idxty))
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            _PREFETCH)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(mat, r):
    """:func:`prefetch` of every 64-byte cache line of row ``r`` of the 2-D array ``mat``."""
    step = max(64 // mat.itemsize, 1)  # elements per cache line
    for line in range((mat.shape[1] + step - 1) // step):
        prefetch(mat, (r, line * step))


# the index's arrays (module docstring); the tuples hold references, so kernels write in place
Pages = namedtuple("Pages", "keys uk proj loc abs valid next node used")
Nodes = namedtuple("Nodes", "first npages nleaf m2")
Tokens = namedtuple("Tokens", "sq parent page slot")


# ----------------------------------------------------------------------------- bulk load (``src/dci.c`` construction)

@njit(cache=True, nogil=True, parallel=True)
def bulk_load(parent, proj, uk, keys, tok_abs, page_size, pages, nodes, tokens):
    """Cut every node's children, sorted by projection, into ``ceil(c/S)`` evenly filled pages
    (fills ``pages``, ``nodes.first``, ``nodes.npages``, ``tokens.page`` and ``tokens.slot``)."""
    for h in prange(parent.shape[0]):  # heads own disjoint slices of every array
        # one call per head: numba (0.68) can lose stores through a tuple's fields made directly
        # in a prange body (seen on ``pages.used``), not those made in a called function
        _load_head(h, parent, proj, uk, keys, tok_abs, page_size, pages, nodes, tokens)


@njit(cache=True, nogil=True)
def _load_head(h, parent, proj, uk, keys, tok_abs, page_size, pages, nodes, tokens):
    """:func:`bulk_load` of head ``h``."""
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
    """``nodes.nleaf``: number of level-0 pages in each node's subtree (``num_finest_level_nodes``)."""
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


# ----------------------------------------------------------------------------- query (``dci_query``)

@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _score_page(h, qv, pg, s0, s1, rank, pages, best, touched, n_touched, cand_s, cand_v, cand_p, nc):
    """Exact scores ``q.k`` of slots ``s0 .. s1-1`` of upper-level page ``pg``, appended as candidates
    (score, node index, page); with ``rank`` (rule ``"scored"``) they also update the page's best score.
    Returns ``(n_touched, nc)``."""
    d = qv.shape[0]
    top = -np.inf
    for s in range(s0, s1):
        acc = np.float32(0.0)
        for j in range(d):
            acc += qv[j] * key_f32(pages.keys[h, pg, s, j])
        top = max(top, acc)
        cand_s[nc] = acc
        cand_v[nc] = pages.loc[h, pg, s] + 1
        cand_p[nc] = pg
        nc += 1
    if rank:
        n_touched = _rank(pg, top, best, touched, n_touched)
    return n_touched, nc


@njit(cache=True, nogil=True, inline="always")
def _rank(pg, score, best, touched, n_touched):
    """Page ``pg``'s best score becomes at least ``score`` (recorded as touched the first time); returns
    ``n_touched``."""
    if best[pg] == -np.inf:
        touched[n_touched] = pg
        n_touched += 1
    best[pg] = max(best[pg], score)
    return n_touched


@njit(cache=True, nogil=True, inline="always")
def _child_count(h, node, pages, nodes):
    """Number of children of ``node`` (the used slots of its pages)."""
    c = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        c += pages.valid[h, pg]
        pg = pages.next[h, pg]
    return c


@njit(cache=True, nogil=True, inline="always")
def _fill_positions(h, node, pages, nodes, pos_pg, pos_sl):
    """``pos_pg[i], pos_sl[i]``: the page and slot of ``node``'s ``i``-th child in projection order."""
    i = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        for s in range(pages.valid[h, pg]):
            pos_pg[i] = pg
            pos_sl[i] = s
            i += 1
        pg = pages.next[h, pg]


@njit(cache=True, nogil=True, inline="always")
def _proj_at(h, i, pages, pos_pg, pos_sl):
    """Projection of the child at position ``i`` (:func:`_fill_positions`)."""
    return pages.proj[h, pos_pg[i], pos_sl[i]]


@njit(cache=True, nogil=True, inline="always")
def _leaves_at(h, i0, i1, pages, nodes, pos_pg, pos_sl):
    """Level-0 pages below the children at positions ``i0 .. i1-1``."""
    leaves = 0
    for i in range(i0, i1):
        leaves += nodes.nleaf[h, pages.loc[h, pos_pg[i], pos_sl[i]] + 1]
    return leaves


@njit(cache=True, nogil=True, inline="always")
def _chunk_walk(h, c, qp, prop, chunk, need_scored, need_leaves, upper, pages, nodes, pos_pg, pos_sl):
    """The C code's visiting order inside one node (``dci_next_closest_proj``) over its ``c`` children, whose
    positions :func:`_fill_positions` wrote: from the position of ``p(q)`` among them (sorted by
    projection), chunks of up to ``chunk`` children (``CLOSEST`` = 128 in the C code), each from the side
    whose next child is closer to ``p(q)`` (topped up from the other side when that side runs out); stop
    after a chunk once at least ``ceil(prop * c)`` children, at least ``need_scored`` children and at least
    ``need_leaves`` level-0 pages below them are visited.

    The visited children always form one contiguous run of the sorted list: returns its bounds ``[lo, hi)``.
    ``p(q)``'s position is found by bisection and each chunk is taken as two index ranges, so the walk costs
    O(log c + chunks), not O(c) (level-0 pages are counted child by child only for upper levels).
    """
    lo, hi = 0, c
    while lo < hi:  # left = last child with projection < p(q)
        mid = (lo + hi) // 2
        if _proj_at(h, mid, pages, pos_pg, pos_sl) < qp:
            lo = mid + 1
        else:
            hi = mid
    left = lo - 1
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
            from_right = (_proj_at(h, right, pages, pos_pg, pos_sl) - qp
                          < qp - _proj_at(h, left, pages, pos_pg, pos_sl))
        if from_right:
            n_right = min(chunk, c - right)
            n_left = min(chunk - n_right, left + 1)
        else:
            n_left = min(chunk, left + 1)
            n_right = min(chunk - n_left, c - right)
        if upper:
            leaves += (_leaves_at(h, right, right + n_right, pages, nodes, pos_pg, pos_sl)
                       + _leaves_at(h, left + 1 - n_left, left + 1, pages, nodes, pos_pg, pos_sl))
        right += n_right
        left -= n_left
        scored += n_right + n_left
        if scored >= want and scored >= need_scored and leaves >= need_leaves:
            break
    return left + 1, right


@njit(cache=True, nogil=True, inline="always")
def _visited_run(h, node, qp, prop, chunk, need_scored, need_leaves, upper, pages, nodes, pos_pg, pos_sl):
    """The run ``[lo, hi)`` of ``node``'s sorted children that one query scores (:func:`_chunk_walk`; a
    node of at most ``chunk`` children is scored in full)."""
    c = _child_count(h, node, pages, nodes)
    if c <= chunk:
        return 0, c
    _fill_positions(h, node, pages, nodes, pos_pg, pos_sl)
    return _chunk_walk(h, c, qp, prop, chunk, need_scored, need_leaves, upper, pages, nodes, pos_pg, pos_sl)


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _expand(h, node, qv, qp, prop, chunk, need_scored, need_leaves, rank, pages, nodes, pos_pg, pos_sl,
            best, touched, n_touched, cand_s, cand_v, cand_p, nc):
    """Single-node search of the C code (``dci_query_single_point_single_level`` with one simple
    index) above level 0: score exactly the children :func:`_chunk_walk` visits. A node with ``c <= chunk``
    children is scored in full (the first chunk takes them all). Returns ``(n_touched, nc)``."""
    lo, hi = _visited_run(h, node, qp, prop, chunk, need_scored, need_leaves, True, pages, nodes, pos_pg,
                          pos_sl)
    if lo >= hi:
        return n_touched, nc
    i = 0  # position of the first slot of page pg in the node's sorted child list
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        v = pages.valid[h, pg]
        s0 = max(lo - i, 0)
        s1 = min(hi - i, v)
        if s0 < s1:
            n_touched, nc = _score_page(h, qv, pg, s0, s1, rank, pages, best, touched, n_touched,
                                        cand_s, cand_v, cand_p, nc)
        i += v
        pg = pages.next[h, pg]
    return n_touched, nc


@njit(cache=True, nogil=True)
def _order_desc(scores, n, keys):
    """Positions of ``scores[:n]`` from the highest score to the lowest, ties in position order: each
    score's order-preserving integer image is packed with its position into one int64 key and the keys are
    sorted (numba's float argsort took ~3x longer on the search's candidate lists)."""
    for i in range(n):
        bits = np.int64(np.float32(scores[i]).view(np.int32))
        mono = bits ^ 0x7FFFFFFF if bits < 0 else bits  # a larger float has a larger image
        keys[i] = ((-mono - 1) << 32) | i  # descending score, then ascending position
    keys[:n].sort()
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        order[i] = keys[i] & 0xFFFFFFFF
    return order


@njit(cache=True, nogil=True, fastmath=_FAST)
def _descend(qv, qp, h, k_pages, fov, prop, chunk, top_level, n_upper, official, pages, nodes, pos_pg, pos_sl,
             best, touched, kept, counts):
    """The upper levels of one query head's top-down search (see :func:`search`): from the virtual root,
    expand the kept nodes of a level, sort the children found by score and keep the smallest prefix whose
    level-0 pages reach ``k_pages``, but at least ``min(fov, found)``. Every scored child ranks its page,
    or (``official``, the C rule) only the kept prefix. Stops at the nodes whose children are level-0
    pages, written to ``kept``. Returns ``(n_kept, n_touched)``, ``n_kept = 0`` when a level has no
    children (nothing left to expand). Adds the keys scored on these levels to ``counts[0]`` and the nodes
    expanded (virtual root included) to ``counts[1]``."""
    cand_s = np.empty(n_upper + 1, dtype=np.float32)
    cand_v = np.empty(n_upper + 1, dtype=np.int64)
    cand_p = np.empty(n_upper + 1, dtype=np.int64)
    sort_keys = np.empty(n_upper + 1, dtype=np.int64)
    kept[0] = 0
    n_kept = 1
    n_touched = 0
    child_level = top_level
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
            n_touched, nc = _expand(h, kept[a], qv, qp, prop, chunk, fov, k_pages, not official, pages, nodes,
                                    pos_pg, pos_sl, best, touched, n_touched, cand_s, cand_v, cand_p, nc)
        counts[0] += nc  # one candidate per scored child
        if nc == 0:
            return 0, n_touched
        for a in range(nc):  # what the next level reads of each candidate, requested before the sort
            prefetch(nodes.nleaf, (h, cand_v[a]))
            prefetch(nodes.first, (h, cand_v[a]))
            prefetch(nodes.npages, (h, cand_v[a]))
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
            if official:
                n_touched = _rank(cand_p[order[a]], cand_s[order[a]], best, touched, n_touched)
        child_level -= 1
    return n_kept, n_touched


@njit(cache=True, nogil=True, fastmath=_FAST)
def _rank_top_children(h, qv, node, lo, hi, k_pages, pages, nodes, best, touched, n_touched, buf_s, buf_p):
    """Level 0 under the C rule (``dci_query_single_point_single_level`` with ``num_neighbours = K`` and
    ``add_to_list``): of the children ``lo .. hi-1`` of ``node`` that the query scores, only the ``K``
    best rank their pages (ties: the earlier child in projection order). Returns ``n_touched``."""
    n = 0
    i = 0
    pg = nodes.first[h, node]
    for _ in range(nodes.npages[h, node]):
        v = pages.valid[h, pg]
        for s in range(max(lo - i, 0), min(hi - i, v)):
            acc = np.float32(0.0)
            for j in range(qv.shape[0]):
                acc += qv[j] * key_f32(pages.keys[h, pg, s, j])
            buf_s[n] = acc
            buf_p[n] = pg
            n += 1
        i += v
        pg = pages.next[h, pg]
    order = np.argsort(-buf_s[:n], kind="mergesort")
    for a in range(min(k_pages, n)):
        n_touched = _rank(buf_p[order[a]], buf_s[order[a]], best, touched, n_touched)
    return n_touched


@njit(cache=True, nogil=True, inline="always")
def _touch(g, pg, best, touched, n_touched):
    """Records page ``pg`` as touched by query ``g`` the first time it is scored (``best`` still -inf)."""
    if best[g, pg] == -np.inf:
        touched[g, n_touched[g]] = pg
        n_touched[g] += 1


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _score_slots(h, q_group, g, pg, s0, s1, pages, best):
    """``best[g, pg] = max(best[g, pg], max_s q_g.k_s)`` over slots ``s0 .. s1-1`` of page ``pg``."""
    top = best[g, pg]
    for s in range(s0, s1):
        acc = np.float32(0.0)
        for j in range(q_group.shape[1]):
            acc += q_group[g, j] * key_f32(pages.keys[h, pg, s, j])
        top = max(top, acc)
    best[g, pg] = top


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _score_slots3(h, q_group, gs, s0s, s1s, k, pg, pages, best):
    """:func:`_score_slots` for the three queries ``gs[k:k+3]``, each over its own slots ``s0s[.] ..
    s1s[.]-1``: every key of the union of their slots is loaded once for the three dot products (the same
    arithmetic per query, so the same scores), and each maximum takes only its query's slots."""
    g0, g1, g2 = gs[k], gs[k + 1], gs[k + 2]
    a0, a1, a2 = s0s[k], s0s[k + 1], s0s[k + 2]
    b0, b1, b2 = s1s[k], s1s[k + 1], s1s[k + 2]
    t0, t1, t2 = best[g0, pg], best[g1, pg], best[g2, pg]
    for s in range(min(a0, a1, a2), max(b0, b1, b2)):
        d0 = np.float32(0.0)
        d1 = np.float32(0.0)
        d2 = np.float32(0.0)
        for j in range(q_group.shape[1]):
            key = key_f32(pages.keys[h, pg, s, j])
            d0 += q_group[g0, j] * key
            d1 += q_group[g1, j] * key
            d2 += q_group[g2, j] * key
        if a0 <= s < b0:
            t0 = max(t0, d0)
        if a1 <= s < b1:
            t1 = max(t1, d1)
        if a2 <= s < b2:
            t2 = max(t2, d2)
    best[g0, pg], best[g1, pg], best[g2, pg] = t0, t1, t2


@njit(cache=True, nogil=True, inline="always")
def _prefetch_page(h, pg, pages):
    """Requests every used key of page ``pg`` (none when ``pg < 0``): the next page of a node is scored while
    its keys arrive (a page is 2-4 KB at a place the hardware prefetcher cannot guess)."""
    if pg < 0:
        return
    keys = pages.keys[h, pg]
    for s in range(pages.valid[h, pg]):
        prefetch_row(keys, s)


@njit(cache=True, nogil=True, fastmath=_FAST)
def _score_level0(h, q_group, runs, n_runs, pages, nodes, best, touched, n_touched):
    """Level 0 of the search for a KV head's query heads together: ``runs [n, 4]`` rows ``(node, query,
    lo, hi)`` sorted by node; each node's pages are read once while every query that kept the node scores
    its run of them, three queries at a time (:func:`_score_slots3`; the page stays in L1 between them, so
    the group reads the keys once instead of once per query head). Updates ``best [G, P]`` (a page's best
    ``q.k``) and the touched lists ``touched [G, P]`` / ``n_touched [G]`` exactly as one search per query
    head would."""
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
def _level0_runs(h, runs, n_runs, order, qps, prop, chunk, k_pages, pages, nodes, pos_pg, pos_sl):
    """Fills ``lo, hi`` of the level-0 ``runs`` (rows ``(node, query, lo, hi)``, visited in ``order``, sorted by
    node): each node's children are counted, and laid out for the chunk walk, once for all the queries that
    kept it."""
    a = 0
    while a < n_runs:
        node = runs[order[a], 0]
        b = a
        while b < n_runs and runs[order[b], 0] == node:
            b += 1
        c = _child_count(h, node, pages, nodes)
        if c > chunk:
            _fill_positions(h, node, pages, nodes, pos_pg, pos_sl)
        for e in range(a, b):
            r = order[e]
            if c <= chunk:
                runs[r, 2], runs[r, 3] = 0, c
            else:
                runs[r, 2], runs[r, 3] = _chunk_walk(h, c, qps[runs[r, 1]], prop, chunk, k_pages, 0, False, pages,
                                                     nodes, pos_pg, pos_sl)
        a = b


@njit(cache=True, nogil=True)
def _top_pages(best, touched, n_touched, out_row, score_row):
    """The touched pages with the best tokens, best first (insertion into a sorted top-C, as the C
    code); ``-1`` / ``-inf`` padded."""
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


@njit(cache=True, nogil=True, fastmath=_FAST)
def _search_group(q_group, qps, h, k_pages, fov, prop, chunk, top_level, n_upper, max_children, official,
                  pages, nodes, out, out_scores, counts):
    """Searches of the ``G`` query heads ``q_group [G, d]`` of KV head ``h`` (see :func:`search`): each
    descends the upper levels alone (:func:`_descend`), then level 0, where nearly all the scoring is, is
    scored for the group in one pass (:func:`_score_level0`), or per query under the C rule
    (:func:`_rank_top_children`). Writes ``counts [G, 2]`` (keys scored, nodes expanded; :func:`search`)."""
    n_group = q_group.shape[0]
    n_pages_h = pages.used[h]
    best = np.full((n_group, n_pages_h), -np.inf, dtype=np.float32)
    touched = np.empty((n_group, n_pages_h), dtype=np.int64)
    n_touched = np.zeros(n_group, dtype=np.int64)
    pos_pg = np.empty(max_children, dtype=np.int64)
    pos_sl = np.empty(max_children, dtype=np.int64)
    kept = np.empty(n_upper + 1, dtype=np.int64)
    runs = np.empty((n_group * (n_upper + 1), 4), dtype=np.int64)
    n_runs = 0
    for g in range(n_group):
        counts[g, 0] = 0
        counts[g, 1] = 0
        n_kept, n_touched[g] = _descend(q_group[g], qps[g], h, k_pages, fov, prop, chunk, top_level,
                                        n_upper, official, pages, nodes, pos_pg, pos_sl, best[g], touched[g],
                                        kept, counts[g])
        for a in range(n_kept):
            runs[n_runs, 0] = kept[a]
            runs[n_runs, 1] = g
            n_runs += 1
    order = np.argsort(runs[:n_runs, 0], kind="mergesort")
    _level0_runs(h, runs, n_runs, order, qps, prop, chunk, k_pages, pages, nodes, pos_pg, pos_sl)
    for r in range(n_runs):  # level 0: each run is one expanded node and the children its query scores
        counts[runs[r, 1], 0] += runs[r, 3] - runs[r, 2]
        counts[runs[r, 1], 1] += 1
    if official:
        buf_s = np.empty(max_children, dtype=np.float32)
        buf_p = np.empty(max_children, dtype=np.int64)
        for r in range(n_runs):
            g = runs[r, 1]
            n_touched[g] = _rank_top_children(h, q_group[g], runs[r, 0], runs[r, 2], runs[r, 3], k_pages, pages,
                                              nodes, best[g], touched[g], n_touched[g], buf_s, buf_p)
    else:
        _score_level0(h, q_group, runs[order], n_runs, pages, nodes, best, touched, n_touched)
    for g in range(n_group):
        _top_pages(best[g], touched[g], n_touched[g], out[g], out_scores[g])


@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def search(queries, u, group, k_pages, fov, prop, chunk, top_level, n_upper, max_children, official, pages, nodes,
           out, out_scores, counts, n_threads):
    """Top-down page search of every query head (``dci_query``), in parallel on ``n_threads`` threads; writes
    ``out [H_q, C]`` (page ids, -1 padded), ``out_scores [H_q, C]`` (best token's ``q.k``, -inf
    padded), ``C >= k_pages``, and ``counts [H_q, 2]`` (int64), how much of the index each query head's
    search touched:

    - ``counts[:, 0]``, keys scored: the keys whose ``q.k`` the search computed for that query head, i.e. the
      children of every node it expanded that the chunk walk visited (:func:`_chunk_walk`; all of them when
      ``c <= visit_chunk`` or ``prop_to_retrieve = 1``), upper levels and level 0 together. Each key has one
      parent, so it is counted at most once and ``counts[:, 0] <= n`` (the keys in the index). Under the C
      rule the level-0 keys are scored and then only the ``K`` best rank pages: still counted. Keys whose
      dot product :func:`_score_slots3` computes for another query head of the group only (the union of
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
    of the default's candidates). ``n_upper`` bounds the
    number of upper-level (level >= 1) tokens, ``max_children`` the children of one node. The ``group``
    query heads of a KV head search together (:func:`_search_group`): same pages and scores as one search
    per query head, with the level-0 keys read once per group. Each thread takes an equal share of the query
    heads, cut at query heads rather than KV heads (SmolLM2's 3 KV heads on 2 threads: 5 and 4 query heads
    instead of 2 KV heads and 1; the split KV head's level-0 keys are read by both threads). 28 layers at 32k
    tokens: 17.9-19.6 -> 16.2-18.9 ms per token (alternated runs, "AMD EPYC", 2 threads).

    The search is bound by memory latency, not arithmetic: every step reads each layer's index cold (at 32k,
    ~1 MB of keys and scattered node and page records per KV head), and a top-down walk chases pointers (node
    -> first page -> next page). So the records a level will read are requested together before it reads them
    (:func:`prefetch`: the kept nodes' first pages, the candidates' node records before their sort, a node's
    next page while one is scored). With that, the group-wide level-0 runs (:func:`_level0_runs`) and the packed
    candidate sort (:func:`_order_desc`), 28 captured SmolLM2 layers, "AMD EPYC" (family 26), 2 threads: 4k
    7.8 -> 4.9 ms, 32k 15.4 -> 10.3 ms per token, the same pages and scores.
    """
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
            _search_group(qv[q0:q1], qps[q0:q1], h, k_pages, fov, prop, chunk, top_level, n_upper, max_children,
                          official, pages, nodes, out[q0:q1], out_scores[q0:q1], counts[q0:q1])
            q0 = q1


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
def insert(new_keys, new_uk, new_sq, new_parent, new_loc, new_abs, m2, u_last, page_size, pages, nodes,
           tokens, changed):
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


# ----------------------------------------------------------------------------- search statistics

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
