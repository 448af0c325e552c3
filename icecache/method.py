"""IceCache (Mao, Wang, Ester, Li, "IceCache: Memory-efficient KV-cache Management for Long-Sequence
LLMs", ICLR 2026, arXiv 2604.10539) and IceCache(reuse); official code: the IceCache repository's
``source/icecache/infer_state.py`` and ``kv_cache.py``.

Regions of a budgeted layer (official ``kv_cache.py``), in pages of ``page_size`` tokens, all on the device:

    [ sink: n_sink pages | K retrieved page slots per KV head | window: n_window pages ]

They are one persistent buffer per layer (:class:`~icecache.resident.ResidentBuffer`), so
attention reads the resident set in place: a page load writes into its slot, a new token into its
window slot, and nothing is concatenated per step. The window region is a ring of ``n_window`` pages
(position ``p`` lives in ring page ``(p // page_size) % n_window``); attention is a set operation over
RoPE'd keys, so the order of the slots does not matter.

The budget ``B`` tokens = ``B / page_size`` pages, sink and window included, so ``K = B/page_size -
n_sink - n_window``. Every other token is *offloaded*: its K/V live in an :class:`~icecache.offload.
OffloadStore` (host memory, pinned on CUDA) and its key in the layer's M-DCI index (``icecache.dci``),
whose pages are groups of semantically close sibling tokens.

* Prefill (official ``infer_state.prefill_evict_extra_pages``): exact full causal attention; then the
  layer's job goes to the background worker:
  move the offloaded tokens (everything but the sink pages and the last ``n_window`` token-order pages)
  into the offload store and build the M-DCI index over them (token ids = absolute positions). The
  layer's first decode step awaits the job, so the build shows in TT2T, and while layer ``i+1``
  computes the worker builds layer ``i`` (pipelined prefill; ``prefill_pipeline="official"`` adds the official
  backpressure: one job in flight, all joined before prefill returns; where the prefill leaves no core idle,
  a CPU whose cores all run torch, the job runs inline instead: :func:`icecache.kv.state.jobs_inline`). A prompt of at most ``B`` tokens is
  not indexed (official fallback): the layer attends everything until its context first exceeds
  ``B`` tokens, then offloads at that step, the index built on the background worker while the rest of the
  step runs (the official code never indexes after prefill and lets the table outgrow the budget:
  ``short_prompt="dense"``, the default; ``"offload"`` keeps the budget).
* Decode (official ``infer_state._DCI_query``, ``recall``, ``scatter_pages``): the new token joins the
  window. One index search per query head (``K`` pages,
  field of view from the sequence length), GQA merge per KV head (rank-interleaved, capped at ``K``:
  ``gqa_merge="interleaved"``, official; ``"union"`` keeps the whole union, an ablation that attends
  up to ``group * K`` pages per KV head, i.e. over the budget). Pages already resident in a slot and
  not changed since keep their slot; only new or changed pages are bulk-loaded (one packed transfer,
  :meth:`OffloadStore.bulk_load`) into the slots freed by pages that dropped out. Attention runs over
  sink + selected pages + window, the empty slots of under-filled pages masked (head axis ``H_kv``).
* Window eviction (official ``decode_backup_win_page``, ``offload_win_page_to_DCI``): at the step whose token
  fills the window's last page, the oldest window page is copied to the offload store and its keys are
  inserted into the index before this step's search, while it is still in the window (the official
  ``adapter/modeling.py`` decode path inserts the staged page after layer 0's attention of that step, before any
  budgeted layer searches); at the next step it leaves the window. Until then its tokens are attended twice
  if a selected page holds some of them, as in the official code. ``window_insert="on_evict"`` inserts the
  page only as it leaves the window (no token is in both). A prompt whose last page is full leaves the window
  full at prefill; its oldest page is inserted at the first decode step (official ``_finish_prefill`` stages
  it, ``_prepare_decode`` inserts it). The pages an insert changed are marked stale, so a resident copy is
  refetched when selected again. The window thus holds between ``(n_window - 1) * page_size + 1`` and
  ``n_window * page_size`` tokens at attention, the current one included.

Budget layouts, the readings of a 64-token budget (the official code asserts at 64 tokens with 16-token pages,
as no page is left to retrieve): ``budget_layout="auto"`` (default) lowers the sink to as few as one page when the
budget would otherwise leave no retrieved page, so 64 tokens = (1 sink, 1 retrieved, 2 window) pages of 16, while
80 tokens and up keep (2 sink, 2 window, K); ``"fixed"`` uses ``n_sink_pages`` as given (``n_sink_pages=0``:
0 + 2 + 2 pages of 16, which the official CLI's ``--n-sink-pages 0`` allows); ``page_size=8`` gives 2 + 4 + 2 pages
of 8 tokens; ``"retrieved"`` reads the budget as retrieved tokens only (2 + 4 + 2 pages of 16, 128 tokens).

Accounting: :meth:`resident_tokens` counts the device-side resident set of a budgeted layer, sink +
every retrieved slot's capacity + window (at most ``B`` tokens between steps; at attention at most
``B - 1`` past tokens plus the current one, since a full window evicts before the new token); the offload
store is not resident. ``state.bytes_moved`` (total) and ``state.step_bytes`` (last step) count the
bytes copied from the store to the device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from icecache.dci import DCIConfig, MDCIIndex, merge_gqa
from icecache.dci.gqa import MERGE_MODES, SCORED_MODES
from icecache.kv import BudgetError, Fetched, KVMethod, ModelSpec
from icecache.kv.base import tensor_bytes
from icecache.offload import OffloadStore
from icecache.paged_state import IceSequence, IceState, prompt_seed
from icecache.resident import ResidentBuffer

__all__ = ["BUDGET_LAYOUTS", "IceCache", "IceSequence", "IceState", "prompt_seed"]

# how ``budget`` splits into pages (:meth:`IceCache.layout`); the readings of a 64-token budget are in docs/fidelity.md
BUDGET_LAYOUTS = ("auto", "fixed", "retrieved")


@dataclass(frozen=True)
class IceCache(KVMethod):
    """Paged offloading with M-DCI page retrieval, in the official configuration by default.

    Every default is the official code's (``run_longbench.sh``, ``passkey_pred.py``, ``infer_state.py``,
    ``src/dci.c``), listed in :attr:`official`; a test checks them. One choice is ours where the official code
    cannot run: at 64 tokens with 16-token pages the official code asserts (no page is left to retrieve), and
    ``budget_layout="auto"`` then gives 1 sink + 1 retrieved + 2 window pages (chosen as the smallest change to
    the official layout, before any score was looked at). This project's improvements are the registered
    variant ``icecache_tuned`` (:class:`icecache.tuned.IceCacheTuned`).

    Args:
        budget: past tokens per head per step in a budgeted layer, a multiple of ``page_size`` (sink and
            window included; 256 = 2 sink + 12 retrieved + 2 window pages).
        page_size: tokens per page = M-DCI leaf capacity (16 in every official script).
        n_sink_pages: first pages always resident (official 2; see ``budget_layout``).
        n_window_pages: most recent pages always resident, the last one being filled (official 2, >= 2).
        budget_layout: ``"auto"``: fewer sink pages (down to 1) when the budget leaves no retrieved page
            (64 tokens -> 1 sink + 1 retrieved + 2 window pages); ``"fixed"``: ``n_sink_pages`` as given;
            ``"retrieved"``: the budget counts the retrieved pages only, sink and window pages come on top
            (64 -> 2 sink + 4 retrieved + 2 window pages of 16, 128 tokens attended).
        n_dense_layers: first layers kept dense (official ``n_unlimited_layers`` = 2).
        gqa_merge: ``"interleaved"`` (official ``first_k_unique``, capped at ``K`` pages per KV head),
            ``"union"`` (every page any query head of the group selected; over the budget by design), or the
            group-level merges within the budget ``"mass"`` / ``"max"`` (:func:`~icecache.dci.merge_gqa`).
        gqa_candidates: pages each query head reports to the ``mass``/``max`` merges (0: ``group * K``).
        always_index: also index prompts of at most ``budget`` tokens (official: only longer ones); with a
            budget that covers the context, every page is then retrieved through the index.
        short_prompt: a prompt of at most ``budget`` tokens: ``"dense"`` (official: never indexed, the layer
            attends everything) or ``"offload"`` (offloaded at the step its context first exceeds the budget).
        prop_to_retrieve: share of an expanded node's children scored (official ``q_prop_to_retrieve`` 0.8).
        candidate_rule: which scored keys rank their pages (:class:`~icecache.dci.DCIConfig`): ``"official"``
            (the C code's ``add_to_list``: each upper level's kept prefix and each expanded level-1 node's ``K``
            best children) or ``"scored"`` (every key the search scores).
        prefill_pipeline: ``"official"``: before queueing layer ``i``'s offload + index build the prefill waits
            for the job queued before it, and joins the last job before returning, so TTFT includes every build
            but the overlap of one layer (official ``infer_state``); ``"overlap"``: every job is queued on the
            background worker and awaited at that layer's first decode step (the builds show in TT2T).
        projection: ``"per_prompt"`` (official reading): a fresh random direction for every prompt, as the official
            ``infer_state._prepare_prefill`` draws ``torch.randn(1, d + 1)`` at every prefill after the scripts'
            ``seed_everything(42)``, so prompt ``i`` of a run gets the ``i``-th draw of that stream (the C code's
            clock-seeded ``drand48`` drives only the random promotion, which the scripts leave off). Here the
            direction is drawn from ``seed`` and a digest of the prompt (:func:`prompt_seed`), so it does not depend
            on the order or the process in which prompts run (a resumed, replayed or sharded run gets the same
            one); ``"seeded"``: one direction from ``seed`` for every prompt. Either way all layers and heads of
            one prefill share it, as the official code passes one ``proj_vec`` to every layer.
        window_insert: when the oldest window page enters the offload store and the index: ``"when_full"``
            (official: at the step the window fills, one step before it leaves the window) or ``"on_evict"``
            (as it leaves the window).
        key_storage: the index's copy of the keys: ``"auto"`` (bf16 keys stay bf16: the same scores at half the
            bytes the search reads) or ``"float32"`` (:class:`~icecache.dci.DCIConfig`).
        ratio_1, ratio_2, search_ratio, min_fov, seed: M-DCI parameters
            (:class:`~icecache.dci.DCIConfig`; defaults of the official LongBench/passkey scripts).
    """

    page_size: int = 16
    n_sink_pages: int = 2
    n_window_pages: int = 2
    budget_layout: str = "auto"
    n_dense_layers: int = 2
    gqa_merge: str = "interleaved"
    gqa_candidates: int = 0
    always_index: bool = False
    short_prompt: str = "dense"
    ratio_1: float = 0.01
    ratio_2: float = 0.2
    search_ratio: float = 1.5e-3
    min_fov: int = 30
    prop_to_retrieve: float = 0.8
    candidate_rule: str = "official"
    prefill_pipeline: str = "official"
    projection: str = "per_prompt"
    window_insert: str = "when_full"
    key_storage: str = "auto"
    seed: int = 0
    name: ClassVar[str] = "icecache"
    example_budget: ClassVar[int] = 128
    # the official scripts' values (a test checks that the defaults are these)
    official: ClassVar[dict] = dict(
        page_size=16, n_sink_pages=2, n_window_pages=2, n_dense_layers=2, gqa_merge="interleaved",
        always_index=False, short_prompt="dense", ratio_1=0.01, ratio_2=0.2, search_ratio=1.5e-3, min_fov=30,
        prop_to_retrieve=0.8, candidate_rule="official", prefill_pipeline="official", projection="per_prompt",
        window_insert="when_full")

    # ------------------------------------------------------------------ configuration
    def layout(self) -> tuple[int, int, int]:
        """``(sink, window, retrieved)`` pages of the budget."""
        pages, sink = self.budget // self.page_size, self.n_sink_pages
        if self.budget_layout == "retrieved":
            return sink, self.n_window_pages, pages
        if self.budget_layout == "auto":
            sink = min(sink, max(1, pages - self.n_window_pages - 1))
        return sink, self.n_window_pages, pages - sink - self.n_window_pages

    @property
    def attended_tokens(self) -> int:
        """Past tokens a budgeted layer holds for attention: sink + retrieved + window pages (the budget, except
        under ``budget_layout="retrieved"``, where the budget counts the retrieved pages only)."""
        return sum(self.layout()) * self.page_size

    def validate(self) -> None:
        for key in ("page_size", "n_sink_pages", "n_window_pages", "n_dense_layers", "gqa_candidates"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int):
                raise ValueError(f"{self.name}: {key} must be a whole number, got {getattr(self, key)!r}")
        self.check_choice("short_prompt", ("offload", "dense"))
        self.check_choice("candidate_rule", ("scored", "official"))
        self.check_choice("prefill_pipeline", ("overlap", "official"))
        self.check_choice("projection", ("seeded", "per_prompt"))
        self.check_choice("window_insert", ("when_full", "on_evict"))
        self.check_choice("key_storage", ("auto", "float32"))
        if self.budget_layout not in BUDGET_LAYOUTS:
            raise ValueError(f"{self.name}: budget_layout must be one of {BUDGET_LAYOUTS}, got {self.budget_layout!r}")
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

    def n_slots(self, group: int) -> int:
        """Page slots per KV head of the resident buffer for query groups of ``group`` heads (``K``; ``group * K``
        for the union merge)."""
        return self.layout()[2] * (group if self.gqa_merge == "union" else 1)

    def dci_config(self, seed: int | None = None) -> DCIConfig:
        """The index configuration of a prefill's layers; ``seed``: their projection seed (the prompt's
        :attr:`IceSequence.projection_seed`; default ``seed``)."""
        return DCIConfig(page_size=self.page_size, ratio_1=self.ratio_1, ratio_2=self.ratio_2,
                         search_ratio=self.search_ratio, min_fov=self.min_fov,
                         prop_to_retrieve=self.prop_to_retrieve, candidate_rule=self.candidate_rule,
                         key_storage=self.key_storage, seed=self.seed if seed is None else seed)

    def make_sequence(self) -> IceSequence:
        return IceSequence(self.name, self.seed)

    def make_state(self, layer_idx: int) -> IceState:
        return IceState(layer_idx)

    def is_budgeted(self, st: IceState) -> bool:
        return st.layer_idx >= self.n_dense_layers

    def index_threshold(self) -> int:
        """A budgeted layer offloads once it holds more tokens than this (official: ``B``)."""
        sink, window, _ = self.layout()
        return (sink + window) * self.page_size if self.always_index else self.attended_tokens

    # ------------------------------------------------------------------ cross-layer hooks (reuse)
    def builds_index(self, layer_idx: int) -> bool:
        return True

    def page_source(self, st: IceState) -> IceState:
        """The state whose index lays out this layer's pages (itself; the anchor in IceCache(reuse))."""
        return st

    def candidate_width(self, k: int) -> int:
        """Pages per KV head the search hands on (``K``; more in IceCache(reuse) with ``rerank``)."""
        return k

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, st: IceState) -> None:
        if st.layer_idx == 0 and self.projection == "per_prompt":
            st.seq.projection_seed = prompt_seed(self.seed, st.k)
        if self.is_budgeted(st):
            if st.n_seen > self.index_threshold():
                if self.prefill_pipeline == "official":
                    self.join_prefill_job(st.seq)  # backpressure: one layer's job in flight at a time
                self.offload(st, background=True)
                st.seq.prefill_job = st.pending
            elif self.short_prompt == "dense":
                st.dense = True  # official: a prompt within the budget is never indexed
        if self.prefill_pipeline == "official" and st.layer_idx == st.spec.n_layers - 1:
            self.join_prefill_job(st.seq)  # the official prefill returns with every index built

    @staticmethod
    def join_prefill_job(seq: IceSequence) -> None:
        """Waits for the offload job queued last during ``seq``'s prefill (``prefill_pipeline="official"``)."""
        job, seq.prefill_job = seq.prefill_job, None
        if job is not None:
            job.result()

    def offload(self, st: IceState, background: bool) -> None:
        """Splits the resident tokens into sink | offloaded | window and starts the offload job."""
        s, n = self.page_size, st.n_seen
        sink_pages, window_pages, _ = self.layout()
        first, w0 = sink_pages * s, (-(-n // s) - window_pages) * s
        st.buffer = ResidentBuffer(st.k, st.v, first, self.n_slots(st.spec.group), s, window_pages, w0)
        k_buf, v_buf = st.buffers.pop("k"), st.buffers.pop("v")  # row p = position p (nothing evicted yet)
        st.k = st.v = st.pos = None
        job = (self.offload_job, st, k_buf, v_buf, first, w0)
        if background:
            self.submit_background(st, *job)
        else:
            job[0](*job[1:])

    def offload_job(self, st: IceState, k_buf: torch.Tensor, v_buf: torch.Tensor, first: int, end: int) -> None:
        """Background job: positions ``first .. end - 1`` of the prefill buffers become the offload store
        (taken over without a copy on CPU, copied to pinned host memory on CUDA), then (anchors) the M-DCI
        index is built over their keys."""
        slots = k_buf.shape[0] * self.n_slots(st.spec.group)
        st.store = OffloadStore.adopt(k_buf, v_buf, first, end, k_buf.device, slots, self.page_size)
        if self.builds_index(st.layer_idx):
            config = self.dci_config(st.seq.projection_seed)
            st.index = MDCIIndex.build(st.store.keys(), torch.arange(first, end), config)

    # ------------------------------------------------------------------ decode
    def append(self, st: IceState, k: torch.Tensor, v: torch.Tensor) -> None:
        if not st.offloaded:
            super().append(st, k, v)
            return
        if st.buffer.window_full():  # the oldest page leaves
            self.evict_oldest_window_page(st)
        st.buffer.append(k, v)
        if self.window_insert == "when_full" and st.buffer.window_full():
            self.index_oldest_window_page(st)

    def index_oldest_window_page(self, st: IceState) -> None:
        """The oldest window page goes to the offload store and (anchors) into the index, before this step's
        search; resident copies of the pages the insert changed go stale. The page stays in the window."""
        k, v, positions = st.buffer.oldest_window_page()
        st.store.append(k, v)
        st.buffer.mark_stale(self.insert_evicted(st, k, positions).numpy())
        st.window_page_indexed = True

    def evict_oldest_window_page(self, st: IceState) -> None:
        """The oldest window page leaves the window, indexed first if it is not yet."""
        if not st.window_page_indexed:
            self.index_oldest_window_page(st)
        st.buffer.drop_oldest_window_page()
        st.window_page_indexed = False

    def insert_evicted(self, st: IceState, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inserts the host keys ``[H_kv, s, d]`` evicted from the window; returns the changed-page flags."""
        st.changed, st.changed_at = st.index.insert(keys, positions), st.n_seen
        return st.changed

    def select(self, st: IceState, q: torch.Tensor) -> torch.Tensor | None:
        """Page ids ``[H_kv, W]`` (-1 padded) for this step, or None (dense / not yet offloaded)."""
        if not st.offloaded:
            return None
        k, queries = self.layout()[2], q[:, 0].float().cpu()
        width = self.candidate_width(k)
        if self.gqa_merge in SCORED_MODES:
            n_cand = max(k, self.gqa_candidates or st.spec.group * k, width)
            pages, scores = self.search_pages(st, queries, k, n_cand)
            st.candidates = merge_gqa(pages, st.spec.group, width, self.gqa_merge, scores, st.spec.scaling)
        else:
            pages = self.search_pages(st, queries, k, width)[0]  # = the index's search() when width == K
            st.candidates = merge_gqa(pages, st.spec.group, width, mode=self.gqa_merge)
        # both merges are prefix-stable: the first K of a list capped at ``width`` are the list capped at K
        st.selection = st.candidates if self.gqa_merge == "union" else st.candidates[:, :k]
        st.selected_at = st.n_seen
        return st.selection

    def search_pages(self, st: IceState, queries: torch.Tensor, k: int, width: int):
        """Per query head its ``width`` best pages, best key's ``q.k``: the search (``page_oracle``: exact)."""
        return st.index.search_scored(queries, k, width, n_seq=st.n_seen)

    def fetch(self, st: IceState, selection: torch.Tensor | None) -> Fetched:
        """Keeps the resident selected pages, loads the missing ones into freed slots (one packed
        transfer) and returns the resident buffer in place."""
        if selection is None:
            return Fetched(st.k, st.v)
        buf = st.buffer
        heads, pages, slots = buf.assign_slots(selection.numpy())
        st.step_bytes = 0
        if heads.size:
            st.step_bytes = buf.load_pages(self.page_source(st).index.page_positions(), heads, pages, slots, st.store)
        st.bytes_moved += st.step_bytes
        buf.refresh_mask()
        return self.resident_kv(st)

    @staticmethod
    def resident_kv(st: IceState) -> Fetched:
        """The resident buffer in place: sink + page slots + window (current token included), the empty
        slots of under-filled or unused pages and unused window slots masked; ``n_past`` from the host
        page table (no device read)."""
        buf = st.buffer
        return Fetched(buf.k, buf.v, buf.valid, n_past=buf.n_past())

    def attended_positions(self, st: IceState, selection=None) -> torch.Tensor:
        """Absolute positions of what :meth:`fetch` returns: ``[H_kv, R]`` for :meth:`resident_kv`'s entries once
        the layer is offloaded (-1 where masked), else the resident positions (attention recall, tests)."""
        return st.buffer.attended_positions() if st.offloaded else st.pos

    def observe(self, st: IceState, q, fetched, selection) -> None:
        if not self.is_budgeted(st):
            return
        if not st.offloaded and not st.dense and st.n_seen > self.index_threshold():
            self.offload(st, background=True)  # awaited at this layer's next step

    # ------------------------------------------------------------------ accounting
    def resident_tokens(self, st: IceState) -> int:
        if not st.offloaded:
            return st.resident_tokens()
        return st.buffer.resident_tokens()

    def layer_stats(self, st: IceState) -> dict[str, float]:
        """How much of this layer's index its searches scored (keys scored as a fraction of the indexed keys,
        nodes expanded: :meth:`~icecache.dci.MDCIIndex.search_stats`); none for a layer without an index."""
        return st.index.search_stats() if st.index is not None else {}

    def resident_bound(self, group: int) -> int:
        """Most resident past tokens allowed for query groups of ``group`` heads: the budget, or its union-merge
        extension (ablation)."""
        return self.attended_tokens + (self.n_slots(group) - self.layout()[2]) * self.page_size

    def check_resident(self, st: IceState) -> None:
        if self.is_budgeted(st) and not st.dense and self.resident_tokens(st) > self.resident_bound(st.spec.group):
            raise AssertionError(f"{self.name}: layer {st.layer_idx} holds {self.resident_tokens(st)} resident "
                                 f"tokens, over the bound of {self.resident_bound(st.spec.group)} (budget {self.budget})")

    def layer_memory(self, st: IceState) -> dict[str, int]:
        """An offloaded layer: on the device its resident buffer (sink + page slots + window: the budget's tokens)
        and the transit buffer's device twin (``2 x H_kv x slots`` pages, allocated on CUDA; counted on a CPU too);
        on the host the offload store's tokens; as index the M-DCI arrays. Any other layer: its K/V on the device."""
        if not st.offloaded:
            return super().layer_memory(st)
        transit = 0 if st.store is None else tensor_bytes(st.store.transit)
        index = 0 if st.index is None else sum(tensor_bytes(a) for a in vars(st.index).values()
                                                if isinstance(a, np.ndarray))
        return {"device_kv_bytes": tensor_bytes(st.buffer.k, st.buffer.v) + transit, "transit_bytes": transit,
                "host_kv_bytes": 0 if st.store is None else tensor_bytes(st.store.keys(), st.store.values()),
                "index_bytes": index}

    def warm_up(self, spec: ModelSpec, n_prompt: int) -> None:
        """Compiles (or loads from numba's disk cache) the M-DCI and resident-buffer kernels for this model before
        the first timed request (:meth:`KVMethod.warm_up`), once per process and configuration: a rehearsal at this
        layout's smallest budget over a prompt four pages longer (offloaded and indexed at prefill; the first decode
        step evicts a window page into the index, every step searches and loads pages), then, when the prompt is
        long enough for it, one index build whose level 0 takes the anchor path (more than ``exact_parent_threshold``
        points: several super-blocks, whose slices are the strided arrays a long prompt's build passes)."""
        small = (self.n_sink_pages + self.n_window_pages + 1) * self.page_size
        rehearsal = dataclasses.replace(self, budget=small, debug=False)
        config = rehearsal.dci_config()
        shapes = (spec.dtype, str(spec.device), spec.n_layers, spec.n_q_heads, spec.n_kv_heads, spec.head_dim)
        if self.warm_once((*shapes, repr(rehearsal))):
            self.rehearse(spec, small + 4 * self.page_size, 3, budget=small, debug=False)
        if config.use_anchors and n_prompt > config.exact_parent_threshold and self.warm_once((*shapes, repr(config))):
            n = math.ceil((config.exact_parent_threshold + 1) / (1 - config.ratio_1)) + 4 * self.page_size
            keys = torch.randn(spec.n_kv_heads, n, spec.head_dim, generator=torch.Generator().manual_seed(0))
            MDCIIndex.build(keys.to(spec.dtype), torch.arange(n), config)
