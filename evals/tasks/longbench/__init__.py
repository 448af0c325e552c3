"""LongBench v1 (Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding",
arXiv 2308.14508) with the official protocol of THUDM/LongBench ``pred.py`` / ``eval.py``,
on the 16 English tasks that KV-cache papers report (IceCache, PQCache, SnapKV, kvpress) plus, with ``chinese: true``, the 5 Chinese tasks.

Per sample (``pred.py``):
1. ``prompt = dataset2prompt[task].format(**row)``; templates and generation lengths are read from
   ``<data_dir>/longbench_config/dataset2prompt.json`` and ``dataset2maxlen.json`` (the official files).
2. Middle truncation: if the prompt tokenizes (special tokens included) to more than ``max_length``
   tokens, keep the first and last ``int(max_length / 2)`` tokens, decode each half with
   ``skip_special_tokens=True`` and concatenate the strings.
3. The chat wrapper is applied after truncation, except for trec, triviaqa, samsum, lsht, lcc and
   repobench-p. The wrapper is chosen per model (``conf/model/*.yaml`` ``prompt.longbench``; the names are
   :mod:`evals.tasks.longbench.templates`), as IceCache's ``IceCache/benchmark/longbench_pred.py``
   ``build_chat`` does:
   ``template`` = the tokenizer's chat template with an optional system turn and ``chat_template_kwargs``
   (Llama-3.1: PQCache's/IceCache's system "You are a helpful assistant."; the rendered text is tokenized
   again with special tokens, which reproduces their double BOS, ``chat_add_special_tokens: false`` turns that
   off; Qwen3: no system turn, ``enable_thinking=False``), ``inst`` = ``f"[INST]{prompt}[/INST]"`` (Mistral;
   official llama2), ``vicuna`` = FastChat's vicuna conversation (LongChat, official ``pred.py``),
   ``none`` = never wrap.
4. Greedy, ``max_new_tokens = dataset2maxlen[task]``; samsum stops at the "\\n" token (the last id of
   ``encode("\\n")``) and cannot stop before its first new token (``min_length = context + 1``). As ``pred.py``
   passes ``eos_token_id=[tokenizer.eos_token_id, newline]`` for samsum, which replaces the generation
   config's EOS list, samsum stops at the tokenizer's EOS and "\\n" only (``Sample.eos_token_ids``; on
   Llama-3.1 ``<|end_of_text|>`` and ``<|eom_id|>`` do not end a samsum answer); the other tasks stop at
   every EOS id of the generation config, as ``model.generate`` does.

Scoring (``metrics.py`` and ``eval.py``, :mod:`evals.tasks.longbench.metrics`): the first-line rule for trec/triviaqa/samsum/lsht,
then the task metric maximised over the reference answers; a task's score is ``round(100 * mean, 2)``
and ``score`` is the unweighted mean of the English task scores (the papers' "Avg.").

Data: the official jsonl per task at ``<data_dir>/<longbench_dir>/<task>.jsonl``. With the default
``longbench_dir`` and no ``<data_dir>/longbench`` folder, the 6-task sample ``longbench_sample`` is used
and the results say so (``data``). ``hf_dataset`` (e.g. ``THUDM/LongBench`` or the parquet copy
``Xnhyacinth/LongBench``) loads tasks whose file is missing through ``datasets`` where the hub is
reachable; it is off by default.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ...task import DataError, Sample, Suite, chat_text, count_jsonl, read_jsonl
from .metrics import score_prediction
from .templates import LONGBENCH_CHAT_FORMATS, inst_prompt, vicuna_prompt

ENGLISH_TASKS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report",
                 "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en",
                 "lcc", "repobench-p")
CHINESE_TASKS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
CLASSIFICATION_TASKS = frozenset({"trec", "lsht"})
CHAT_FORMATS = LONGBENCH_CHAT_FORMATS
REQUIRED_FIELDS = ("input", "context", "answers")
DEFAULT_DIR, SAMPLE_DIR, CONFIG_DIR = "longbench", "longbench_sample", "longbench_config"
HOW_TO_GET = ("available here: {available}. For other tasks unzip data/<task>.jsonl from "
              "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip into a folder you can write "
              "(e.g. ~/data/longbench) and pass eval.longbench_dir=/that/folder, or set "
              "eval.hf_dataset=THUDM/LongBench where the hub is reachable")

log = logging.getLogger(__name__)


@dataclass
class LongBenchOptions:
    """LongBench options; in a run, ``chat_format``, ``system_prompt`` and ``chat_template_kwargs`` follow the
    model (``conf/model/<model>.yaml`` ``prompt:``, :attr:`LongBench.model_links`)."""

    tasks: list[str] | None = None  # None: the 16 English tasks of the KV-cache papers
    chinese: bool = False  # true adds multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh
    longbench_dir: str = DEFAULT_DIR  # <data_dir>/<longbench_dir>/<task>.jsonl; else longbench_sample
    hf_dataset: str | None = None  # e.g. THUDM/LongBench: tasks with no local file through `datasets`
    chat_format: str = "template"  # template | inst ("[INST]{prompt}[/INST]") | vicuna (FastChat) | none
    system_prompt: str | None = "You are a helpful assistant."  # system turn of chat_format=template
    chat_add_special_tokens: bool = True  # tokenize the rendered chat text with special tokens
    chat_template_kwargs: dict | None = None  # Qwen3: {enable_thinking: false}


class LongBench(Suite):
    name = "longbench"
    needs_data = True
    Options = LongBenchOptions
    model_links = {"chat_format": "${model.prompt.longbench}", "system_prompt": "${model.prompt.system_prompt}",
                   "chat_template_kwargs": "${model.prompt.chat_template_kwargs}"}

    def configure(self, tasks, chinese, longbench_dir, hf_dataset, chat_format, system_prompt,
                  chat_add_special_tokens, chat_template_kwargs) -> None:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("eval 'longbench' needs the model's tokenizer (truncation and chat template are "
                             "part of the protocol)")
        self.tasks = _select_tasks(tasks, chinese)
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"longbench chat_format must be one of {CHAT_FORMATS}, got '{chat_format}'")
        if chat_format == "template" and not getattr(tokenizer, "chat_template", None) \
                and any(t not in NO_CHAT_TASKS for t in self.tasks):
            raise ValueError("longbench chat_format=template, but the tokenizer has no chat template; "
                             "use eval.chat_format=inst or eval.chat_format=none")
        self.chat_format = chat_format
        self.system_prompt = system_prompt
        self.chat_add_special_tokens = chat_add_special_tokens
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.hf_dataset = hf_dataset
        self.prompts = self._config("dataset2prompt.json")
        self.max_new = self._config("dataset2maxlen.json")
        self.folder = self._data_folder(longbench_dir)
        if hf_dataset is None:
            self.tasks = self._present_tasks(explicit=tasks is not None or chinese)

    def _present_tasks(self, explicit: bool) -> list[str]:
        """The selected tasks whose file exists. By default (no ``eval.tasks``) the missing ones are skipped
        with a one-line notice; a task asked for by name must exist."""
        present = [t for t in self.tasks if (self.folder / f"{t}.jsonl").exists()]
        available = sorted(p.stem for p in self.folder.glob("*.jsonl")) if self.folder.is_dir() else []
        missing = [t for t in self.tasks if t not in present]
        if missing and (explicit or not present):
            raise DataError(f"eval 'longbench': {self.folder / (missing[0] + '.jsonl')} not found; "
                            + HOW_TO_GET.format(available=", ".join(available) or "none"))
        if missing:
            log.warning("longbench: running the %d tasks present in %s (%s); %d others have no data file there",
                        len(present), self.folder, ", ".join(present), len(missing))
        return present

    # ---------------------------------------------------------------- data
    def _config(self, filename: str) -> dict:
        path = self.require_file(f"{CONFIG_DIR}/{filename}")
        table = json.loads(path.read_text(encoding="utf-8"))
        missing = [t for t in self.tasks if t not in table]
        if missing:
            raise DataError(f"eval 'longbench': {path} has no entry for task(s) {missing}")
        return table

    def _data_folder(self, longbench_dir: str) -> Path:
        folder = self.data_dir / longbench_dir
        if not folder.is_dir() and longbench_dir == DEFAULT_DIR and (self.data_dir / SAMPLE_DIR).is_dir():
            if self.hf_dataset is not None or all((self.data_dir / SAMPLE_DIR / f"{t}.jsonl").exists()
                                                  for t in self.tasks):
                log.warning("longbench: %s not found; using the small sample %s (4 rows per task, 6 tasks)",
                            folder, self.data_dir / SAMPLE_DIR)  # (else _present_tasks says it in one line)
            folder = self.data_dir / SAMPLE_DIR
        return folder

    def n_total(self) -> int:
        """The rows of every selected task (4,750 for the 16 English tasks of the full data)."""
        return sum(self.task_size(task) for task in self.tasks)

    def task_size(self, task: str) -> int:
        """The rows of ``task``'s data file (or, without one, of its ``hf_dataset`` test split)."""
        path = self.folder / f"{task}.jsonl"
        if path.exists():
            return count_jsonl(path)
        from datasets import load_dataset

        return len(load_dataset(self.hf_dataset, task, split="test"))

    def rows(self, task: str) -> Iterator[tuple[int, dict, str]]:
        """``(index, row, source)`` for the first ``limit`` rows of ``task`` (a limited run spreads over every
        task, ``limit`` rows each), validated; ``source`` is the
        data folder's name (``longbench`` or ``longbench_sample``) or ``hf:<dataset id>``."""
        path = self.folder / f"{task}.jsonl"
        if path.exists():
            yield from self._local_rows(task, path)
        else:
            yield from self._hub_rows(task)

    def _local_rows(self, task: str, path: Path) -> Iterator[tuple[int, dict, str]]:
        for index, lineno, row in read_jsonl(path, self.limit):
            _check_row(row, task, f"{path}, line {lineno}")
            yield index, row, path.parent.name

    def _hub_rows(self, task: str) -> Iterator[tuple[int, dict, str]]:
        from datasets import load_dataset

        data = load_dataset(self.hf_dataset, task, split="test")
        n = len(data) if self.limit is None else min(self.limit, len(data))
        for index in range(n):
            row = dict(data[index])
            _check_row(row, task, f"{self.hf_dataset} ({task}, test), row {index}")
            yield index, row, f"hf:{self.hf_dataset}"

    # ---------------------------------------------------------------- prompts
    def build_prompt(self, task: str, row: dict) -> tuple[list[int], int]:
        """Token ids of the final prompt and the token count before truncation (``pred.py``)."""
        prompt = self.prompts[task].format(**row)
        ids = self.tokenizer(prompt, truncation=False)["input_ids"]
        if len(ids) > self.max_length:
            prompt = self.truncate_middle(ids)
        if task in NO_CHAT_TASKS or self.chat_format == "none":
            return self.tokenizer(prompt, truncation=False)["input_ids"], len(ids)
        return self.wrap_chat(prompt), len(ids)

    def truncate_middle(self, ids: list[int]) -> str:
        half = int(self.max_length / 2)
        decode = self.tokenizer.decode
        return decode(ids[:half], skip_special_tokens=True) + decode(ids[-half:], skip_special_tokens=True)

    def wrap_chat(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` in the model's chat wrapper (``build_chat`` then ``tokenizer(prompt)``)."""
        if self.chat_format == "inst":
            return self.tokenizer(inst_prompt(prompt), truncation=False)["input_ids"]
        if self.chat_format == "vicuna":
            return self.tokenizer(vicuna_prompt(prompt), truncation=False)["input_ids"]
        text = chat_text(self.tokenizer, prompt, self.system_prompt, self.chat_template_kwargs)
        return self.tokenizer(text, truncation=False, add_special_tokens=self.chat_add_special_tokens)["input_ids"]

    def samples(self) -> Iterator[Sample]:
        newline = self.tokenizer.encode("\n", add_special_tokens=False)[-1]
        for task in self.tasks:
            for index, row, source in self.rows(task):
                prompt_ids, n_untruncated = self.build_prompt(task, row)
                samsum = task == "samsum"
                yield Sample(
                    id=f"{task}-{row.get('_id') or index}", task=task, prompt_ids=prompt_ids,
                    max_new_tokens=int(self.max_new[task]),
                    reference={"answers": list(row["answers"]), "all_classes": row.get("all_classes")},
                    stop_token_ids=[newline] if samsum else [], min_new_tokens=1 if samsum else 0,
                    eos_token_ids=[self.tokenizer.eos_token_id] if samsum and self.tokenizer.eos_token_id is not None
                    else None,
                    meta={"data": source, "length": row.get("length"), "n_prompt_tokens": len(prompt_ids),
                          "n_tokens_untruncated": n_untruncated, "truncated": n_untruncated > self.max_length,
                          "chat": task not in NO_CHAT_TASKS and self.chat_format != "none",
                          "chat_format": self.chat_format})

    # ---------------------------------------------------------------- scores
    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        ref = sample.reference
        return {"score": score_prediction(sample.task, prediction, ref["answers"], ref["all_classes"])}

    def aggregate(self, rows: list[dict]) -> dict:
        """Per task ``round(100 * mean, 2)`` (eval.py); ``score`` = mean over the English tasks present
        (over the Chinese ones if only those ran), ``score_zh`` = mean over the Chinese tasks present."""
        per_task: dict[str, list[float]] = {}
        for row in rows:
            per_task.setdefault(row["task"], []).append(float(row["scores"]["score"]))
        tasks = {t: round(100 * sum(v) / len(v), 2) for t, v in per_task.items()}
        english = [tasks[t] for t in ENGLISH_TASKS if t in tasks]
        chinese = [tasks[t] for t in CHINESE_TASKS if t in tasks]
        out = {"score": _mean(english or chinese), "tasks": tasks, "n_samples": len(rows),
               "n_english_tasks": len(english),
               "data": sorted({str(row.get("meta", {}).get("data", "?")) for row in rows})}
        if chinese:
            out["score_zh"] = _mean(chinese)
        return out


def _select_tasks(tasks, chinese: bool) -> list[str]:
    selected = list(ENGLISH_TASKS) if tasks is None else [str(t) for t in tasks]
    if chinese:
        selected += [t for t in CHINESE_TASKS if t not in selected]
    unknown = [t for t in selected if t not in ENGLISH_TASKS + CHINESE_TASKS]
    if unknown or not selected:
        raise ValueError(f"longbench: unknown or no task(s) {unknown}; valid: {', '.join(ENGLISH_TASKS + CHINESE_TASKS)}")
    return list(dict.fromkeys(selected))


def _check_row(row, task: str, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with fields {REQUIRED_FIELDS}, got {type(row).__name__}")
    for name in REQUIRED_FIELDS + (("all_classes",) if task in CLASSIFICATION_TASKS else ()):
        if row.get(name) is None:
            raise DataError(f"{where}: missing field '{name}' (a LongBench {task} row needs {name})")
    for name in ("answers",) + (("all_classes",) if task in CLASSIFICATION_TASKS else ()):
        if not isinstance(row[name], list):
            raise DataError(f"{where}: field '{name}' must be a list, got {type(row[name]).__name__}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
