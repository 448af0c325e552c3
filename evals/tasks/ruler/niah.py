"""NIAH, the needle-in-a-haystack family (NVIDIA/RULER ``scripts/data/synthetic/niah.py``)."""
from __future__ import annotations

import random
import uuid

from ...task import GARBAGE
from .cell import Cell
from .constants import DEPTHS, NEEDLE


class Niah:
    """``niah.py``: needles ``NEEDLE`` in a noise, essay or distractor-needle haystack."""

    def __init__(self, cell: Cell, type_haystack, type_needle_k, type_needle_v, num_needle_k, num_needle_v,
                 num_needle_q):
        self.cell, self.haystack = cell, type_haystack
        self.type_k, self.type_v = type_needle_k, type_needle_v
        self.num_k, self.num_v, self.num_q = max(num_needle_k, num_needle_q), num_needle_v, num_needle_q

    def random(self, kind: str) -> str:
        rng = self.cell.rng
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return rng.choice(self.cell.res.adj_noun_words)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def build(self, num_haystack: int) -> tuple[str, list[str]]:
        rng = self.cell.rng
        keys, values, needles = [], [], []
        for _ in range(self.num_k):
            keys.append(self.random(self.type_k))
            value = []
            for _ in range(self.num_v):
                value.append(self.random(self.type_v))
                needles.append(NEEDLE.format(type_needle_v=self.type_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(self.cell.seed).shuffle(needles)
        if self.haystack == "essay":
            context = self.essay_context(num_haystack, needles)
        else:
            if self.haystack == "noise":
                sentences = [GARBAGE] * num_haystack
            else:
                sentences = [NEEDLE.format(type_needle_v=self.type_v, key=self.random(self.type_k),
                                           value=self.random(self.type_v)) for _ in range(num_haystack)]
            for index, element in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
                sentences.insert(index, element)
            context = "\n".join(sentences)
        indices = rng.sample(range(self.num_k), self.num_q)
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        type_v = self.type_v[:-1] if self.num_q * self.num_v == 1 else self.type_v
        return self.cell.template.format(type_needle_v=type_v, context=context, query=query), answers

    def essay_context(self, num_haystack: int, needles: list[str]) -> str:
        sents = self.cell.res.essay_sentences(num_haystack)
        positions = ([0] + sorted(int(len(sents) * (d / 100)) for d in self.cell.rng.sample(DEPTHS, len(needles)))
                     + [len(sents)])
        parts = []
        for i in range(1, len(positions)):
            parts.append(" ".join(sents[positions[i - 1]:positions[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        cell = self.cell
        incremental = 500 if self.haystack == "essay" else (5 if cell.length < 4096 else 25)
        n = cell.haystack_size(lambda m: self.build(m)[0], incremental)
        return [cell.step_down(self.build, n, incremental) for _ in range(num)]
