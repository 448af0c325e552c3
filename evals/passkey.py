"""Passkey retrieval (reference/evals.md §1): the Quest-style generator, seeded.

Prompt (joined by newlines): the task description, a garbage prefix, the pass-key line, a garbage
suffix, and the final question. The garbage is one sentence repeated; prefix and suffix are cut from
its start. Lengths are *token* targets (the garbage is sized with the model's tokenizer so the prompt
has about that many tokens); depths are the needle's relative position.

Where the final question goes (``question_via_decode``):
- ``False`` (default): appended to the prompt and prefilled, as IceCache's official ``passkey_pred.py``
  does (the ArkVale script; its ``--use-3-stages-gen`` flag is off by default, reference/icecache.md §6.1).
  Only the answer tokens are decoded under the budget.
- ``True``: fed token by token through the decode path, as Quest does (and ArkVale's optional 3-stage
  generation), so the question tokens' hidden states are also computed under the budget. This is much
  harder for a small model: on SmolLM2-135M at 2k tokens and budget 64 the exact top-k oracle drops from
  10/10 to 7/10 and IceCache from 10/10 to 0/10 (docs/benchmarks.md), while full stays at 10/10.

Score: the first integer of the output equals the pass key. Each sample's RNG is
``random.Random(seed + 1000 * length_idx + depth_idx)``.
"""
from __future__ import annotations

import random
import re
from typing import Iterator

from .base import Sample, Suite

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


class Passkey(Suite):
    name = "passkey"

    def __init__(self, tokenizer, lengths=(2048, 4096), depths: int | list[float] = 10,
                 question_via_decode: bool = False, max_new_tokens: int = 10, **common):
        super().__init__(tokenizer, **common)
        self.lengths = [int(n) for n in lengths]
        self.depths = ([i / depths for i in range(depths)] if isinstance(depths, int) else [float(d) for d in depths])
        if not self.lengths or min(self.lengths) < 64 or not self.depths:
            raise ValueError("passkey needs lengths >= 64 tokens and at least one depth")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"passkey depths must lie in [0, 1], got {self.depths}")
        for n in self.lengths:
            if n > self.max_length:
                raise ValueError(f"passkey length {n} exceeds the model's maximum of {self.max_length} tokens; "
                                 f"use eval.lengths=[...] up to {self.max_length}")
        self.question_via_decode = question_via_decode
        self.max_new_tokens = max_new_tokens
        self._chars_per_token = len(GARBAGE) / len(tokenizer(GARBAGE, add_special_tokens=False)["input_ids"])

    def build_prompt(self, n_garbage: int, depth: float, pass_key: int) -> str:
        garbage = " ".join([GARBAGE] * (n_garbage // len(GARBAGE) + 2))
        n_prefix = int(n_garbage * depth)
        info = f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
        return "\n".join([TASK, garbage[:n_prefix], info, garbage[: n_garbage - n_prefix], QUESTION])

    def fit(self, target: int, depth: float, pass_key: int) -> list[int]:
        """Token ids of the prompt whose length is closest to ``target`` (garbage sized in characters)."""
        n_garbage = int(target * self._chars_per_token)
        for _ in range(4):
            ids = self.tokenizer(self.build_prompt(n_garbage, depth, pass_key))["input_ids"]
            if abs(len(ids) - target) <= 8:
                break
            n_garbage = max(0, n_garbage + int((target - len(ids)) * self._chars_per_token))
        return ids

    def samples(self) -> Iterator[Sample]:
        n_question = len(self.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
        for li, length in enumerate(self.lengths):
            for di, depth in enumerate(self.depths[: self.limit]):
                pass_key = random.Random(self.seed + 1000 * li + di).randint(1, 50000)
                ids = self.fit(length, depth, pass_key)
                split = len(ids) - n_question if self.question_via_decode else len(ids)
                yield Sample(id=f"passkey-{length}-{depth:.3f}", task=f"passkey_{length}", prompt_ids=ids[:split],
                             decode_ids=ids[split:], max_new_tokens=self.max_new_tokens, reference=str(pass_key),
                             meta={"length": length, "depth": depth, "n_tokens": len(ids)})

    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        found = re.search(r"\d+", prediction)
        return {"score": float(found is not None and found.group(0) == sample.reference)}
