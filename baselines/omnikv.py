"""OmniKV (Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs", ICLR 2025;
official code ``antgroup/OmniKV``, ``modeling/omnikv.py`` + ``modeling/spec_cache.py``).

Budget mapping: docs/architecture.md.

Layer roles (``OmniKVMultiStageCache``): layers before the first filter layer are dense; each filter
layer ``f`` and the ``wait_layers`` layers after it are dense (the official "wait" layers hide the
CPU->GPU gather); the layers after them, up to the next filter layer, are *sparse*.

* Prefill: exact attention in every layer, nothing evicted; the sparse layers' K/V move to the
  offload store (pinned host memory on CUDA) and their device prefill buffers are freed: as the official
  ``OmniKVMultiStageCache.update`` (``real_offload``), which keeps those layers' prompt K/V on the CPU only
  and the generated tokens in a separate ``tail_k``.
* Decode, filter layer ``f``: logits of the current (post-RoPE) query over the layer's own *prompt*
  keys, max over all query heads (selector ``last``, the official example config;
  ``softmax_before_last`` takes the softmax per head first), top-``budget`` -> one sorted index set
  shared by all heads and by every sparse layer until the next filter layer. The filter layer itself
  attends everything.
* Decode, sparse layer: gathers ``K[I], V[I]`` from its offload store (bytes counted in
  ``state.bytes_moved``) and attends them plus every generated token (the "tail", never dropped).

Filter layers default to the official Llama-3-8B choice ``2, 8, 18`` of 32 layers scaled to the
model's depth (``round(f * n_layers / 32)``): SmolLM2's 30 layers -> ``2, 8, 17``.

Budget ``B`` = selected prompt tokens per sparse layer (top-k = B). Exempt, and logged through the
effective tokens: dense/filter/wait layers (everything) and the generated tail of sparse layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from icecache.kv import Bound, Fetched, KVMethod, LayerState, ModelSpec
from icecache.kv.attention import attention_logits
from icecache.kv.base import tensor_bytes
from icecache.kv.storage import to_store

from .common import scaled_layers

OFFICIAL_FILTER_LAYERS = (2, 8, 18)  # configs/example.json, for 32-layer Llama-3-8B
SELECTORS = ("last", "softmax_before_last")


def scaled_filter_layers(n_layers: int) -> tuple[int, ...]:
    """The official filter layers scaled to a model of ``n_layers`` layers."""
    return scaled_layers(OFFICIAL_FILTER_LAYERS, n_layers)


def layer_roles(n_layers: int, filters: Sequence[int], wait_layers: int) -> dict[int, tuple[str, int | None]]:
    """``layer -> (role, filter layer of its group)`` with role in dense / filter / wait / sparse."""
    roles: dict[int, tuple[str, int | None]] = {i: ("dense", None) for i in range(filters[0])}
    for f, nxt in zip(filters, list(filters[1:]) + [n_layers]):
        roles[f] = ("filter", f)
        for i in range(f + 1, nxt):
            roles[i] = ("wait" if i <= f + wait_layers else "sparse", f)
    return roles


def select_tokens(q: torch.Tensor, k: torch.Tensor, scaling: float, n_select: int, selector: str) -> torch.Tensor:
    """OmniKV's head-shared selection: ``q: [H_q, 1, d]``, prompt keys ``k: [H_kv, L, d]`` -> the sorted
    positions ``[min(n_select, L)]`` of the largest (max over heads) logits or softmax probabilities."""
    scores = attention_logits(q, k, scaling)[:, 0]  # [H_q, L]
    if selector == "softmax_before_last":
        scores = torch.softmax(scores, dim=-1)
    scores = scores.max(dim=0).values
    return scores.topk(min(n_select, scores.shape[0])).indices.sort().values


class OmniState(LayerState):
    """Dense/filter/wait layers: everything resident (``k, v, pos``). Sparse layers: the prompt K/V in
    the offload store (``store_k/v``), the gathered selection (``part_k/v``, positions ``selected``,
    replaced at every step as the official ``part_key``) and the generated tail (``k, v, pos``)."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.n_prompt = 0
        self.store_k: torch.Tensor | None = None
        self.store_v: torch.Tensor | None = None
        self.part_k: torch.Tensor | None = None
        self.part_v: torch.Tensor | None = None
        self.selected: torch.Tensor | None = None
        self.selected_at = -1  # n_seen at the filter layer's last selection


@dataclass(frozen=True)
class OmniBound(Bound):
    """OmniKV's values for one model: ``roles``, layer -> (role, its filter layer) (:func:`layer_roles`)."""

    roles: dict

    def settings(self) -> dict:
        return {"filter_layers": sorted(layer for layer, (role, _) in self.roles.items() if role == "filter")}


