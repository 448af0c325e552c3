"""IceCache with this project's small-budget choices, the registered variant ``icecache_tuned`` of
:class:`~icecache.method.IceCache` (official configuration by default)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from icecache.method import IceCache


@dataclass(frozen=True)
class IceCacheTuned(IceCache):
    """IceCache with this project's small-budget choices (``cache=icecache_tuned``), a registered variant of
    :class:`IceCache`. The fields it changes (:attr:`deviations`); the scores behind each: docs/fidelity.md, "Why
    the variants' settings", and the tables of docs/results.md:

    - ``page_size``: 8 below 256 tokens (64 = 2 sink + 4 retrieved + 2 window pages of 8; 128 = 2 + 12 + 2),
      the official 16 from 256 on: with one retrieved page of 16 a needle written one token per digit straddles
      pages and the rank-interleaved merge serves only the group's first query head.
    - ``prop_to_retrieve``: 1.0 (official 0.8), every child of an expanded node scored (nodes of more than 128
      children, the only ones where it changes the work, are rare).
    - ``candidate_rule``: ``"scored"``: every scored key ranks its page, a superset of the C rule's candidates.
    - ``short_prompt``: ``"offload"``: a prompt within the budget is offloaded once its context exceeds the budget,
      so the budget holds for every prompt (the official code attends the whole short prompt and the tokens
      generated after it, over the budget).
    - ``prefill_pipeline``: ``"overlap"``: the index builds never block the prefill (TTFT excludes them).
    - ``projection``: ``"seeded"``: one projection direction for every prompt.
    """

    page_size: int | None = None  # resolved from the budget: 8 below 256 tokens, else 16
    prop_to_retrieve: float = 1.0
    candidate_rule: str = "scored"
    short_prompt: str = "offload"
    prefill_pipeline: str = "overlap"
    projection: str = "seeded"
    name: ClassVar[str] = "icecache_tuned"
    extends: ClassVar[str] = "icecache"  # the registered method whose official configuration this varies
    deviations: ClassVar[tuple] = ("page_size", "prop_to_retrieve", "candidate_rule", "short_prompt",
                                   "prefill_pipeline", "projection")

    def __post_init__(self) -> None:
        if self.page_size is None and self.budget is not None:
            object.__setattr__(self, "page_size", 8 if 0 < self.budget < 256 else 16)  # construction
        super().__post_init__()
