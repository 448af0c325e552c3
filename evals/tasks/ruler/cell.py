"""One (task, length) run of an official RULER generator script, and the haystack-size search every
generator shares (NVIDIA/RULER ``scripts/data/synthetic/*.py``: a binary search for the largest haystack
whose probe fits, then per sample a step down by ``incremental`` until it fits)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .resources import Resources


@dataclass
class Cell:
    """One (task, length) run of an official generator script: its RNG state, template and token counter."""
    task: str
    length: int
    seed: int
    template: str  # model wrapper + task template + answer prefix, ready for ``str.format``
    tokens_to_generate: int
    count: Callable[[str], int]
    res: Resources

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.nprng = np.random.RandomState(self.seed)

    def total(self, text: str, extra: int = 0) -> int:
        return self.count(text) + extra + self.tokens_to_generate

    def largest_fitting(self, build: Callable[[int], str], lower: int, upper: int, extra: int = 0) -> int | None:
        """The official binary search for the largest haystack whose probe fits."""
        best = None
        while lower <= upper:
            mid = (lower + upper) // 2
            if self.total(build(mid), extra) <= self.length:
                best, lower = mid, mid + 1
            else:
                upper = mid - 1
        return best

    def step_down(self, build: Callable[[int], tuple[str, list[str]]], n: int, incremental: int):
        """The official per-sample loop: regenerate ``incremental`` units smaller until the sample fits."""
        while True:
            text, answers = build(n)
            if self.total(text) <= self.length:
                return text, answers, n
            if n <= incremental:
                raise ValueError(f"RULER {self.task}: even {n} haystack units exceed {self.length} tokens "
                                 "with this tokenizer")
            n -= incremental

    def haystack_size(self, build: Callable[[int], str], incremental: int, probe: int | None = None,
                      upper: Callable[[float], int] | None = None, extra: int = 0) -> int:
        """The official search for a cell's haystack size: tokens per unit from one probe of ``probe`` units
        (default ``incremental``), then :meth:`largest_fitting` between ``incremental`` and ``upper(tokens per
        unit)`` (default three lengths' worth; never below ``2 * incremental``), ``incremental`` if none fits.
        The probes draw from the cell's RNG, as upstream."""
        probe = probe or incremental
        per_unit = self.count(build(probe)) / probe
        top = upper(per_unit) if upper else int((self.length / per_unit) * 3)
        return self.largest_fitting(build, incremental, max(top, incremental * 2), extra) or incremental
