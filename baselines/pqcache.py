"""PQCache (Zhang et al., "PQCache: Product Quantization-based KVCache for Long Context LLM Inference",
SIGMOD 2025; official code ``HugoZHL/PQCache``, ``vq_method/retrieval_based/pq_search.py``).

Budget mapping: docs/architecture.md.

* Prefill: exact causal attention; every key/value is copied to a separate offload store (pinned host
  memory on CUDA). For each KV head, the non-sink keys are split into ``n_subvec`` sub-vectors and
  clustered per subspace into ``2**n_bits`` centroids (k-means, Lloyd, ``n_init=1``, initialised on
  random distinct keys, as the official sklearn worker ``compute_kmeans_worker`` of
  ``vq_method/retrieval_based/multi_core_compressor_v2.py`` does). The clustering runs on the method's
  background worker and is awaited at the layer's first decode step (so it shows in TT2T).
* Iterations (``kmeans_iters``), this class's one deliberate deviation from the official default: at most 300,
  with sklearn's earlier stop at convergence (``tol=1e-4``: summed squared centroid shift <= 1e-4 x the mean
  per-dimension variance, or unchanged assignments), i.e. the official sklearn call (``compute_kmeans_worker``,
  ``tol = 0.0001``, ``max_iter``) given ``--max_iter 300`` (``vq_pred.py`` line 51). The official default
  ``max_iter=0`` (``run_llama.sh`` line 20, "0 for dynamic setting") sizes the iterations to a predicted GPU
  prefill time instead (``MultiCoreCompressor_v2.compress``, lines 409-415: ``int((gpu_time - kmeans_3_iters) /
  kmeans_per_iter + 3)`` clamped to ``[3, 300]``, with the prefill time fitted on an RTX 4090 for Llama and
  Mistral, lines 220-224, and the k-means times profiled once on the machine, lines 345-385). That rule depends
  on the machine and its load. With this module's k-means and the official 4090 prefill fit, three iterations
  already take about as long as the predicted layer prefill, so the rule stays at its floor of 3 iterations at
  every length, well short of convergence, and gives 3 as well on a CPU whose cores all run torch; the floor
  recalls a little less of the exact top-k than convergence (both measured in docs/fidelity.md, "PQCache", "The
  one deliberate deviation").
  Convergence is kept because it reads no clock: the codebooks, codes and selections depend only on the seed,
  not on the machine's load or its thread count (the assignment matmul, the centroid sums and the variance give
  the same bits with 1 to 4 threads; tests/test_determinism.py), and a stored prefill replays (LongBench tables
  replay every prompt); its codebook is the one the official rule tends to as its time budget grows, and it
  quantises at least as well as any fewer iterations from the same start. Its cost, several times that of a
  fixed 10 iterations, is paid on the background worker (docs/fidelity.md, "PQCache", "Cost of the default").
  ``kmeans_iters=0`` (:attr:`PQCache.ADAPTIVE`) is the official rule, read live:
  the iterations that fit in the previous layer's measured prefill time (layer 0: the minimum 3) times the share
  of CPU cores the prefill leaves idle (:func:`spare_cpu_share`: all of them when the model runs on a GPU, none on
  a CPU whose cores all run torch's threads, which gives the minimum 3), the time per iteration measured as it
  runs, clamped to ``[3, 300]``: its iterations, codes and selections change with the machine's load and speed
  (only ``method_stats.kmeans_iterations`` records them) and it cannot replay a stored prefill. Any other
  ``kmeans_iters > 0`` is a fixed cap (``10`` with ``kmeans_tol=0``: exactly 10). Fewer keys than centroids: one
  centroid per key (the official code skips PQ and attends everything in that case; we keep the method and its
  budget).
* Decode: for each query head, lookup tables ``T[s] = q^(s) . C^(s)`` give approximate logits
  ``sum_s T[s][code_j^(s)]``; softmax per query head (scaled like the model's attention), summed over
  the GQA group, top-k per KV head over the candidates (tokens between the sinks and the recent
  window). Sinks + top-k + recent window are attended exactly; the top-k K/V are gathered from the
  offload store (bytes counted in ``state.bytes_moved``).
* How the scores are computed (the official selection either way, up to ties and rounding): a token's
  group-summed softmax depends only on its tuple of codes, so when the tuples are few
  (``(2**n_bits)**n_subvec <=`` :data:`JOINT_CODES_MAX`, the official 2 x 6 bits gives 4096) every tuple is
  scored once from per-tuple token counts (:func:`joint_code_scores`) and a token's score is one lookup of
  its tuple's; otherwise every token's logits are summed from the tables (:func:`lookup_scores`,
  :func:`group_probs`). The first removes the per-token gathers, exponentials and group sums that made
  PQCache's TPOT grow with the context on CPU (docs/results.md, "Decode latency on equal terms").
* A token leaving the recent window gets its PQ code by nearest centroid (no re-clustering).

Budget ``B`` = ``n_sink`` sinks + ``recent`` window + ``top-k``: the official split (``pq_search.py`` lines
235-237: ``recent_ratio`` 0.5 of what the compression keeps after the sinks, the rest top-k), with the budget in
place of the compression ratio: ``(B - n_sink) / 2`` each (docs/architecture.md). Sinks (``n_sink``): the official
entry point's default is 2 (``vq_pred.py`` line 37, ``--sink-size``); its LongBench scripts pass 32
(``run_llama.sh`` and ``run_mistral.sh`` line 13) and the GSM8K script's own default is 32
(``GSM8k/evaluation_gsm8k.py`` line 203): ``conf/suite_cache/longbench_pqcache.yaml`` and ``gsm8k_pqcache.yaml``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from icecache.kv import Bound, BudgetError, Fetched, KVMethod, LayerState, ModelSpec
from icecache.kv.base import tensor_bytes
from icecache.kv.storage import HostKV, append_to_buffer, keep_sinks_and_recent

from icecache.kv.state import spare_cpu_share


JOINT_CODES_MAX = 1 << 16  # most tuples of codes scored one by one (the official 2 sub-vectors x 6 bits: 4096)


def split_subvectors(x: torch.Tensor, n_subvec: int) -> torch.Tensor:
    """``[H, n, d]`` -> ``[H, m, n, d/m]`` (sub-vector ``s`` of every token)."""
    h, n, d = x.shape
    return x.reshape(h, n, n_subvec, d // n_subvec).permute(0, 2, 1, 3)


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Codes ``[P, n]`` of points ``x: [P, n, ds]`` for codebooks ``centroids: [P, C, ds]`` (L2): the argmin of
    ``|c|^2 - 2 x.c``, which orders the centroids as ``|x - c|^2`` does, in one batched matmul, faster than
    ``torch.cdist`` + argmin (docs/fidelity.md, "PQCache", "Cost of the default")."""
    x, centroids = x.float(), centroids.float()
    half = centroids.pow(2).sum(-1)[:, None, :]
    return torch.baddbmm(half, x, centroids.transpose(1, 2), alpha=-2).argmin(-1)


