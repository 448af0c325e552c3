"""IceCache's host offload store :class:`OffloadStore`, a :class:`~icecache.kv.storage.HostKV` with a page bulk
loader (Mao et al., "IceCache", ICLR 2026; official ``infer_state.py``: ``recall``,
``scatter_pages``).

:class:`OffloadStore` holds the K/V of one layer's offloaded tokens in host memory (pinned when the
model runs on CUDA), indexed by absolute token position. The M-DCI index's ``page_table`` says which
positions make up each (KV head, page); :meth:`OffloadStore.bulk_load` moves a list of such pages to the
device the way the official ``recall`` + ``scatter_pages`` do:

1. pack every requested (head, page) block into the contiguous prefix ``[2, N, page_size, d]`` of one
   host *transit buffer* (all Ks, then all Vs; the official ``copy_to_buffer``),
2. **one** host-to-device copy of that contiguous prefix (non-blocking, on a side stream that the
   compute stream waits for),
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

from icecache.kv.storage import HostKV, host_empty


class OffloadStore(HostKV):
    """IceCache's :class:`HostKV` with the page bulk loader: a host transit buffer of ``max_blocks``
    pages and its device twin, used through their contiguous prefixes.

    Two ways to make one: :meth:`copy_of` copies K/V into new host memory (pinned when the model runs on
    CUDA), and :meth:`adopt` takes over a layer's prefill buffers without a copy when they already live in
    host memory (CPU runs), so a long prompt's K/V are not held twice."""

    def __init__(self, k_data: torch.Tensor, v_data: torch.Tensor, base_pos: int, first_pos: int, end_pos: int,
                 device: torch.device, max_blocks: int, page_size: int):
        """Use :meth:`copy_of` or :meth:`adopt`. ``k_data, v_data`` are contiguous host buffers."""
        self.device = torch.device(device)
        super().__init__(k_data, v_data, base_pos, first_pos, end_pos, self.device.type == "cuda")
        self.block = (page_size, k_data.shape[2])
        # flat, so that the first n blocks of Ks and of Vs ([2, n, s, d]) are one contiguous prefix
        self.transit = host_empty(2 * max_blocks * page_size * k_data.shape[2], k_data.dtype, self.pin)
        self.device_transit = torch.empty_like(self.transit, device=self.device) if self.pin else None
        self.stream = torch.cuda.Stream(self.device) if self.pin else None
        self.copied = None  # CUDA event: the last transit -> device copy finished reading the transit buffer

    @property
    def max_blocks(self) -> int:
        return self.transit.numel() // (2 * self.block[0] * self.block[1])

    @classmethod
    def copy_of(cls, k: torch.Tensor, v: torch.Tensor, first_pos: int, device, max_blocks: int,
                page_size: int) -> "OffloadStore":
        """A store holding a host copy of ``k, v: [H_kv, n, d]`` (any device) = positions ``first_pos ..``,
        sized to ``n`` (plus the growth slack), pinned when the model runs on CUDA."""
        k_data, v_data = cls._host_copy(k, v, torch.device(device).type == "cuda")
        return cls(k_data, v_data, first_pos, first_pos, first_pos + k.shape[1], device, max_blocks, page_size)

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

    def transit_prefix(self, n_blocks: int, device: bool = False) -> torch.Tensor:
        """The contiguous first ``2 * n_blocks`` pages of the (device) transit buffer as ``[2, n, s, d]``."""
        flat = self.device_transit if device else self.transit
        return flat[: 2 * n_blocks * self.block[0] * self.block[1]].view(2, n_blocks, *self.block)

    def bulk_load(self, heads, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Packs the pages ``positions [N, s]`` (absolute ids, -1 = empty slot) of KV heads ``heads [N]``
        (numpy arrays or CPU LongTensors) into the contiguous prefix of the transit buffer (all Ks, then
        all Vs: the official ``copy_to_buffer``), copies that prefix to the device in one transfer and
        returns the device views ``k, v: [N, s, d]`` (empty slots hold arbitrary values: the caller masks
        them). On CUDA the copy runs on a side stream that the current stream then waits for (no host
        sync; the next load waits for this copy before it overwrites the transit buffer). On CPU the
        "device" is host memory: the packed prefix itself is returned."""
        heads, positions = np.asarray(heads, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        n_blocks = positions.shape[0]
        if n_blocks > self.max_blocks:
            raise ValueError(f"{n_blocks} pages requested, transit buffer holds {self.max_blocks}")
        d = self.k_data.shape[2]
        rows = self._rows(heads, positions)
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has long finished reading the transit buffer
        used = self.transit_prefix(n_blocks)
        for kv, data in enumerate((self.k_data, self.v_data)):
            torch.index_select(data.view(-1, d), 0, rows, out=used[kv].view(-1, d))
        if self.stream is None:
            return used[0], used[1]
        dev = self.transit_prefix(n_blocks, device=True)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the last step's scatter has read the device transit buffer
        with torch.cuda.stream(self.stream):
            dev.copy_(used, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)
        current.wait_stream(self.stream)
        return dev[0], dev[1]
