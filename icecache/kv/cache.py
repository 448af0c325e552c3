"""The two thin adapters into transformers (its ``Cache``/``CacheLayerMixin`` of ``cache_utils.py`` and the
``AttentionInterface`` registry of ``modeling_utils.py``).

:class:`KVCache` is a transformers ``Cache`` holding one :class:`MethodLayer` per decoder layer; it
reports the logical length (so position ids stay right) and returns the new K/V unchanged from
``update``. :func:`kv_attention`, registered with ``AttentionInterface``, receives the post-RoPE query,
key and value and hands them to the method: ``prefill`` on the prompt, ``decode`` per new token.

Phases are explicit: the runner calls :meth:`KVCache.begin_prefill`, :meth:`KVCache.begin_step` and
:meth:`KVCache.end_step`. Inside ``model.generate`` nobody calls them, so a cache that was never told
runs in *generate mode*: its first forward pass is the prefill and every later pass is decoding (a
pass with several new tokens is decoded token by token, which is exactly causal).

A cache serves one sequence. ``model.generate`` marks a user-supplied cache at the start of every call;
a cache that already holds a sequence refuses a second call with a clear error (transformers would
otherwise continue the first sequence with the new prompt, or fail on a shorter one with an unrelated
reshape error). :meth:`KVCache.reset` empties it for a new prompt. Everything a sequence holds (the layers'
states, the background worker, the probe) is in the cache's :class:`~icecache.kv.state.SequenceState`; the
method keeps only its hyperparameters.
"""
from __future__ import annotations

import contextvars

import torch

from . import compat
from .base import MEMORY_KEYS, KVMethod, ModelSpec
from .state import LayerState
from .timing import PhaseTimer

_ACTIVE_CACHE: contextvars.ContextVar["KVCache | None"] = contextvars.ContextVar("kvbench_cache", default=None)


class MethodLayer(compat.CacheLayerMixin):
    """transformers-facing view of one layer: tracks the logical length, stores nothing itself."""

    is_sliding = False

    def __init__(self, state: LayerState):
        super().__init__()
        self.state = state
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states=None):  # noqa: D401 - transformers contract
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # the logical length grows in KVCache.run_attention, token by token as the method consumes them
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.state.n_seen

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        query_length = int(query_length.shape[0]) if torch.is_tensor(query_length) else int(query_length)
        return self.state.n_seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("reset the whole cache with KVCache.reset(), not one layer")


