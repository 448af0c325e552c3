"""Shared numba helpers of the M-DCI kernels, and the index's storage as the kernels receive it.

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

The kernels live by job: construction in ``_build.py``, the query in ``_search.py`` (upper levels),
``_level0.py`` (level 0 and page ranking) and ``_walk.py`` (one node's visiting order), insertion in
``_insert.py``. What else a kernel needs travels as named tuples too, so that no kernel takes more than eight
parameters: the search's scalars, outputs and upper-level candidates (``_search.SearchParams``, ``Result``,
``Candidates``), the query heads and their page rankings (``_level0.Queries``, ``Query``, ``Ranking``,
``Floor``). The arrays a call from Python bundles (the points to lay out or insert, the search's outputs) travel
as plain tuples, unpacked by name at the top of the kernel: numba dispatches a plain tuple faster than a named
one.

numba's on-disk cache (``cache=True``) checks only the source file of the cached function, so the cache folder
is named after a digest of every kernel file (:mod:`icecache.kernel_cache`): editing a helper here recompiles
the kernels that inline it.
"""

from __future__ import annotations

from collections import namedtuple

from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# fastmath without "nnan"/"ninf": the search uses -inf as the "page not touched yet" sentinel
FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}
# the search's flags: without "reassoc" and "contract" the compiler keeps the order of operations written
# (no reordered sums, no fused multiply-adds). With them the vectoriser picks a sum order per loop, CPU and
# vector width, and two paths of the search can score one key an ulp apart; the search's scores come from
# :func:`dot_key`, whose order is explicit
EXACT = {"nsz", "arcp", "afn"}

# the index's arrays (module docstring); the tuples hold references, so kernels write in place
Pages = namedtuple("Pages", "keys uk proj loc abs valid next node used")
Nodes = namedtuple("Nodes", "first npages nleaf m2")
Tokens = namedtuple("Tokens", "sq parent page slot")


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


_LANES = 8


