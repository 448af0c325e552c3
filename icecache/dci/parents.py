"""Parent assignment of M-DCI construction (official ``src/dci.c``, parent assignment).

Levels are processed top-down. Each point on level ``t`` gets as parent its nearest point on level
``t+1`` under ``D(a, b) = ||T_K(a) - T_K(b)||^2 / 2``. Since ``||T_K||`` is the same (``M``) for every
key of a head, the nearest point under ``D`` is the one with the largest lifted inner product
``T_K(a).T_K(b)``; all searches below maximise that with dense (batched over heads) matmuls.

Node indices: the virtual root is node 0, token ``i`` (local index) is node ``i + 1``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .config import DCIConfig

_CHUNK_ELEMS = 1 << 22  # scores materialised per matmul chunk (16 MiB of fp32)


def exact_parents(lifted: torch.Tensor, points: np.ndarray, uppers: np.ndarray) -> torch.Tensor:
    """Exact brute force: for each head, the position in ``uppers`` of each point's nearest upper point.

    ``lifted``: ``[H, n, d+1]`` transformed keys; ``points``/``uppers``: local indices.
    Returns int64 ``[H, len(points)]`` (positions into ``uppers``).
    """
    heads = lifted.shape[0]
    up = lifted[:, torch.from_numpy(uppers)].transpose(1, 2).contiguous()
    chunk = max(1, _CHUNK_ELEMS // max(1, heads * len(uppers)))
    out = torch.empty(heads, len(points), dtype=torch.int64)
    for start in range(0, len(points), chunk):
        idx = torch.from_numpy(points[start:start + chunk])
        out[:, start:start + len(idx)] = torch.bmm(lifted[:, idx], up).argmax(-1)
    return out


_SUPERBLOCK = 16  # anchor intervals whose points share one candidate set and one matmul


@njit(cache=True, nogil=True)
def _anchor_candidates(anchor_parent: np.ndarray, window: int, n_upper: int, block: int) -> np.ndarray:
    """Distinct parents of the anchors seen by each super-block of ``block`` anchor intervals.

    A level-0 point between anchors ``j`` and ``j+1`` sees anchors ``j-window+1 .. j+window``; a
    super-block ``[J0, J1)`` takes the union ``J0-window+1 .. J1-1+window`` (a superset of each of
    its points' own candidates). Returns ``[H, n_super, C]`` upper positions, padded with -1.
    """
    heads, n_anchor = anchor_parent.shape
    n_super = (n_anchor + block - 1) // block
    cap = min(2 * window + block, n_upper)
    cand = np.full((heads, n_super, cap), -1, dtype=np.int64)
    seen = np.full(n_upper, -1, dtype=np.int64)
    width = 0
    for h in range(heads):
        for b in range(n_super):
            stamp = h * n_super + b
            c = 0
            lo = max(0, b * block - window + 1)
            hi = min(n_anchor, min(n_anchor, (b + 1) * block) - 1 + window + 1)
            for a in range(lo, hi):
                p = anchor_parent[h, a]
                if seen[p] != stamp:
                    seen[p] = stamp
                    cand[h, b, c] = p
                    c += 1
            width = max(width, c)
    return cand[:, :, :width]


@njit(cache=True, nogil=True)
def _accept(parent, dist, complete, max_child, threshold):
    """Sequential acceptance test of one super-block, in token order, per head (``src/dci.c`` anchors).

    A point keeps its anchor-derived parent ``P`` if ``D <= threshold * maxchilddist(P)`` (always when
    its candidates were every upper point); an accepted point raises ``maxchilddist(P)``. Returns the
    rejected points ``[H, m]`` (they fall back to the exact search).
    """
    heads, m = parent.shape
    rejected = np.zeros((heads, m), dtype=np.bool_)
    for h in range(heads):
        for i in range(m):
            p = parent[h, i]
            if complete[h] or dist[h, i] <= threshold * max_child[h, p]:
                max_child[h, p] = max(max_child[h, p], dist[h, i])
            else:
                rejected[h, i] = True
    return rejected


def _best_upper(lifted: torch.Tensor, points: np.ndarray, up_t: torch.Tensor):
    """Exact nearest upper point of ``points``: (position into the uppers, lifted similarity)."""
    sim = torch.bmm(lifted[:, torch.from_numpy(points)], up_t)
    return sim.max(-1)


def anchor_parents(lifted: torch.Tensor, m2: torch.Tensor, level0: np.ndarray, uppers: np.ndarray,
                   cfg: DCIConfig) -> torch.Tensor:
    """Anchor shortcut for a large level 0 (``src/dci.c`` anchors); returns positions into ``uppers``, ``[H, n0]``.

    Anchors (every ``anchor_interval``-th level-0 point in token order) get exact parents first. Every
    other point takes the closest ``P`` among the distinct parents of the anchors around it
    (``anchor_window`` on each side, pooled over a super-block of ``_SUPERBLOCK`` intervals so that
    one dense matmul serves ~1000 points) and keeps it if ``D <= anchor_threshold * maxchilddist(P)``;
    otherwise it falls back to the exact search. As in the official code, ``maxchilddist`` grows
    with every child a node receives: the points are tested in token order (one super-block at a
    time), accepted points update it at once, fallback points after their super-block's exact search.
    Where a super-block's candidates are every upper point, ``P`` is the exact parent and is kept.
    """
    heads = lifted.shape[0]
    interval = cfg.anchor_interval
    anchors = level0[::interval]
    up_t = lifted[:, torch.from_numpy(uppers)].transpose(1, 2).contiguous()  # [H, d+1, nu]
    anchor_sim, anchor_par = _best_upper(lifted, anchors, up_t)  # [H, nA]
    cand_np = _anchor_candidates(anchor_par.numpy(), cfg.anchor_window, len(uppers), _SUPERBLOCK)
    cand = torch.from_numpy(cand_np)  # [H, n_super, C]
    n_super, width = cand.shape[1], cand.shape[2]
    span = interval * _SUPERBLOCK
    n0 = len(level0)
    pad = n_super * span - n0
    pts = lifted[:, torch.from_numpy(np.concatenate([level0, np.full(pad, level0[-1])]))]
    pts = pts.view(heads * n_super, span, -1)
    complete = ((cand >= 0).sum(-1) == len(uppers)).numpy()  # [H, n_super]
    cand = torch.where(cand >= 0, cand, cand[:, :, :1])  # pad with a repeat of the first candidate
    cand_keys = up_t.transpose(1, 2)[torch.arange(heads)[:, None, None], cand]
    cand_keys = cand_keys.view(heads * n_super, width, -1).transpose(1, 2)
    best_sim = torch.empty(heads * n_super, span)
    arg = torch.empty(heads * n_super, span, dtype=torch.int64)
    step = max(1, _CHUNK_ELEMS // (span * width))
    for b in range(0, heads * n_super, step):
        sim = torch.bmm(pts[b:b + step], cand_keys[b:b + step])
        torch.max(sim, -1, out=(best_sim[b:b + step], arg[b:b + step]))
    result = cand.view(heads * n_super, width).gather(1, arg).view(heads, -1)[:, :n0].contiguous()
    dist = (m2[:, None] - best_sim.view(heads, -1)[:, :n0]).contiguous()
    res_np, dist_np, m2_np = result.numpy(), dist.numpy(), m2.numpy()
    max_child = np.full((heads, len(uppers)), -np.inf, dtype=np.float32)
    anchor_d = m2_np[:, None] - anchor_sim.numpy()
    np.maximum.at(max_child, (np.arange(heads)[:, None], anchor_par.numpy()), anchor_d)
    rows = np.arange(heads)[:, None]
    for b in range(n_super):
        sl = slice(b * span, min((b + 1) * span, n0))
        rejected = _accept(res_np[:, sl], dist_np[:, sl], complete[:, b], max_child,
                           np.float32(cfg.anchor_threshold))
        redo = np.flatnonzero(rejected.any(0))
        if redo.size == 0:
            continue
        sim, pos = _best_upper(lifted, level0[sl][redo], up_t)
        use = rejected[:, redo]
        block = res_np[:, sl]
        block[:, redo] = np.where(use, pos.numpy(), block[:, redo])
        np.maximum.at(max_child, (np.broadcast_to(rows, use.shape)[use], pos.numpy()[use]),
                      (m2_np[:, None] - sim.numpy())[use])
    return result


def assign_parents(lifted: torch.Tensor, m2: torch.Tensor, level: np.ndarray,
                   cfg: DCIConfig) -> np.ndarray:
    """Parent node index of every token for every head: int64 ``[H, n]`` (0 = virtual root).

    Exact brute force over the upper level whatever its size (the official code switches to an
    approximate top-down search above ``exact_parent_threshold`` upper points; see the package
    docstring), with the anchor shortcut at a level 0 larger than ``exact_parent_threshold``.
    """
    heads, n = lifted.shape[:2]
    parent = np.zeros((heads, n), dtype=np.int64)
    top = int(level.max()) if n else 0
    for t in range(top - 1, -1, -1):
        points = np.flatnonzero(level == t)
        uppers = np.flatnonzero(level == t + 1)
        if t == 0 and cfg.use_anchors and len(points) > cfg.exact_parent_threshold:
            pos = anchor_parents(lifted, m2, points, uppers, cfg)
        else:
            pos = exact_parents(lifted, points, uppers)
        parent[:, points] = uppers[pos.numpy()] + 1
    return parent
