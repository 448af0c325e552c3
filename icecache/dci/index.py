"""``MDCIIndex``: the M-DCI instances of one layer, batched over its KV heads (official ``src/dci.c``,
``dciknn/core.py``).

See the package docstring (``icecache/dci/__init__.py``) for the API and for what differs from the
official C code. Internal storage is numpy (shared zero-copy with the torch views this class
returns); the irregular work runs in the numba kernels of ``_build.py``, ``_search.py`` and ``_insert.py``
(the search in parallel over query heads), the dense work in BLAS matmuls: parent search at construction in torch
(batched over heads), parent search at insert in numpy (one small matmul per head, no torch call overhead).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import _build, _insert, _search
from .config import DCIConfig
from .intrinsics import Nodes, Pages, Tokens
from .levels import assign_levels, level_sizes
from .threads import one_blas_thread
from .parents import assign_parents


def _as_f32(x: torch.Tensor) -> np.ndarray:
    """Contiguous fp32 numpy array of a CPU tensor (a view when it already is one)."""
    return np.ascontiguousarray(x.detach().to(torch.float32).numpy())


def _stored_keys(x: torch.Tensor, x_f32: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` in the index's key storage ``dtype``: ``x_f32`` (``x`` in fp32, already made by the caller) for fp32,
    or uint16 holding the bits of ``x`` in bf16 (``DCIConfig.key_storage``; ``intrinsics.key_f32`` reads them back)."""
    if dtype == np.uint16:
        return x.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return x_f32


