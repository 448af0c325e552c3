"""MagicPIG (Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025; official
code ``Infini-AI-Lab/MagicPIG`` v0.2, ``models/attnserver.py`` + ``library/lsh``).

Budget mapping: docs/architecture.md.

* Dense layers (official ``[0, 16]`` for 32 layers, scaled to depth: ``0`` and ``n_layers // 2``,
  i.e. 0 and 15 for SmolLM2's 30 layers) keep and attend everything.
* Sparse layers, end of prefill: the ``n_sink`` first and ``local`` last prompt tokens stay resident
  (the "GPU part", which also keeps every generated token, as the official generation buffer); the
  middle tokens go to the offload store. Keys are centred per KV head (``mu`` = mean offloaded key),
  hashed by SimHash (``K`` sign bits per table, ``L`` tables, seeded Gaussian projections shared by
  all layers and heads as the official ``hash_func``), and each table is sorted into buckets — on the
  background worker, awaited at the layer's first decode.
* Decode: the query of each *query* head is hashed with its KV head's tables; candidates ``S_h`` =
  keys colliding in at least ``min_collisions`` of the ``L`` tables. With ``p_j = (1 - theta_j/pi)^K``
  (``theta_j`` = angle between ``q_h`` and the centred key), the inclusion probability is
  ``w_j = P[Binomial(L, p_j) >= min_collisions]``; the sampled part is the self-normalised importance
  attention ``softmax(q.k_j / sqrt(d) - log(w_j + 1e-4))`` over ``S_h`` (the official cap of the weight,
  ``sparse_attention/sparse_attention.cc`` ``transform_kernel``; :func:`importance_log_weight`), computed
  where the store lives (the official CPU part), and merged with the exact part by log-sum-exp.

Budget ``B`` = exact part + expected sample size: ``local = min(local_window, (B - n_sink) // 2)``
and, with ``calibrate=True``, each sparse layer picks the smallest ``K`` in ``[0, max_bits]`` whose
expected sample size for the last prompt query (mean over heads of ``sum_j w_j``) is at most
``B - n_sink - local`` (the reference calibrates ``(K, L)`` on a dev set; we calibrate ``K`` per layer
on the prompt at ``L`` fixed). This calibration is our extension: the official configuration is a fixed
``K = 10, L = 150`` for every layer and prompt (``models/attnserver.py``), available by name as
``cache=magicpig_official`` (:class:`MagicPIGOfficial`, ``calibrate=False``), where the budget sets only the
exact part and the sample size is whatever ``K = 10`` gives. Either way the chosen ``K``, the expected
sample size and the target of every sparse layer are recorded (:meth:`MagicPIG.layer_stats`, ``timing.json``
``method_stats``, mean over samples), and when no ``K <= max_bits`` meets the target, calibration uses
``max_bits`` and warns once. The effective tokens (exact part + actual ``|S_h|``) are logged. Measured
on SmolLM2-135M keys at 2k tokens (docs/fidelity.md): relative attention-output error 0.09-0.16 per layer at
budget 256 (calibrated K = 9) and 0.15-0.38 for the official K = 10, against 0.25-0.96 for the exact part alone.
"Budget covers the context" for MagicPIG: when every offloaded token fits the sample target, ``K = 0``
is chosen, every key collides in every table, ``w_j = 1`` and the method attends everything exactly.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np
import torch
from numba import njit

from icecache.kv import BudgetError, Fetched, KVMethod, LayerState, ModelSpec
from icecache.kv.attention import attention_logits, expand_heads
from icecache.offload import to_store

from .common import keep_sinks_and_recent, scaled_layers

OFFICIAL_DENSE_LAYERS = (0, 16)  # for 32-layer Llama
OFFICIAL_BITS, OFFICIAL_TABLES = 10, 150  # models/attnserver.py LSHSparseAttnServer(K=10, L=150)
WEIGHT_FLOOR = 1e-4  # sparse_attention/sparse_attention.cc transform_kernel: score / sqrt(d) - log(w + 1e-4)


# ---------------------------------------------------------------------------------------- SimHash
def simhash(x: torch.Tensor, proj: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Codes ``[..., L]`` (int64): table ``l``'s code is the ``K``-bit sign pattern of ``x . proj[:, l]``;
    ``x: [..., d]``, ``proj: [d, L, K]``. ``chunk`` vectors at a time, so the ``L x K`` sign bits of a chunk
    stay small (one layer's 8k keys at L = 150, K = 10 in one piece: 2.3 s on one CPU thread, in chunks of
    256: 0.2 s, the same codes). The bits are packed by one small matmul with the powers of two (exact: the
    sums are integers below ``2^K``, exact in fp32 up to ``K = 24``, in fp64 beyond), half the time of an
    int64 multiply-and-sum (8k keys, K = 10, 2 threads: 77 -> 38 ms)."""
    d, n_tables, n_bits = proj.shape
    flat = proj.float().reshape(d, n_tables * n_bits)
    pack = torch.float32 if n_bits <= 24 else torch.float64
    weights = torch.pow(2.0, torch.arange(n_bits, device=x.device, dtype=pack))
    rows = x.reshape(-1, d)
    codes = torch.empty(rows.shape[0], n_tables, dtype=torch.int64, device=x.device)
    for start in range(0, rows.shape[0], chunk):
        part = rows[start:start + chunk]
        bits = torch.matmul(part.float(), flat).gt_(0).view(part.shape[0], n_tables, n_bits)
        codes[start:start + chunk] = torch.matmul(bits.to(pack), weights).long()
    return codes.view(*x.shape[:-1], n_tables)


