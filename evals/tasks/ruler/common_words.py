"""Common words extraction, CWE (NVIDIA/RULER ``scripts/data/synthetic/common_words_extraction.py``)."""
from __future__ import annotations

import random

from .cell import Cell


class CommonWords:
    """``common_words_extraction.py``: a numbered word list where 10 words repeat ``freq_cw`` times."""

    def __init__(self, cell: Cell, freq_cw: int, freq_ucw: int, num_cw: int, num_fewshot: int):
        self.cell, self.num_cw, self.num_fewshot = cell, num_cw, num_fewshot
        self.freq_cw, self.freq_ucw = freq_cw, freq_ucw

    def example(self, num_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        words = self.cell.res.cwe_words
        pool = words if num_words <= len(words) else self.cell.res.english_words
        chosen = self.cell.rng.sample(pool, num_words)
        common, uncommon = chosen[:self.num_cw], chosen[self.num_cw:]
        word_list = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(self.cell.seed).shuffle(word_list)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common

    def build(self, num_words: int) -> tuple[str, list[str]]:
        small = self.cell.length < 4096
        shots = [self.example(20, 3, 1) if small else self.example(40, 10, 3) for _ in range(self.num_fewshot)]
        context, answer = (self.example(num_words, 6, 1) if small
                           else self.example(num_words, self.freq_cw, self.freq_ucw))
        template = self.cell.template
        shots_text = "\n".join(template.format(num_cw=self.num_cw, context=c, query="") + " "
                               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in shots)
        return shots_text + "\n" + template.format(num_cw=self.num_cw, context=context, query=""), answer

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        cell, incremental = self.cell, 10
        n = cell.haystack_size(lambda m: self.build(m)[0], incremental, probe=4096,
                               upper=lambda per_word: int(cell.length // per_word) * 2)
        return [cell.step_down(self.build, n, incremental) for _ in range(num)]
