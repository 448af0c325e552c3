"""MagicPIG's LSH tables (Chen et al., ICLR 2025, Sec. 4; official ``models/attnserver.py`` ``fill`` and
``build_table``): SimHash codes of the keys, one bucket table per (KV head, hash table), and the lookup of a
query's colliding keys.

Precision follows the official code: the projections are one Gaussian matrix in the model's dtype
(``hash_func = torch.randn(head_dim, K * L, dtype=bfloat16)``), the centred keys are hashed in that dtype and
codes are int16 (int32 here when ``K > 15``). On a CPU with AVX512-BF16 the bf16 product is several times
faster than fp32 (docs/fidelity.md, "MagicPIG", "Implementation"); a model run in fp32 hashes in fp32. The tables
are most of MagicPIG's memory (3 x 150 x 8k entries per layer at 8k tokens), and on a VM every freshly touched
page adds to the TT2T (same section), so they are kept small: key ids int16 while the store holds at most 2^15
keys (the official int32 beyond), and on CPU the buckets as offsets (``2^K + 1`` per table) instead of the sorted
codes (``n`` per table) whenever ``2^K <= n`` (:class:`BucketTables`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

SIGN_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # float width -> signed int of that width
ROWS_PER_PRODUCT = 1024  # keys per projection product: its [rows, K * L] output stays in the L2 cache


def code_dtype(n_bits: int) -> torch.dtype:
    """int16 codes up to ``K = 15`` (the official storage), int32 beyond."""
    return torch.int16 if n_bits <= 15 else torch.int32


def bit_major(proj: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``proj [d, L, K]`` as one ``[d, K * L]`` matrix in ``dtype``, bit-major (column ``b * L + l`` is table
    ``l``'s bit ``b``), so that one bit of every table is contiguous in a product row."""
    d, n_tables, n_bits = proj.shape
    return proj.permute(0, 2, 1).reshape(d, n_bits * n_tables).to(dtype).contiguous()