class KVCache(compat.Cache):
    """What users pass to ``model(...)``/``model.generate(...)`` as ``past_key_values``."""

    def __init__(self, method: KVMethod, spec: ModelSpec, profile: bool = False, probe=None):
        """``probe``: a :class:`~icecache.kv.recall.RecallProbe` (``diagnostics=recall``) that keeps a copy of
        every layer's K/V and measures what the method attends at each decode step; it never writes the
        method's tensors. The method measures through the sequence state (between attend and observe); the
        cache feeds the probe the K/V."""
        self.method, self.spec, self.probe = method, spec, probe
        self.bound = method.bind(spec)  # the method's per-model values, shared by every sequence of this cache
        self.timer = PhaseTimer(sync=profile, device=spec.device)
        self._start_sequence()
        super().__init__(layers=self.layers)

    @classmethod
    def for_model(cls, method: KVMethod, model: torch.nn.Module, profile: bool = False, probe=None) -> "KVCache":
        """A cache of ``method`` for ``model.generate(..., past_key_values=KVCache.for_model(method, model))``;
        also switches the model's attention to the cache-aware function (idempotent). One cache serves one
        sequence (batch size 1): make a new one per prompt."""
        compat.enable_attention(model)
        cache = cls(method, compat.model_spec(model), profile=profile, probe=probe)
        method.attach(model, cache)
        return cache

    def _start_sequence(self) -> None:
        self.sequence = self.method.new_sequence(self.bound, self.probe)  # per-sequence state: layers, worker, probe
        self.states = self.sequence.layers
        self.layers = [MethodLayer(s) for s in self.states]
        self.phase = "new"  # new -> prefill -> decode
        self.explicit_phases = False

    def reset(self) -> None:
        """Empties the cache (same method, same budget) so it can serve a new, unrelated prompt."""
        self.wait_background()
        self.sequence.close()
        if self.probe is not None:
            self.probe.reset()
        self._start_sequence()

    def n_tokens(self) -> int:
        """Tokens of the sequence this cache holds (0 when new or reset)."""
        return self.states[0].n_seen if self.states else 0

    @property
    def _is_user_defined(self) -> bool:
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' generate() sets this on a user-supplied cache at the start of every call
        if self.n_tokens():
            raise RuntimeError(
                f"this KVCache already holds a sequence of {self.n_tokens()} tokens and serves one prompt; call "
                "cache.reset() before generating for a new prompt (or make a new cache with make_cache(...))")

    # ------------------------------------------------------------------ phases (explicit)
    def begin_prefill(self) -> None:
        if self.phase != "new":
            raise RuntimeError("begin_prefill() on a cache that has already been used")
        self.explicit_phases, self.phase = True, "prefill"

    def begin_step(self) -> None:
        self.phase = "decode"
        self.timer.reset()

    def end_step(self) -> dict[str, float]:
        """Seconds per phase spent in this decode step, summed over layers."""
        return self.timer.reset()

    # ------------------------------------------------------------------ transformers contract
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"KVCache supports batch size 1 (one sequence at a time), got {key_states.shape[0]}")
        if layer_idx == 0 and not self.explicit_phases:
            self.phase = "prefill" if self.phase == "new" else "decode"
        _ACTIVE_CACHE.set(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def run_attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dispatches one layer's attention to the method (tensors batch-squeezed)."""
        st, method = self.states[layer_idx], self.method
        if self.phase == "prefill":
            if self.probe is not None:
                self.probe.keep(layer_idx, k, v)
            return method.fill(st, k, v, q)
        if self.phase != "decode":
            raise RuntimeError("attention called before begin_prefill()")
        outs = []
        for i in range(q.shape[1]):
            if self.probe is not None:
                self.probe.keep(layer_idx, k[:, i:i + 1], v[:, i:i + 1])
            outs.append(method.step(st, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], self.timer))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def replay_prefill(self, kv: list[tuple[torch.Tensor, torch.Tensor]],
                       last_queries: list[torch.Tensor] | None = None) -> None:
        """Fills the cache, in its prefill phase, as a live prefill whose exact attention produced the
        per-layer post-RoPE ``kv`` (``[H_kv, n, d]`` each) would: layer by layer, the logical length, the probe's
        copy, the method's :meth:`~KVMethod.store` and :meth:`~KVMethod.finish_prefill` -- what
        :meth:`run_attention` does around the attention itself. With ``last_queries`` (``[H_q, 1, d]`` per layer,
        the prompt's last query) the method's own :meth:`~KVMethod.prefill` runs on that one query instead of
        ``store``, for methods whose prefill reads no other query (its attention output is discarded). The
        tensors are only read: one captured prefill can fill the caches of many methods."""
        if self.phase != "prefill":
            raise RuntimeError("replay_prefill() needs a cache in its prefill phase (begin_prefill() first)")
        if len(kv) != len(self.states):
            raise ValueError(f"replay_prefill: {len(kv)} layers of K/V for a model of {len(self.states)} layers")
        method = self.method
        for i, (st, (k, v)) in enumerate(zip(self.states, kv)):
            if self.probe is not None:
                self.probe.keep(st.layer_idx, k, v)
            method.fill(st, k, v, None if last_queries is None else last_queries[i])

    # ------------------------------------------------------------------ reporting
    def effective_tokens(self) -> list[float | None]:
        """Mean past tokens attended per head at a decode step, per layer (None before decoding); reads
        the device-side sums once (the only host sync of the accounting)."""
        return [float(s.attended_sum) / s.attended_steps if s.attended_steps else None for s in self.states]

    def method_stats(self) -> dict[str, list[float | None]]:
        """``{stat: [value per layer, None where the layer has none]}`` of :meth:`KVMethod.layer_stats` (after
        any background work, which may set them)."""
        self.wait_background()
        per_layer = [self.method.layer_stats(s) for s in self.states]
        names = sorted({k for stats in per_layer for k in stats})
        return {k: [stats.get(k) for stats in per_layer] for k in names}

    def budgeted_layers(self) -> list[int]:
        """The layers subject to the budget (:meth:`KVMethod.is_budgeted`; dense/exempt layers left out)."""
        return [s.layer_idx for s in self.states if self.method.is_budgeted(s)]

    def resident_tokens(self) -> list[int]:
        return [self.method.resident_tokens(s) for s in self.states]

    def bytes_moved(self) -> int:
        """Bytes copied from offload stores into fast memory so far, over all layers."""
        return sum(s.bytes_moved for s in self.states)

    def memory_bytes(self) -> dict[str, int]:
        """``{device_kv_bytes, transit_bytes, host_kv_bytes, index_bytes}`` summed over layers
        (:meth:`KVMethod.layer_memory`: what a GPU run would hold in device memory, of which transit buffers,
        apart from the host offload store and the retrieval metadata), after any background work."""
        self.wait_background()
        total = dict.fromkeys(MEMORY_KEYS, 0)
        for s in self.states:
            for key, value in self.method.layer_memory(s).items():
                total[key] += int(value)
        return total

    def max_budgeted_resident(self) -> int:
        """The largest resident set (past tokens in fast memory) over the budgeted layers."""
        return max((self.method.resident_tokens(s) for s in self.states if self.method.is_budgeted(s)),
                   default=0)

    def wait_background(self) -> None:
        for s in self.states:
            self.method.await_background(s)

    def close(self) -> None:
        self.sequence.close()


def kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function registered with transformers (see :mod:`icecache.kv.compat`). Its parameters follow
    transformers' own (``integrations/sdpa_attention.py`` ``sdpa_attention_forward``: ``dropout`` before
    ``scaling``), so a wrapper that passes ``dropout`` positionally (``kvpress/attention_patch.py``, applied to
    every registered function when kvpress is imported) calls it correctly. Both are unused: the method
    attends with the model's scaling, without dropout."""
    cache = _ACTIVE_CACHE.get()
    _ACTIVE_CACHE.set(None)  # consumed: a later forward with another cache type must not see this one
    if cache is None:
        raise RuntimeError(
            f"this model's attention is routed through '{compat.ATTN_IMPLEMENTATION}', which needs a cache "
            "from KVCache.for_model(method, model) (by name: evals.registry.make_cache(...)) passed as "
            "past_key_values; call model.set_attn_implementation('sdpa') "
            "to use the model without one")
    out = cache.run_attention(module.layer_idx, query[0], key[0], value[0])
    return out.transpose(0, 1)[None].contiguous(), None


compat.register_attention(kv_attention)
