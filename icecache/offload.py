"""IceCache's offload store and page bulk loader (reference/icecache.md §4 step 5, §5; DESIGN.md "Devices").

:class:`OffloadStore` holds the K/V of one layer's offloaded tokens in host memory (pinned when the
model runs on CUDA), indexed by absolute token position. The M-DCI index's ``page_table`` says which
positions make up each (KV head, page); :meth:`OffloadStore.bulk_load` moves a list of such pages to the
device the way the official ``recall`` + ``scatter_pages`` do:

1. pack every requested (head, page) block into one host *transit buffer* ``[2, N, page_size, d]``
   (all Ks, then all Vs; the official ``copy_to_buffer``),
2. **one** host-to-device copy of the used prefix (non-blocking, on a side stream, then synchronised),
3. the caller scatters the blocks into its resident page slots.

The store is token-indexed rather than page-laid-out: the index's pages are re-read from its
``page_table`` at every load, so a page whose content changed after an insert (split, re-pack) is
packed from its current token list, and a layer that reuses another layer's pages (IceCache(reuse))
gathers *its own* K/V in the anchor's page layout from the same positions. On a CPU-only machine the
"device" is host memory too; the same packing path runs and the bytes moved are counted.
"""
from __future__ import annotations

import numpy as np
import torch


def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer, page-locked (pinned) when ``pin`` (the model runs on CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def to_store(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` for a baseline's offload store, pinned when the model runs on CUDA."""
    host = x.detach().to("cpu", copy=True)
    return host.pin_memory() if x.is_cuda else host


class OffloadStore:
    """Host-memory K/V ``k_data, v_data: [H_kv, capacity, d]`` of one layer; row ``r`` holds position
    ``base_pos + r``, and positions ``first_pos .. end_pos - 1`` are the stored (offloaded) ones.

    Two ways to make one: :meth:`copy_of` copies K/V into new host memory (pinned when the model runs on
    CUDA), and :meth:`adopt` takes over a layer's prefill buffers without a copy when they already live in
    host memory (CPU runs), so a long prompt's K/V are not held twice."""

    def __init__(self, k_data: torch.Tensor, v_data: torch.Tensor, base_pos: int, first_pos: int, end_pos: int,
                 device: torch.device, max_blocks: int, page_size: int):
        """Use :meth:`copy_of` or :meth:`adopt`. ``k_data, v_data`` are contiguous host buffers."""
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.k_data, self.v_data = k_data, v_data
        self.base_pos, self.first_pos, self.end_pos = base_pos, first_pos, end_pos
        d = k_data.shape[2]
        self.transit = host_empty((2, max_blocks, page_size, d), k_data.dtype, self.pin)
        self.device_transit = torch.empty_like(self.transit, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.pin else None
        self.bytes_moved = 0

    @classmethod
    def copy_of(cls, k: torch.Tensor, v: torch.Tensor, first_pos: int, device, max_blocks: int,
                page_size: int) -> "OffloadStore":
        """A store holding a host copy of ``k, v: [H_kv, n, d]`` (any device) = positions ``first_pos ..``."""
        pin = torch.device(device).type == "cuda"
        h, n, d = k.shape
        k_data, v_data = (host_empty((h, max(2 * n, 64), d), k.dtype, pin) for _ in range(2))
        k_data[:, :n], v_data[:, :n] = k.detach().to("cpu"), v.detach().to("cpu")
        return cls(k_data, v_data, first_pos, first_pos, first_pos + n, device, max_blocks, page_size)

    @classmethod
    def adopt(cls, k_buf: torch.Tensor, v_buf: torch.Tensor, first_pos: int, end_pos: int, device,
              max_blocks: int, page_size: int) -> "OffloadStore":
        """A store of positions ``first_pos .. end_pos - 1`` of the buffers ``[H_kv, capacity, d]`` whose
        row ``p`` is position ``p`` (a layer's prefill buffers). Host buffers of a CPU run are taken over
        as they are (the rows before ``first_pos`` stay unused); otherwise the range is copied."""
        if torch.device(device).type == "cpu" and k_buf.device.type == "cpu" and k_buf.is_contiguous() \
                and v_buf.is_contiguous():
            return cls(k_buf, v_buf, 0, first_pos, end_pos, device, max_blocks, page_size)
        return cls.copy_of(k_buf[:, first_pos:end_pos], v_buf[:, first_pos:end_pos], first_pos, device,
                           max_blocks, page_size)

    @property
    def n(self) -> int:
        """Stored positions."""
        return self.end_pos - self.first_pos

    def keys(self) -> torch.Tensor:
        """``[H_kv, n, d]`` view of the stored keys (positions ``first_pos .. end_pos - 1``)."""
        return self.k_data[:, self.first_pos - self.base_pos: self.end_pos - self.base_pos]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k, v: [H_kv, m, d]`` at the next ``m`` positions (capacity doubles when full)."""
        m, row = k.shape[1], self.end_pos - self.base_pos
        if row + m > self.k_data.shape[1]:
            h, cap, d = self.k_data.shape
            grown = [host_empty((h, max(2 * cap, row + m), d), self.k_data.dtype, self.pin) for _ in range(2)]
            grown[0][:, :row], grown[1][:, :row] = self.k_data[:, :row], self.v_data[:, :row]
            self.k_data, self.v_data = grown
        self.k_data[:, row: row + m] = k.detach().to("cpu")
        self.v_data[:, row: row + m] = v.detach().to("cpu")
        self.end_pos += m

    def _rows(self, heads: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Row ids into the ``[H_kv * capacity]`` flattening of the store (empty slots read row 0); index
        arithmetic in numpy, whose per-call cost on these few hundred ids is far below torch's."""
        used = positions[positions >= 0]
        if used.size and (used.min() < self.first_pos or used.max() >= self.end_pos):
            raise IndexError(f"positions {used.min()}..{used.max()} are not all in the offload store "
                             f"({self.first_pos}..{self.end_pos - 1})")
        local = np.maximum(positions - self.base_pos, 0)
        return torch.from_numpy((heads[:, None] * self.k_data.shape[1] + local).ravel())

    def bulk_load(self, heads, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Packs the pages ``positions [N, s]`` (absolute ids, -1 = empty slot) of KV heads ``heads [N]``
        (numpy arrays or CPU LongTensors) into the transit buffer, copies it to the device in one transfer
        and returns the device views ``k, v: [N, s, d]`` (empty slots hold arbitrary values: the caller
        masks them)."""
        heads, positions = np.asarray(heads, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        n_blocks = positions.shape[0]
        if n_blocks > self.transit.shape[1]:
            raise ValueError(f"{n_blocks} pages requested, transit buffer holds {self.transit.shape[1]}")
        d = self.k_data.shape[2]
        rows = self._rows(heads, positions)
        used = self.transit[:, :n_blocks]
        for kv, data in enumerate((self.k_data, self.v_data)):  # all Ks, then all Vs, into the transit buffer
            torch.index_select(data.view(-1, d), 0, rows, out=used[kv].view(-1, d))
        dev = self.device_transit[:, :n_blocks]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # last step's scatter read it
            with torch.cuda.stream(self.stream):
                dev.copy_(used, non_blocking=True)
            self.stream.synchronize()
        else:
            dev.copy_(used)
        self.bytes_moved += used.numel() * used.element_size()
        return dev[0], dev[1]
