"""Parent assignment of M-DCI construction (icecache.md §3.2, "Parents").

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


@njit(cache=True, nogil=True)
def _anchor_candidates(anchor_parent: np.ndarray, window: int, n_upper: int) -> np.ndarray:
    """Distinct parents of the anchors ``j-window+1 .. j+window`` for every block ``j`` and head.

    The level-0 points strictly between anchor ``j`` and anchor ``j+1`` all see the same ``window``
    anchors on each side, so a block shares one candidate set. Returns ``[H, n_anchor, C]`` positions
    into the upper level, padded with -1.
    """
    heads, n_anchor = anchor_parent.shape
    cap = min(2 * window, n_upper)
    cand = np.full((heads, n_anchor, cap), -1, dtype=np.int64)
    seen = np.full(n_upper, -1, dtype=np.int64)
    width = 0
    for h in range(heads):
        for j in range(n_anchor):
            stamp = h * n_anchor + j
            c = 0
            for a in range(max(0, j - window + 1), min(n_anchor, j + window + 1)):
                p = anchor_parent[h, a]
                if seen[p] != stamp:
                    seen[p] = stamp
                    cand[h, j, c] = p
                    c += 1
            width = max(width, c)
    return cand[:, :, :width]


def _blocked_nonanchors(level0: np.ndarray, interval: int) -> np.ndarray:
    """Non-anchor level-0 points as ``[n_anchor, interval-1]`` local indices (-1 padded)."""
    n_anchor = -(-len(level0) // interval)
    padded = np.full(n_anchor * interval, -1, dtype=np.int64)
    padded[: len(level0)] = level0
    return padded.reshape(n_anchor, interval)[:, 1:]


def anchor_parents(lifted: torch.Tensor, m2: torch.Tensor, level0: np.ndarray, uppers: np.ndarray,
                   cfg: DCIConfig) -> torch.Tensor:
    """Anchor shortcut for a large level 0 (§3.2 step 3); returns positions into ``uppers``, ``[H, n0]``.

    Anchors (every ``anchor_interval``-th level-0 point in token order) get exact parents. Every other
    point takes the closest ``P`` among the distinct parents of ``anchor_window`` anchors on each side
    and keeps it if ``D <= anchor_threshold * maxchilddist(P)``; otherwise it falls back to the exact
    search. ``maxchilddist(P)`` is measured over ``P``'s anchor children (the official code updates
    it while children arrive; using anchors only is slightly stricter).
    """
    heads = lifted.shape[0]
    interval = cfg.anchor_interval
    anchors = level0[::interval]
    anchor_par = exact_parents(lifted, anchors, uppers)  # [H, nA]
    up = lifted[:, torch.from_numpy(uppers)]  # [H, nu, d+1]
    anchor_sim = (lifted[:, torch.from_numpy(anchors)] * up.gather(
        1, anchor_par.unsqueeze(-1).expand(-1, -1, up.shape[-1]))).sum(-1)
    max_child = torch.full((heads, len(uppers)), float("-inf"))
    max_child.scatter_reduce_(1, anchor_par, m2[:, None] - anchor_sim, reduce="amax")

    cand = torch.from_numpy(_anchor_candidates(anchor_par.numpy(), cfg.anchor_window, len(uppers)))
    blocks = torch.from_numpy(_blocked_nonanchors(level0, interval))  # [nA, I-1]
    result = torch.empty(heads, len(level0), dtype=torch.int64)
    result[:, ::interval] = anchor_par
    block_rows = max(1, _CHUNK_ELEMS // max(1, heads * blocks.shape[1] * max(1, cand.shape[-1])))
    fallback = []
    for j0 in range(0, blocks.shape[0], block_rows):
        blk = blocks[j0:j0 + block_rows]
        cnd = cand[:, j0:j0 + block_rows]  # [H, b, C]
        pts = lifted[:, blk.clamp_min(0)]  # [H, b, I-1, d+1]
        ckeys = up[torch.arange(heads)[:, None, None], cnd.clamp_min(0)]  # [H, b, C, d+1]
        sim = pts @ ckeys.transpose(-1, -2)  # [H, b, I-1, C]
        sim.masked_fill_((cnd < 0).unsqueeze(2), float("-inf"))
        best_sim, best_c = sim.max(-1)
        par = cnd.gather(2, best_c)  # [H, b, I-1]
        dist = m2[:, None, None] - best_sim
        bad = dist > cfg.anchor_threshold * max_child.gather(1, par.flatten(1)).view_as(par)
        # local -> position in level0: block j, column c -> j * interval + c + 1
        pos = (torch.arange(j0, j0 + blk.shape[0])[:, None] * interval
               + torch.arange(1, interval)[None, :])
        valid = blk >= 0
        pos_v = pos[valid]
        result[:, pos_v] = par[:, valid]
        fallback.append(pos_v[bad[:, valid].any(0)])
    redo = torch.cat(fallback) if fallback else torch.empty(0, dtype=torch.int64)
    if redo.numel():
        redo_np = redo.numpy()
        result[:, redo] = exact_parents(lifted, level0[redo_np], uppers)
    return result


def assign_parents(lifted: torch.Tensor, m2: torch.Tensor, level: np.ndarray,
                   cfg: DCIConfig) -> np.ndarray:
    """Parent node index of every token for every head: int32 ``[H, n]`` (0 = virtual root).

    Exact brute force over the upper level whatever its size (the official code switches to an
    approximate top-down search above ``exact_parent_threshold`` upper points; see the package
    docstring), with the anchor shortcut at a level 0 larger than ``exact_parent_threshold``.
    """
    heads, n = lifted.shape[:2]
    parent = np.zeros((heads, n), dtype=np.int32)
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
