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


class OffloadStore:
    """Host-memory K/V ``[2, H_kv, capacity, d]`` of positions ``first_pos ..`` of one layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, first_pos: int, device: torch.device, max_blocks: int,
                 page_size: int):
        """``k, v: [H_kv, n, d]`` (any device) hold positions ``first_pos .. first_pos + n - 1``; the
        transit buffers hold up to ``max_blocks`` (head, page) blocks of ``page_size`` tokens."""
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        h, n, d = k.shape
        self.first_pos, self.n = first_pos, 0
        self.data = self._alloc((2, h, max(2 * n, 64), d), k.dtype)
        self.append(k, v)
        self.transit = self._alloc((2, max_blocks, page_size, d), k.dtype)
        self.device_transit = torch.empty_like(self.transit, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.pin else None
        self.bytes_moved = 0

    def _alloc(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    @property
    def end_pos(self) -> int:
        """One past the last stored position."""
        return self.first_pos + self.n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k, v: [H_kv, m, d]`` at the next ``m`` positions (capacity doubles when full)."""
        m = k.shape[1]
        if self.n + m > self.data.shape[2]:
            grown = self._alloc((*self.data.shape[:2], max(2 * self.data.shape[2], self.n + m), self.data.shape[3]),
                                self.data.dtype)
            grown[:, :, : self.n] = self.data[:, :, : self.n]
            self.data = grown
        self.data[0, :, self.n: self.n + m] = k.detach().to("cpu")
        self.data[1, :, self.n: self.n + m] = v.detach().to("cpu")
        self.n += m

    def _rows(self, heads: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Row ids into the ``[H_kv * capacity]`` flattening of the store (empty slots read row 0); index
        arithmetic in numpy, whose per-call cost on these few hundred ids is far below torch's."""
        used = positions[positions >= 0]
        if used.size and (used.min() < self.first_pos or used.max() >= self.end_pos):
            raise IndexError(f"positions {used.min()}..{used.max()} are not all in the offload store "
                             f"({self.first_pos}..{self.end_pos - 1})")
        local = np.maximum(positions - self.first_pos, 0)
        return torch.from_numpy((heads[:, None] * self.data.shape[2] + local).ravel())

    def bulk_load(self, heads, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Packs the pages ``positions [N, s]`` (absolute ids, -1 = empty slot) of KV heads ``heads [N]``
        (numpy arrays or CPU LongTensors) into the transit buffer, copies it to the device in one transfer
        and returns the device views ``k, v: [N, s, d]`` (empty slots hold arbitrary values: the caller
        masks them)."""
        heads, positions = np.asarray(heads, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        n_blocks = positions.shape[0]
        if n_blocks > self.transit.shape[1]:
            raise ValueError(f"{n_blocks} pages requested, transit buffer holds {self.transit.shape[1]}")
        d = self.data.shape[3]
        rows = self._rows(heads, positions)
        stored = self.data.view(2, -1, d)
        used = self.transit[:, :n_blocks]
        for kv in range(2):  # all Ks, then all Vs, straight into the (pinned) transit buffer
            torch.index_select(stored[kv], 0, rows, out=used[kv].view(-1, d))
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