def collision_probability(cos: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Probability that one ``K``-bit SimHash table puts two vectors of cosine ``cos`` in one bucket."""
    theta = torch.arccos(cos.double().clamp(-1.0, 1.0))
    return (1.0 - theta / math.pi) ** n_bits


def inclusion_probability(p: torch.Tensor, n_tables: int, min_collisions: int) -> torch.Tensor:
    """``P[Binomial(L, p) >= min_collisions]`` in float64 (``w_j`` of the paper)."""
    p = p.double()
    below = sum(math.comb(n_tables, i) * p ** i * (1.0 - p) ** (n_tables - i) for i in range(min_collisions))
    return (1.0 - below).clamp(min=0.0)


def importance_log_weight(w: torch.Tensor) -> torch.Tensor:
    """The official capped correction ``log(w + 1e-4)`` (at most ``log(1e4) = 9.2`` nats for an unlikely key),
    shifted by the constant ``log(1 + 1e-4)`` so that a certain key (``w = 1``) gets exactly 0: the shift
    cancels in each head's sampled softmax and only keeps its LSE exact when every key is certain (``K = 0``)."""
    return torch.log((w.double() + WEIGHT_FLOOR) / (1.0 + WEIGHT_FLOOR)).float()


def build_tables(codes: torch.Tensor, n_bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket tables: per (KV head, table) the codes sorted and the key ids in that order (``codes [H_kv, L,
    n]``). On CPU a counting sort over the ``2^K`` buckets (:func:`_bucket_sort`, stable; one layer's 8k keys
    at L = 150, K = 11: 90-100 ms with ``torch.sort``); elsewhere ``torch.sort``. ``n_bits`` (``K``) defaults to
    the bits the largest code needs."""
    codes = codes.contiguous()
    if codes.device.type != "cpu" or codes.numel() == 0:
        return codes.sort(dim=-1)
    if n_bits is None:
        n_bits = int(codes.max()).bit_length()
    rows = codes.view(-1, codes.shape[-1]).numpy()
    sorted_codes, order = np.empty_like(rows), np.empty_like(rows)
    _bucket_sort(rows, 1 << n_bits, sorted_codes, order)
    return torch.from_numpy(sorted_codes).view(codes.shape), torch.from_numpy(order).view(codes.shape)


@njit(cache=True, nogil=True)
def _bucket_sort(codes, n_buckets, sorted_codes, order):
    """Stable counting sort of each row of ``codes`` (values in ``[0, n_buckets)``): histogram, prefix sums,
    scatter; O(n + 2^K) per row."""
    start = np.empty(n_buckets + 1, dtype=np.int64)
    for r in range(codes.shape[0]):
        start[:] = 0
        for i in range(codes.shape[1]):
            start[codes[r, i] + 1] += 1
        for b in range(n_buckets):
            start[b + 1] += start[b]
        for i in range(codes.shape[1]):
            c = codes[r, i]
            j = start[c]
            start[c] = j + 1
            sorted_codes[r, j] = c
            order[r, j] = i


def lookup(sorted_codes: torch.Tensor, order: torch.Tensor, q_codes: torch.Tensor, min_collisions: int) -> torch.Tensor:
    """Candidate mask ``[H_kv * G, n]``: keys sharing the query's bucket in ``>= min_collisions`` tables.

    ``sorted_codes, order: [H_kv, L, n]``; ``q_codes: [H_kv, L, G]`` (the ``G`` query heads of a group)."""
    h_kv, n_tables, n = order.shape
    group = q_codes.shape[-1]
    start = torch.searchsorted(sorted_codes, q_codes).flatten()  # rows ordered (kv, table, g)
    lengths = torch.searchsorted(sorted_codes, q_codes, right=True).flatten() - start
    rows = torch.arange(lengths.numel(), device=order.device)
    row_of_hit = rows.repeat_interleave(lengths)
    first_hit = lengths.cumsum(0) - lengths
    within = torch.arange(row_of_hit.numel(), device=order.device) - first_hit[row_of_hit]
    table_row = row_of_hit // group  # (kv, table)
    keys = order.reshape(-1)[table_row * n + start[row_of_hit] + within]
    q_head = (row_of_hit // (n_tables * group)) * group + row_of_hit % group
    counts = torch.bincount(q_head * n + keys, minlength=h_kv * group * n)
    return counts.reshape(h_kv * group, n) >= min_collisions


# ------------------------------------------------------------------------------- partial attention
def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                      valid: torch.Tensor | None = None, log_weight: torch.Tensor | None = None):
    """Attention of ``q: [H_q, 1, d]`` over ``k, v: [H, m, d]`` returning ``(out [H_q, 1, d] fp32,
    lse [H_q, 1] fp32)``; ``log_weight [H, m]`` is subtracted from the logits (importance correction).
    A head with no valid key gets ``lse = -inf`` and a zero output."""
    n_q = q.shape[0]
    logits = attention_logits(q, k, scaling)  # [H_q, 1, m]
    if log_weight is not None:
        logits = logits - expand_heads(log_weight, n_q)[:, None, :].float()
    if valid is not None:
        logits = logits.masked_fill(~expand_heads(valid, n_q)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.where(torch.isfinite(lse)[..., None], torch.exp(logits - lse[..., None]), 0.0)
    return torch.matmul(probs, expand_heads(v, n_q).float()), lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Log-sum-exp merge of two partial attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


# ------------------------------------------------------------------------------------ the method
@dataclass
class SampledFetched(Fetched):
    """The exact part (``k, v``: resident, current token included) plus the sampled candidates of each
    query head, kept in the offload store: ``sk, sv [H_q, c, d]``, ``svalid``, ``snorm`` (centred-key
    norms) ``[H_q, c]``."""

    sk: torch.Tensor | None = None
    sv: torch.Tensor | None = None
    svalid: torch.Tensor | None = None
    snorm: torch.Tensor | None = None

    def past_tokens_per_head(self) -> float:
        sampled = 0.0 if self.svalid is None else float(self.svalid.sum(-1).float().mean())
        return super().past_tokens_per_head() + sampled


class PigState(LayerState):
    """Sparse layers: resident ``k, v, pos`` = sinks + local window + generated tokens; offload store
    ``store_k/v`` = the middle prompt tokens, their centred-key norms, ``mu`` and the bucket tables."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.n_prompt = 0
        self.store_k: torch.Tensor | None = None
        self.store_v: torch.Tensor | None = None
        self.mu: torch.Tensor | None = None
        self.knorm: torch.Tensor | None = None
        self.sorted_codes: torch.Tensor | None = None
        self.order: torch.Tensor | None = None
        self.n_bits = 0
        self.expected_samples: float | None = None  # at n_bits, for the last prompt query (mean over heads)
        self.calib_q: torch.Tensor | None = None


@dataclass
class MagicPIG(KVMethod):
    """LSH (SimHash) sampling of the offloaded keys + exact sinks/local/generated, merged by LSE.

    Args:
        budget: exact part (sinks + local) + expected sample size per head per sparse layer.
        n_bits: ``K``, sign bits per table (official 10); used as is when ``calibrate=False``.
        n_tables: ``L``, number of tables (official 150 in bench, 170 in generation).
        min_collisions: tables a key must share with the query to be sampled (official 2).
        n_sink: first tokens attended exactly (official 4).
        local_window: last prompt tokens attended exactly (official 64; capped at (B - n_sink) // 2).
        dense_layers: layers kept dense; ``None`` scales the official ``0, 16`` of 32 layers to depth.
        calibrate: choose ``K`` per layer so the expected sample size fits the budget (see module doc).
        max_bits: largest ``K`` calibration may pick.
        seed: seed of the random SimHash projections.
    """

    n_bits: int = OFFICIAL_BITS
    n_tables: int = OFFICIAL_TABLES
    min_collisions: int = 2
    n_sink: int = 4
    local_window: int = 64
    dense_layers: Sequence[int] | None = None
    calibrate: bool = True
    max_bits: int = 20
    seed: int = 0
    name: ClassVar[str] = "magicpig"
    example_budget: ClassVar[int] = 128
    dense: frozenset = field(default=frozenset(), init=False, repr=False)
    proj: torch.Tensor | None = field(default=None, init=False, repr=False)
    _warned_target: bool = field(default=False, init=False, repr=False)

    @property
    def local(self) -> int:
        return min(self.local_window, (self.budget - self.n_sink) // 2)

    @property
    def sample_target(self) -> int:
        return self.budget - self.n_sink - self.local

    def validate(self) -> None:
        if self.budget < self.n_sink + 2:
            raise BudgetError(f"magicpig: budget {self.budget} must be >= n_sink + 2 = {self.n_sink + 2} "
                              "(sinks, a local window and a sampled part)")
        if not 1 <= self.min_collisions <= self.n_tables:
            raise BudgetError(f"magicpig: need 1 <= min_collisions ({self.min_collisions}) <= n_tables ({self.n_tables})")
        self.check_whole("n_bits", "n_sink", "local_window", "max_bits", "seed")
        self.check_whole("n_tables", "min_collisions", minimum=1)
        self.check_choice("calibrate", (False, True))
        if self.dense_layers is not None and not all(isinstance(i, int) and i >= 0 for i in self.dense_layers):
            raise ValueError(f"magicpig: dense_layers must be layer ids (whole numbers >= 0), got {self.dense_layers}")

    def bind(self, spec: ModelSpec) -> None:
        super().bind(spec)
        layers = self.dense_layers
        if layers is None:
            layers = scaled_layers(OFFICIAL_DENSE_LAYERS, spec.n_layers)
        self.dense = frozenset(int(i) for i in layers)
        generator = torch.Generator().manual_seed(self.seed)
        bits = max(self.n_bits, self.max_bits if self.calibrate else 0)
        self.proj = torch.randn(spec.head_dim, self.n_tables, bits, generator=generator)

    def make_state(self, layer_idx: int) -> PigState:
        return PigState(layer_idx)

    def is_budgeted(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense

    # ------------------------------------------------------------------ prefill
    def prefill(self, st: PigState, q, k, v):
        st.calib_q = q[:, -1].detach().float().cpu()
        return super().prefill(st, q, k, v)

    def finish_prefill(self, st: PigState) -> None:
        st.n_prompt = st.n_seen
        n_mid = st.n_seen - self.n_sink - self.local
        if not self.is_budgeted(st.layer_idx) or n_mid <= 0:
            return
        mid = slice(self.n_sink, self.n_sink + n_mid)
        st.store_k, st.store_v = to_store(st.k[:, mid]), to_store(st.v[:, mid])
        keep_sinks_and_recent(st, self.n_sink, self.local)  # the prompt's sinks and local window stay resident
        self.submit_background(st, self.build_index, st)

    def build_index(self, st: PigState) -> None:
        """Centres the offloaded keys, picks ``K`` (calibration), hashes and sorts into bucket tables."""
        st.mu = st.store_k.float().mean(dim=1, keepdim=True)  # [H_kv, 1, d]
        centred = st.store_k.float() - st.mu
        st.knorm = centred.norm(dim=-1)
        st.n_bits, st.expected_samples = self.choose_bits(st, centred)
        st.sorted_codes, st.order = build_tables(simhash(centred, self.proj[..., :st.n_bits]).transpose(1, 2),
                                                 st.n_bits)

    def choose_bits(self, st: PigState, centred: torch.Tensor) -> tuple[int, float | None]:
        """``(K, expected sample size at K)``. With ``calibrate``: the smallest ``K`` whose expected sample size
        (last prompt query, mean over heads) fits the target, else ``max_bits`` with a warning (once per
        method). Without: ``n_bits``, its expected sample size recorded (``None`` without a prompt query)."""
        if st.calib_q is None:
            return self.n_bits, None
        keys = expand_heads(centred, self.spec.n_q_heads)
        cos = torch.einsum("hd,hnd->hn", st.calib_q, keys) / (
            st.calib_q.norm(dim=-1, keepdim=True) * keys.norm(dim=-1)).clamp(min=1e-12)
        one_bit = collision_probability(cos, 1)  # the arccos once; K bits collide with probability one_bit ** K

        def expected(bits: int) -> float:
            p = one_bit ** bits
            return float(inclusion_probability(p, self.n_tables, self.min_collisions).sum(-1).mean())

        if not self.calibrate:
            return self.n_bits, expected(self.n_bits)
        for bits in range(self.max_bits + 1):
            if (size := expected(bits)) <= self.sample_target:
                return bits, size
        if not self._warned_target:
            self._warned_target = True
            warnings.warn(f"magicpig: layer {st.layer_idx}: no K <= max_bits={self.max_bits} brings the expected "
                          f"sample size to the target {self.sample_target} (K={self.max_bits} expects {size:.1f} of "
                          f"{centred.shape[1]} offloaded keys); using K={self.max_bits}, the budget is exceeded "
                          f"(timing.json method_stats); raise max_bits or the budget. Warned once per run.",
                          RuntimeWarning, stacklevel=2)
        return self.max_bits, size

    def layer_stats(self, st: PigState) -> dict[str, float]:
        """Sparse layers with an index: the chosen ``K`` and the expected sample size (timing.json
        ``method_stats``)."""
        if st.store_k is None or st.pending is not None:
            return {}
        stats = {"lsh_bits": float(st.n_bits), "sample_target": float(self.sample_target)}
        if st.expected_samples is not None:
            stats["expected_samples"] = st.expected_samples
        return stats

    # ------------------------------------------------------------------ decode
    def select(self, st: PigState, q: torch.Tensor) -> torch.Tensor | None:
        """Candidate mask ``[H_q, n_mid]`` (``None`` in dense layers or with nothing offloaded)."""
        if st.store_k is None:
            return None
        q_host = q[:, 0].detach().float().cpu()
        codes = simhash(q_host, self.proj[..., :st.n_bits])  # [H_q, L]
        codes = codes.reshape(self.spec.n_kv_heads, self.spec.group, -1).transpose(1, 2).contiguous()
        return lookup(st.sorted_codes, st.order, codes, self.min_collisions)

    def fetch(self, st: PigState, selection: torch.Tensor | None) -> Fetched:
        if selection is None:
            return Fetched(st.k, st.v)
        n_cand = int(selection.sum(-1).max())
        idx = torch.argsort((~selection).to(torch.int8), dim=-1, stable=True)[:, :n_cand]  # candidates first
        kv = (torch.arange(self.spec.n_q_heads) // self.spec.group)[:, None]
        return SampledFetched(st.k, st.v, sk=st.store_k[kv, idx], sv=st.store_v[kv, idx],
                              svalid=selection.gather(1, idx), snorm=st.knorm[kv, idx])

    def attended_positions(self, st: PigState, selection: torch.Tensor | None) -> torch.Tensor:
        """``[H_q, m]``: the exact part (resident) then every sampled candidate of each query head (the store
        holds prompt positions ``n_sink .. n_sink + n_mid - 1``), -1 where a head sampled fewer."""
        if selection is None:
            return st.pos
        store = torch.arange(self.n_sink, self.n_sink + selection.shape[1])
        sampled = torch.where(selection.cpu(), store, -1)  # [H_q, n_mid]
        return torch.cat([st.pos.cpu().expand(sampled.shape[0], -1), sampled], dim=1)

    def attend(self, st: PigState, q: torch.Tensor, fetched: Fetched) -> torch.Tensor:
        out, lse = partial_attention(q, fetched.k, fetched.v, self.spec.scaling)
        if isinstance(fetched, SampledFetched):
            sampled_out, sampled_lse = self.sampled_attention(st, q, fetched)
            out, lse = merge_attention(out, lse, sampled_out.to(out.device), sampled_lse.to(out.device))
            st.bytes_moved += (q.numel() + sampled_out.numel() + sampled_lse.numel()) * 4
        return out.to(q.dtype)

    def sampled_attention(self, st: PigState, q: torch.Tensor, fetched: SampledFetched):
        """The offload-side part: importance-weighted attention over each query head's candidates."""
        q_host = q.detach().float().cpu()  # [H_q, 1, d]
        mu = expand_heads(st.mu, self.spec.n_q_heads)  # [H_q, 1, d]
        dots = torch.matmul(q_host, (fetched.sk.float() - mu).transpose(1, 2))[:, 0]  # q . centred key
        cos = dots / (q_host[:, 0].norm(dim=-1, keepdim=True) * fetched.snorm).clamp(min=1e-12)
        w = inclusion_probability(collision_probability(cos, st.n_bits), self.n_tables, self.min_collisions)
        log_w = importance_log_weight(w)
        return partial_attention(q_host, fetched.sk, fetched.sv, self.spec.scaling, fetched.svalid, log_w)

    # ------------------------------------------------------------------ accounting
    def check_resident(self, st: PigState) -> None:
        """Sparse layers: resident prompt tokens (sinks + local) within the exact part of the budget;
        generated tokens are kept on top (exempt, as the official generation buffer)."""
        if not self.is_budgeted(st.layer_idx):
            return
        prompt_part = self.resident_tokens(st) - (st.n_seen - st.n_prompt)
        if prompt_part > self.n_sink + self.local:
            raise AssertionError(f"magicpig: layer {st.layer_idx} holds {prompt_part} resident prompt tokens, "
                                 f"over its exact part of {self.n_sink + self.local} (budget {self.budget})")


@dataclass
class MagicPIGOfficial(MagicPIG):
    """The official configuration (``models/attnserver.py``): ``K = 10``, ``L = 150`` for every layer and
    prompt, no calibration; the budget sets the exact part (sinks + local window) only."""

    calibrate: bool = False
    name: ClassVar[str] = "magicpig_official"
