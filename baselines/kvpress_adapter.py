"""NVIDIA kvpress scorer presses run through our interface (``cache=kvpress cache.press=<Name>``; optional extra,
``pip install --no-deps kvpress==0.5.5 cachetools fire``, see docs/kvpress.md).

kvpress' own path (``kvpress/presses/base_press.py`` ``BasePress.forward_hook``) fails on transformers >= 5.3
(it reads ``kwargs["cache_position"]``), but a ``ScorerPress``'s ``score()`` is a plain function of the attention
module, the layer's input hidden states, the post-RoPE keys and values, the attention weights (``None`` under
sdpa, as in kvpress' default pipeline) and the forward's kwargs (``position_embeddings``). This adapter:

1. captures each layer's ``hidden_states`` and ``position_embeddings`` with a forward pre-hook on its
   ``self_attn`` (registered by :meth:`KVPress.attach`, which :meth:`icecache.kv.KVCache.for_model` calls), and
   sets ``self_attn.rotary_emb`` as ``BasePress.__call__`` does (``ExpectedAttentionPress`` reads it);
2. after the exact prefill of a layer, calls ``press.score(module, hidden_states, keys, values, None, kwargs)``
   and keeps the top-``budget`` tokens per KV head, as ``ScorerPress.compress`` (``kvpress/presses/
   scorer_press.py``) keeps its top-``n_kept`` with ``n_kept = int(q_len * (1 - compression_ratio))``. The
   press gets ``compression_ratio = 1 - (budget + 0.5) / q_len``, so that ``n_kept`` is exactly ``budget``
   (``StreamingLLMPress`` reads the ratio inside ``score()``);
3. decodes as kvpress does: generated tokens are appended and never evicted (the prefill selection is all
   kvpress compresses; ``BasePress.forward_hook`` returns early after prefill). Resident and attended past
   tokens are thus ``budget + generated`` -- a declared exemption like SnapKV ``grow``
   (:meth:`KVPress.check_resident`; the effective tokens per layer in ``timing.json`` show it).

A prompt of ``<= budget`` tokens is kept whole. Supported presses (:data:`SUPPORTED_PRESSES`) are the
``ScorerPress`` subclasses whose ``score()`` needs nothing but those inputs; presses that are not one score per
token (AdaKV's per-head variable sets, KVzip's reconstruction, DecodingPress, PyramidKV's per-layer budgets,
ObservedAttention's eager attention weights, presses that load weights from the hub) are refused by name.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch

from icecache.kv import KVMethod, SequenceState, compat
from icecache.kv.storage import PerHeadState, keep_per_head, store_per_head

# ScorerPress subclasses whose score() reads only (module, hidden_states, keys, values, kwargs[position_embeddings])
TESTED_PRESSES = ("SnapKVPress", "ExpectedAttentionPress", "TOVAPress", "KnormPress", "StreamingLLMPress")
SUPPORTED_PRESSES = TESTED_PRESSES + ("RandomPress", "KeyDiffPress", "LagKVPress")


def import_kvpress():
    """``import kvpress``, with a clear error when the optional extra is missing. Importing kvpress wraps every
    registered attention function (``kvpress/attention_patch.py``), ours included; :func:`icecache.kv.cache.
    kv_attention` takes ``dropout`` and ``scaling`` in transformers' order so the wrapper's positional
    ``dropout`` lands where it belongs."""
    try:
        import kvpress
    except ImportError as err:
        raise ImportError("cache=kvpress needs the optional kvpress package: pip install --no-deps kvpress==0.5.5 "
                          f"'cachetools>=5.5,<6' 'fire>=0.6,<0.7' (see docs/kvpress.md); import failed: {err}") from err
    return kvpress


def make_press(name: str, kwargs: dict):
    """The kvpress press ``name`` (one of :data:`SUPPORTED_PRESSES`) built with ``kwargs``."""
    if name not in SUPPORTED_PRESSES:
        raise ValueError(f"kvpress: press must be one of {SUPPORTED_PRESSES} (ScorerPress subclasses whose score() "
                         f"the adapter can feed; see docs/kvpress.md), got {name!r}")
    if "compression_ratio" in kwargs:
        raise ValueError("kvpress: the compression ratio follows from the budget; do not set compression_ratio")
    return getattr(import_kvpress(), name)(**kwargs)


class PressSequence(SequenceState):
    """A prompt's captured layer inputs, ``inputs[layer] = (module, hidden_states, position_embeddings)``, kept
    from each layer's forward pre-hook to its ``finish_prefill``; ``capturing`` until the last layer's prefill."""

    def __init__(self, worker_name: str):
        super().__init__(worker_name)
        self.capturing = True  # a fresh sequence: the next forward is its prefill
        self.inputs: dict = {}


def _capture(cache_ref: weakref.ref, layer_idx: int, module, args, kwargs) -> None:
    """Forward pre-hook of a ``self_attn``: hands the layer's inputs to the cache's sequence awaiting a prefill."""
    cache = cache_ref()
    seq = None if cache is None else cache.sequence
    if isinstance(seq, PressSequence) and seq.capturing:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seq.inputs[layer_idx] = (module, hidden, kwargs["position_embeddings"])


@dataclass(frozen=True)
class KVPress(KVMethod):
    """A kvpress ``ScorerPress`` (NVIDIA/kvpress 0.5.5) as a method.

    Args:
        budget: prompt tokens kept per KV head after prefill (top scores of ``press.score``); generated
            tokens are kept on top of it, as in kvpress (a declared exemption).
        press: the press class name, one of :data:`SUPPORTED_PRESSES` (kvpress' defaults otherwise, e.g.
            SnapKVPress window_size 64, kernel_size 5).
        press_kwargs: keyword arguments of the press (``+cache.press_kwargs.window_size=32``); not
            ``compression_ratio``, which the budget sets.
    """

    press: str = "SnapKVPress"
    press_kwargs: dict = field(default_factory=dict)
    name: ClassVar[str] = "kvpress"
    _press: Any = field(default=None, init=False, repr=False, compare=False)  # built from press, press_kwargs

    def validate(self) -> None:
        if not isinstance(self.press_kwargs, dict):
            raise ValueError(f"kvpress: press_kwargs must be a mapping, got {self.press_kwargs!r}")
        object.__setattr__(self, "_press", make_press(self.press, dict(self.press_kwargs)))  # construction

    def attach(self, model: torch.nn.Module, cache) -> None:
        """Registers the capture pre-hook of ``cache`` on every ``self_attn`` of ``model`` (replacing an earlier
        cache's hook there, so a layer has one), and the rotary module and model statistics presses read."""
        self._press.post_init_from_model(model)
        for layer_idx, attn in enumerate(compat.attention_modules(model)):
            attn.rotary_emb = compat.rotary_embedding(model)  # as BasePress.__call__ (kvpress/presses/base_press.py)
            previous = getattr(attn, "_kvpress_capture", None)
            if previous is not None:
                previous.remove()
            attn._kvpress_capture = attn.register_forward_pre_hook(
                partial(_capture, weakref.ref(cache), layer_idx), with_kwargs=True)

    def make_sequence(self) -> PressSequence:
        return PressSequence(self.name)

    def make_state(self, layer_idx: int) -> PerHeadState:
        return PerHeadState(layer_idx)

    def store(self, st: PerHeadState, k: torch.Tensor, v: torch.Tensor) -> None:
        store_per_head(st, k, v)

    def finish_prefill(self, st: PerHeadState) -> None:
        """Keeps the ``budget`` top-scored prompt tokens of every KV head (slots in position order)."""
        if st.layer_idx not in st.seq.inputs:
            raise RuntimeError("kvpress: no captured layer inputs; build the cache with KVCache.for_model(method, "
                               "model) (or make_cache), which registers the capture hooks")
        module, hidden, position_embeddings = st.seq.inputs.pop(st.layer_idx)
        if st.layer_idx == st.spec.n_layers - 1:
            st.seq.capturing = False
        st.n_prompt = n = st.k.shape[1]
        if n > self.budget:
            keep_per_head(st, self.kept_indices(module, hidden, position_embeddings, st.k, st.v))

    def kept_indices(self, module, hidden, position_embeddings, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[H_kv, budget]`` sorted prompt indices: the top scores of ``press.score`` per KV head, with the
        press' compression ratio set so that its ``n_kept`` is the budget."""
        n = k.shape[1]
        self._press.compression_ratio = 1.0 - (self.budget + 0.5) / n
        with torch.no_grad():
            scores = self._press.score(module, hidden, k[None], v[None], None,
                                       {"position_embeddings": position_embeddings})
        return scores[0].topk(self.budget, dim=-1).indices.sort(-1).values

    def check_resident(self, st: PerHeadState) -> None:
        """Generated tokens are kept (kvpress' decoding), so ``budget + generated`` tokens may be resident."""
        allowed = min(st.n_prompt, self.budget) + st.n_seen - st.n_prompt
        if self.resident_tokens(st) > allowed:
            raise AssertionError(f"kvpress: layer {st.layer_idx} holds {self.resident_tokens(st)} resident tokens, "
                                 f"over the allowed {allowed} (budget {self.budget} + generated)")
