"""IceCache's resident buffer and its page table (Mao et al., "IceCache", ICLR 2026; the
official ``infer_state.py`` keeps the same regions in its per-layer page table).

One :class:`ResidentBuffer` per budgeted layer owns the device-side K/V a decode step attends, laid out as

    [ sink: n_sink tokens | n_slots page slots of page_size tokens | window: ring of n_window pages ]

per KV head (``k, v [H_kv, R, d]``, ``valid [H_kv, R]``), and the host-side table of what each slot holds
(``slot_page [H_kv, W]`` page id, -1 = empty; ``slot_tokens [H_kv, W, s]`` absolute positions, -1 = empty),
kept in numpy: the index returns numpy page ids and the offload store is read through numpy views, so a
step never converts index-side arrays to tensors and back. Attention reads the buffer in place; nothing is
concatenated per step. The window is a ring: position ``p`` lives in ring page ``(p // s) % n_window``.

Named operations (in the spirit of vLLM's ``BlockTable``): :meth:`append` (a new token into the window),
:meth:`evict_oldest_window_page`, :meth:`mark_stale` (pages an index insert changed lose their slot),
:meth:`assign_slots` (keep the resident selected pages, give the missing ones free slots),
:meth:`load_pages` (write loaded pages into their slots), :meth:`refresh_mask` and :meth:`n_past` (the
slot mask and the attended count), :meth:`attended_positions`. The index-side loops are small numba kernels
(``_assign``, ``_positions``, ``_load_host``, ``_refresh_mask``), so one step costs a few calls, not dozens
of small numpy/torch ops per layer.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from icecache.dci.gqa import find
from icecache.dci.intrinsics import prefetch_row

_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes as integers of the element's width (any dtype, bf16 included):
    the kernels below only copy elements, so they need no floating-point type numpy lacks."""
    return x.view(_RAW[x.element_size()]).numpy()


@njit(cache=True, nogil=True)
def _assign(held, slot_tokens, want, heads, pages, slots):
    """Per KV head: slots whose page is not in ``want`` are freed (page and tokens -1); every wanted page
    not resident gets the lowest free slot, in ``want``'s column order. Writes the loads to make into
    ``heads, pages, slots`` (head-major) and returns their number."""
    n_heads, width = held.shape
    n = 0
    for h in range(n_heads):
        for w in range(width):
            p = held[h, w]
            if p < 0:
                continue
            if find(want[h], want.shape[1], p) < 0:
                held[h, w] = -1
                slot_tokens[h, w, :] = -1
        free = 0
        for c in range(want.shape[1]):
            p = want[h, c]
            if p < 0:
                continue
            if find(held[h], width, p) >= 0:
                continue
            while held[h, free] >= 0:
                free += 1
            held[h, free] = p
            heads[n], pages[n], slots[n] = h, p, free
            n += 1
    return n


@njit(cache=True, nogil=True)
def _positions(page_abs, heads, pages, slots, n, slot_tokens, out):
    """``out[i] = slot_tokens[heads[i], slots[i]] = page_abs[heads[i], pages[i]]`` for the first ``n`` loads."""
    for i in range(n):
        for j in range(page_abs.shape[2]):
            pos = page_abs[heads[i], pages[i], j]
            out[i, j] = pos
            slot_tokens[heads[i], slots[i], j] = pos


@njit(cache=True, nogil=True)
def _load_host(src, positions, heads, slots, offset, k_dst, v_dst):
    """Copies the store rows at ``positions [n, s]`` (absolute, -1 = empty slot: reads the head's first row,
    masked later) of KV heads ``heads [n]`` into slots ``slots [n]`` of the buffer ``k_dst, v_dst`` (region
    starting at ``offset``). ``src`` = ``(k, v, base_pos, first_pos, end_pos)``, the store's host buffers ``[H,
    capacity, d]`` (``HostKV.host_buffers``: row ``r`` holds position ``base_pos + r``) and its stored positions
    ``first_pos .. end_pos-1``. Returns False (nothing partly checked is copied) when a position is outside
    them."""
    # serial: a parallel copy is faster alone but slows the decode step, its spinning numba workers competing
    # with torch's ops (docs/benchmarks.md, "Threads and OpenMP waiting")
    k_src, v_src, base_pos, first_pos, end_pos = src
    n, s = positions.shape
    for i in range(n):
        for j in range(s):
            pos = positions[i, j]
            if pos >= 0 and (pos < first_pos or pos >= end_pos):
                return False
    for i in range(n):  # the rows to read are scattered over the store: request them all first
        for j in range(s):
            row = max(positions[i, j] - base_pos, 0)
            prefetch_row(k_src[heads[i]], row)
            prefetch_row(v_src[heads[i]], row)
    for i in range(n):
        h = heads[i]
        for j in range(s):
            row = max(positions[i, j] - base_pos, 0)
            dst = offset + slots[i] * s + j
            for e in range(k_src.shape[2]):  # element loops: a slice assignment per row costs more than the copy
                k_dst[h, dst, e] = k_src[h, row, e]
                v_dst[h, dst, e] = v_src[h, row, e]
    return True


