"""M-DCI: the multi-level dynamic continuous index of IceCache (M-DCI, official repository ``src/dci.c``).

One :class:`MDCIIndex` holds the M-DCI instances of all KV heads of one layer (one logical instance
per (layer, KV head), stored and searched together). Pages are groups of siblings: the children of
one tree node, sorted by their projection on one random direction and cut into pages of
``page_size`` tokens; the search returns page ids, and the page table maps them to token ids.

API::

    cfg = DCIConfig(page_size=16, ratio_1=0.01, ratio_2=0.2, promotion="deterministic",
                    search_ratio=1.5e-3, min_fov=30, prop_to_retrieve=0.8, visit_chunk=128,
                    exact_parent_threshold=3000, seed=0)          # + anchor_* knobs, see config.py
    index = MDCIIndex.build(keys, token_ids, cfg)   # keys [H_kv, n, d] post-RoPE (bf16 ok, fp32
                                                    # inside); token_ids LongTensor [n] = absolute
                                                    # positions in the layer's token store
    pages = index.search(queries, k_pages, n_seq=None)   # queries [H_q, d] -> LongTensor [H_q, K],
                                                    # page ids of KV head i // (H_q/H_kv), -1 padded,
                                                    # in order of each page's best token
    kv_pages = merge_gqa(pages, group, k, mode="interleaved")  # -> LongTensor [H_kv, k], -1 padded
    changed = index.insert(new_keys, new_token_ids)  # [H_kv, m, d], [m] -> BoolTensor
                                                    # [H_kv, n_pages] of pages to refetch
    index.page_table        # LongTensor [H_kv, n_pages, page_size] absolute token ids, -1 = empty
    index.page_valid        # LongTensor [H_kv, n_pages] used slots (0 for a head's unused page ids)
    index.n_pages           # page ids per head are 0 .. n_pages-1 (heads independent)
    index.page_token_ids(head_idx, page_ids)      # -> LongTensor [..., page_size], -1 padded
    index.page_valid_counts(head_idx, page_ids)   # -> LongTensor [...], 0 for page -1
    index.token_ids, index.token_page, index.token_parent, index.level_sizes, index.max_sq_norm
    index.search_counts     # int64 [H_q, 2] of the last search, per query head: keys whose q.k it computed
                            # (upper levels + level 0, each key at most once, <= index.n) and nodes expanded
                            # (virtual root included)
    index.search_stats()    # summary of every search so far: search_scored_fraction = mean over searches of
                            # mean over query heads of keys scored / index.n at that search; its min and max
                            # over searches and heads; mean keys scored, nodes expanded, index.n; search_calls

``page_table`` and ``page_valid`` are zero-copy views of the index's storage: re-read them after an
insert (a split can append page ids and reallocate). Page ``j`` of head 0 and page ``j`` of head 1
hold different tokens. Slots ``0 .. valid-1`` of a page are used, in projection order.

Algorithm (what the official C code ``src/dci.c`` does): the keys are lifted to ``T_K(k) = [k; sqrt(M^2 -
|k|^2)]`` and queries to ``T_Q(q) = [q/|q|; 0]`` (computed inline by the kernels; ``tests/dci_reference.py`` is
the plain reference); tokens are promoted to levels by the positional rule (``levels.py``); every point's parent
is its nearest point one level up under ``D`` (``parents.py``); every node's children form its pages
(``_build.bulk_load``); a query descends from the virtual root keeping ``max(floor(n*search_ratio), min_fov)``
nodes per level and scores the children of each expanded node exactly, visited as the C code does
(``_search.search``, below); new tokens join their nearest level-1 node, full pages split in half (``_insert.insert``).

Visiting the children of an expanded node (``dci_query_single_point_single_level`` with one simple
index and ``dci_next_closest_proj``, CLOSEST = 128): from the position of ``p(q)`` in the node's
sorted child list, chunks of up to 128 children are taken from the side whose next child is closer
in projection (topped up from the other side when one side runs out); every child of a chunk is
scored; the walk stops after a chunk once ``ceil(prop_to_retrieve * c)`` children, ``num_neighbours``
children (``fov`` above level 0, ``K`` at level 0) and, above level 0, ``K`` level-0 pages below them
are scored. So a node with ``c <= 128`` children -- nearly every node with the default ratios -- is
scored in full, and ``prop_to_retrieve`` only matters for larger nodes. ``visit_chunk=1`` scores
exactly the ``ceil(0.8 c)`` children closest in projection instead; docs/benchmarks.md, "Index
benchmark", compares the recall of the two rules.

Threads: ``search`` runs in parallel over shares of the query heads (numba ``prange``; ``numba.set_num_threads``),
``bulk_load`` over KV heads, the dense parent searches in torch (``torch.set_num_threads``). Both use
OpenMP; the numba threading layer is pinned to a thread-safe one (``threads.py``: the search and
the background build run parallel regions concurrently). On a machine shared with other processes
set ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported, or the spinning idle threads of the two
pools starve each other.

Differences from the C code, and why:

- Batched layout instead of one B+-tree per node: a node's pages are a linked list of fixed
  16-slot blocks with keys stored contiguously (``[H, P, 16, d]``; fp32, or bf16 when the keys are bf16,
  ``DCIConfig.key_storage``), so scoring a node is a dense scan. The children visited by the chunk
  walk always form one contiguous run of the sorted list, which is scored page by page.
- Candidates (``DCIConfig.candidate_rule``): the result is the ``K`` distinct pages in order of their best
  candidate token, as in ``dci_query``. By default (``"scored"``) every token the search scores is a
  candidate, upper levels included. The C code (``dci_query_single_point``, ``add_to_list``) keeps fewer:
  each upper level's kept prefix and only the ``K`` best children of each expanded level-1 node, so a page
  whose best child ranks below ``K`` in its node is never returned; ``"official"`` reproduces that rule.
  The larger candidate set is where this index's attention recall gain over the authors' comes from
  (docs/fidelity.md). The prefix rule itself (keep ``fov`` nodes, more until ``K`` level-0 pages) is the
  C code's at every level whose nodes have children.
- Parents: exact brute force (one dense matmul per chunk, batched over heads) whatever the upper
  level's size; the approximate top-down construction search used above ``exact_parent_threshold``
  upper points (n >~ 300k tokens with the defaults) is not implemented. The level-0 anchor shortcut
  is implemented: anchors get exact parents first; the other points' candidate parents (the distinct
  parents of the anchors within ``anchor_window``) are pooled over super-blocks of 16 anchor
  intervals (a superset of each point's own candidates) so that one matmul serves ~1000 points; the
  acceptance test ``D <= 1.02 maxchilddist(P)`` runs in token order with ``maxchilddist`` growing with
  every child a node receives (accepted points at once, fallback points after their super-block's
  exact search), as in the C code's sequential insertion. A super-block whose candidates are every
  upper point keeps ``P`` without the test (the fallback would return the same point).
- Insert: the new tokens' parents are found with one matmul per head over the level-1 keys.
- Norm correction (``src/dci.c``, norm re-projection): the lazy per-node correction is kept (node
  ``M^2`` stored per node; a node
  receiving a token after ``M`` grew is re-projected, re-sorted and re-packed evenly into its
  existing pages). The C code re-bulk-loads the node (possibly fewer leaves); we keep its page ids so
  no page id is freed, and flag only pages whose token list changed.
- Random promotion compacts empty intermediate levels (a token lives on one level only).
- Keys in bf16 are stored in bf16 (``key_storage="auto"``) and scored in fp32 arithmetic: the scores of
  an fp32 copy exactly, at half its memory. The projection direction ``u`` is drawn per index from
  ``cfg.seed`` (the C code draws one per prefill, shared by all layers; pass the same seed to share).
"""

from . import _build, _search, threads
from .config import DCIConfig
from .gqa import merge_gqa
from .index import MDCIIndex

THREADING_LAYER = threads.install((_build, _search))  # before any parallel kernel runs: see threads.py

__all__ = ["DCIConfig", "MDCIIndex", "merge_gqa"]