@dataclass(frozen=True)
class OmniKV(KVMethod):
    """Filter layers select one token set from their own attention logits; sparse layers reuse it.

    Args:
        budget: prompt tokens selected (top-k) for every sparse layer at each step.
        filter_layers: layers that select (official ``do_select_layers``); ``None`` scales the official
            ``2, 8, 18`` of 32 layers to the model's depth.
        wait_layers: dense layers after each filter layer (official ``num_wait_load_layers`` = 1).
        selector: ``last`` (max over heads of the logits, official example) or ``softmax_before_last``.
    """

    filter_layers: Sequence[int] | None = None
    wait_layers: int = 1
    selector: str = "last"
    name: ClassVar[str] = "omnikv"

    def validate(self) -> None:
        if self.selector not in SELECTORS:
            raise ValueError(f"omnikv: selector must be one of {SELECTORS}, got '{self.selector}'")
        if self.wait_layers < 0:
            raise ValueError(f"omnikv: wait_layers must be >= 0, got {self.wait_layers}")
        self.check_whole("wait_layers")
        if self.filter_layers is not None and not all(isinstance(f, int) and f >= 0 for f in self.filter_layers):
            raise ValueError(f"omnikv: filter_layers must be layer ids (whole numbers >= 0), got {self.filter_layers}")

    def bind(self, spec: ModelSpec) -> OmniBound:
        """Each layer's role for a model of ``spec``: the filter layers (scaled to its depth when ``None``)."""
        filters = (scaled_filter_layers(spec.n_layers) if self.filter_layers is None
                   else tuple(sorted({int(f) for f in self.filter_layers})))
        if not filters or filters[0] < 0 or filters[-1] >= spec.n_layers:
            raise ValueError(f"omnikv: filter_layers {filters} must be layers of a {spec.n_layers}-layer model")
        return OmniBound(spec, layer_roles(spec.n_layers, filters, self.wait_layers))

    def make_state(self, layer_idx: int) -> OmniState:
        return OmniState(layer_idx)

    def is_budgeted(self, st: OmniState) -> bool:
        return st.bound.roles[st.layer_idx][0] == "sparse"

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, st: OmniState) -> None:
        st.n_prompt = st.n_seen
        if self.is_budgeted(st):
            st.store_k, st.store_v = to_store(st.k), to_store(st.v)
            # free the device prefill buffers: no view of them may stay (a prefix view would keep the whole
            # buffer alive and the in-place append would write the generated tail into it); the tail gets
            # its own buffer at the first append
            st.buffers.clear()
            st.k = st.v = st.pos = None

    # ------------------------------------------------------------------ decode
    def select(self, st: OmniState, q: torch.Tensor) -> torch.Tensor | None:
        role, group = st.bound.roles[st.layer_idx]
        if role == "filter":
            st.selected = select_tokens(q, st.k[:, :st.n_prompt], st.spec.scaling, self.budget, self.selector)
            st.selected_at = st.n_seen
        if role != "sparse":
            return None
        source = st.seq.layers[group]
        if source.selected_at != st.n_seen:
            raise RuntimeError(f"omnikv: layer {st.layer_idx} found no selection of filter layer {group} "
                               f"for this step")
        return source.selected

    def fetch(self, st: OmniState, selection: torch.Tensor | None) -> Fetched:
        if selection is None:
            return Fetched(st.k, st.v)
        idx = selection.cpu()
        st.part_k = st.store_k[:, idx].to(st.k.device, non_blocking=True)
        st.part_v = st.store_v[:, idx].to(st.v.device, non_blocking=True)
        st.selected = selection
        st.bytes_moved += 2 * st.part_k.numel() * st.part_k.element_size()
        return Fetched(torch.cat([st.part_k, st.k], dim=1), torch.cat([st.part_v, st.v], dim=1))

    def attended_positions(self, st: OmniState, selection: torch.Tensor | None) -> torch.Tensor:
        """``[m]`` (one set for every head): the selected prompt positions, then the generated tail."""
        if selection is None:
            return st.pos
        return torch.cat([selection.to(st.pos.device), st.pos])

    # ------------------------------------------------------------------ accounting
    def resident_tokens(self, st: OmniState) -> int:
        part = 0 if st.part_k is None or not self.is_budgeted(st) else st.part_k.shape[1]
        return part + st.resident_tokens()

    def layer_memory(self, st: OmniState) -> dict[str, int]:
        """Sparse layers: the selected prompt tokens (gathered from the host at each step: transit) and the generated
        tail on the device, the prompt in the host store; other layers: their K/V on the device."""
        if st.store_k is None:
            return super().layer_memory(st)
        transit = tensor_bytes(st.part_k, st.part_v)
        return {"device_kv_bytes": tensor_bytes(st.k, st.v) + transit, "transit_bytes": transit,
                "host_kv_bytes": tensor_bytes(st.store_k, st.store_v)}

    def check_resident(self, st: OmniState) -> None:
        """Sparse layers: the selected prompt tokens must fit the budget; the tail (exempt, as in the
        official code) must hold generated tokens only."""
        if not self.is_budgeted(st):
            return
        part, tail = self.resident_tokens(st) - st.resident_tokens(), st.resident_tokens()
        if part > self.budget or tail != st.n_seen - st.n_prompt:
            raise AssertionError(f"omnikv: layer {st.layer_idx} holds {part} selected prompt tokens (budget "
                                 f"{self.budget}) and a tail of {tail} (generated: {st.n_seen - st.n_prompt})")
