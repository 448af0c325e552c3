"""IceCache (Mao, Wang, Ester, Li, "IceCache: Memory-efficient KV-cache Management for Long-Sequence
LLMs", ICLR 2026, arXiv 2604.10539) and IceCache(reuse); spec: reference/icecache.md §1, §4, §5.

Regions of a budgeted layer (§1), in pages of ``page_size`` tokens, all on the device:

    [ sink: n_sink pages | K retrieved page slots per KV head | window: n_window pages ]

They are one persistent buffer per layer (``res_k, res_v [H_kv, R, d]`` and ``res_valid [H_kv, R]``), so
attention reads the resident set in place: a page load writes into its slot, a new token into its
window slot, and nothing is concatenated per step. The window region is a ring of ``n_window`` pages
(position ``p`` lives in ring page ``(p // page_size) % n_window``); attention is a set operation over
RoPE'd keys, so the order of the slots does not matter.

The budget ``B`` tokens = ``B / page_size`` pages, sink and window included, so ``K = B/page_size -
n_sink - n_window``. Every other token is *offloaded*: its K/V live in an :class:`~icecache.offload.
OffloadStore` (host memory, pinned on CUDA) and its key in the layer's M-DCI index (``icecache.dci``),
whose pages are groups of semantically close sibling tokens.

* Prefill (§5): exact full causal attention; then the layer's job goes to the background worker:
  move the offloaded tokens (everything but the sink pages and the last ``n_window`` token-order pages)
  into the offload store and build the M-DCI index over them (token ids = absolute positions). The
  layer's first decode step awaits the job, so the build shows in TT2T, and while layer ``i+1``
  computes the worker builds layer ``i`` (pipelined prefill). A prompt of at most ``B`` tokens is
  not indexed (official fallback): the layer attends everything until its context first exceeds
  ``B`` tokens, then offloads and builds the index at that step (the official code never indexes after
  prefill and lets the table outgrow the budget; we keep the budget).
* Decode (§4): the new token joins the window. One index search per query head (``K`` pages,
  field of view from the sequence length), GQA merge per KV head (rank-interleaved, capped at ``K``:
  ``gqa_merge="interleaved"``, official; ``"union"`` keeps the whole union, an ablation that attends
  up to ``group * K`` pages per KV head, i.e. over the budget). Pages already resident in a slot and
  not changed since keep their slot; only new or changed pages are bulk-loaded (one packed transfer,
  :meth:`OffloadStore.bulk_load`) into the slots freed by pages that dropped out. Attention runs over
  sink + selected pages + window, the empty slots of under-filled pages masked (head axis ``H_kv``).
* Window eviction (§4 "New tokens"): when a new token finds the window's pages all full, the oldest
  window page leaves the window first: its K/V go to the offload store and its keys are inserted into
  the index before this step's search (where the official code's staged insert lands); the pages the
  insert changed are marked stale, so a resident copy is refetched when selected again. The window
  thus holds between ``(n_window - 1) * page_size + 1`` and ``n_window * page_size`` tokens at
  attention, the current one included.

Budget layouts (§1, §9 "64-token budget"): ``budget_layout="auto"`` (default) lowers the sink to as
few as one page when the budget would otherwise leave no retrieved page, so 64 tokens with 16-token
pages = (1 sink, 1 retrieved, 2 window) — the setting of reference §10's measurements — while 80
tokens and up keep (2 sink, 2 window, K); ``"fixed"`` uses ``n_sink_pages`` as given. The other
option the reference lists, 8-token pages at 64 tokens (2+4+2 pages), is ``page_size=8``.

Accounting: :meth:`resident_tokens` counts the device-side resident set of a budgeted layer, sink +
every retrieved slot's capacity + window (at most ``B`` tokens between steps; at attention at most
``B - 1`` past tokens plus the current one, since a full window evicts before the new token); the offload
store is not resident. ``state.bytes_moved`` (total) and ``state.step_bytes`` (last step) count the
bytes copied from the store to the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from icecache.dci import DCIConfig, MDCIIndex, merge_gqa
from icecache.dci.gqa import MERGE_MODES, SCORED_MODES
from icecache.kv import BudgetError, Fetched, KVMethod, LayerState, ModelSpec
from icecache.offload import OffloadStore


class IceState(LayerState):
    """One layer: before offloading, the inherited ``k, v, pos`` hold every token (dense layers always);
    after, the device holds the resident buffer ``res_*`` = sink | page slots | window ring."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.offloaded = False
        self.res_k = self.res_v = None  # [H_kv, R, d] resident buffer (device)
        self.res_valid: torch.Tensor | None = None  # [H_kv, R] attended entries
        self.n_sink_tokens = 0  # sink region = res[:, :n_sink_tokens]
        self.win_offset = 0  # window ring = res[:, win_offset:]
        self.win_start = 0  # oldest window position; the window holds win_start .. win_start + win_len - 1
        self.win_len = 0
        self.slot_k = self.slot_v = None  # [H_kv, W, s, d] views of the slot region of res_*
        self.slot_page: torch.Tensor | None = None  # [H_kv, W] page id held per slot, -1 = empty
        self.slot_tokens: torch.Tensor | None = None  # [H_kv, W, s] absolute positions, -1 = empty
        self.store: OffloadStore | None = None
        self.index: MDCIIndex | None = None  # anchors only
        self.selection: torch.Tensor | None = None  # [H_kv, W] pages selected at step ``selected_at``
        self.candidates: torch.Tensor | None = None  # [H_kv, C >= W] the merged candidates, best first
        self.selected_at = -1
        self.changed: torch.Tensor | None = None  # [H_kv, n_pages] pages changed by the last insert
        self.changed_at = -1
        self.bytes_moved = 0
        self.step_bytes = 0


