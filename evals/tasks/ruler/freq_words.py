"""Frequent words extraction, FWE (NVIDIA/RULER ``scripts/data/synthetic/freq_words_extraction.py``).

FWE has no haystack search: it grows or shrinks the coded text by ``max_len // 32`` words, as upstream."""
from __future__ import annotations

import random
import string

import numpy as np

from .cell import Cell


class FrequentWords:
    """``freq_words_extraction.py``: Zipf(``alpha``)-distributed coded words; the answer is ranks 2-4
    (rank 1 is the noise word '...')."""

    def __init__(self, cell: Cell, alpha: float, coded_wordlen: int):
        import mpmath  # scipy.special.zeta's value for real alpha > 1

        self.cell, self.alpha, self.wordlen = cell, alpha, coded_wordlen
        self.zeta = float(mpmath.zeta(alpha))

    def vocabulary(self, size: int) -> list[str]:
        rng = self.cell.rng
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=self.wordlen)) for _ in range(size)]
        while len(set(vocab)) < size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=self.wordlen)))
        vocab = sorted(set(vocab))
        random.Random(self.cell.seed).shuffle(vocab)
        vocab[0] = "..."
        return vocab

    def text(self, vocab: list[str], num_words: int) -> tuple[str, list[str]]:
        counts = (num_words * (np.arange(1, len(vocab) + 1) ** -self.alpha) / self.zeta).astype(int)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(self.cell.seed).shuffle(words)
        return self.cell.template.format(context=" ".join(words), query=""), vocab[1:4]

    def generate(self, max_len: int, vocab_size: int, num_words: int = -1) -> tuple[str, list[str], int]:
        vocab, count, step = self.vocabulary(vocab_size), self.cell.count, max_len // 32
        if num_words > 0:
            text, answer = self.text(vocab, num_words)
            while count(text) > max_len:
                num_words -= step
                text, answer = self.text(vocab, num_words)
        else:
            num_words = max_len // self.wordlen
            text, answer = self.text(vocab, num_words)
            while count(text) < max_len:
                num_words += step
                text, answer = self.text(vocab, num_words)
            num_words -= step
        text, answer = self.text(vocab, num_words)
        return text, answer, num_words

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        max_len = self.cell.length - self.cell.tokens_to_generate
        vocab_size = max_len // 50
        if max_len // 32 < 1 or vocab_size < 4:
            raise ValueError(f"RULER fwe: length {self.cell.length} is too short")
        n = self.generate(max_len, vocab_size)[2]
        return [self.generate(max_len, vocab_size, n) for _ in range(num)]
