"""Per-layer and per-prompt state of IceCache (:mod:`icecache.method`): a layer's resident buffer, offload store,
index and selection; a prompt's projection seed and queued prefill job."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from icecache.dci import MDCIIndex
from icecache.kv import LayerState
from icecache.kv.state import SequenceState
from icecache.offload import OffloadStore
from icecache.resident import ResidentBuffer


class IceState(LayerState):
    """One layer: before offloading, the inherited ``k, v, pos`` hold every token (dense layers always);
    after, :attr:`buffer` (a :class:`~icecache.resident.ResidentBuffer`) holds sink | page slots | window."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.buffer: ResidentBuffer | None = None
        self.store: OffloadStore | None = None
        self.index: MDCIIndex | None = None  # anchors only
        self.selection: torch.Tensor | None = None  # [H_kv, W] pages selected at step ``selected_at``
        self.candidates: torch.Tensor | None = None  # [H_kv, C >= W] the merged candidates, best first
        self.selected_at = -1
        self.changed: torch.Tensor | None = None  # [H_kv, n_pages] pages changed by the last insert
        self.changed_at = -1
        self.step_bytes = 0
        self.dense = False  # a short prompt under ``short_prompt="dense"``: attends everything, never offloads
        self.window_page_indexed = False  # the oldest window page is already in the store and the index

    @property
    def offloaded(self) -> bool:
        return self.buffer is not None

    # read-only views of the buffer's page table (tests, tools)
    win_start = property(lambda self: self.buffer.win_start)
    win_len = property(lambda self: self.buffer.win_len)
    slot_k = property(lambda self: self.buffer.slot_k)
    slot_v = property(lambda self: self.buffer.slot_v)
    slot_page = property(lambda self: torch.from_numpy(self.buffer.slot_page))
    slot_tokens = property(lambda self: torch.from_numpy(self.buffer.slot_tokens))


class IceSequence(SequenceState):
    """A prompt's state across layers: the projection seed of its indexes (``projection="per_prompt"``: drawn at
    the first layer's prefill) and the offload job queued last (``prefill_pipeline="official"``)."""

    def __init__(self, worker_name: str, seed: int):
        super().__init__(worker_name)
        self.projection_seed = seed
        self.prefill_job = None


def prompt_seed(seed: int, keys: torch.Tensor) -> int:
    """A projection seed drawn from ``seed`` and one prompt (``projection="per_prompt"``): a digest of the first
    layer's prompt keys ``[H_kv, n, d]``, which depend on the token ids and positions only, so the same prompt
    gets the same direction in any process, order or replay, and another prompt another one."""
    flat = keys.detach().reshape(-1, keys.shape[-1])
    rows = torch.cat([flat[:64], flat[-64:]]).float().cpu().numpy()
    digest = hashlib.blake2b(rows.tobytes() + np.int64(keys.shape[1]).tobytes(), digest_size=8).digest()
    return int(np.random.default_rng([seed, int.from_bytes(digest, "little")]).integers(2**31))
