"""Level assignment (promotion) of M-DCI (official ``src/dci.c``, level assignment).

Every token lives on exactly one level. Level sizes shrink geometrically: ``n_{t+1} ~ p_t n_t`` with
``p_0 = ratio_1`` and ``p_{t>=1} = ratio_2``. The assignment depends only on token order (and the
seed), so it is shared by all KV heads of a layer; parents differ per head.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from .config import DCIConfig


@njit(cache=True, nogil=True)
def _deterministic_levels(n: int, ratio_1: float, ratio_2: float) -> np.ndarray:
    """The official positional rule, token by token (``src/dci.c`` construction).

    After a token is placed on level ``t``, the next token goes to ``t+1`` if ``t`` is the top level
    and now holds ``ceil(1/p_t)`` points (a new level opens), or if ``t`` is below the top and
    ``n_t >= n_{t+1} / p_t``; otherwise it goes to level 0.
    """
    level = np.zeros(n, dtype=np.int32)
    counts = np.zeros(64, dtype=np.int64)
    top = 0
    nxt = 0
    for i in range(n):
        t = nxt
        level[i] = t
        counts[t] += 1
        p = ratio_1 if t == 0 else ratio_2
        if t == top:
            promote = counts[t] >= math.ceil(1.0 / p)
        else:
            promote = counts[t] >= counts[t + 1] / p
        if promote:
            nxt = t + 1
            if t == top:
                top += 1
        else:
            nxt = 0
    return level


def _random_levels(n: int, ratio_1: float, ratio_2: float, seed: int) -> np.ndarray:
    """Geometric promotion: promote while ``U(0,1) <= p`` (``p_0 = ratio_1``, then ``ratio_2``)."""
    gen = torch.Generator().manual_seed(seed + 1)
    level = np.zeros(n, dtype=np.int32)
    alive = np.arange(n)
    p = ratio_1
    while alive.size:
        draw = torch.rand(alive.size, generator=gen, dtype=torch.float64).numpy()
        alive = alive[draw <= p]
        level[alive] += 1
        p = ratio_2
    # a token lives on one level only, so a middle level can come out empty: close the gaps
    return np.unique(level, return_inverse=True)[1].astype(np.int32)


def assign_levels(n: int, cfg: DCIConfig) -> np.ndarray:
    """Level of each of ``n`` tokens (int32 ``[n]``), by ``cfg.promotion``."""
    if cfg.promotion == "deterministic":
        return _deterministic_levels(n, cfg.ratio_1, cfg.ratio_2)
    return _random_levels(n, cfg.ratio_1, cfg.ratio_2, cfg.seed)


def level_sizes(level: np.ndarray) -> list[int]:
    """Number of points per level, level 0 first."""
    return np.bincount(level).tolist() if level.size else []