@njit(cache=True, nogil=True)
def _refresh_mask(slot_tokens, offset, valid):
    """``valid`` of the slot region = filled slot entries; returns the filled entries over all heads."""
    n_heads, width, s = slot_tokens.shape
    filled = 0
    for h in range(n_heads):
        for w in range(width):
            for j in range(s):
                ok = slot_tokens[h, w, j] >= 0
                valid[h, offset + w * s + j] = ok
                filled += ok
    return filled


class ResidentBuffer:
    """The device-side resident set of one budgeted layer and its page table (see the module docstring)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, n_sink: int, n_slots: int, page_size: int,
                 n_window: int, window_start: int):
        """The buffer for ``k, v [H_kv, n, d]`` (a layer's tokens so far): positions ``0 .. n_sink - 1``
        become the sink, ``window_start ..`` (at most ``n_window`` pages) the window; the slots start empty."""
        h, _, d = k.shape
        s = page_size
        self.page_size, self.n_window, self.n_sink = s, n_window, n_sink
        self.offset = n_sink  # first slot entry
        self.win_offset = n_sink + n_slots * s  # first window entry
        size = self.win_offset + n_window * s
        self.k = torch.zeros(h, size, d, dtype=k.dtype, device=k.device)
        self.v = torch.zeros_like(self.k)
        self.valid = torch.zeros(h, size, dtype=torch.bool, device=k.device)
        self.k[:, :n_sink], self.v[:, :n_sink], self.valid[:, :n_sink] = k[:, :n_sink], v[:, :n_sink], True
        self.slot_page = np.full((h, n_slots), -1, dtype=np.int64)
        self.slot_tokens = np.full((h, n_slots, s), -1, dtype=np.int64)
        self.on_host = k.device.type == "cpu"
        self.filled = 0  # filled slot entries over all heads (host count: no device read)
        # scratch of the loads of one step (at most every slot of every head)
        self._loads = np.empty((3, h * n_slots), dtype=np.int64)
        self._positions = np.empty((h * n_slots, s), dtype=np.int64)
        self.win_start, self.win_len = window_start, 0
        self.append(k[:, window_start:], v[:, window_start:])

    # ------------------------------------------------------------------ shape
    @property
    def heads(self) -> int:
        return self.slot_page.shape[0]

    @property
    def n_slots(self) -> int:
        return self.slot_page.shape[1]

    @property
    def slot_k(self) -> torch.Tensor:
        """``[H_kv, W, s, d]`` view of the slot region of :attr:`k`."""
        return self.k[:, self.offset: self.win_offset].view(self.heads, self.n_slots, self.page_size, -1)

    @property
    def slot_v(self) -> torch.Tensor:
        return self.v[:, self.offset: self.win_offset].view(self.heads, self.n_slots, self.page_size, -1)

    def resident_tokens(self) -> int:
        """Past tokens the buffer holds room for: sink + every slot's capacity + window."""
        return self.n_sink + self.n_slots * self.page_size + self.win_len

    # ------------------------------------------------------------------ window
    def window_full(self) -> bool:
        return self.win_len >= self.n_window * self.page_size

    def window_index(self, positions):
        """Entries of the buffer holding window ``positions`` (an int, or a LongTensor of positions)."""
        s = self.page_size
        return self.win_offset + (positions // s) % self.n_window * s + positions % s

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes ``k, v [H_kv, m, d]`` at the next ``m`` window positions (the window must have room)."""
        start, m = self.win_start + self.win_len, k.shape[1]
        if m == 1:  # a decode step: one entry, plain indexing
            i = self.window_index(start)
            self.k[:, i], self.v[:, i], self.valid[:, i] = k[:, 0], v[:, 0], True
        elif m:
            i = self.window_index(torch.arange(start, start + m)).to(self.k.device)
            self.k[:, i], self.v[:, i], self.valid[:, i] = k, v, True
        self.win_len += m

    def oldest_window_page(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A host copy of the oldest window page, which stays in the window: ``k, v [H_kv, s, d]`` (one
        device-to-host copy) and its positions ``[s]``."""
        s = self.page_size
        positions = torch.arange(self.win_start, self.win_start + s)
        oldest = self.window_index(positions).to(self.k.device)
        k, v = torch.stack((self.k[:, oldest], self.v[:, oldest])).cpu()
        return k, v, positions

    def drop_oldest_window_page(self) -> None:
        """Removes the oldest window page from the window (its entries masked until reused)."""
        s = self.page_size
        self.valid[:, self.window_index(torch.arange(self.win_start, self.win_start + s)).to(self.k.device)] = False
        self.win_start, self.win_len = self.win_start + s, self.win_len - s

    def evict_oldest_window_page(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Removes the oldest window page; returns what :meth:`oldest_window_page` returns."""
        page = self.oldest_window_page()
        self.drop_oldest_window_page()
        return page

    # ------------------------------------------------------------------ page slots
    def mark_stale(self, changed: np.ndarray) -> None:
        """Resident pages whose content changed (``changed [H_kv, n_pages]`` bool) lose their slot."""
        held = self.slot_page
        stale = (held >= 0) & np.take_along_axis(changed, np.maximum(held, 0), 1)
        held[stale] = -1
        self.slot_tokens[stale] = -1

    def assign_slots(self, selection: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keeps the selected pages already resident in their slots, frees the others and gives the missing
        pages the lowest free slots; ``selection [H_kv, K']`` (-1 padded, distinct per head). Returns the
        ``(heads, pages, slots)`` to load (int64, possibly empty), in head-major selection order."""
        n = _assign(self.slot_page, self.slot_tokens, np.ascontiguousarray(selection, dtype=np.int64),
                    *self._loads)
        return self._loads[0, :n], self._loads[1, :n], self._loads[2, :n]

    def load_pages(self, page_abs: np.ndarray, heads: np.ndarray, pages: np.ndarray, slots: np.ndarray,
                   store) -> int:
        """Loads pages ``(heads, pages)`` of the page table ``page_abs [H_kv, P, s]`` (absolute positions) from
        ``store`` (an :class:`~icecache.offload.OffloadStore`) into ``slots``; returns the bytes moved. On the
        host the rows are copied from the store straight into the slots (the "device" is host memory); on an
        accelerator through the store's packed transit buffer (one host-to-device copy)."""
        n = heads.shape[0]
        positions = self._positions[:n]
        _positions(page_abs, heads, pages, slots, n, self.slot_tokens, positions)
        d = self.k.shape[2]
        if self.on_host and store.device.type == "cpu":
            k_data, v_data = store.host_buffers()
            src = (raw_numpy(k_data), raw_numpy(v_data), store.base_pos, store.first_pos, store.end_pos)
            ok = _load_host(src, positions, heads, slots, self.offset, raw_numpy(self.k), raw_numpy(self.v))
            if not ok:
                used = positions[positions >= 0]
                raise IndexError(f"positions {used.min()}..{used.max()} are not all in the offload store "
                                 f"({store.first_pos}..{store.end_pos - 1})")
        else:
            k, v = store.bulk_load(heads, positions)
            dev = self.k.device
            dev_heads, dev_slots = torch.from_numpy(heads).to(dev), torch.from_numpy(slots).to(dev)
            self.slot_k[dev_heads, dev_slots], self.slot_v[dev_heads, dev_slots] = k, v
        return 2 * n * self.page_size * d * self.k.element_size()

    def refresh_mask(self) -> None:
        """The slot region of :attr:`valid` = the filled slot entries (after assign / load / stale)."""
        if self.on_host:
            self.filled = _refresh_mask(self.slot_tokens, self.offset, self.valid.numpy())
            return
        filled = self.slot_tokens >= 0
        self.filled = int(np.count_nonzero(filled))
        self.valid[:, self.offset: self.win_offset].copy_(torch.from_numpy(filled.reshape(self.heads, -1)))

    # ------------------------------------------------------------------ what attention reads
    def n_past(self) -> float:
        """Mean past tokens per head at attention (current token excluded), from the host page table."""
        return self.n_sink + self.filled / self.heads + self.win_len - 1

    def attended_positions(self) -> torch.Tensor:
        """Absolute positions ``[H_kv, R]`` of the buffer's entries, -1 where masked."""
        h = self.heads
        window = torch.full((h, self.k.shape[1] - self.win_offset), -1, dtype=torch.long)
        positions = torch.arange(self.win_start, self.win_start + self.win_len)
        window[:, self.window_index(positions) - self.win_offset] = positions
        return torch.cat([torch.arange(self.n_sink).expand(h, -1), torch.from_numpy(self.slot_tokens).view(h, -1),
                          window], dim=1)
