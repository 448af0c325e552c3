"""The RULER suite: one sample per (task, length, index) from the generators, scored by the official metrics."""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import version
from typing import Iterator

import numpy as np

from ...task import Sample, Suite, chat_text
from .cell import Cell
from .common_words import CommonWords
from .constants import DATA_FILES, GROUPS, TASKS, TEMPLATES
from .freq_words import FrequentWords
from .metrics import postprocess, string_match_all, string_match_part
from .niah import Niah
from .qa import QA
from .resources import Resources
from .templates import RULER_TEMPLATES, ruler_wrapper
from .variable_tracking import VariableTracking

log = logging.getLogger(__name__)
_MARKER = "@@RULER_TASK_TEMPLATE@@"

GENERATORS = {"niah": Niah, "variable_tracking": VariableTracking, "common_words_extraction": CommonWords,
              "freq_words_extraction": FrequentWords, "qa": QA}


def _needed_files(task: str) -> list[str]:
    generator, args = TASKS[task]
    if generator == "qa":
        return [DATA_FILES[args["dataset"]]]
    return [DATA_FILES["essay"]] if args.get("type_haystack") == "essay" else []


# ------------------------------------------------------------------------------------------------ suite
@dataclass
class RulerOptions:
    """RULER options; in a run, ``model_template`` and ``chat_template_kwargs`` follow the model
    (``conf/model/<model>.yaml`` ``prompt:``, :attr:`Ruler.model_links`)."""

    lengths: list[int] = field(default_factory=lambda: [4096])  # target tokens per sample, generation included
    num_samples: int = 25  # per task per length (official: 500); `limit` caps it
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # qa_2 is skipped when HotpotQA is absent
    model_template: str = "auto"  # a RULER template name, chat (the tokenizer's) or auto (chat if any, else base)
    chat_template_kwargs: dict | None = None  # for model_template=chat (Qwen3: enable_thinking=false)
    token_count: str = "official"  # official: counted without special tokens | exact: the ids fed


