"""IceCache with this project's small-budget choices, the registered variant ``icecache_tuned`` of
:class:`~icecache.method.IceCache` (official configuration by default)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from icecache.method import IceCache


@dataclass
class IceCacheTuned(IceCache):
    """IceCache with this project's small-budget choices (``cache=icecache_tuned``), a registered variant of
    :class:`IceCache`. Each field it changes (:attr:`deviations`), with the measurement behind it
    (docs/benchmarks.md, "IceCache at small budgets"; SmolLM2-135M, 2k-4k-token prompts, chosen on passkey
    seeds 0-2 and RULER seed 0, checked on passkey seeds 3-5 and RULER seed 1):

    - ``page_size``: 8 below 256 tokens (64 = 2 sink + 4 retrieved + 2 window pages of 8; 128 = 2 + 12 + 2),
      the official 16 from 256 on. RULER 4k niah at 64 tokens (5 tasks x 8 samples): 16-token pages 18.2, 8-token
      pages 52.4 (both ``prop_to_retrieve=0.8``; full 66.2): with one retrieved page of 16 a needle written one
      token per digit straddles pages and the rank-interleaved merge serves only the group's first query head.
    - ``prop_to_retrieve``: 1.0 (official 0.8), every child of an expanded node scored. RULER niah at 64: 60.4
      against 52.4; passkey at 64, seeds 1-2: 40/40 against 29/31; RULER 4k (12 tasks x 16) at 256: 0.957 of full
      against 0.917. No measurable search cost (nodes of more than 128 children are rare).
    - ``candidate_rule``: ``"scored"`` (every scored key ranks its page; a superset of the C rule's candidates):
      attention-mass recall on captured 4k keys +0.011 at 128 tokens, +0.002 at 256, 0 at 64 and 512.
    - ``short_prompt``: ``"offload"``: a prompt within the budget is offloaded once its context exceeds the budget,
      so the budget holds for every prompt (the official code attends the whole short prompt and the tokens
      generated after it, over the budget).
    - ``prefill_pipeline``: ``"overlap"``: the index builds never block the prefill (TTFT excludes them; at 8k on
      2 cores the official backpressure cost about 1 s, within the run-to-run spread).
    - ``projection``: ``"seeded"``: one projection direction for every prompt, the configuration the numbers above
      were measured with.
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
            self.page_size = 8 if 0 < self.budget < 256 else 16
        super().__post_init__()
