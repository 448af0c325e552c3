"""Plain torch reference of M-DCI's inner product -> Euclidean transform (official ``src/dci.c``, transform and
projection), which the index's numba kernels (``icecache/dci/_search.py``) compute inline; the tests check
the kernels against it.

Keys are lifted to ``T_K(k) = [k ; sqrt(M^2 - ||k||^2)]`` (norm ``M``) and queries to
``T_Q(q) = [q / ||q|| ; 0]`` (norm 1), so ``||T_Q(q) - T_K(k)||^2 = 1 + M^2 - 2 q.k / ||q||``
decreases in ``q.k``: Euclidean nearest neighbours of ``T_Q(q)`` are the keys of largest inner
product. ``M^2`` is the running maximum of ``||k||^2`` of one head. All functions work in fp32 and
broadcast over leading (head) axes.
"""

from __future__ import annotations

import math

import torch


def sq_norms(keys: torch.Tensor) -> torch.Tensor:
    """Squared norms ``||k||^2`` in fp32, shape ``keys.shape[:-1]``."""
    keys = keys.float()
    return (keys * keys).sum(-1)


def lift_height(sq: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """The extra coordinate ``sqrt(M^2 - ||k||^2)`` (clamped at 0 against round-off)."""
    return (m2 - sq).clamp_min(0.0).sqrt()


def transform_keys(keys: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """``T_K``: ``[..., n, d] -> [..., n, d+1]``; ``m2`` has shape ``[...]`` (one value per head)."""
    keys = keys.float()
    height = lift_height(sq_norms(keys), m2.unsqueeze(-1))
    return torch.cat([keys, height.unsqueeze(-1)], dim=-1)


def transform_queries(queries: torch.Tensor) -> torch.Tensor:
    """``T_Q``: ``[..., d] -> [..., d+1]``, unit norm, last coordinate 0."""
    queries = queries.float()
    unit = queries / queries.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return torch.cat([unit, torch.zeros_like(unit[..., :1])], dim=-1)


def key_key_distance(a: torch.Tensor, b: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """``D(a, b) = ||T_K(a) - T_K(b)||^2 / 2 = M^2 - a.b - sqrt((M^2-|a|^2)(M^2-|b|^2))``.

    ``a``: ``[H, n, d]``, ``b``: ``[H, m, d]``, ``m2``: ``[H]`` -> ``[H, n, m]``. Used for parent
    assignment (the nearest upper-level point under ``D`` becomes the parent, ``src/dci.c`` construction).
    """
    ta, tb = transform_keys(a, m2), transform_keys(b, m2)
    return m2[:, None, None] - ta @ tb.transpose(-1, -2)


def key_projection(keys: torch.Tensor, u: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """``p(k) = u_{1:d}.k + u_{d+1} sqrt(M^2 - ||k||^2)`` (``src/dci.c``), shape ``keys.shape[:-1]``."""
    return transform_keys(keys, m2) @ u


def query_projection(queries: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``p(q) = u_{1:d}.q / ||q||`` (``src/dci.c``)."""
    return transform_queries(queries) @ u


def search_pages(index, keys: torch.Tensor, q: torch.Tensor, head: int, k_pages: int, fov: int,
                 rule: str) -> list[int]:
    """Plain reference of the top-down page search for one query of KV head ``head`` when every child of an
    expanded node is scored (``prop_to_retrieve = 1``), built from
    the tree alone (each token's level, parent and page) and fp64 scores ``q.k``: per upper level, the children of
    the kept nodes ranked by score, keeping at least ``min(fov, found)`` and enough to reach ``k_pages`` level-0
    pages below them. ``rule="scored"``: every scored token ranks its page; ``"official"`` (the C code's
    ``add_to_list``): the kept tokens of each upper level and the ``k_pages`` best children of each kept
    level-1 node. Returns the ranked pages, best first (by their best candidate's score)."""
    level = torch.as_tensor(index.level[: index.n]).long()
    parent = index.token_parent[head] + 1  # node ids: 0 = virtual root, i + 1 = token i
    page = index.token_page[head]
    score = (keys[head].double() @ q.double()).tolist()
    children: dict[int, list[int]] = {}
    for t in range(index.n):
        children.setdefault(int(parent[t]), []).append(t)
    leaf_pages: dict[int, int] = {}  # node -> level-0 pages below it

    def pages_below(node: int) -> int:
        if node not in leaf_pages:
            kids = children.get(node, [])
            if kids and int(level[kids[0]]) == 0:
                leaf_pages[node] = len({int(page[t]) for t in kids})
            else:
                leaf_pages[node] = sum(pages_below(t + 1) for t in kids)
        return leaf_pages[node]

    best: dict[int, float] = {}

    def rank(tokens):
        for t in tokens:
            best[int(page[t])] = max(best.get(int(page[t]), -math.inf), score[t])

    kept = [0]
    top = int(level.max())
    for _ in range(top):  # levels top .. 1: their nodes are expanded into the level below
        found = sorted((t for node in kept for t in children.get(node, [])), key=lambda t: -score[t])
        n_kept = min(fov, len(found))
        while sum(pages_below(t + 1) for t in found[:n_kept]) < k_pages and n_kept < len(found):
            n_kept += 1
        rank(found if rule == "scored" else found[:n_kept])
        kept = [t + 1 for t in found[:n_kept]]
    for node in kept:  # level 0
        kids = sorted(children.get(node, []), key=lambda t: -score[t])
        rank(kids if rule == "scored" else kids[:k_pages])
    return sorted(best, key=lambda p: -best[p])