def simhash(x: torch.Tensor, proj: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Codes ``[..., L]``: table ``l``'s code is the ``K``-bit sign pattern of ``x . proj[:, l]`` (bit ``b`` set
    when ``x . proj[:, l, b] > 0``); ``x: [..., d]``, ``proj: [d, L, K]``. The product runs in ``x``'s dtype
    (``matrix``: :func:`bit_major` of ``proj`` in that dtype, when the caller keeps one). The codes are a view
    of a table-major ``[B, L, n]`` buffer (``x`` read as ``[B, n, d]``), so ``codes.transpose(-1, -2)`` of
    keys ``[H, n, d]`` is the contiguous ``[H, L, n]`` that :func:`build_tables` sorts without a copy."""
    d, n_tables, n_bits = proj.shape
    if matrix is None:
        matrix = bit_major(proj, x.dtype)
    if x.dim() == 1:
        return simhash(x[None], proj, matrix)[0]
    lead, n = x.shape[:-2], x.shape[-2]
    rows = x.reshape(-1, n, d)
    codes = torch.empty(rows.shape[0], n_tables, n, dtype=code_dtype(n_bits))
    product = torch.empty(min(n, ROWS_PER_PRODUCT), matrix.shape[1], dtype=x.dtype)  # reused: no page faults
    ints = SIGN_VIEW[x.element_size()]
    for b in range(rows.shape[0]):
        for start in range(0, n, ROWS_PER_PRODUCT):
            part = rows[b, start:start + ROWS_PER_PRODUCT]
            torch.matmul(part, matrix, out=product[:part.shape[0]])
            _pack_sign_bits(product[:part.shape[0]].view(ints).numpy(), n_tables, n_bits, codes[b].numpy(), start)
    return codes.transpose(1, 2).reshape(*lead, n, n_tables)


@njit(cache=True, nogil=True)
def _pack_sign_bits(product, n_tables, n_bits, codes, offset):
    """``codes[l, offset + r]`` = the sign bits of bit-major ``product[r]`` (floats read as same-width signed
    ints: ``> 0`` exactly for positive floats). Bits outer, tables inner (a contiguous inner loop); 16 rows'
    codes are gathered before they are written, 16 consecutive codes per table, much faster than writing a code
    at a time, ``L`` scattered stores per row (docs/fidelity.md, "MagicPIG", "Implementation")."""
    block = np.zeros((16, n_tables), dtype=codes.dtype)
    for r0 in range(0, product.shape[0], 16):
        r1 = min(product.shape[0], r0 + 16)
        block[:] = 0
        for r in range(r0, r1):
            code = block[r - r0]
            for b in range(n_bits):
                row = product[r, b * n_tables:(b + 1) * n_tables]
                for t in range(n_tables):
                    code[t] |= (row[t] > 0) << b
        for t in range(n_tables):
            for r in range(r0, r1):
                codes[t, offset + r] = block[r - r0, t]


def id_dtype(n_keys: int) -> torch.dtype:
    """int16 key ids for stores of fewer than 2^15 keys, int32 beyond (the official int32)."""
    return torch.int16 if n_keys <= np.iinfo(np.int16).max + 1 else torch.int32


@dataclass
class BucketTables:
    """One layer's bucket tables, per (KV head, table): ``order [H_kv, L, n]``, the key ids grouped by bucket
    (stably: by id within a bucket), and where each bucket lies in them, either as ``offsets [H_kv, L, 2^K + 1]``
    (bucket ``c`` is ``order[..., offsets[c]:offsets[c + 1]]``; built on CPU when the ``2^K`` buckets are no more
    than the keys, as with the official ``K = 10`` from 1,024 keys on) or as the codes in that order, ``sorted_codes
    [H_kv, L, n]``, searched by bisection (the official ``build_table``; on CUDA, and for ``K`` past ``log2 n``). The offsets take ``2^K / n`` of the sorted codes' memory and no gather to build."""

    order: torch.Tensor
    offsets: torch.Tensor | None = None
    sorted_codes: torch.Tensor | None = None

    def bucket_bounds(self, q_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first slot, length)`` in ``order`` of each query code's bucket (int64, ``q_codes``' shape
        ``[H_kv, L, G]``)."""
        if self.offsets is not None:
            codes = q_codes.long()
            start = self.offsets.gather(-1, codes).long()
            return start, self.offsets.gather(-1, codes + 1).long() - start
        codes = q_codes.to(self.sorted_codes.dtype)
        start = torch.searchsorted(self.sorted_codes, codes)
        return start, torch.searchsorted(self.sorted_codes, codes, right=True) - start


def build_tables(codes: torch.Tensor, n_bits: int | None = None) -> BucketTables:
    """:class:`BucketTables` of ``codes [H_kv, L, n]`` (the official ``build_table``; key ids in :func:`id_dtype`).
    On CPU with ``2^K <= n``: a stable counting sort over the ``2^K`` buckets (:func:`_bucket_sort`, bucket
    offsets), faster than ``torch.sort`` for the tables' sizes (docs/fidelity.md, "MagicPIG",
    "Implementation"); else a stable
    ``torch.sort`` (sorted codes). ``n_bits`` (``K``) defaults to the bits the largest code needs."""
    codes = codes.contiguous()
    n = codes.shape[-1]
    if n_bits is None:
        n_bits = int(codes.max()).bit_length() if codes.numel() else 0
    if codes.device.type != "cpu" or codes.numel() == 0 or (1 << n_bits) > n:
        sorted_codes, order = codes.sort(dim=-1, stable=True)
        return BucketTables(order.to(id_dtype(n)), sorted_codes=sorted_codes)
    rows = codes.view(-1, n).numpy()
    order = torch.empty(rows.shape, dtype=id_dtype(n))
    offsets = torch.empty(rows.shape[0], (1 << n_bits) + 1, dtype=id_dtype(n + 1))
    _bucket_sort(rows, order.numpy(), offsets.numpy())
    return BucketTables(order.view(codes.shape), offsets=offsets.view(*codes.shape[:-1], -1))


@njit(cache=True, nogil=True)
def _bucket_sort(codes, order, offsets):
    """Stable counting sort of each row of ``codes`` (values in ``[0, n_buckets)``, ``n_buckets = offsets.shape[1]
    - 1``): histogram, prefix sums (the row's ``offsets``), key ids scattered to their bucket's next slot; O(n +
    2^K) per row. Two rows at a time, so that two independent chains of counter updates overlap (faster than one
    row at a time; an odd last row is paired with itself, both chains then write the same values)."""
    n, n_buckets = codes.shape[1], offsets.shape[1] - 1
    start = np.empty((2, n_buckets + 1), dtype=np.int32)
    for r0 in range(0, codes.shape[0], 2):
        r1 = min(r0 + 1, codes.shape[0] - 1)
        row_a, row_b, next_a, next_b = codes[r0], codes[r1], start[0], start[1]
        start[:] = 0
        for i in range(n):
            next_a[row_a[i] + 1] += 1
            next_b[row_b[i] + 1] += 1
        for b in range(n_buckets):
            next_a[b + 1] += next_a[b]
            next_b[b + 1] += next_b[b]
        offsets[r0], offsets[r1] = next_a, next_b
        order_a, order_b = order[r0], order[r1]
        for i in range(n):
            code_a, code_b = row_a[i], row_b[i]
            slot_a, slot_b = next_a[code_a], next_b[code_b]
            next_a[code_a], next_b[code_b] = slot_a + 1, slot_b + 1
            order_a[slot_a], order_b[slot_b] = i, i


def warm_up(dtype: torch.dtype, n_keys: int, bit_counts) -> None:
    """Compiles (or loads from numba's disk cache) both kernels for the signatures that hashing in ``dtype`` with
    ``K`` in ``bit_counts`` and the tables of ``n_keys`` keys use (:func:`code_dtype`, :func:`id_dtype`), on one-row
    arrays; a signature already loaded costs one dispatch."""
    ints = SIGN_VIEW[torch.empty(0, dtype=dtype).element_size()]
    for codes in {code_dtype(b) for b in bit_counts}:
        codes = torch.zeros(1, 2, dtype=codes).numpy()
        _pack_sign_bits(torch.zeros(1, 1, dtype=dtype).view(ints).numpy(), 1, 1, codes, 0)
        _bucket_sort(codes, torch.zeros(1, 2, dtype=id_dtype(n_keys)).numpy(),
                     torch.zeros(1, 3, dtype=id_dtype(n_keys + 1)).numpy())


def lookup(tables: BucketTables, q_codes: torch.Tensor, min_collisions: int) -> torch.Tensor:
    """Candidate mask ``[H_kv * G, n]``: keys sharing the query's bucket in ``>= min_collisions`` tables
    (``q_codes: [H_kv, L, G]``, the ``G`` query heads of each group)."""
    h_kv, n_tables, n = tables.order.shape
    group = q_codes.shape[-1]
    start, lengths = (x.flatten() for x in tables.bucket_bounds(q_codes))  # rows ordered (kv, table, g)
    rows = torch.arange(lengths.numel(), device=start.device)
    row_of_hit = rows.repeat_interleave(lengths)
    first_hit = lengths.cumsum(0) - lengths
    within = torch.arange(row_of_hit.numel(), device=start.device) - first_hit[row_of_hit]
    table_row = row_of_hit // group  # (kv, table)
    keys = tables.order.reshape(-1)[table_row * n + start[row_of_hit] + within].long()
    q_head = (row_of_hit // (n_tables * group)) * group + row_of_hit % group
    counts = torch.bincount(q_head * n + keys, minlength=h_kv * group * n)
    return counts.reshape(h_kv * group, n) >= min_collisions