def kmeans(x: torch.Tensor, n_centroids: int, iters: int, generator: torch.Generator, tol: float = 0.0,
           stats: dict | None = None, time_budget_s: float | None = None, min_iters: int = 1):
    """Batched Lloyd k-means over ``P`` independent problems ``x: [P, n, ds]``, as the official sklearn
    ``KMeans(n_init=1, init=<random distinct points>, algorithm="lloyd", tol=tol, max_iter=iters)``
    (``multi_core_compressor_v2.py``, ``compute_kmeans_worker``).

    Returns ``(centroids [P, C, ds], codes [P, n])`` with ``C = min(n_centroids, n)``; an empty cluster keeps
    its previous centroid. A problem stops (and is frozen) once its assignments no longer change or, as
    sklearn, once the summed squared centroid shift is at most ``tol`` times its mean per-dimension variance;
    after ``iters`` iterations at most. ``time_budget_s`` (PQCache's adaptive bound) also stops it, after at
    least ``min_iters`` iterations, before an iteration that would end past the budget at the mean time per
    iteration so far: the one input that depends on the clock. Without it the result depends only on
    ``generator`` and ``x``: the reductions (centroid sums by ``index_add_`` in index order, the integer
    counts, the per-column variance, the shift over ``C x ds`` values) and the assignment matmul give the same
    bits whatever torch's thread count (1 to 4 threads, tests/test_determinism.py). ``stats`` (a dict)
    receives ``iterations``: ``[P]`` iterations run."""
    start = time.perf_counter()
    p, n, ds = x.shape
    x = x.float()
    c = min(n_centroids, n)
    init = torch.stack([torch.randperm(n, generator=generator)[:c] for _ in range(p)]).to(x.device)
    centroids = x.gather(1, init[..., None].expand(-1, -1, ds))
    codes = nearest_centroid(x, centroids)
    threshold = x.var(dim=1, unbiased=False).mean(-1) * tol  # [P], sklearn's _tolerance
    done = torch.zeros(p, dtype=torch.bool, device=x.device)
    n_iter = torch.zeros(p, dtype=torch.long, device=x.device)
    offsets = torch.arange(p, device=x.device)[:, None] * c  # problem i's clusters are rows i*c ... i*c+c-1
    for it in range(1, iters + 1):
        flat = (codes + offsets).view(-1)
        sums = torch.zeros(p * c, ds, device=x.device).index_add_(0, flat, x.reshape(-1, ds)).view(p, c, ds)
        counts = torch.bincount(flat, minlength=p * c).view(p, c).to(x.dtype)
        new = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
        new = torch.where(done[:, None, None], centroids, new)
        shift = (new - centroids).pow(2).sum((1, 2))
        new_codes = torch.where(done[:, None], codes, nearest_centroid(x, new))
        n_iter += (~done).long()
        done = done | torch.all(new_codes == codes, dim=1) | (shift <= threshold)
        centroids, codes = new, new_codes
        if bool(done.all()) or out_of_time(start, it, min_iters, time_budget_s):
            break
    if stats is not None:
        stats["iterations"] = n_iter
    return centroids, codes