def _grow(arr: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    """Copy of ``arr`` enlarged to ``size`` along ``axis``, new entries set to ``fill``."""
    shape = list(arr.shape)
    shape[axis] = size
    out = np.full(shape, fill, dtype=arr.dtype)
    out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out


# (attribute, axis that grows, fill value) of the token-indexed and page-indexed arrays
_TOKEN_ARRAYS = (("tok_abs", 0, -1), ("level", 0, 0), ("sq", 1, 0.0), ("parent", 1, 0),
                 ("tok_page", 1, -1), ("tok_slot", 1, -1))
_NODE_ARRAYS = (("node_first", 1, -1), ("node_npages", 1, 0), ("node_nleaf", 1, 0),
                ("node_m2", 1, 0.0))
_PAGE_ARRAYS = (("page_keys", 1, 0.0), ("page_uk", 1, 0.0), ("page_proj", 1, 0.0),
                ("page_loc", 1, -1), ("page_abs", 1, -1), ("page_valid_np", 1, 0),
                ("page_next", 1, -1), ("page_node", 1, -1))


class MDCIIndex:
    """One layer's M-DCI index: one logical instance per KV head, stored and searched together."""

    def __init__(self, cfg: DCIConfig, heads: int, dim: int, n: int, token_cap: int, page_cap: int,
                 key_dtype: type = np.float32):
        """Allocate empty storage; use :meth:`build`. ``key_dtype``: np.float32, or np.uint16 (bf16 bits)."""
        self.cfg = cfg
        self.heads, self.dim, self.n = heads, dim, n
        s = cfg.page_size
        self.tok_abs = np.full(token_cap, -1, dtype=np.int64)
        self.level = np.zeros(token_cap, dtype=np.int32)
        self.sq = np.zeros((heads, token_cap), dtype=np.float32)
        self.parent = np.zeros((heads, token_cap), dtype=np.int64)
        self.tok_page = np.full((heads, token_cap), -1, dtype=np.int64)
        self.tok_slot = np.full((heads, token_cap), -1, dtype=np.int64)
        self.node_first = np.full((heads, token_cap + 1), -1, dtype=np.int64)
        self.node_npages = np.zeros((heads, token_cap + 1), dtype=np.int64)
        self.node_nleaf = np.zeros((heads, token_cap + 1), dtype=np.int64)
        self.node_m2 = np.zeros((heads, token_cap + 1), dtype=np.float32)
        self.page_keys = np.zeros((heads, page_cap, s, dim), dtype=key_dtype)
        self.page_uk = np.zeros((heads, page_cap, s), dtype=np.float32)
        self.page_proj = np.zeros((heads, page_cap, s), dtype=np.float32)
        self.page_loc = np.full((heads, page_cap, s), -1, dtype=np.int64)
        self.page_abs = np.full((heads, page_cap, s), -1, dtype=np.int64)
        self.page_valid_np = np.zeros((heads, page_cap), dtype=np.int64)
        self.page_next = np.full((heads, page_cap), -1, dtype=np.int64)
        self.page_node = np.full((heads, page_cap), -1, dtype=np.int64)
        self.n_pages_h = np.zeros(heads, dtype=np.int64)
        self.m2 = np.zeros(heads, dtype=np.float32)
        self.u = random_direction(dim + 1, cfg.seed).numpy()
        self.top_level = 0
        self.n_upper = 0  # tokens on levels >= 1 (inserted tokens are level 0)
        self._max_children = 0  # bound on the children of one node (search scratch size)
        self._l1_loc = np.zeros(0, dtype=np.int64)
        self._l1_keys_t = np.zeros((heads, dim, 0), dtype=np.float32)  # level-1 keys, [H, d, n1]
        self._l1_sq = np.zeros((heads, 0), dtype=np.float32)
        self.search_counts = np.zeros((0, 2), dtype=np.int64)  # the last search's, see search_scored
        self._tally = _search.new_tally()  # running totals of every search, see search_stats
        self._pack()

    def _pack(self) -> None:
        """The kernels' named tuples of the storage arrays (``intrinsics.Pages``, ``Nodes``, ``Tokens``):
        references, no copies; rebuilt whenever :meth:`_ensure_tokens` / :meth:`_ensure_pages`
        reallocate an array."""
        self._pages = Pages(self.page_keys, self.page_uk, self.page_proj, self.page_loc,
                                     self.page_abs, self.page_valid_np, self.page_next,
                                     self.page_node, self.n_pages_h)
        self._nodes = Nodes(self.node_first, self.node_npages, self.node_nleaf, self.node_m2)
        self._tokens = Tokens(self.sq, self.parent, self.tok_page, self.tok_slot)

    # ------------------------------------------------------------------------- construction

    @classmethod
    def build(cls, keys: torch.Tensor, token_ids: torch.Tensor,
              cfg: DCIConfig | None = None) -> "MDCIIndex":
        """Build the index over ``keys [H_kv, n, d]`` (post-RoPE, any float dtype; fp32 arithmetic, bf16 keys
        stored as bf16 under ``cfg.key_storage="auto"``).

        ``token_ids [n]`` are the absolute positions of these keys in the layer's token store; pages
        and search results refer to them through :attr:`page_table`.
        """
        cfg = cfg or DCIConfig()
        heads, n, dim = keys.shape
        if n < 1:
            raise ValueError("cannot build an M-DCI index over zero keys")
        keys32 = keys.detach().to(torch.float32).contiguous()
        bf16 = cfg.key_storage == "auto" and keys.dtype == torch.bfloat16
        self = cls(cfg, heads, dim, n, token_cap=n + max(256, n // 8), page_cap=1,
                   key_dtype=np.uint16 if bf16 else np.float32)
        k_np = keys32.numpy()
        sq, uk = _build.norms_and_proj(k_np, self.u)
        m2 = sq.max(1)
        height = np.sqrt(np.maximum(m2[:, None] - sq, 0.0))
        level = assign_levels(n, cfg)
        lifted = torch.cat([keys32, torch.from_numpy(height).unsqueeze(-1)], dim=-1)
        parent = assign_parents(lifted, torch.from_numpy(m2), level, cfg)
        proj = uk + self.u[-1] * height
        k_stored = _stored_keys(keys, k_np, self.page_keys.dtype)
        self._bulk_load(k_np, k_stored, uk, proj, sq, m2, token_ids, level, parent)
        return self

    def _bulk_load(self, k_np, k_stored, uk, proj, sq, m2, token_ids, level, parent) -> None:
        """Fill the token, node and page arrays from the levels and parents (``src/dci.c`` page construction);
        ``k_np`` fp32 keys, ``k_stored`` the same in the page storage's dtype."""
        n, s = self.n, self.cfg.page_size
        self.tok_abs[:n] = token_ids.detach().to(torch.int64).numpy()
        self.level[:n] = level
        self.sq[:, :n] = sq
        self.parent[:, :n] = parent
        self.m2[:] = m2
        self.node_m2[:] = self.m2[:, None]
        self.top_level = int(level.max())
        children = np.stack([np.bincount(p, minlength=n + 1) for p in parent])
        pages = int(((children + s - 1) // s).sum(1).max())
        self._max_children = int(children.max())
        self._ensure_pages(pages + max(64, pages // 8))
        _build.bulk_load((k_stored, uk, proj, parent, self.tok_abs), s, self._pages, self._nodes, self._tokens)
        upper = np.flatnonzero(level > 0)
        by_level = upper[np.argsort(level[upper], kind="stable")].astype(np.int64)
        self.n_upper = int(upper.size)
        _build.leaf_page_counts(parent, level, by_level, self._nodes)
        self._l1_loc = np.flatnonzero(level == 1).astype(np.int64)
        self._l1_keys_t = np.ascontiguousarray(k_np[:, self._l1_loc].transpose(0, 2, 1))
        self._l1_sq = np.ascontiguousarray(self.sq[:, self._l1_loc])

    # ------------------------------------------------------------------------- capacity

    def _ensure_tokens(self, size: int) -> None:
        cap = self.tok_abs.shape[0]
        if size <= cap:
            return
        new = max(size, 2 * cap)
        for name, axis, fill in _TOKEN_ARRAYS:
            setattr(self, name, _grow(getattr(self, name), axis, new, fill))
        for name, axis, fill in _NODE_ARRAYS:
            setattr(self, name, _grow(getattr(self, name), axis, new + 1, fill))
        self._pack()

    def _ensure_pages(self, size: int) -> None:
        cap = self.page_keys.shape[1]
        if size <= cap:
            return
        new = max(size, 2 * cap)
        for name, axis, fill in _PAGE_ARRAYS:
            setattr(self, name, _grow(getattr(self, name), axis, new, fill))
        self._pack()

    # ------------------------------------------------------------------------- query

    def search(self, queries: torch.Tensor, k_pages: int, n_seq: int | None = None) -> torch.Tensor:
        """Top-``k_pages`` page ids per query head (``dci_query``): ``queries [H_q, d]`` -> ``LongTensor [H_q, K]``.

        Query head ``i`` searches KV head ``i // (H_q / H_kv)``. Pages are listed in order of their
        best-scoring token, -1 padded. ``n_seq`` (default: indexed tokens) sets the field of view
        ``max(floor(n_seq * search_ratio), min_fov)``.
        """
        return self.search_scored(queries, k_pages, k_pages, n_seq)[0]

    def search_scored(self, queries: torch.Tensor, k_pages: int, n_candidates: int,
                      n_seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The search of :meth:`search` (steered by ``k_pages``), reporting the ``n_candidates >= k_pages``
        best pages it scored per query head with their best token's ``q.k``: ``(LongTensor [H_q, C],
        FloatTensor [H_q, C])``, -1 / -inf padded. The first ``k_pages`` columns equal :meth:`search`;
        the rest are what a group-level GQA merge (:func:`~icecache.dci.gqa.merge_gqa`) ranks.

        Sets :attr:`search_counts`, ``[H_q, 2]`` int64: per query head, column 0 the keys whose ``q.k`` the
        search computed (at most :attr:`n`, the keys in the index; upper levels included) and column 1 the
        nodes it expanded, the virtual root included (``_search.search``); and adds them to the totals
        :meth:`search_stats` reports."""
        n_q = queries.shape[0]
        if n_q % self.heads:
            raise ValueError(f"H_q={n_q} is not a multiple of H_kv={self.heads}")
        if n_candidates < k_pages:
            raise ValueError(f"n_candidates={n_candidates} must be >= k_pages={k_pages}")
        q = _as_f32(queries)
        out = np.empty((n_q, n_candidates), dtype=np.int64)
        scores = np.empty((n_q, n_candidates), dtype=np.float32)
        counts = np.empty((n_q, 2), dtype=np.int64)
        fov = self.cfg.fov(self.n if n_seq is None else n_seq)
        params = _search.SearchParams(int(k_pages), int(fov), float(self.cfg.prop_to_retrieve),
                                      int(self.cfg.visit_chunk), int(self.top_level), int(self.n_upper),
                                      int(self._max_children), self.cfg.candidate_rule == "official")
        _search.search(q, self.u, n_q // self.heads, params, self._pages, self._nodes, (out, scores, counts),
                       numba.get_num_threads())
        _search.tally(counts, self.n, self._tally)
        self.search_counts = counts
        return torch.from_numpy(out), torch.from_numpy(scores)

    def search_stats(self) -> dict[str, float]:
        """How much of the index the searches so far scored (all calls of :meth:`search_scored`; ``{}`` before
        the first). Per search, per query head ``h``: ``scored_h`` = keys whose ``q.k`` it computed (upper levels
        and level 0; each key at most once), ``nodes_h`` = nodes expanded (virtual root included), ``n`` = keys
        in the index at that search (:attr:`search_counts`). Reported:

        - ``search_calls``: number of searches;
        - ``search_indexed_keys``: mean ``n``;
        - ``search_scored_keys``: mean over searches of ``mean_h scored_h``;
        - ``search_scored_fraction``: mean over searches of ``mean_h scored_h / n`` (1.0 = a brute force);
        - ``search_scored_fraction_min`` / ``_max``: least / largest ``scored_h / n`` over searches and heads;
        - ``search_nodes_expanded``: mean over searches of ``mean_h nodes_h``.
        """
        totals = dict(zip(_search.TALLY, self._tally.tolist()))
        calls = totals["searches"]
        if not calls:
            return {}
        return {"search_calls": calls, "search_indexed_keys": totals["indexed_keys"] / calls,
                "search_scored_keys": totals["scored_keys"] / calls,
                "search_scored_fraction": totals["scored_fraction"] / calls,
                "search_scored_fraction_min": totals["scored_fraction_min"],
                "search_scored_fraction_max": totals["scored_fraction_max"],
                "search_nodes_expanded": totals["nodes_expanded"] / calls}

    # ------------------------------------------------------------------------- insert

    def insert(self, keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Insert ``keys [H_kv, m, d]`` (post-RoPE) with absolute ids ``token_ids [m]`` (``dci_add``).

        Every new token becomes a level-0 point under its nearest level-1 node (exact brute force
        under ``D``). Returns ``BoolTensor [H_kv, n_pages]`` (``n_pages`` after the insert): True for
        every (head, page) whose content changed, new pages included, so stale copies are refetched.
        """
        heads, m, _ = keys.shape
        k_np = _as_f32(keys)
        with one_blas_thread():  # tiny matmul: BLAS threads only contend (threads.py)
            sim = np.matmul(k_np, self._l1_keys_t)  # [H, m, n1] inner products with level 1
        sq, uk, parent = _insert.insert_parents(k_np, self.u, self.m2, sim, self._l1_sq, self._l1_loc)
        self._ensure_tokens(self.n + m)
        self._ensure_pages(int(self.n_pages_h.max()) + m)
        loc = np.arange(self.n, self.n + m, dtype=np.int64)
        abs_ids = token_ids.detach().to(torch.int64).numpy()
        self.tok_abs[loc] = abs_ids
        changed = np.zeros(self.page_valid_np.shape, dtype=np.bool_)
        batch = (_stored_keys(keys, k_np, self.page_keys.dtype), uk, sq, parent, loc, abs_ids)
        most = _insert.insert(batch, self.m2, np.float32(self.u[-1]), self.cfg.page_size, self._pages, self._nodes,
                              self._tokens, changed)
        self.n += m
        self._max_children = max(self._max_children, most * self.cfg.page_size)
        return torch.from_numpy(changed[:, : self.n_pages])

    # ------------------------------------------------------------------------- page views

    @property
    def n_pages(self) -> int:
        """Page slots per head (the largest head's page count); shorter heads have empty pages."""
        return int(self.n_pages_h.max())

    def page_positions(self) -> np.ndarray:
        """int64 ``[H_kv, n_pages, page_size]`` of absolute token ids, -1 = empty slot: a numpy view of the
        storage (re-read it after an insert), the form :attr:`page_table` wraps."""
        return self.page_abs[:, : self.n_pages]

    def page_fill(self) -> np.ndarray:
        """int64 ``[H_kv, n_pages]``: used slots of each page, a numpy view of the storage (the form
        :attr:`page_valid` wraps)."""
        return self.page_valid_np[:, : self.n_pages]

    @property
    def page_table(self) -> torch.Tensor:
        """``LongTensor [H_kv, n_pages, page_size]`` of absolute token ids, -1 = empty slot."""
        return torch.from_numpy(self.page_positions())

    @property
    def page_valid(self) -> torch.Tensor:
        """``LongTensor [H_kv, n_pages]``: used slots of each page (slots ``0..valid-1`` are used)."""
        return torch.from_numpy(self.page_fill())

    def page_token_ids(self, head_idx: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Absolute token ids of pages: ``head_idx``, ``page_ids`` broadcastable LongTensors (page -1
        allowed) -> ``LongTensor [..., page_size]``, -1 for empty slots and for page -1."""
        table = self.page_table
        out = table[head_idx, page_ids.clamp_min(0)]
        return out.masked_fill((page_ids < 0).unsqueeze(-1), -1)

    def page_valid_counts(self, head_idx: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Used slots of pages (0 for page -1), same broadcasting as :meth:`page_token_ids`."""
        counts = self.page_valid[head_idx, page_ids.clamp_min(0)]
        return counts.masked_fill(page_ids < 0, 0)

    # ------------------------------------------------------------------------- token views

    @property
    def token_ids(self) -> torch.Tensor:
        """``LongTensor [n]``: absolute ids of the indexed tokens, in insertion order."""
        return torch.from_numpy(self.tok_abs[: self.n])

    @property
    def token_page(self) -> torch.Tensor:
        """``LongTensor [H_kv, n]``: page holding each token of :attr:`token_ids`, per head."""
        return torch.from_numpy(self.tok_page[:, : self.n])

    @property
    def token_parent(self) -> torch.Tensor:
        """``LongTensor [H_kv, n]``: parent of each token as a local index (-1 = virtual root)."""
        return torch.from_numpy(self.parent[:, : self.n] - 1)

    @property
    def level_sizes(self) -> list[int]:
        """Points per level, level 0 first (inserted tokens are level 0)."""
        return level_sizes(self.level[: self.n])

    @property
    def max_sq_norm(self) -> torch.Tensor:
        """``[H_kv]`` running maximum squared key norm ``M^2`` (``src/dci.c``)."""
        return torch.from_numpy(self.m2)


def random_direction(dim: int, seed: int) -> torch.Tensor:
    """The single random unit direction ``u`` in ``R^{dim}`` (Gaussian, normalised, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    return (u / u.norm()).float()
