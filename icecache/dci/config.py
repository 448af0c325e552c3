"""Hyper-parameters of the M-DCI index (defaults = the official IceCache scripts and M-DCI's bf16 branch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DCIConfig:
    """Configuration of one layer's M-DCI index.

    Attributes:
        page_size: tokens per page = B+-tree leaf capacity (``BTREE_LEAF_MAX_NUM_SLOTS``, ``src/dci.c`` construction).
        ratio_1: promotion ratio from level 0 to level 1 (``p_0``, ``src/dci.c`` construction; 0.01 in the scripts).
        ratio_2: promotion ratio between higher levels (``p_{t>=1}``, ``src/dci.c`` construction).
        promotion: ``"deterministic"`` (positional rule of the official code, ``src/dci.c`` construction) or
            ``"random"`` (geometric coin flips with a seeded generator).
        search_ratio: the query's field of view is ``max(floor(n * search_ratio), min_fov)`` (``dci_query``).
        min_fov: lower bound of the field of view (30, ``dci_query``).
        prop_to_retrieve: share of an expanded node's children scored exactly, picked by projection
            proximity to the query (0.8, ``dci_query``), in chunks of ``visit_chunk``.
        visit_chunk: children are visited in runs of up to this many around ``p(q)`` (``CLOSEST`` =
            128 in the C code's ``dci_next_closest_proj``): a node with at most 128 children is scored
            in full, a larger one in multiples of 128 until ``prop_to_retrieve`` is reached. 1 scores
            exactly the ``ceil(prop_to_retrieve * c)`` children closest in projection.
        candidate_rule: which scored tokens rank their pages in the result. ``"scored"`` (default): every
            token the search scores, upper levels included; ``"official"``: the C code's rule (``dci.c``,
            ``dci_query_single_point`` with ``add_to_list``): the kept prefix of each upper level and the
            ``K`` best scored children of each expanded level-1 node. The default's candidates are a
            superset; on captured SmolLM2 keys they raise the attention recall (docs/fidelity.md, "IceCache and
            IceCache(reuse)").
        exact_parent_threshold: parents are found by exact brute force while the upper level has at
            most this many points (``numa_threshold`` = 3000, ``src/dci.c`` construction).
        anchor_interval: every ``anchor_interval``-th level-0 point is an anchor (60, bf16 branch).
        anchor_window: anchors looked at on each side of a level-0 point (``X`` = 60).
        anchor_threshold: a point keeps its anchor-derived parent ``P`` if
            ``D <= anchor_threshold * maxchilddist(P)`` (1.02), else it falls back to the full search.
        use_anchors: use the anchor shortcut at level 0 when it holds more than
            ``exact_parent_threshold`` points (``src/dci.c`` anchors).
        key_storage: how the index stores its copy of the keys: ``"auto"`` (default) keeps bf16 keys in
            bf16 (their raw bits, read as fp32 by the kernels: every score is the same as with an fp32 copy,
            at half the memory and half the bytes the search reads) and other dtypes in fp32; ``"float32"``
            always stores fp32.
        seed: seeds the projection direction ``u`` and random promotion.
    """

    page_size: int = 16
    ratio_1: float = 0.01
    ratio_2: float = 0.2
    promotion: str = "deterministic"
    search_ratio: float = 1.5e-3
    min_fov: int = 30
    prop_to_retrieve: float = 0.8
    visit_chunk: int = 128
    candidate_rule: str = "scored"
    exact_parent_threshold: int = 3000
    anchor_interval: int = 60
    anchor_window: int = 60
    anchor_threshold: float = 1.02
    use_anchors: bool = True
    key_storage: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.promotion not in ("deterministic", "random"):
            raise ValueError(f"promotion must be 'deterministic' or 'random', got {self.promotion!r}")
        if self.page_size < 2:
            raise ValueError("page_size must be >= 2 (a full page splits in half)")
        if not (0.0 < self.ratio_1 < 1.0 and 0.0 < self.ratio_2 < 1.0):
            raise ValueError("promotion ratios must lie in (0, 1)")
        if self.candidate_rule not in ("scored", "official"):
            raise ValueError(f"candidate_rule must be 'scored' or 'official', got {self.candidate_rule!r}")
        if self.key_storage not in ("auto", "float32"):
            raise ValueError(f"key_storage must be 'auto' or 'float32', got {self.key_storage!r}")
        if self.visit_chunk < 1:
            raise ValueError("visit_chunk must be >= 1")
        if not 0.0 < self.prop_to_retrieve <= 1.0:
            raise ValueError("prop_to_retrieve must lie in (0, 1]")

    def fov(self, n_seq: int) -> int:
        """Field of view of a query at sequence length ``n_seq`` (``dci_query``)."""
        return max(int(n_seq * self.search_ratio), self.min_fov)
