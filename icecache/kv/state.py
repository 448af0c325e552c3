"""Per-layer state of one sequence: what a cache holds for each decoder layer (the methods' policy lives in
the method classes, the state here, as in transformers' ``cache_utils``)."""
from __future__ import annotations

import concurrent.futures

import torch


class LayerState:
    """Per-layer storage. The default holds the resident K/V ``[H_kv, n, d]`` and the original position
    of each resident token (``pos``, ``[n]``). Methods attach their own fields (indexes, scores...)."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # growable storage behind k/v (see append_to_buffer)
        self.n_seen = 0  # logical length: tokens ever appended to this layer
        self.pending: concurrent.futures.Future | None = None
        self.bytes_moved = 0  # bytes copied from an offload store into fast memory (methods count them)
        self.attended_sum: float | torch.Tensor = 0.0  # sum over decode steps of past tokens attended per
        # head; a device tensor when a step only knew it there (read once, by KVCache.effective_tokens)
        self.attended_steps = 0

    def resident_tokens(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])
