"""Per-phase wall-clock timing of decode steps (reference/baselines.md §5.2).

Every decode step of every method is ``append -> select -> fetch -> attend -> observe``; the method base
class wraps each call in :meth:`PhaseTimer.span`, so the breakdown is measured the same way for all
methods. Phases: ``select`` (scoring, index search, top-k), ``transfer`` (gathers/copies from the offload
store), ``attention``, ``update`` (append, eviction, index insert, waiting for background index builds).
``other`` is the remainder of the step's wall time (MLPs, projections, LM head, Python).
On CUDA, ``sync=True`` synchronises around each span for exact attribution (a profile mode).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("select", "transfer", "attention", "update")


class PhaseTimer:
    """Accumulates seconds per phase for the current step; :meth:`reset` starts a new step."""

    def __init__(self, sync: bool = False):
        self.sync = sync and torch.cuda.is_available()
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> dict[str, float]:
        done, self.seconds = dict(self.seconds), defaultdict(float)
        return done

    @contextmanager
    def span(self, phase: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
