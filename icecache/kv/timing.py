"""Per-phase timing of decode steps (the TPOT breakdown of the IceCache paper's latency figures).

Every decode step of every method is ``append -> select -> fetch -> attend -> observe``; the method base
class wraps each call in :meth:`PhaseTimer.span`, so the breakdown is measured the same way for all
methods. Phases: ``select`` (scoring, index search, top-k), ``transfer`` (gathers/copies from the offload
store), ``attention``, ``update`` (append, eviction, index insert, waiting for background index builds).
``other`` is the remainder of the step's wall time (MLPs, projections, LM head, Python).

Clocks:
- CPU: host wall clock (``time.perf_counter``) around each span.
- CUDA (default): a pair of CUDA events recorded on the current stream around each span, resolved once
  per step by :meth:`PhaseTimer.reset` (one wait on the step's last event, no added syncs inside the
  step). An event pair measures the stream's timeline between the two points, so the GPU time of a phase
  is attributed to it even though its kernels finish after the host has moved on, and host-side work in
  a span (an index search on the CPU) shows as the idle gap the stream waits through.
- ``sync=True`` (``profile=true``): ``torch.cuda.synchronize()`` around every span and the host clock,
  for exact host-side attribution (slower: it serialises host and device).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

import torch

PHASES = ("select", "transfer", "attention", "update")


def cuda_timing_event():
    return torch.cuda.Event(enable_timing=True)


class PhaseTimer:
    """Accumulates seconds per phase for the current step; :meth:`reset` starts a new step. ``current``
    names the phase being timed (None outside a span)."""

    def __init__(self, sync: bool = False, device: torch.device | str | None = None,
                 event_factory: Callable | None = None):
        """``device``: the model's device (CUDA events are used on CUDA unless ``sync``); ``event_factory``
        makes the timing events (default ``torch.cuda.Event(enable_timing=True)``)."""
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.sync = sync and torch.cuda.is_available()
        self.use_events = (on_cuda and not self.sync) or event_factory is not None
        self.event_factory = event_factory or cuda_timing_event
        self.seconds: dict[str, float] = defaultdict(float)
        self.current: str | None = None
        self._pending: list[tuple[str, object, object]] = []  # (phase, start event, end event) of this step
        self._free: list = []  # recorded-and-resolved events, reused

    def _event(self):
        return self._free.pop() if self._free else self.event_factory()

    def resolve(self) -> None:
        """Adds the elapsed time of this step's event pairs, waiting once for the last one."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for phase, start, end in self._pending:
            self.seconds[phase] += start.elapsed_time(end) / 1000.0  # ms -> s
            self._free += [start, end]
        self._pending = []

    def reset(self) -> dict[str, float]:
        self.resolve()
        done, self.seconds = dict(self.seconds), defaultdict(float)
        return done

    @contextmanager
    def span(self, phase: str):
        outer, self.current = self.current, phase
        if self.use_events:
            start = self._event()
            start.record()
            try:
                yield
            finally:
                end = self._event()
                end.record()
                self._pending.append((phase, start, end))
                self.current = outer
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
            self.current = outer