def _lane_halves(builder, v, width):
    """The first and second halves of the ``width``-lane vector ``v``."""
    lanes = ir.VectorType(ir.IntType(32), width // 2)
    return (builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width // 2)))),
            builder.shuffle_vector(v, v, ir.Constant(lanes, list(range(width // 2, width)))))


@intrinsic
def _dot_chunks(typingctx, queries, keys, n_chunks):
    """``sum_j q[j] * k[j]`` over the first ``8 * n_chunks`` elements of contiguous rows, for each pair of rows
    ``(queries[i], keys[i])`` of two tuples (queries fp32; keys fp32, or bf16 bits as uint16; a one-row
    ``keys`` pairs its row with every query and loads it once per chunk), in one order fixed by the code, not the
    compiler: per pair an 8-lane vector accumulates chunk after chunk (element ``j`` in lane ``j mod 8``;
    plain IEEE multiply then add, no fast-math flags), then its halves are added, twice, down to one lane.
    One vector instruction per chunk on any x86 CPU (two on SSE-only ones, with the same roundings). The
    pairs' sums are independent chains, so several pairs run at once; each has the arithmetic of a pair
    alone. Returns a tuple of one float32 per pair."""
    if not (isinstance(queries, types.BaseTuple) and isinstance(keys, types.BaseTuple)
            and len(keys) in (1, len(queries)) and len(queries) > 0):
        return None
    rows = tuple(queries) + tuple(keys)
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in rows):
        return None
    if any(q.dtype != types.float32 for q in queries) or any(k.dtype not in (types.float32, types.uint16)
                                                             for k in keys):
        return None
    m = len(queries)
    f32x8 = ir.VectorType(ir.FloatType(), _LANES)
    i32x8 = ir.VectorType(ir.IntType(32), _LANES)

    def load_rows(context, builder, tuple_type, value):
        return [context.make_array(tuple_type[i])(context, builder, a).data
                for i, a in enumerate(cgutils.unpack_tuple(builder, value, len(tuple_type)))]

    def load_key(builder, data, dtype, offset):
        vec = f32x8 if dtype == types.float32 else ir.VectorType(ir.IntType(16), _LANES)
        kv = builder.load(builder.bitcast(builder.gep(data, [offset]), vec.as_pointer()), align=dtype.bitwidth // 8)
        if dtype != types.float32:  # bf16 bits -> fp32, as key_f32
            kv = builder.bitcast(builder.shl(builder.zext(kv, i32x8), ir.Constant(i32x8, [16] * _LANES)), f32x8)
        return kv

    def codegen(context, builder, sig, args):
        q_data = load_rows(context, builder, sig.args[0], args[0])
        k_data = load_rows(context, builder, sig.args[1], args[1])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(f32x8, None)) for _ in range(m)]
        with cgutils.for_range(builder, args[2]) as loop:
            offset = builder.mul(loop.index, ir.Constant(loop.index.type, _LANES))
            kvs = [load_key(builder, data, sig.args[1][i].dtype, offset) for i, data in enumerate(k_data)]
            for i in range(m):
                kv = kvs[i % len(kvs)]
                qv = builder.load(builder.bitcast(builder.gep(q_data[i], [offset]), f32x8.as_pointer()), align=4)
                builder.store(builder.fadd(builder.load(accs[i]), builder.fmul(qv, kv)), accs[i])
        totals = []
        for acc in accs:
            v, width = builder.load(acc), _LANES
            while width > 1:
                v = builder.fadd(*_lane_halves(builder, v, width))
                width //= 2
            totals.append(builder.extract_element(v, ir.Constant(ir.IntType(32), 0)))
        return context.make_tuple(builder, sig.return_type, totals)
    return types.UniTuple(types.float32, m)(queries, keys, n_chunks), codegen


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def dot_key(qv, key):
    """``q.k`` of a query row ``qv [d]`` (fp32) and a stored key row ``key [d]`` (:func:`key_f32`'s types):
    :func:`_dot_chunks` over the first ``8 * (d // 8)`` elements, then the rest added in turn. Every score
    of the search comes from here or :func:`dot_key3` (the same arithmetic per query), so one key scored by
    two paths of the search (a group's level-0 pass and one query's, an upper level and level 0) has one
    score, on any CPU and vector width."""
    d = qv.shape[0]
    full = d // 8
    (total,) = _dot_chunks((qv,), (key,), full)
    for j in range(full * 8, d):
        total += qv[j] * key_f32(key[j])
    return total


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def dot_key3(q0, q1, q2, key):
    """:func:`dot_key` of three query rows with one key row, the key read once: the same three scores."""
    d = q0.shape[0]
    full = d // 8
    t0, t1, t2 = _dot_chunks((q0, q1, q2), (key,), full)
    for j in range(full * 8, d):
        k = key_f32(key[j])
        t0 += q0[j] * k
        t1 += q1[j] * k
        t2 += q2[j] * k
    return t0, t1, t2


@njit(cache=True, nogil=True, fastmath=EXACT, inline="always")
def dot_keys4(qv, k0, k1, k2, k3):
    """:func:`dot_key` of one query row with four key rows, the four sums computed side by side (independent
    chains, so they overlap instead of each waiting for the previous one): the same four scores."""
    d = qv.shape[0]
    full = d // 8
    t0, t1, t2, t3 = _dot_chunks((qv, qv, qv, qv), (k0, k1, k2, k3), full)
    for j in range(full * 8, d):
        t0 += qv[j] * key_f32(k0[j])
        t1 += qv[j] * key_f32(k1[j])
        t2 += qv[j] * key_f32(k2[j])
        t3 += qv[j] * key_f32(k3[j])
    return t0, t1, t2, t3


# LLVM >= 16 (llvmlite >= 0.45) names the intrinsic after an opaque pointer, older ones after i8*
_PREFETCH = "llvm.prefetch.p0" if binding.llvm_version_info >= (16,) else "llvm.prefetch.p0i8"


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint that ``arr[idx]`` (``idx`` a tuple of indices) will be read soon: its cache line is requested
    now (``llvm.prefetch``, read, high locality), so that reads known in advance overlap instead of each
    waiting for memory in turn."""
    # the search is bound by such waits: a query chases nodes and pages through an index that is cold in the
    # CPU's caches at every decode step
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