def official_preset(budget: int) -> dict:
    """The official scripts' settings (``run_longbench.sh``, ``passkey_pred.py``): 16-token pages, the
    rank-interleaved ``first_k_unique`` GQA merge and ``q_prop_to_retrieve = 0.8`` at every budget. At 64
    tokens, where the official code asserts, ``budget_layout="auto"`` gives 1 sink + 1 retrieved + 2 window
    pages."""
    return {"page_size": 16, "gqa_merge": "interleaved", "prop_to_retrieve": 0.8}


def budget_preset(budget: int) -> dict:
    """This project's defaults, chosen from the ablation in docs/benchmarks.md ("IceCache at small budgets"):
    below 256 tokens 8-token pages (64 tokens = 2 sink + 4 retrieved + 2 window pages of 8; 128 = 2 + 12 + 2)
    and every child of an expanded node scored (``prop_to_retrieve = 1``), from 256 on the official values;
    the official merge throughout. With the official 16-token pages, 64 tokens leave 1 sink + 1 retrieved + 2
    window pages: a needle written one token per digit straddles pages, and the rank-interleaved merge then
    serves only the group's first query head. With few pages per head, the official partial scoring of large
    nodes (80%) missed the needle's page on pass keys that full found. 4-token pages had a higher attention
    recall still, but a window of 5-8 tokens and missed a pass key that full found."""
    if budget < 256:
        return {"page_size": 8, "gqa_merge": "interleaved", "prop_to_retrieve": 1.0}
    return {"page_size": 16, "gqa_merge": "interleaved", "prop_to_retrieve": 0.8}


PRESETS = {"budget": budget_preset, "official": official_preset}