class Ruler(Suite):
    """RULER suite. Options: ``lengths`` (target tokens, ``tokens_to_generate`` included), ``num_samples``
    per task per length (``limit`` caps it), ``tasks`` (default: all 13), ``model_template``: ``auto``
    (the tokenizer's chat template when it has one, else ``base``), ``chat``, or a RULER template name
    (``base``, ``meta-llama3``, ``meta-chat``, ``vicuna-chat``, ...), ``chat_template_kwargs`` (for ``chat``)
    and ``token_count`` (``official`` | ``exact``).
    Sample ids: ``<task>-<length>-<index>``."""

    name = "ruler"
    needs_data = True
    Options = RulerOptions
    model_links = {"model_template": "${model.prompt.ruler}",
                   "chat_template_kwargs": "${model.prompt.chat_template_kwargs}"}

    def configure(self, lengths, num_samples, tasks, model_template, chat_template_kwargs, token_count) -> None:
        tokenizer = self.tokenizer
        self.lengths = [int(n) for n in lengths]
        self.tasks = list(tasks) if tasks else list(TASKS)
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown RULER task(s) {unknown}; valid: {', '.join(TASKS)}")
        if not self.lengths or any(n > self.max_length for n in self.lengths):
            raise ValueError(f"RULER lengths {self.lengths} must be non-empty and at most the model's maximum of "
                             f"{self.max_length} tokens")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if token_count not in ("official", "exact"):
            raise ValueError(f"RULER token_count must be official or exact, got {token_count!r}")
        self.num_samples = min(num_samples, self.limit) if self.limit else num_samples
        self.model_template = _model_template(model_template, bool(getattr(tokenizer, "chat_template", None)))
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.token_count = token_count
        self.skipped: dict[str, str] = {}
        self._check_data()
        self.res = Resources(self)

    def _check_data(self) -> None:
        for task in self.tasks:
            for rel in _needed_files(task):
                if task == "qa_2" and (self.data_dir is None or not (self.data_dir / rel).exists()):
                    where = self.data_dir / rel if self.data_dir else f"<data_dir>/{rel}"
                    self.skipped[task] = (f"RULER qa_2 skipped: HotpotQA not found at {where}; download "
                                          "hotpot_dev_distractor_v1.json (RULER download_qa_dataset.sh) to that path")
                    log.warning(self.skipped[task])
                else:
                    self.require_file(rel)

    @cached_property
    def wrapper(self) -> tuple[str, str]:
        """(head, tail) of the model template around the task template, braces escaped for ``str.format``."""
        if self.model_template in RULER_TEMPLATES:
            head, tail = ruler_wrapper(self.model_template)
        else:
            rendered = chat_text(self.tokenizer, _MARKER, None, self.chat_template_kwargs)
            if rendered.count(_MARKER) != 1:
                raise ValueError("the tokenizer's chat template does not keep the user message verbatim")
            head, tail = rendered.split(_MARKER)
        return tuple(s.replace("{", "{{").replace("}", "}}") for s in (head, tail))

    def template(self, task: str) -> str:
        generator, args = TASKS[task]
        task_template, prefix = TEMPLATES[generator]["template"], TEMPLATES[generator]["answer_prefix"]
        if generator == "niah" and args["num_needle_q"] * args["num_needle_v"] == 1:
            task_template, prefix = (_singular(t) for t in (task_template, prefix))
        head, tail = self.wrapper
        return head + task_template + tail + prefix

    def encode(self, text: str) -> list[int]:
        """The ids fed to the model: RULER's templates through ``tokenizer(text)`` (the official HF client),
        the tokenizer's chat text (which carries its own BOS) without extra special tokens."""
        return self.tokenizer(text, add_special_tokens=self.model_template != "chat")["input_ids"]

    def count(self, text: str) -> int:
        """Prompt tokens for the length fit: RULER's counter (no special tokens) or the exact ids fed."""
        if self.token_count == "official":
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return len(self.encode(text))

    def generate(self, task: str, length: int, num: int) -> list[tuple[str, list[str], int]]:
        """(prompt text incl. answer prefix, references, haystack units) for one (task, length) cell."""
        generator, args = TASKS[task]
        cell = Cell(task, length, self.seed, self.template(task), TEMPLATES[generator]["tokens_to_generate"],
                    self.count, self.res)
        return GENERATORS[generator](cell, **args).samples(num)

    def n_total(self) -> int:
        """``num_samples`` per task (those not skipped) per length: the samples without ``limit``."""
        return len([t for t in self.tasks if t not in self.skipped]) * len(self.lengths) * self.options.num_samples

    def samples(self) -> Iterator[Sample]:
        """``num_samples`` (``limit`` caps it) per task per length: a limited run spreads over every task and
        length; the first of a cell's samples, as each is an independent draw of its generator."""
        ww = version("wonderwords")
        for length in self.lengths:
            for task in self.tasks:
                if task in self.skipped:
                    continue
                generator = TASKS[task][0]
                spec = TEMPLATES[generator]
                for i, (text, answers, units) in enumerate(self.generate(task, length, self.num_samples)):
                    ids = self.encode(text)
                    yield Sample(id=f"{task}-{length}-{i}", task=task, prompt_ids=ids,
                                 max_new_tokens=spec["tokens_to_generate"], reference=answers,
                                 meta={"length": length, "n_tokens": len(ids), "haystack_units": units,
                                       "answer_prefix": text[text.rfind(spec["answer_prefix"][:10]):],
                                       "model_template": self.model_template, "token_count": self.token_count,
                                       "wonderwords": ww})

    def needle_texts(self, sample: Sample) -> list[str]:
        """The values of the needles the query asks for (niah tasks; the distractor needles are not followed)."""
        return [str(v) for v in sample.reference] if TASKS[sample.task][0] == "niah" else []

    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        pred = postprocess(prediction)
        metric = string_match_part if TASKS[sample.task][0] == "qa" else string_match_all
        return {"score": metric(pred, sample.reference), "null": float(pred == "")}

    def aggregate(self, rows: list[dict]) -> dict:
        """Per length: task scores ``round(100 * mean, 2)`` and their mean; overall: each task's mean over
        lengths, ``score`` = mean over tasks; ``groups`` = means of the NIAH/QA variants present."""
        cells: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for row in rows:
            cells[int(row["meta"]["length"])][row["task"]].append(row["scores"])
        lengths = {}
        for length, tasks in sorted(cells.items()):
            per_task = {t: round(100 * float(np.mean([s["score"] for s in v])), 2) for t, v in tasks.items()}
            lengths[str(length)] = {"score": float(np.mean(list(per_task.values()))), "tasks": per_task,
                                    "nulls": {t: float(np.mean([s["null"] for s in v])) for t, v in tasks.items()}}
        names = [t for t in TASKS if any(t in c["tasks"] for c in lengths.values())]
        tasks = {t: float(np.mean([c["tasks"][t] for c in lengths.values() if t in c["tasks"]])) for t in names}
        groups = {g: float(np.mean([tasks[t] for t in members if t in tasks]))
                  for g, members in GROUPS.items() if any(t in tasks for t in members)}
        return {"score": float(np.mean(list(tasks.values()))) if tasks else 0.0, "tasks": tasks, "groups": groups,
                "lengths": lengths, "n_samples": len(rows), "skipped": dict(self.skipped)}


def _model_template(name: str, has_chat: bool) -> str:
    """``auto`` -> ``chat`` (tokenizer template) or ``base``; ``chat`` needs a chat template; else a RULER name."""
    if name == "auto":
        return "chat" if has_chat else "base"
    if name == "chat":
        if not has_chat:
            raise ValueError("model_template=chat but the tokenizer has no chat template")
        return name
    if name not in RULER_TEMPLATES:
        raise ValueError(f"model_template must be auto, chat or one of RULER's templates "
                         f"({', '.join(RULER_TEMPLATES)}), got {name!r}")
    return name


def _singular(text: str) -> str:
    """NIAH with one query and one value: RULER's ``str.replace`` rewrite to the singular."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text