def out_of_time(start: float, done_iters: int, min_iters: int, budget_s: float | None) -> bool:
    """Whether one more iteration, at the mean time per iteration so far, would end past ``budget_s``."""
    if budget_s is None or done_iters < min_iters:
        return False
    elapsed = time.perf_counter() - start
    return elapsed + elapsed / done_iters > budget_s


def lookup_scores(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Approximate logits ``[H_q, n]`` (unscaled ``q . k_hat``) from PQ lookup tables.
    ``q: [H_q, d]``, ``centroids: [H_kv, m, C, d/m]``, ``codes: [H_kv, n, m]``. One gather per subspace reads
    each KV head's codes through a view expanded over its GQA group (no per-query-head copy of the codes)."""
    h_kv, m, _, ds = centroids.shape
    group = q.shape[0] // h_kv
    tables = torch.einsum("hgsd,hscd->hgsc", q.float().reshape(h_kv, group, m, ds), centroids.float())
    scores = tables[:, :, 0].gather(2, codes[:, None, :, 0].expand(-1, group, -1))  # [H_kv, G, n]
    for s in range(1, m):
        scores += tables[:, :, s].gather(2, codes[:, None, :, s].expand(-1, group, -1))
    return scores.view(h_kv * group, -1)


def group_probs(scores: torch.Tensor, scaling: float, n_kv_heads: int) -> torch.Tensor:
    """PQCache's GQA score: softmax of the scaled scores per query head, summed over the group.
    ``scores: [H_q, n]`` -> ``[H_kv, n]``."""
    probs = torch.softmax(scores * scaling, dim=-1)
    return probs.reshape(n_kv_heads, -1, probs.shape[-1]).sum(1)


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[H, min(k, n)]`` of the ``k`` highest ``scores: [H, n]`` per row, in increasing order."""
    return scores.topk(min(k, scores.shape[-1]), dim=-1).indices.sort(-1).values


def joint_code_ids(codes: torch.Tensor, n_centroids: int) -> torch.Tensor:
    """One id per token for its tuple of codes: ``codes [H, n, m]`` -> ``[H, n]`` (int64), the codes read as
    the digits of a base-``n_centroids`` number, sub-vector 0 first (the order :func:`joint_code_scores` uses)."""
    ids = codes[..., 0].long()
    for s in range(1, codes.shape[-1]):
        ids = ids * n_centroids + codes[..., s]
    return ids


def tuple_logits(q: torch.Tensor, centroids: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled PQ logits ``[H_kv, G, C^m]`` (float32) of every tuple of codes (ids of :func:`joint_code_ids`) for
    each query head of each GQA group: ``sum_s scaling * T[s][c_s]``, the tables ``T[s] = q^(s) . C^(s)`` of
    :func:`lookup_scores` (one batched matmul, scaled before the sum)."""
    h_kv, m, _, ds = centroids.shape
    group = q.shape[0] // h_kv
    q_sub = q.float().reshape(h_kv, group, m, ds).transpose(1, 2)  # [H_kv, m, G, ds]
    tables = torch.matmul(q_sub, centroids.float().transpose(-1, -2)).mul_(scaling)  # [H_kv, m, G, C]
    logits = tables[:, 0]
    for s in range(1, m):
        logits = (logits[..., :, None] + tables[:, s, :, None, :]).flatten(-2)  # [H_kv, G, C^(s+1)]
    return logits


def candidate_mask(counts: torch.Tensor) -> torch.Tensor:
    """``0`` where a tuple has candidates, ``-inf`` where it has none: ``counts [H_kv, C^m]`` -> float32."""
    return torch.zeros(counts.shape, dtype=torch.float32, device=counts.device).masked_fill_(counts <= 0, float("-inf"))


def joint_code_scores(q: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, scaling: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`group_probs` of :func:`lookup_scores` for every tuple of codes: ``[H_kv, C^m]`` (float32).

    Every token of a tuple ``t`` has the logit ``l_t`` (:func:`tuple_logits`), so the softmax over the
    candidates (official ``pq_search.py``, per token) is ``exp(l_t - M) / Z`` with
    ``Z = sum_t counts[t] exp(l_t - M)``, the sum over the candidates grouped by tuple; a tuple's score is this
    summed over the query heads of the GQA group. ``counts [H_kv, C^m]``: candidates per tuple; ``mask``: its
    :func:`candidate_mask` (kept up to date by :meth:`PQCache.count_candidates`; computed when ``None``).
    ``M`` is the largest logit of a tuple that has candidates, the per-token softmax's own shift, so
    ``1 <= Z <= n_candidates`` whatever the logits of centroids no candidate uses (a shift by the sum of
    per-subspace maxima over all centroids underflows ``Z`` to 0, even in float64, once an unused centroid's
    scaled logit stands ~745 above every used one's, and every score becomes NaN); tuples without candidates,
    never read, score 0.
    The same selection as the per-token path up to ties and rounding. A non-finite normaliser (a non-finite
    query or centroid) raises ``FloatingPointError`` instead of ranking NaN scores (one host read per call)."""
    logits = tuple_logits(q, centroids, scaling)
    logits += candidate_mask(counts)[:, None] if mask is None else mask[:, None]
    logits -= logits.amax(-1, keepdim=True)
    e = logits.exp_()
    z = (e * counts[:, None].to(e.dtype)).sum(-1, keepdim=True)
    if not math.isfinite(float(z.sum())):
        raise FloatingPointError(f"pqcache: non-finite softmax normaliser {z.flatten().tolist()} (a non-finite "
                                 "query or centroid)")
    return e.div_(z).sum(1)


class PQState(LayerState):
    """Resident (what ``resident_tokens`` counts): sinks + recent window (``k, v, pos``); the top-k are
    gathered per step and dropped after attention. Offload store: every token (``store``, a growable
    :class:`~icecache.kv.storage.HostKV`, pinned on CUDA). PQ: ``centroids [H_kv, m, C, d/m]`` and
    ``codes [H_kv, n_coded, m]`` (a prefix view of a growable buffer) for positions ``n_sink...``; with joint
    scores also their tuple ids ``code_ids [H_kv, n_coded]`` (likewise), ``code_counts [H_kv, C^m]``, the
    candidates per tuple among the first ``n_counted`` coded tokens, and ``code_mask``, its
    :func:`candidate_mask`."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.store: HostKV | None = None
        self.centroids: torch.Tensor | None = None
        self.codes: torch.Tensor | None = None
        self.code_ids: torch.Tensor | None = None
        self.code_counts: torch.Tensor | None = None
        self.code_mask: torch.Tensor | None = None
        self.n_counted = 0
        self.kmeans_iterations = 0
        self.prefill_done: float | None = None  # the clock at this layer's finish_prefill (adaptive k-means)


@dataclass(frozen=True)
class PQCache(KVMethod):
    """Product-quantisation retrieval of the top-k keys per KV head.

    Args:
        budget: past tokens attended per head per step = n_sink + recent + top-k.
        n_sink: initial tokens always attended (official ``vq_pred.py --sink-size`` default 2; the LongBench and
            GSM8K scripts' 32 is their suite setting, conf/suite_cache/).
        n_subvec: sub-vectors per key, ``m`` (official ``SUBVEC`` = 2; one of 1, 2, 4, 8, 16).
        n_bits: bits per sub-vector code, ``2**n_bits`` centroids (official ``SUBBITS`` = 6 -> 64).
        kmeans_iters: most Lloyd iterations (default 300 with ``kmeans_tol``: run to convergence, deterministic
            given ``seed``; the one deliberate deviation, module docstring); 0 (:attr:`ADAPTIVE`, the official
            ``max_iter=0``): the iterations that fit in the layer's prefill time on the cores it leaves idle,
            clamped to [3, 300], which depend on the machine's load.
        kmeans_tol: sklearn's convergence tolerance, relative to the keys' variance (official 1e-4).
        recent_ratio: share of ``budget - n_sink`` given to the recent window (official 0.5).
        seed: seed of the k-means initialisation (one torch.Generator per layer).
        joint_scores: score each tuple of codes once when there are at most :data:`JOINT_CODES_MAX` of them
            (module docstring; the same selection); ``False`` scores every token, as the official code does.
    """

    n_sink: int = 2
    n_subvec: int = 2
    n_bits: int = 6
    kmeans_iters: int = 300
    kmeans_tol: float = 1e-4
    recent_ratio: float = 0.5
    seed: int = 0
    joint_scores: bool = True
    name: ClassVar[str] = "pqcache"
    ADAPTIVE: ClassVar[int] = 0  # kmeans_iters of the official time-budgeted bound (load-dependent)
    ADAPTIVE_ITERS: ClassVar[tuple[int, int]] = (3, 300)  # the official clamp of the adaptive max_iter

    @property
    def recent(self) -> int:
        return int((self.budget - self.n_sink) * self.recent_ratio)

    @property
    def topk(self) -> int:
        return self.budget - self.n_sink - self.recent

    @property
    def uses_joint_scores(self) -> bool:
        """Whether :meth:`select` scores tuples of codes (:func:`joint_code_scores`) rather than tokens."""
        return self.joint_scores and (2 ** self.n_bits) ** self.n_subvec <= JOINT_CODES_MAX

    def validate(self) -> None:
        if self.n_subvec not in (1, 2, 4, 8, 16):
            raise ValueError(f"pqcache: n_subvec must be one of 1, 2, 4, 8, 16, got {self.n_subvec}")
        if self.recent < 1 or self.topk < 1:
            raise BudgetError(f"pqcache: budget {self.budget} leaves no room for a recent window and a top-k "
                              f"after {self.n_sink} sinks (recent={self.recent}, top-k={self.topk}); "
                              f"use budget >= {self.n_sink + 2} and 0 < recent_ratio < 1")
        self.check_whole("n_sink", "seed")
        self.check_whole("kmeans_iters")
        if not isinstance(self.kmeans_tol, (int, float)) or isinstance(self.kmeans_tol, bool) or self.kmeans_tol < 0:
            raise ValueError(f"pqcache: kmeans_tol must be a number >= 0, got {self.kmeans_tol!r}")
        self.check_whole("n_bits", minimum=1)

    def bind(self, spec: ModelSpec) -> Bound:
        if spec.head_dim % self.n_subvec:
            raise ValueError(f"pqcache: head_dim {spec.head_dim} is not divisible by n_subvec={self.n_subvec}")
        return super().bind(spec)

    def make_state(self, layer_idx: int) -> PQState:
        return PQState(layer_idx)

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, st: PQState) -> None:
        if st.n_seen <= self.n_sink:
            raise ValueError(f"pqcache: the prompt ({st.n_seen} tokens) must be longer than n_sink={self.n_sink}")
        st.store = HostKV.copy_of(st.k, st.v)
        self.trim_window(st)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + st.layer_idx)
        self.submit_background(st, self.build_codebook, st, st.store.keys()[:, self.n_sink:], generator,
                               self.kmeans_time_budget(st))

    def kmeans_time_budget(self, st: PQState) -> float | None:
        """Adaptive bound (``kmeans_iters=0``): the previous layer's prefill time, from its ``finish_prefill`` to
        this one's, times :func:`spare_cpu_share`; 0 for layer 0 (no layer timed yet: the minimum iterations).
        ``None`` (no clock read) for a fixed bound, the default."""
        if self.kmeans_iters != self.ADAPTIVE:
            return None
        st.prefill_done = now = time.perf_counter()
        last = st.seq.layers[st.layer_idx - 1].prefill_done if st.layer_idx else None
        layer_s = 0.0 if last is None else now - last
        return layer_s * spare_cpu_share(st.spec.device)

    def build_codebook(self, st: PQState, keys: torch.Tensor, generator: torch.Generator,
                       time_budget_s: float | None) -> None:
        """k-means per (KV head, subspace) on the non-sink prompt keys (background worker)."""
        h, n, _ = keys.shape
        sub = split_subvectors(keys, self.n_subvec)  # [H, m, n, ds]
        low, high = self.ADAPTIVE_ITERS
        stats = {}
        centroids, codes = kmeans(sub.reshape(h * self.n_subvec, n, -1), 2 ** self.n_bits,
                                  self.kmeans_iters or high, generator, tol=self.kmeans_tol, stats=stats,
                                  time_budget_s=time_budget_s, min_iters=low)
        st.kmeans_iterations = int(stats["iterations"].max())
        st.centroids = centroids.reshape(h, self.n_subvec, *centroids.shape[1:]).to(st.spec.device)
        st.codes = codes.reshape(h, self.n_subvec, n).permute(0, 2, 1).to(st.spec.device)
        if self.uses_joint_scores:
            st.code_ids = joint_code_ids(st.codes, st.centroids.shape[2])

    def layer_memory(self, st: PQState) -> dict[str, int]:
        """Sinks and recent window on the device, plus the top-k K/V a step gathers from the host (transit); every
        token in the host store; the codebooks, codes and tuple counts as index."""
        if st.store is None:
            return super().layer_memory(st)
        transit = min(self.topk, self.n_candidates(st)) * 2 * st.k.shape[0] * st.k.shape[2] * st.k.element_size()
        return {"device_kv_bytes": tensor_bytes(st.k, st.v) + transit, "transit_bytes": transit,
                "host_kv_bytes": tensor_bytes(st.store.keys(), st.store.values()),
                "index_bytes": tensor_bytes(st.centroids, st.codes, st.code_ids, st.code_counts, st.code_mask)}

    def layer_stats(self, st: PQState) -> dict[str, float]:
        """Lloyd iterations run on this layer's prompt keys (the most of its KV heads and subspaces)."""
        return {"kmeans_iterations": float(st.kmeans_iterations)}

    # ------------------------------------------------------------------ decode
    def select(self, st: PQState, q: torch.Tensor) -> torch.Tensor:
        """Positions ``[H_kv, k]`` of the top-k candidates per KV head."""
        n_cand = self.n_candidates(st)
        if n_cand == 0:
            return torch.empty(st.spec.n_kv_heads, 0, dtype=torch.long, device=q.device)
        if self.uses_joint_scores:
            counts, mask = self.count_candidates(st, n_cand)
            tuple_scores = joint_code_scores(q[:, 0], st.centroids, counts, st.spec.scaling, mask)
            scores = tuple_scores.gather(1, st.code_ids[:, :n_cand])
        else:
            scores = group_probs(lookup_scores(q[:, 0], st.centroids, st.codes[:, :n_cand]), st.spec.scaling,
                                 st.spec.n_kv_heads)
        return topk_sorted(scores, self.topk) + self.n_sink

    @staticmethod
    def count_candidates(st: PQState, n_cand: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(code_counts, code_mask)`` brought up to the first ``n_cand`` coded tokens (only the tokens added since
        the last call are counted: one per step). Counts in float32: exact up to 2**24 tokens per tuple."""
        if st.code_counts is None:
            shape = (st.code_ids.shape[0], st.centroids.shape[2] ** st.centroids.shape[1])
            st.code_counts = torch.zeros(shape, dtype=torch.float32, device=st.code_ids.device)
            st.code_mask = torch.full(shape, float("-inf"), dtype=torch.float32, device=st.code_ids.device)
        new = st.code_ids[:, st.n_counted:n_cand]
        st.code_counts.scatter_add_(1, new, torch.ones(new.shape, dtype=torch.float32, device=new.device))
        st.code_mask.scatter_(1, new, 0.0)
        st.n_counted = n_cand
        return st.code_counts, st.code_mask

    @staticmethod
    def n_candidates(st: PQState) -> int:
        """Tokens between the sinks and the recent window, from shapes (no host sync): the resident set is
        the sinks plus a window of consecutive positions ending at the newest token."""
        return st.n_seen - st.k.shape[1]

    def fetch(self, st: PQState, selection: torch.Tensor) -> Fetched:
        k, v = st.store.gather(selection.cpu().numpy())  # the indices must reach the host store: one copy
        k, v = k.to(st.k.device, non_blocking=True), v.to(st.v.device, non_blocking=True)
        st.bytes_moved += k.numel() * k.element_size() + v.numel() * v.element_size()
        return Fetched(torch.cat([k, st.k], dim=1), torch.cat([v, st.v], dim=1))

    def attended_positions(self, st: PQState, selection: torch.Tensor) -> torch.Tensor:
        """The retrieved positions (absolute: the host store holds every token) then the resident ones."""
        return torch.cat([selection, st.pos.to(selection.device).expand(selection.shape[0], -1)], dim=1)

    def append(self, st: PQState, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(st, k, v)
        st.store.append(k, v)  # one row into the preallocated store (official pq_search.py)

    def observe(self, st: PQState, q, fetched, selection) -> None:
        self.trim_window(st)

    def trim_window(self, st: PQState) -> None:
        """Keeps the sinks and the ``recent`` newest tokens resident; a token leaving the window without
        a PQ code gets one by nearest centroid."""
        n_window = st.k.shape[1] - self.n_sink
        if n_window <= self.recent:
            return
        n_leave, first = n_window - self.recent, st.n_seen - n_window  # first: position of the oldest window token
        if st.codes is not None:  # prompt tokens were coded by k-means; only generated ones need a code
            uncoded = max(0, self.n_sink + st.codes.shape[1] - first)  # leaving tokens that already have one
            if uncoded < n_leave:
                self.assign_code(st, st.k[:, self.n_sink + uncoded: self.n_sink + n_leave])
        keep_sinks_and_recent(st, self.n_sink, self.recent)

    def assign_code(self, st: PQState, k: torch.Tensor) -> None:
        """Appends the nearest-centroid codes of the tokens ``k: [H, t, d]`` (amortised O(1) per token)."""
        sub = split_subvectors(k, self.n_subvec)  # [H, m, t, ds]
        h, m, t = sub.shape[:3]
        codes = nearest_centroid(sub.reshape(h * m, t, -1), st.centroids.reshape(h * m, *st.centroids.shape[2:]))
        new = codes.reshape(h, m, t).permute(0, 2, 1)
        st.buffers["codes"], st.codes = append_to_buffer(st.buffers.get("codes"), st.codes, new)
        if st.code_ids is not None:
            ids = joint_code_ids(new, st.centroids.shape[2])
            st.buffers["code_ids"], st.code_ids = append_to_buffer(st.buffers.get("code_ids"), st.code_ids, ids)