@dataclass
class IceCache(KVMethod):
    """Paged offloading with M-DCI page retrieval.

    Args:
        budget: past tokens per head per step in a budgeted layer, a multiple of ``page_size`` (sink and
            window included; 256 = 2 sink + 12 retrieved + 2 window pages).
        preset: where ``page_size``, ``gqa_merge`` and ``prop_to_retrieve`` come from when not given (``None``):
            ``"budget"`` (default, :func:`budget_preset`: chosen per budget from this project's ablation) or
            ``"official"`` (:func:`official_preset`: the official scripts' values at every budget).
        page_size: tokens per page = M-DCI leaf capacity (16 in every official script; ``None``: preset).
        n_sink_pages: first pages always resident (official 2; see ``budget_layout``).
        n_window_pages: most recent pages always resident, the last one being filled (official 2, >= 2).
        budget_layout: ``"auto"``: fewer sink pages (down to 1) when the budget leaves no retrieved page
            (64 tokens -> 1 sink + 1 retrieved + 2 window pages); ``"fixed"``: ``n_sink_pages`` as given.
        n_dense_layers: first layers kept dense (official ``n_unlimited_layers`` = 2).
        gqa_merge: ``"interleaved"`` (official ``first_k_unique``, capped at ``K`` pages per KV head),
            ``"union"`` (every page any query head of the group selected; over the budget by design), or the
            group-level merges within the budget ``"mass"`` / ``"max"`` (:func:`~icecache.dci.merge_gqa`);
            ``None``: preset.
        gqa_candidates: pages each query head reports to the ``mass``/``max`` merges (0: ``group * K``).
        always_index: also index prompts of at most ``budget`` tokens (official: only longer ones); with a
            budget that covers the context, every page is then retrieved through the index.
        prop_to_retrieve: share of an expanded node's children scored (official 0.8; ``None``: preset).
        ratio_1, ratio_2, search_ratio, min_fov, seed: M-DCI parameters
            (:class:`~icecache.dci.DCIConfig`; defaults of the official LongBench/passkey scripts). Every
            layer uses the same ``seed``, hence one projection direction shared by all layers and heads,
            as the official code draws one per prefill.
    """

    preset: str = "budget"
    page_size: int | None = None
    n_sink_pages: int = 2
    n_window_pages: int = 2
    budget_layout: str = "auto"
    n_dense_layers: int = 2
    gqa_merge: str | None = None
    gqa_candidates: int = 0
    always_index: bool = False
    ratio_1: float = 0.01
    ratio_2: float = 0.2
    search_ratio: float = 1.5e-3
    min_fov: int = 30
    prop_to_retrieve: float | None = None
    seed: int = 0
    name: ClassVar[str] = "icecache"
    example_budget: ClassVar[int] = 128
    _states: dict = field(default_factory=dict, init=False, repr=False)

    # ------------------------------------------------------------------ configuration
    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"{self.name}: preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        if self.budget is not None and self.budget > 0:
            for key, value in PRESETS[self.preset](self.budget).items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
        super().__post_init__()

    def layout(self) -> tuple[int, int, int]:
        """``(sink, window, retrieved)`` pages of the budget."""
        pages = self.budget // self.page_size
        sink = self.n_sink_pages
        if self.budget_layout == "auto":
            sink = min(sink, max(1, pages - self.n_window_pages - 1))
        return sink, self.n_window_pages, pages - sink - self.n_window_pages

    def validate(self) -> None:
        for key in ("page_size", "n_sink_pages", "n_window_pages", "n_dense_layers", "gqa_candidates"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int):
                raise ValueError(f"{self.name}: {key} must be a whole number, got {getattr(self, key)!r}")
        if self.budget_layout not in ("auto", "fixed"):
            raise ValueError(f"{self.name}: budget_layout must be 'auto' or 'fixed', got {self.budget_layout!r}")
        if self.gqa_merge not in MERGE_MODES:
            raise ValueError(f"{self.name}: gqa_merge must be one of {MERGE_MODES}, got {self.gqa_merge!r}")
        if self.gqa_candidates < 0:
            raise ValueError(f"{self.name}: gqa_candidates must be >= 0 (0 = group * K), got {self.gqa_candidates}")
        if self.n_window_pages < 2 or self.n_sink_pages < 0 or self.page_size < 2:
            raise ValueError(f"{self.name}: needs n_window_pages >= 2 (official assertion), n_sink_pages >= 0 "
                             "and page_size >= 2")
        s = self.page_size
        smallest = (min(self.n_sink_pages, 1) if self.budget_layout == "auto" else self.n_sink_pages)
        smallest = (smallest + self.n_window_pages + 1) * s
        if self.budget % s or self.layout()[2] < 1:
            near = sorted({max(smallest, self.budget // s * s), max(smallest, -(-self.budget // s) * s)})
            raise BudgetError(f"{self.name}: budget {self.budget} is invalid: it must be a multiple of "
                              f"page_size={s} leaving sink ({self.layout()[0]} pages) + window "
                              f"({self.n_window_pages} pages) + at least one retrieved page; nearest valid "
                              f"budgets: {' or '.join(map(str, near))}")

    def bind(self, spec: ModelSpec) -> None:
        super().bind(spec)
        self.n_slots = self.layout()[2] * (spec.group if self.gqa_merge == "union" else 1)

    def dci_config(self) -> DCIConfig:
        return DCIConfig(page_size=self.page_size, ratio_1=self.ratio_1, ratio_2=self.ratio_2,
                         search_ratio=self.search_ratio, min_fov=self.min_fov,
                         prop_to_retrieve=self.prop_to_retrieve, seed=self.seed)

    def new_state(self, layer_idx: int) -> IceState:
        self._states[layer_idx] = IceState(layer_idx)
        return self._states[layer_idx]

    def is_budgeted(self, layer_idx: int) -> bool:
        return layer_idx >= self.n_dense_layers

    def index_threshold(self) -> int:
        """A budgeted layer offloads once it holds more tokens than this (official: ``B``)."""
        sink, window, _ = self.layout()
        return (sink + window) * self.page_size if self.always_index else self.budget

    # ------------------------------------------------------------------ cross-layer hooks (reuse)
    def builds_index(self, layer_idx: int) -> bool:
        return True

    def page_source(self, st: IceState) -> IceState:
        """The state whose index lays out this layer's pages (itself; the anchor in IceCache(reuse))."""
        return st

    def candidate_width(self, k: int) -> int:
        """Pages per KV head the search hands on (``K``; more in IceCache(reuse) with ``rerank``)."""
        return k

    # ------------------------------------------------------------------ prefill (§5)
    def finish_prefill(self, st: IceState) -> None:
        if self.is_budgeted(st.layer_idx) and st.n_seen > self.index_threshold():
            self.offload(st, background=True)

    def offload(self, st: IceState, background: bool) -> None:
        """Splits the resident tokens into sink | offloaded | window and starts the offload job."""
        s, n = self.page_size, st.n_seen
        sink_pages, window_pages, _ = self.layout()
        first, w0 = sink_pages * s, (-(-n // s) - window_pages) * s
        k, v = st.k, st.v
        h, _, d = k.shape
        st.n_sink_tokens, st.win_offset = first, first + self.n_slots * s
        size = st.win_offset + window_pages * s
        st.res_k = torch.zeros(h, size, d, dtype=k.dtype, device=k.device)
        st.res_v = torch.zeros_like(st.res_k)
        st.res_valid = torch.zeros(h, size, dtype=torch.bool, device=k.device)
        st.res_k[:, :first], st.res_v[:, :first], st.res_valid[:, :first] = k[:, :first], v[:, :first], True
        st.slot_k = st.res_k[:, first: st.win_offset].view(h, self.n_slots, s, d)
        st.slot_v = st.res_v[:, first: st.win_offset].view(h, self.n_slots, s, d)
        st.win_start, st.win_len = w0, 0
        self.window_write(st, k[:, w0:], v[:, w0:])
        st.slot_page = torch.full((h, self.n_slots), -1, dtype=torch.long)
        st.slot_tokens = torch.full((h, self.n_slots, s), -1, dtype=torch.long)
        k_buf, v_buf = st.buffers.pop("k"), st.buffers.pop("v")  # row p = position p (nothing evicted yet)
        st.k = st.v = st.pos = None
        st.offloaded = True
        job = (self.offload_job, st, k_buf, v_buf, first, w0)
        if background:
            self.submit_background(st, *job)
        else:
            job[0](*job[1:])

    def offload_job(self, st: IceState, k_buf: torch.Tensor, v_buf: torch.Tensor, first: int, end: int) -> None:
        """Background job: positions ``first .. end - 1`` of the prefill buffers become the offload store
        (taken over without a copy on CPU, copied to pinned host memory on CUDA), then (anchors) the M-DCI
        index is built over their keys."""
        st.store = OffloadStore.adopt(k_buf, v_buf, first, end, k_buf.device, k_buf.shape[0] * self.n_slots,
                                      self.page_size)
        if self.builds_index(st.layer_idx):
            st.index = MDCIIndex.build(st.store.keys(), torch.arange(first, end), self.dci_config())

    # ------------------------------------------------------------------ decode (§4)
    def append(self, st: IceState, k: torch.Tensor, v: torch.Tensor) -> None:
        if not st.offloaded:
            super().append(st, k, v)
            return
        if st.win_len >= self.n_window_pages * self.page_size:  # window full: the oldest page leaves
            self.evict_oldest_window_page(st)
        self.window_write(st, k, v)

    def evict_oldest_window_page(self, st: IceState) -> None:
        """The oldest window page goes to the offload store and (anchors) into the index, before this
        step's search, as the official code inserts it; resident copies of the pages it changed go stale."""
        s = self.page_size
        positions = torch.arange(st.win_start, st.win_start + s)
        oldest = self.window_slots(st, positions).to(st.res_k.device)
        k, v = torch.stack((st.res_k[:, oldest], st.res_v[:, oldest])).cpu()  # one device-to-host copy
        st.store.append(k, v)
        st.res_valid[:, oldest] = False
        st.win_start, st.win_len = st.win_start + s, st.win_len - s
        self.mark_stale(st, self.insert_evicted(st, k, positions))

    def window_slots(self, st: IceState, positions):
        """Indices into ``res_*`` of window positions (ring of ``n_window_pages`` pages); a LongTensor of
        positions gives a LongTensor, one int position gives an int."""
        s = self.page_size
        return st.win_offset + (positions // s) % self.n_window_pages * s + positions % s

    def window_write(self, st: IceState, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes ``k, v [H_kv, m, d]`` at the next ``m`` window positions."""
        start = st.win_start + st.win_len
        if k.shape[1] == 1:  # a decode step: one slot, plain indexing
            slot = self.window_slots(st, start)
            st.res_k[:, slot], st.res_v[:, slot], st.res_valid[:, slot] = k[:, 0], v[:, 0], True
        else:
            slots = self.window_slots(st, torch.arange(start, start + k.shape[1])).to(st.res_k.device)
            st.res_k[:, slots], st.res_v[:, slots], st.res_valid[:, slots] = k, v, True
        st.win_len += k.shape[1]

    def insert_evicted(self, st: IceState, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inserts the host keys ``[H_kv, s, d]`` evicted from the window; returns the changed-page flags."""
        st.changed, st.changed_at = st.index.insert(keys, positions), st.n_seen
        return st.changed

    @staticmethod
    def mark_stale(st: IceState, changed: torch.Tensor) -> None:
        """Resident pages whose content changed lose their slot (refetched when selected again)."""
        held = st.slot_page
        stale = (held >= 0) & changed.gather(1, held.clamp_min(0))
        held[stale] = -1
        st.slot_tokens[stale] = -1

    def select(self, st: IceState, q: torch.Tensor) -> torch.Tensor | None:
        """Page ids ``[H_kv, W]`` (-1 padded) for this step, or None (dense / not yet offloaded)."""
        if not st.offloaded:
            return None
        k, queries = self.layout()[2], q[:, 0].float().cpu()
        width = self.candidate_width(k)
        if self.gqa_merge in SCORED_MODES:
            n_cand = max(k, self.gqa_candidates or self.spec.group * k, width)
            pages, scores = st.index.search_scored(queries, k, n_cand, n_seq=st.n_seen)
            st.candidates = merge_gqa(pages, self.spec.group, width, self.gqa_merge, scores, self.spec.scaling)
        else:
            pages = st.index.search_scored(queries, k, width, n_seq=st.n_seen)[0]  # = search() when width == K
            st.candidates = merge_gqa(pages, self.spec.group, width, mode=self.gqa_merge)
        # both merges are prefix-stable: the first K of a list capped at ``width`` are the list capped at K
        st.selection = st.candidates if self.gqa_merge == "union" else st.candidates[:, :k]
        st.selected_at = st.n_seen
        return st.selection

    def fetch(self, st: IceState, selection: torch.Tensor | None) -> Fetched:
        if selection is None:
            return Fetched(st.k, st.v)
        heads, pages, slots = self.assign_slots(st, selection)
        st.step_bytes = 0
        if heads.size:
            positions = self.page_source(st).index.page_abs[heads, pages]  # numpy [N, s]
            k, v = st.store.bulk_load(heads, positions)
            dev = st.slot_k.device
            dev_heads, dev_slots = torch.from_numpy(heads).to(dev), torch.from_numpy(slots).to(dev)
            st.slot_k[dev_heads, dev_slots], st.slot_v[dev_heads, dev_slots] = k, v
            st.slot_tokens.numpy()[heads, slots] = positions
            st.step_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        st.bytes_moved += st.step_bytes
        return self.resident_kv(st)

    @staticmethod
    def assign_slots(st: IceState, selection: torch.Tensor):
        """Keeps selected pages already resident in their slots, frees the others and gives the missing
        pages free slots (lowest free slot first); returns the ``(heads, pages, slots)`` to load
        (int64 numpy arrays, possibly empty). Vectorised over KV heads in numpy (the arrays are tiny and torch's
        per-op overhead dominated): ``selection [H_kv, K']``, -1 padded, distinct ids per head."""
        held, want = st.slot_page.numpy(), selection.numpy()  # views: ``held`` is updated in place
        keep = (held[:, :, None] == want[:, None, :]).any(-1) & (held >= 0)
        held[~keep] = -1
        st.slot_tokens.numpy()[~keep] = -1
        missing = (want >= 0) & ~(want[:, :, None] == held[:, None, :]).any(-1)
        free = ~keep & (np.cumsum(~keep, 1) <= missing.sum(1, keepdims=True))  # the first n_missing free slots
        heads, col = missing.nonzero()
        slots = free.nonzero()[1]  # row-major, so aligned with (heads, col) head by head
        pages = want[heads, col]
        held[heads, slots] = pages
        return heads, pages, slots

    def resident_kv(self, st: IceState) -> Fetched:
        """The resident buffer in place: sink + page slots + window (current token included), the empty
        slots of under-filled or unused pages and unused window slots masked."""
        h, w, s, _ = st.slot_k.shape
        filled = st.slot_tokens >= 0
        st.res_valid[:, st.n_sink_tokens: st.win_offset] = filled.view(h, w * s).to(st.res_valid.device)
        n_past = st.n_sink_tokens + np.count_nonzero(filled.numpy()) / h + st.win_len - 1  # host count, no sync
        return Fetched(st.res_k, st.res_v, st.res_valid, n_past=n_past)

    def attended_positions(self, st: IceState) -> torch.Tensor:
        """Absolute positions ``[H_kv, R]`` of :meth:`resident_kv`'s entries, -1 where masked (to measure
        attention recall, and for tests)."""
        h = st.slot_tokens.shape[0]
        window = torch.full((h, st.res_k.shape[1] - st.win_offset), -1, dtype=torch.long)
        positions = torch.arange(st.win_start, st.win_start + st.win_len)
        window[:, self.window_slots(st, positions) - st.win_offset] = positions
        return torch.cat([torch.arange(st.n_sink_tokens).expand(h, -1), st.slot_tokens.view(h, -1), window], dim=1)

    def observe(self, st: IceState, q, fetched, selection) -> None:
        if not self.is_budgeted(st.layer_idx):
            return
        if not st.offloaded and st.n_seen > self.index_threshold():
            self.offload(st, background=False)

    # ------------------------------------------------------------------ accounting
    def resident_tokens(self, st: IceState) -> int:
        if not st.offloaded:
            return st.resident_tokens()
        return st.n_sink_tokens + st.slot_k.shape[1] * self.page_size + st.win_len

    def resident_bound(self) -> int:
        """Most resident past tokens allowed: the budget, or its union-merge extension (ablation)."""
        return self.budget + (self.n_slots - self.layout()[2]) * self.page_size

    def check_resident(self, st: IceState) -> None:
        if self.is_budgeted(st.layer_idx) and self.resident_tokens(st) > self.resident_bound():
            raise AssertionError(f"{self.name}: layer {st.layer_idx} holds {self.resident_tokens(st)} resident "
                                 f"tokens, over the bound of {self.resident_bound()} (budget {self.budget})")


@dataclass
class IceCacheReuse(IceCache):
    """IceCache(reuse) (§4, official ``--n_reuse_layers``): an anchor layer's page selection is reused by
    the next ``n_reuse_layers - 1`` layers, which build no index and run no search but load *their own*
    K/V of the anchor's pages (gathered from their own store through the anchor's page table).

    Anchors (official ``check_reuse``, with the first budgeted layer ``n_dense_layers`` in place of the
    hard-coded 2): layers ``<= n_dense_layers``, then every layer with ``(l - n_dense_layers) mod N == 0``.

    Re-ranking (``rerank = m >= 2``, this project's extension; ``0`` = official): the anchor's search hands
    on ``m * K`` merged candidate pages per KV head (its own selection is their first ``K``), and each
    reusing layer attends the ``K`` candidates on which its own queries put the most exact softmax mass
    (:meth:`rerank_pages`, computed from the layer's own keys in its offload store). Only the anchor
    searches the index, as in the official reuse; the transfer and the budget stay those of ``K`` pages.
    Copying the anchor's pages loses what the reusing layers attend differently: on SmolLM2 passkey at 64
    tokens the official reuse scores 25-30% where IceCache scores 100% (docs/benchmarks.md).

    Args:
        n_reuse_layers: ``N``, layers sharing one anchor's selection, the anchor included (scripts: 3).
        rerank: ``0`` (official): reusing layers attend the anchor's selection; ``m >= 2``: they re-rank the
            anchor's ``m * K`` candidates with their own queries.
    """

    n_reuse_layers: int = 3
    rerank: int = 3
    name: ClassVar[str] = "icecache_reuse"

    def validate(self) -> None:
        if self.n_reuse_layers < 1:
            raise ValueError(f"{self.name}: n_reuse_layers must be >= 1, got {self.n_reuse_layers}")
        if self.rerank < 0 or self.rerank == 1:
            raise ValueError(f"{self.name}: rerank must be 0 (official) or >= 2 candidates per page, got {self.rerank}")
        if self.rerank and self.gqa_merge == "union":
            raise ValueError(f"{self.name}: rerank needs a merge within the budget, not gqa_merge='union'")
        super().validate()

    def candidate_width(self, k: int) -> int:
        return self.rerank * k if self.rerank else k

    def anchor_of(self, layer_idx: int) -> int:
        first = self.n_dense_layers
        return layer_idx if layer_idx <= first else layer_idx - (layer_idx - first) % self.n_reuse_layers

    def builds_index(self, layer_idx: int) -> bool:
        return self.anchor_of(layer_idx) == layer_idx

    def page_source(self, st: IceState) -> IceState:
        return self._states[self.anchor_of(st.layer_idx)]

    def insert_evicted(self, st: IceState, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        anchor = self.page_source(st)
        if anchor is st:
            return super().insert_evicted(st, keys, positions)
        if anchor.changed_at != st.n_seen:
            raise RuntimeError(f"{self.name}: layer {st.layer_idx} evicted a window page that its anchor "
                               f"{anchor.layer_idx} did not insert at this step")
        return anchor.changed

    def select(self, st: IceState, q: torch.Tensor) -> torch.Tensor | None:
        anchor = self.page_source(st)
        if anchor is st or not st.offloaded:
            return super().select(st, q)
        if anchor.selected_at != st.n_seen:
            raise RuntimeError(f"{self.name}: anchor layer {anchor.layer_idx} made no selection at this step")
        if not self.rerank:
            return anchor.selection
        st.selection = self.rerank_pages(st, q, anchor)
        return st.selection

    def rerank_pages(self, st: IceState, q: torch.Tensor, anchor: IceState) -> torch.Tensor:
        """The ``K`` of the anchor's candidate pages ``[H_kv, C]`` with the most attention of this layer's query
        group: per query head the exact softmax over every token of the candidates (this layer's own keys),
        summed per page and over the group; -1 candidates are never chosen."""
        cand = anchor.candidates.numpy()
        h, group = cand.shape[0], self.spec.group
        positions = anchor.index.page_abs[np.arange(h)[:, None], cand.clip(0)]  # [H_kv, C, s]
        valid = torch.from_numpy((positions >= 0) & (cand >= 0)[..., None])
        rows = torch.from_numpy(np.where(valid.numpy(), positions - st.store.first_pos, 0))
        keys = st.store.keys()[torch.arange(h)[:, None, None], rows].float()  # [H_kv, C, s, d]
        queries = q[:, 0].float().cpu().view(h, group, -1)
        logits = torch.einsum("hgd,hcsd->hgcs", queries, keys) * self.spec.scaling
        logits = logits.masked_fill(~valid[:, None], float("-inf"))
        probs = logits.flatten(2).softmax(-1).view(logits.shape).nan_to_num(0.0)
        mass = probs.sum(-1).sum(1).masked_fill(torch.from_numpy(cand < 0), -1.0)  # [H_kv, C]
        best = mass.topk(min(self.layout()[2], cand.shape[1]), dim=-1).indices
        return torch.from_numpy(cand).gather(1, best)
