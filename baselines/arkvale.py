"""ArkVale (Chen et al., "ArkVale: Efficient Generative LLM Inference with Recallable Key-Value Eviction",
NeurIPS 2024); official code ``pku-liang/ArkVale``, ``source/arkvale/infer_state.py`` (``InferState``),
``source/arkvale/kv_cache.py`` (``KvCache._decode_alloc_1_page``), ``source/arkvale/adapter/modeling.py``
(``_arkvale_attn_forward``) and the kernels ``source/arkvale_cpp/src/estimate.cu``, ``select.cu``.

Budget mapping: ``page_budgets = budget / page_size`` pages stay resident per budgeted layer (``budget`` must be
a multiple of ``page_size``); every resident page is attended (the official decode asserts
``not use_sparse_attn``), the last one partially filled and holding the current token, so the past tokens
attended per head are ``budget - page_size + (tokens in the last page) - 1 <= budget - 1`` (logged as the
effective tokens). The pages are ``n_sink_pages`` sinks, ``n_win_pages`` window pages (the newest, the
partial one included) and ``page_budgets - n_sink_pages - n_win_pages`` pages recalled by score.

* **Digest** (paper Section 5.2, "bounding-cuboid"; ``InferState._summarize_keys``): per full page and KV
  head, the centre ``c = (max + min) / 2`` of its keys and a radius vector ``r``. The paper offers three
  radii: ``r_max = max_j |c - k_j|`` (``digest='cuboid_max'``, the keys' bounding box: "only r_max guarantees
  to enclose all points", so its score is an upper bound of ``q . k``), ``r_center = (min_j |c - k_j| +
  r_max) / 2`` (``cuboid_center``) and ``r_mean = mean_j |c - k_j|`` (``cuboid_mean``, the default: the one
  the official code computes and the best of the paper's Figure 7, 95% top-1 page recall, Section 6.2); the
  last two give a tighter box whose score is *not* an upper bound (a heuristic importance). The partial
  last page has no digest (the official digests a page when the next one starts).
* **Score** (``estimate.cu``, ``compute_cuboid_scores``): ``sum_i max(q_i (c_i + r_i), q_i (c_i - r_i))`` per
  query head, then the *mean* over the query heads of a selection group (``estimate_scores``: ``.mean(2)``).
  The official default ``n_groups = 1`` makes one group of every head: the layer selects one page set for
  all KV heads (a page holds every head's keys), which is what this port does.
* **Prefill** (``prefill_evict_extra_pages``): exact attention; every page is backed up to host memory
  (:class:`~icecache.kv.storage.HostKV`); when the prompt has more than ``page_budgets`` pages, the last
  prompt query scores the pages and the top ``page_budgets - n_sink - n_win`` of the pages between the sinks
  and the window stay resident.
* **Decode** (``KvCache._decode_alloc_1_page``): a token that starts a new page when every slot is used
  moves the just-filled page into window slot ``page_budgets - n_win + (evictions mod (n_win - 1))``,
  evicting the page held there (already backed up), and takes the last slot. Then, while the context has
  more pages than the budget, each step scores the digested pages and takes the top
  ``k = page_topks - n_sink - (n_win - 1)`` of those between the sinks and the window (``page_topks`` =
  ``page_budgets // 2`` by default, ``InferState``); each selected page that is not resident is recalled
  from host memory into the slot of the lowest-scored resident non-sink, non-window page (``select.cu``,
  ``SelectTopkKernel``; ``InferState.recall``). Then attention over every resident page.

Storage: the resident pages live in slots of buffers preallocated at ``page_budgets * page_size`` rows;
tokens and recalled pages are written in place (no concatenation of the cache). The slots are kept in page
order until the budget is reached, and the last slot always holds the newest page, so the resident rows are
always a prefix of the buffers. ``n_dense_layers`` leading layers are exempt (``InferState``
``n_unlimited_layers``: 0 by default, 2 in the official LongBench and passkey scripts).

Per suite (conf/suite_cache/): ``benchmark/longbench_pred.py`` passes ``--n-unlimited-layers 2`` (line 35),
``--page-topks 32`` (line 38) and ``--n-sink-pages 1`` (line 40); ``benchmark/passkey_pred.py`` passes
``--page-topks 32`` (line 139) and ``--n-unlimited-layers 2`` (line 140) and leaves the sink and window pages at
the ``InferState`` defaults. Both size ``--page-budgets 128`` pages of 32 (4096 tokens), where 32 of 128 pages are
selected; at this harness's 64-256 tokens a budget has 8 pages (256 at 32-token pages, 128 at 16, 64 at 8), which
the official ``InferState`` refuses for ``page_topks=32`` (it asserts ``page_topks < page_budgets``). The paper sets
``k = min(C, c / 2) / p`` pages for a cache of ``c`` tokens (Section 5.1), so the script's 32 is read as that cap
``C``: ``page_budgets // 2`` = 4 pages at these budgets, the same as the class default (:meth:`topk_of`).

The smallest budget at 32-token pages is 256 (8 pages: ``8 // 2 - 2 - 1 = 1`` scored page); smaller budgets
need smaller pages (``cache.page_size=16`` for 128, ``8`` for 64). A fractional budget (GSM8K's
``budget=0.1``) resolves to whole pages (:func:`evals.registry.budget_multiple`): 10% of GSM8K's 10-shot prompts
(3,380-3,482 tokens on Qwen2.5-Coder) is 10 pages of 32; a prompt under 2,560 tokens leaves fewer than 8 and is
refused. With these smaller pages ArkVale keeps its passkey accuracy at 128 and
64 tokens on SmolLM2-135M, recalling few pages per layer (docs/fidelity.md, "ArkVale", "Deviations").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from icecache.kv import BudgetError, Fetched, KVMethod, LayerState
from icecache.kv.attention import causal_attention
from icecache.kv.base import tensor_bytes
from icecache.kv.storage import HostKV, append_to_buffer

DIGESTS = ("cuboid_mean", "cuboid_center", "cuboid_max")


def page_digests(k: torch.Tensor, page_size: int, digest: str = "cuboid_mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Centre and radius ``[H, n // page_size, d]`` of the full pages of ``k: [H, n, d]`` (a partial tail is
    ignored): ``c = (max + min) / 2``; per dimension ``r = mean |c - k|`` (``cuboid_mean``, official
    ``_summarize_keys``), ``(min |c - k| + r_max) / 2`` (``cuboid_center``) or ``r_max = (max - min) / 2``
    (``cuboid_max``, the bounding box)."""
    h, n, d = k.shape
    pages = k[:, : n // page_size * page_size].float().reshape(h, -1, page_size, d)
    hi, lo = pages.amax(2), pages.amin(2)
    centre, r_max = (hi + lo) / 2, (hi - lo) / 2
    if digest == "cuboid_max":
        return centre, r_max
    dev = (centre[:, :, None] - pages).abs()
    return centre, dev.mean(2) if digest == "cuboid_mean" else (dev.amin(2) + r_max) / 2


def page_scores(q: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """ArkVale's page score ``[P]`` for the queries ``q: [H_q, d]``: the box bound ``sum_i max(q_i (c_i + r_i),
    q_i (c_i - r_i))`` per query head (query head ``h`` reads KV head ``h // G``), averaged over every query
    head (the official ``estimate_scores`` with ``n_groups = 1``)."""
    group = q.shape[0] // centre.shape[0]
    qf = q.float().reshape(centre.shape[0], group, 1, -1)  # [H_kv, G, 1, d]
    hi, lo = (centre + radius)[:, None], (centre - radius)[:, None]  # [H_kv, 1, P, d]
    return torch.maximum(qf * hi, qf * lo).sum(-1).mean((0, 1))


class ArkValeState(LayerState):
    """A budgeted layer: page slots ``kbuf, vbuf: [H_kv, slots * page_size, d]`` (``k``/``v`` are views of the
    used prefix), ``slot_page[s]`` = page in slot ``s`` (-1: free), ``page_slot[p]`` = slot of page ``p`` (-1:
    on the host only), the host backup of every token, and the digests ``centre, radius: [H_kv, P, d]``."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.slot_page = np.empty(0, dtype=np.int64)
        self.page_slot = np.empty(0, dtype=np.int64)
        self.used_slots = 0
        self.evictions = 0  # window rotations (official ``_evict_cnt``)
        self.recalls = 0  # pages recalled from the host
        self.host: HostKV | None = None
        self.centre: torch.Tensor | None = None
        self.radius: torch.Tensor | None = None
        self.page_scores: torch.Tensor | None = None  # this step's scores, on the host (select -> fetch)

    def set_page(self, page: int, slot: int) -> None:
        if page >= self.page_slot.size:
            grown = np.full(max(2 * self.page_slot.size, page + 1), -1, dtype=np.int64)
            grown[: self.page_slot.size] = self.page_slot
            self.page_slot = grown
        self.slot_page[slot], self.page_slot[page] = page, slot


@dataclass(frozen=True)
class ArkVale(KVMethod):
    """Recallable page eviction with bounding-box page digests.

    Args:
        budget: resident (and attended) tokens per budgeted layer, ``page_budgets * page_size``.
        page_size: tokens per page (official 32).
        n_sink_pages: first pages always resident (official ``InferState`` default 2).
        n_win_pages: newest pages always resident, the partial one included (official 2; at least 2).
        page_topks: pages selected per step, sinks and window included (0: ``page_budgets // 2``, the
            official default; the LongBench and passkey scripts pass 32, conf/suite_cache/). A value the
            official code would reject (not below ``page_budgets``) is read as the paper's cap ``C``:
            ``min(C, c/2) / p`` pages, i.e. ``page_budgets // 2`` (:meth:`topk_of`).
        digest: ``cuboid_mean`` (official radius, mean absolute deviation), ``cuboid_center`` or ``cuboid_max``
            (the bounding box; paper Section 5.2).
        n_dense_layers: first layers without a budget (official ``n_unlimited_layers``, default 0).
    """

    page_size: int = 32
    n_sink_pages: int = 2
    n_win_pages: int = 2
    page_topks: int = 0
    digest: str = "cuboid_mean"
    n_dense_layers: int = 0
    name: ClassVar[str] = "arkvale"
    example_budget: ClassVar[int] = 256

    # ------------------------------------------------------------------ configuration
    @property
    def page_budget(self) -> int:
        return self.budget // self.page_size

    def topk_of(self, pages: int) -> int:
        """Pages chosen by score per step for ``pages`` resident ones (official ``layer2topk``, sinks and the window
        less its newest page taken off): ``page_topks`` where the official code accepts it (``InferState`` asserts
        ``page_topks < page_budgets``), else ``pages // 2``, the paper's ``k = min(C, c/2) / p`` (Section 5.1) with
        the script's ``page_topks`` as ``C``; ``page_topks=0`` is the ``InferState`` default ``pages // 2``."""
        top = self.page_topks if 0 < self.page_topks < pages else pages // 2
        return top - self.n_sink_pages - (self.n_win_pages - 1)

    def validate(self) -> None:
        self.check_whole("page_size", "n_win_pages", minimum=1)
        self.check_whole("n_sink_pages", "page_topks", "n_dense_layers")
        self.check_choice("digest", DIGESTS)
        if self.n_win_pages < 2:
            raise ValueError(f"arkvale: n_win_pages must be at least 2 (official assert), got {self.n_win_pages}")
        if self.budget % self.page_size or self.topk_of(self.page_budget) < 1:
            valid = [p * self.page_size for p in range(1, self.budget // self.page_size + 4096)
                     if self.topk_of(p) >= 1]
            lower = [b for b in valid if b <= self.budget][-1:]
            upper = [b for b in valid if b >= self.budget][:1]
            raise BudgetError(
                f"arkvale: budget {self.budget} is not a valid page budget (a multiple of page_size="
                f"{self.page_size} leaving at least one scored page after {self.n_sink_pages} sink and "
                f"{self.n_win_pages} window pages, with page_topks={self.page_topks}: pages // 2 when 0 or not below "
                f"the pages); nearest valid budgets: {' or '.join(map(str, lower + upper))}")

    def is_budgeted(self, st: LayerState) -> bool:
        return st.layer_idx >= self.n_dense_layers

    def make_state(self, layer_idx: int) -> LayerState:
        return ArkValeState(layer_idx) if layer_idx >= self.n_dense_layers else LayerState(layer_idx)

    # ------------------------------------------------------------------ prefill
    def prefill(self, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = causal_attention(q, k, v, st.spec.scaling)
        if not self.is_budgeted(st):
            self.store(st, k, v)
            return out
        ps, slots, n = self.page_size, self.page_budget, k.shape[1]
        st.host = HostKV.copy_of(k, v)
        st.kbuf, st.vbuf = (k.new_empty(k.shape[0], slots * ps, k.shape[2]) for _ in range(2))
        st.slot_page = np.full(slots, -1, dtype=np.int64)
        n_pages = -(-n // ps)
        st.centre, st.radius = page_digests(k[:, : (n_pages - 1) * ps], ps, self.digest)
        if n_pages <= slots:
            keep = np.arange(n_pages)
        else:  # sinks + top pages by the last query's scores + window (official prefill_select_topk)
            ns, nw = self.n_sink_pages, self.n_win_pages
            scores = page_scores(q[:, -1], st.centre, st.radius)[ns: n_pages - nw]
            top = scores.topk(slots - ns - nw).indices.cpu().numpy() + ns
            keep = np.concatenate([np.arange(ns), top, np.arange(n_pages - nw, n_pages)])
        for slot, page in enumerate(keep):
            rows = slice(page * ps, min(n, (page + 1) * ps))
            st.kbuf[:, slot * ps: slot * ps + rows.stop - rows.start] = k[:, rows]
            st.vbuf[:, slot * ps: slot * ps + rows.stop - rows.start] = v[:, rows]
            st.set_page(int(page), slot)
        st.used_slots = len(keep)
        self._set_views(st)
        return out

    def _set_views(self, st: ArkValeState) -> None:
        """``st.k``/``st.v``: the used prefix of the slots (the last used slot holds the newest page)."""
        rows = (st.used_slots - 1) * self.page_size + (st.n_seen - 1) % self.page_size + 1
        st.k, st.v = st.kbuf[:, :rows], st.vbuf[:, :rows]

    # ------------------------------------------------------------------ decode
    def append(self, st: LayerState, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.is_budgeted(st):
            return self.store(st, k, v)
        ps, t = self.page_size, st.n_seen - 1
        st.host.append(k, v)  # every token is backed up (the official backs up each page when it fills)
        page, offset = divmod(t, ps)
        if offset == 0:
            self.start_page(st, page)
        slot = st.page_slot[page]
        st.kbuf[:, slot * ps + offset] = k[:, 0]
        st.vbuf[:, slot * ps + offset] = v[:, 0]
        self._set_views(st)

    def start_page(self, st: ArkValeState, page: int) -> None:
        """Page ``page`` starts: digest the page just filled; take a free slot, or rotate the window
        (official ``_decode_alloc_1_page``: the filled page moves into a window slot, evicting its page)."""
        ps, slots, nw = self.page_size, self.page_budget, self.n_win_pages
        filled = st.kbuf[:, st.page_slot[page - 1] * ps: (st.page_slot[page - 1] + 1) * ps]
        centre, radius = page_digests(filled, ps, self.digest)
        st.buffers["centre"], st.centre = append_to_buffer(st.buffers.get("centre"), st.centre, centre)
        st.buffers["radius"], st.radius = append_to_buffer(st.buffers.get("radius"), st.radius, radius)
        if st.used_slots < slots:
            st.set_page(page, st.used_slots)
            st.used_slots += 1
            return
        e = slots - nw + st.evictions % (nw - 1)
        st.evictions += 1
        last = slice((slots - 1) * ps, slots * ps)
        st.kbuf[:, e * ps: (e + 1) * ps] = st.kbuf[:, last]
        st.vbuf[:, e * ps: (e + 1) * ps] = st.vbuf[:, last]
        st.page_slot[st.slot_page[e]] = -1
        st.set_page(page - 1, e)
        st.set_page(page, slots - 1)

    def select(self, st: LayerState, q: torch.Tensor) -> np.ndarray | None:
        """The pages to have resident this step (``[k]`` page ids), or None (dense layer, or a context that
        fits the budget)."""
        if not self.is_budgeted(st) or st.centre.shape[1] < self.page_budget:
            return None
        ns, nw = self.n_sink_pages, self.n_win_pages
        n_digests = st.centre.shape[1]  # the pages before the newest
        scores = page_scores(q[:, 0], st.centre, st.radius).cpu()  # one host read (the official reads rids)
        st.page_scores = scores
        top = scores[ns: n_digests + 1 - nw].topk(self.topk_of(self.page_budget)).indices.numpy() + ns
        return top

    def fetch(self, st: LayerState, selection: np.ndarray | None) -> Fetched:
        if selection is not None:
            self.recall(st, selection, st.page_scores)
        return Fetched(st.k, st.v)

    def attended_positions(self, st: LayerState, selection: np.ndarray | None) -> torch.Tensor:
        """``[m]``: the positions of the used slots' rows (every KV head holds the same pages), in slot order."""
        if not isinstance(st, ArkValeState):
            return st.pos
        rows = np.arange(st.k.shape[1])
        return torch.from_numpy(st.slot_page[rows // self.page_size] * self.page_size + rows % self.page_size)

    def recall(self, st: ArkValeState, selected: np.ndarray, scores: torch.Tensor) -> None:
        """Recalls the selected pages that are not resident, each into the slot of the lowest-scored
        resident page between the sinks and the window (the selected ones excepted)."""
        missing = selected[st.page_slot[selected] < 0]
        if not missing.size:
            return
        ps, ns, nw = self.page_size, self.n_sink_pages, self.n_win_pages
        middle = np.arange(ns, self.page_budget - nw)
        resident_scores = scores[torch.from_numpy(st.slot_page[middle])].clone()
        resident_scores[torch.from_numpy(np.isin(st.slot_page[middle], selected))] = float("inf")
        victims = middle[resident_scores.topk(missing.size, largest=False).indices.numpy()]
        positions = (missing[:, None] * ps + np.arange(ps)).ravel()
        k, v = st.host.gather(np.broadcast_to(positions, (st.kbuf.shape[0], positions.size)))
        k, v = k.to(st.kbuf.device, non_blocking=True), v.to(st.vbuf.device, non_blocking=True)
        for i, (page, slot) in enumerate(zip(missing, victims)):
            st.kbuf[:, slot * ps: (slot + 1) * ps] = k[:, i * ps: (i + 1) * ps]
            st.vbuf[:, slot * ps: (slot + 1) * ps] = v[:, i * ps: (i + 1) * ps]
            st.page_slot[st.slot_page[slot]] = -1
            st.set_page(int(page), int(slot))
        st.recalls += int(missing.size)
        st.bytes_moved += 2 * k.numel() * k.element_size()

    # ------------------------------------------------------------------ accounting
    def layer_memory(self, st: LayerState) -> dict[str, int]:
        """Budgeted layers: the page slots (``budget`` tokens, allocated at prefill) on the device, every token's
        backup on the host, the page digests as index; dense layers: their K/V on the device."""
        if not isinstance(st, ArkValeState) or st.host is None:
            return super().layer_memory(st)
        return {"device_kv_bytes": tensor_bytes(st.kbuf, st.vbuf),
                "host_kv_bytes": tensor_bytes(st.host.keys(), st.host.values()),
                "index_bytes": tensor_bytes(st.centre, st.radius)}

    def layer_stats(self, st: LayerState) -> dict[str, float]:
        if not isinstance(st, ArkValeState):
            return {}
        return {"recalled_pages": float(st.recalls), "window_evictions": float(st.evictions)}
