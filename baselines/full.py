"""Full cache: every past token is kept and attended. The reference every method must equal when its
budget covers the whole context."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from icecache.kv import KVMethod


@dataclass(frozen=True)
class FullCache(KVMethod):
    """Keeps the whole KV cache resident. ``budget`` is ignored (logged as ``None``)."""

    name: ClassVar[str] = "full"
    needs_budget: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", None)  # construction: no budget, full attention in every layer
        super().__post_init__()
