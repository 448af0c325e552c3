"""Question answering over SQuAD / HotpotQA documents (NVIDIA/RULER ``scripts/data/synthetic/qa.py``)."""
from __future__ import annotations

import random

from .cell import Cell
from .constants import DOCUMENT_PROMPT


class QA:
    """``qa.py``: the gold paragraph(s) of question *i* among distractors, shuffled, as numbered documents."""

    def __init__(self, cell: Cell, dataset: str):
        self.cell = cell
        self.qas, self.docs = cell.res.qa(dataset)

    def build(self, index: int, num_docs: int) -> tuple[str, list[str]]:
        qa, docs = self.qas[index], self.docs
        gold, more = qa["context"], qa.get("more_context", [])
        if num_docs < len(docs):
            if num_docs - len(gold) > len(more):
                extra = [i for i, _ in enumerate(docs) if i not in gold + more]
                chosen = gold + more + self.cell.rng.sample(extra, max(0, num_docs - len(gold) - len(more)))
            else:
                chosen = gold + self.cell.rng.sample(more, num_docs - len(gold))
            all_docs = [docs[i] for i in chosen]
        else:
            all_docs = (docs * ((num_docs + len(docs) - 1) // len(docs)))[:num_docs]
        random.Random(self.cell.seed).shuffle(all_docs)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(all_docs))
        return self.cell.template.format(context=context, query=qa["query"]), qa["outputs"]

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        cell, incremental = self.cell, 10
        if num > len(self.qas):
            raise ValueError(f"RULER {cell.task}: {num} samples requested but the data has {len(self.qas)} questions")
        n = cell.haystack_size(lambda m: self.build(0, m)[0], incremental)
        return [cell.step_down(lambda m, i=i: self.build(i, m), n, incremental) for i in range(num)]
