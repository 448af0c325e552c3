"""The state of one sequence, which its cache (:class:`~icecache.kv.KVCache`) owns: one :class:`LayerState` per
decoder layer inside one :class:`SequenceState`. Methods hold hyperparameters and policy only, as transformers'
``cache_utils`` keeps the tensors in the cache and the policy in its layer classes; a method reaches the rest of
its sequence (another layer's state, the background worker, the probe) through ``st.seq``."""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import torch


BACKGROUND_ENV = "ICECACHE_BACKGROUND"  # where prefill jobs run: auto, thread, inline (jobs_inline)


def spare_cpu_share(device: torch.device) -> float:
    """Share of the CPU cores the prefill leaves idle, on which the official codes overlap their index builds
    (IceCache's, PQCache's k-means, MagicPIG's tables): all of them when the model runs on a GPU, else the cores
    beyond torch's intra-op threads."""
    if device.type != "cpu":
        return 1.0
    cores = os.cpu_count() or 1
    return max(0, cores - torch.get_num_threads()) / cores


def jobs_inline(device: torch.device) -> bool:
    """Whether a sequence on ``device`` runs its background jobs inline, at submission, instead of on its worker
    thread. ``ICECACHE_BACKGROUND``: ``auto`` (default) inlines them when the prefill leaves no core idle
    (:func:`spare_cpu_share` 0: a CPU whose cores all run torch's threads), ``thread``, ``inline``. There the
    jobs and the prefill compete for the same cores, and the worker's OpenMP teams beside the prefill's
    oversubscribe them, which makes the TT2T longer than running the jobs inline (docs/benchmarks.md, "Threads and
    OpenMP waiting"). With idle cores (a GPU model) the jobs overlap the prefill, as in the official pipelines.
    Where the jobs run changes no output."""
    mode = os.environ.get(BACKGROUND_ENV, "auto")
    if mode not in ("auto", "thread", "inline"):
        raise ValueError(f"{BACKGROUND_ENV}={mode!r}: use auto (inline when the prefill uses every core), thread "
                         "or inline")
    return mode == "inline" or (mode == "auto" and spare_cpu_share(device) == 0)


class LayerState:
    """Per-layer storage. The default holds the resident K/V ``[H_kv, n, d]`` and the original position
    of each resident token (``pos``, ``[n]``). Methods attach their own fields (indexes, scores...)."""

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx
        self.seq: SequenceState | None = None  # the sequence this layer belongs to (set by KVMethod.new_sequence)
        self.bound: Any = None  # the method's per-model values, a kv.base.Bound (set by KVMethod.new_sequence)
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

    @property
    def spec(self):
        """The model's :class:`~icecache.kv.base.ModelSpec` (``bound.spec``)."""
        return self.bound.spec

    def resident_tokens(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])


class SequenceState:
    """Everything one sequence holds besides the method's hyperparameters: its layers' states (``layers``, the
    one way a layer reads another's: IceCache(reuse)'s anchors, OmniKV's filter layers), the single background
    worker of its prefill pipeline, and the ``diagnostics=recall`` probe (``probe``, a
    :class:`~icecache.kv.recall.RecallProbe` or None). A method that keeps values across the layers of one prompt
    returns a subclass from :meth:`~icecache.kv.KVMethod.make_sequence`."""

    def __init__(self, worker_name: str = "kv"):
        self.layers: list[LayerState] = []
        self.probe: Any = None
        self.bound: Any = None  # the method's per-model values (kv.base.Bound), shared by its layers
        self.worker_name = worker_name
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.outstanding = 0  # background jobs submitted, not yet awaited

    def submit(self, st: LayerState, fn, *args, inline: bool = False) -> None:
        """Runs ``fn(*args)`` on the sequence's background worker, or now when ``inline`` (:func:`jobs_inline`);
        ``st.pending`` is its future either way (an inline job's error is raised where it is awaited, as a
        worker's)."""
        if inline:
            self.outstanding += 1
            st.pending = concurrent.futures.Future()
            try:
                st.pending.set_result(fn(*args))
            except Exception as error:  # noqa: BLE001 - re-raised by the await, like a worker's
                st.pending.set_exception(error)
            return
        if self.executor is None:
            self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.worker_name)
        self.outstanding += 1
        st.pending = self.executor.submit(fn, *args)

    def wait(self, st: LayerState) -> None:
        """Waits for ``st``'s background job. When it was the last one outstanding the worker thread exits
        (:meth:`close`; the next submit starts a new one): a thread that ran parallel torch or numba work keeps
        an OpenMP team of its own while it lives, and libgomp then counts more threads than cores and cuts
        every team's spin-wait to a few microseconds, so each parallel op of the decode paid a thread wake-up
        (docs/benchmarks.md, "Threads and OpenMP waiting")."""
        if st.pending is None:
            return
        pending, st.pending = st.pending, None
        try:
            pending.result()
        finally:
            self.outstanding -= 1
            if self.outstanding == 0:
                self.close()

    def close(self) -> None:
        """Stops the background worker (after its queued jobs)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
