"""The method abstraction every KV-cache method implements.

A method is a frozen ``@dataclass`` whose fields are its hyperparameters (kvpress style); nothing writes them after
construction. What a method resolves from a model (its spec, layer ids scaled to the model's depth, projections)
is returned by :meth:`KVMethod.bind` as a :class:`Bound`, which the cache keeps and every layer state reaches as
``st.bound`` (``st.spec`` for the model's shapes). A method never touches
transformers: it receives plain post-RoPE tensors, batch squeezed — queries ``[H_q, n, d]``, keys and
values ``[H_kv, n, d]`` — and one :class:`LayerState` per decoder layer. Everything a sequence holds (the
layers' states, the background worker, the probe, values kept across layers) lives in the cache's
:class:`~icecache.kv.state.SequenceState`, reached as ``st.seq``; a method object holds no per-sequence state,
so one method object serves many caches, models and threads and compares equal to another of the same
hyperparameters.

Prefill: :meth:`KVMethod.prefill` computes exact causal attention over the prompt and stores the layer's
K/V; :meth:`KVMethod.finish_prefill` then compresses/offloads and may start background work with
:meth:`KVMethod.submit_background`, which is awaited at that layer's first decode step (so its cost
shows in the time to the second token, as in the IceCache paper).

Decode: one step per new token, always ``append -> select -> fetch -> attend -> observe``, each phase
timed by the base class. Eviction methods select "all resident" and evict in ``observe``; retrieval
methods select from the query and fetch from their offload store.

Budget convention (docs/architecture.md): ``budget`` = past tokens each attention head may attend to in a budgeted
layer at one decode step, sink and recent window included, *not* counting the current token. Layers a
method exempts are declared by :meth:`KVMethod.is_budgeted`; every step records the effective number
of past tokens attended per head, per layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .attention import attend, causal_attention
from .state import LayerState, SequenceState, jobs_inline
from .storage import append_to_buffer
from .timing import PhaseTimer


MEMORY_KEYS = ("device_kv_bytes", "transit_bytes", "host_kv_bytes", "index_bytes")  # KVMethod.layer_memory
_WARMED: set = set()  # warm-up keys (KVMethod.warm_once) already run in this process


def tensor_bytes(*tensors) -> int:
    """Bytes of the elements of ``tensors`` (torch tensors or numpy arrays, as shaped: a prefix view counts its
    own elements, not its buffer's capacity); None entries count 0."""
    total = 0
    for x in tensors:
        if x is not None:
            total += x.numel() * x.element_size() if torch.is_tensor(x) else x.nbytes
    return total


class BudgetError(ValueError):
    """An invalid budget for a method; raised at config time, before any model is loaded."""


class UnknownNameError(ValueError):
    """A model/cache/eval name that is not registered."""


@dataclass(frozen=True)
class ModelSpec:
    """What a method needs to know about the model (read once from it by :func:`icecache.kv.compat.model_spec`)."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float
    max_position: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    inv_freq: torch.Tensor | None = None  # RoPE frequencies, for methods that re-rotate keys

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads


@dataclass(frozen=True)
class Bound:
    """A method's per-model values: what :meth:`KVMethod.bind` resolves from one model's :class:`ModelSpec`. The
    cache keeps it (one per model) and hands it to each sequence; every layer state reaches it as ``st.bound``.
    Methods that resolve more from the model (layer ids scaled to its depth, random projections) return a
    subclass holding them."""

    spec: ModelSpec

    def settings(self) -> dict:
        """Hyperparameters left ``None`` at construction that were resolved from the model (layer ids scaled to
        its depth), as the run record states them (``method_bound``); ``{}`` when a method has none."""
        return {}


@dataclass
class Fetched:
    """The K/V a head attends to at one step (current token included): ``[H, m, d]`` with ``H`` in
    {1, H_kv, H_q}, an optional ``[H, m]`` validity mask and, when the method knows it on the host
    without reading the mask (e.g. from its page table), ``n_past``: the mean past tokens per head."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None = None
    n_past: float | None = None

    def past_tokens_per_head(self) -> float | torch.Tensor:
        """Mean number of past tokens attended per head (the current token excluded), without a host
        sync: from the shapes, from ``n_past``, or else as a 0-d tensor on the mask's device, which the
        caller accumulates there and reads once per run (:meth:`KVCache.effective_tokens`)."""
        if self.valid is None:
            return float(self.k.shape[1] - 1)
        if self.n_past is not None:
            return self.n_past
        return self.valid.sum(-1, dtype=torch.float32).mean() - 1.0


@dataclass(frozen=True)
class KVMethod:
    """Base class: the ``full`` behaviour (keep and attend everything). Subclasses override hooks."""

    budget: int | None = None
    debug: bool = False  # assert the resident-set accounting after every step
    name: ClassVar[str] = ""
    needs_budget: ClassVar[bool] = True  # False for methods without one (full)
    example_budget: ClassVar[int] = 64  # suggested in the error when no budget is given

    def __post_init__(self) -> None:
        if self.budget is None:
            if self.needs_budget:
                raise BudgetError(f"{self.name} needs a budget (past tokens per head per budgeted layer), "
                                  f"e.g. budget={self.example_budget}")
        elif self.budget <= 0:
            raise BudgetError(f"{self.name}: budget must be a positive number of tokens, got {self.budget}")
        self.validate()

    # ------------------------------------------------------------------ configuration
    def validate(self) -> None:
        """Validates every hyperparameter, and the budget against them (config time; ``budget`` is set unless
        the method has no budget). Raises :class:`BudgetError` for a budget, ``ValueError`` otherwise."""

    def check_whole(self, *names: str, minimum: int = 0) -> None:
        """Each named hyperparameter is a whole number ``>= minimum``."""
        for key in names:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{self.name}: {key} must be a whole number >= {minimum}, got {value!r}")

    def check_choice(self, key: str, valid: tuple) -> None:
        """The hyperparameter ``key`` is one of ``valid``."""
        if getattr(self, key) not in valid:
            raise ValueError(f"{self.name}: {key} must be one of {valid}, got {getattr(self, key)!r}")

    def attach(self, model: torch.nn.Module, cache) -> None:
        """Called once per cache by :meth:`KVCache.for_model` with the model and the new cache: a method that
        needs more than the attention inputs registers its hooks here (the kvpress adapter captures each
        layer's input hidden states into the cache's sequence state). Default: nothing."""

    def bind(self, spec: ModelSpec) -> Bound:
        """This method's values for a model of ``spec`` (checked against it). :class:`KVCache` binds once per
        cache; the method object itself is left as it was."""
        return Bound(spec)

    def new_sequence(self, bound: Bound, probe=None) -> SequenceState:
        """The state of a new sequence for the model ``bound`` was made for (:meth:`bind`): :meth:`make_sequence`
        holding one :meth:`make_state` per layer (each knowing its sequence as ``st.seq`` and the per-model values
        as ``st.bound``) and the ``diagnostics=recall`` ``probe``. :class:`KVCache` makes one per prompt."""
        seq = self.make_sequence()
        seq.probe, seq.bound = probe, bound
        for layer_idx in range(bound.spec.n_layers):
            st = self.make_state(layer_idx)
            st.seq, st.bound = seq, bound
            seq.layers.append(st)
        return seq

    def make_sequence(self) -> SequenceState:
        """A new sequence's :class:`SequenceState`; methods that keep values across the layers of one prompt
        return a subclass holding them."""
        return SequenceState(worker_name=self.name)

    def make_state(self, layer_idx: int) -> LayerState:
        return LayerState(layer_idx)

    def is_budgeted(self, st: LayerState) -> bool:
        """Whether the layer of ``st`` is subject to the budget (dense/exempt layers return False)."""
        return self.budget is not None

    # ------------------------------------------------------------------ prefill
    def prefill(self, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exact causal attention over the prompt; stores the layer's K/V. Override for methods that
        need prefill statistics (H2O, SnapKV)."""
        out = causal_attention(q, k, v, st.spec.scaling)
        self.store(st, k, v)
        return out

    def finish_prefill(self, st: LayerState) -> None:
        """Called once per layer right after its prefill attention: evict, offload, start index builds."""

    def store(self, st: LayerState, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends K/V with their original positions to the resident store (amortised O(1) per token:
        ``st.k``/``st.v``/``st.pos`` are prefix views of buffers that grow geometrically when full)."""
        pos = torch.arange(st.n_seen - k.shape[1], st.n_seen, device=k.device)
        st.buffers["k"], st.k = append_to_buffer(st.buffers.get("k"), st.k, k)
        st.buffers["v"], st.v = append_to_buffer(st.buffers.get("v"), st.v, v)
        st.buffers["pos"], st.pos = append_to_buffer(st.buffers.get("pos"), st.pos, pos, dim=0)

    # ------------------------------------------------------------------ feeding a layer
    def fill(self, st: LayerState, k: torch.Tensor, v: torch.Tensor,
             q: torch.Tensor | None = None) -> torch.Tensor | None:
        """One layer's whole prefill from its K/V ``[H_kv, n, d]``: the logical length grows by ``n``, then
        :meth:`store` (``q`` None; returns None) or :meth:`prefill` on the queries ``q`` (returns its attention
        output), then :meth:`finish_prefill`. What :class:`~icecache.kv.KVCache` does per layer at a prefill."""
        st.n_seen += k.shape[1]
        out = None
        if q is None:
            self.store(st, k, v)
        else:
            out = self.prefill(st, q, k, v)
        self.finish_prefill(st)
        return out

    def step(self, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             timer: PhaseTimer) -> torch.Tensor:
        """One decode step of one layer: the logical length grows by the new tokens, then :meth:`decode`.
        What :class:`~icecache.kv.KVCache` does per layer and token when decoding."""
        st.n_seen += q.shape[1]
        return self.decode(st, q, k, v, timer)

    # ------------------------------------------------------------------ background work
    def submit_background(self, st: LayerState, fn, *args) -> None:
        """Runs ``fn(*args)`` on the sequence's single background worker (the prefill pipeline), or inline on a
        CPU (:func:`~icecache.kv.state.jobs_inline`)."""
        st.seq.submit(st, fn, *args, inline=jobs_inline(st.spec.device))

    def await_background(self, st: LayerState) -> None:
        """Waits for ``st``'s background job, if any (:meth:`SequenceState.wait`)."""
        if st.pending is not None:
            st.seq.wait(st)

    # ------------------------------------------------------------------ decode
    def decode(self, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               timer: PhaseTimer) -> torch.Tensor:
        """One decode step of one layer: ``append -> select -> fetch -> attend -> observe``."""
        with timer.span("update"):
            self.await_background(st)
            self.append(st, k, v)
        with timer.span("select"):
            selection = self.select(st, q)
        with timer.span("transfer"):
            fetched = self.fetch(st, selection)
        with timer.span("attention"):
            out = self.attend(st, q, fetched)
        probe = None if st.seq is None else st.seq.probe  # a lone LayerState belongs to no sequence
        if probe is not None:  # reads only; before observe, which may evict what was attended
            with timer.span("diagnostics"):
                probe.measure(self, st, q, selection, out)
        with timer.span("update"):
            self.observe(st, q, fetched, selection)
        st.attended_sum = st.attended_sum + fetched.past_tokens_per_head()  # no host sync
        st.attended_steps += 1
        if self.debug:
            self.check_resident(st)
        return out

    def append(self, st: LayerState, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store(st, k, v)

    def select(self, st: LayerState, q: torch.Tensor) -> Any:
        """Returns what to fetch; ``None`` means "all resident" (eviction methods, dense layers)."""
        return None

    def fetch(self, st: LayerState, selection: Any) -> Fetched:
        return Fetched(st.k, st.v)

    def attend(self, st: LayerState, q: torch.Tensor, fetched: Fetched) -> torch.Tensor:
        return attend(q, fetched.k, fetched.v, st.spec.scaling, fetched.valid)

    def observe(self, st: LayerState, q: torch.Tensor, fetched: Fetched, selection: Any) -> None:
        """After attention: update scores, evict (eviction methods) or insert into indexes."""

    def attended_positions(self, st: LayerState, selection: Any) -> torch.Tensor:
        """Original positions of what :meth:`fetch` returned for ``selection`` this step, current token
        included: ``[m]`` (one set for every head) or ``[H, m]`` with ``H`` in {1, H_kv, H_q}, -1 where a slot
        is masked. Read by the ``diagnostics=recall`` probe after attention, before :meth:`observe`. Default:
        the resident positions (methods whose ``fetch`` returns the resident K/V)."""
        return st.pos

    # ------------------------------------------------------------------ first request
    def warm_up(self, spec: ModelSpec, n_prompt: int) -> None:
        """Called by the runner before a request's clock starts (:func:`evals.runner.generate`): compiles or loads
        whatever the method's first request in a process would otherwise compile or load inside its timed phases
        (numba kernels, for this model's dtype, device and shapes and a prompt of ``n_prompt`` tokens), so a
        process's first request is timed like its tenth. Leaves this method's own state as it was. Default:
        nothing."""

    def warm_once(self, key) -> bool:
        """True the first time this process asks for ``(type(self), key)``: a warm-up that costs more than a
        kernel dispatch runs once per process and signature, not once per request."""
        key = (type(self), key)
        if key in _WARMED:
            return False
        _WARMED.add(key)
        return True

    def rehearse(self, spec: ModelSpec, n_prompt: int, n_steps: int, **changes) -> None:
        """Runs a copy of this method (``dataclasses.replace(self, **changes)``: same hyperparameters, states of its
        own) through a prefill of ``n_prompt`` random tokens and ``n_steps`` decode steps of a model of ``spec``'s
        shapes, dtype and device, by the calls :meth:`KVCache.run_attention` makes for a request (:meth:`bind`,
        :meth:`new_sequence`, :meth:`fill` per layer, then :meth:`step` per layer and token), then discards it.
        The global random generators are left as they were."""
        method = dataclasses.replace(self, **changes)
        devices = [spec.device] if spec.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            gen = torch.Generator().manual_seed(0)

            def draw(heads: int, n: int) -> torch.Tensor:
                return torch.randn(heads, n, spec.head_dim, generator=gen).to(spec.device, spec.dtype)
            sequence, timer = method.new_sequence(method.bind(spec)), PhaseTimer(device=spec.device)
            try:
                for st in sequence.layers:
                    q = draw(spec.n_q_heads, n_prompt)
                    method.fill(st, draw(spec.n_kv_heads, n_prompt), draw(spec.n_kv_heads, n_prompt), q)
                for _ in range(n_steps):
                    for st in sequence.layers:
                        q, k, v = draw(spec.n_q_heads, 1), draw(spec.n_kv_heads, 1), draw(spec.n_kv_heads, 1)
                        method.step(st, q, k, v, timer)
                    timer.reset()
                for st in sequence.layers:
                    method.await_background(st)
            finally:
                sequence.close()

    # ------------------------------------------------------------------ accounting
    def resident_tokens(self, st: LayerState) -> int:
        """Past tokens of this layer held in fast (device) memory between steps."""
        return st.resident_tokens()

    def layer_memory(self, st: LayerState) -> dict[str, int]:
        """Bytes one layer holds, by where a GPU run keeps them (:data:`MEMORY_KEYS`, summed over layers by
        :meth:`KVCache.memory_bytes`): ``device_kv_bytes``, the K/V in device memory (the resident set, and
        ``transit_bytes``, the part of it that stages or gathers K/V brought from the host at a step);
        ``host_kv_bytes``, the K/V of the host offload store; ``index_bytes``, the method's retrieval metadata
        (codes, tables, indexes). Counted from the method's buffers, so the numbers are the same whether the run
        is on a CPU or a GPU. Default: every token's K/V resident on the device."""
        return {"device_kv_bytes": tensor_bytes(st.k, st.v)}

    def layer_stats(self, st: LayerState) -> dict[str, float]:
        """Method-specific numbers of one layer for the run's record (``timing.json`` ``method_stats``, e.g.
        MagicPIG's chosen ``K``); read once per sample after generation. Default: none."""
        return {}

    def check_resident(self, st: LayerState) -> None:
        if self.is_budgeted(st) and self.resident_tokens(st) > self.budget:
            raise AssertionError(f"{self.name}: layer {st.layer_idx} holds {self.resident_tokens(st)} resident "
                                 f"tokens, over the budget of {self.budget}")
