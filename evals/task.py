"""What every suite implements (lm-evaluation-harness style: found by name, per-sample rows, ``limit``).

``limit`` caps the samples of each task (passkey: each length; RULER: each task at each length). Where a task's
samples lie on a grid that matters (passkey's depths) the ones kept are spread over it (:func:`spread`), never
its first points only; data files keep their first rows. A limited run is a run of its own (its run directory
and ``config_hash`` name the limit) and :meth:`Suite.n_total` says how many samples the whole suite has.

A suite turns its data into :class:`Sample` objects — token ids, because truncation and chat templates
are part of each benchmark's protocol — and scores the generated text. The runner (``evals/runner.py``)
owns the model: it prefills ``prompt_ids``, feeds ``decode_ids`` one token at a time through the decode
path (so a query-aware cache answers the question; passkey can do this), then generates greedily (or
``sampling``: LongGenBench's official nucleus sampling) up to
``max_new_tokens``, stopping at EOS or any of ``stop``.

Scores are computed per sample (:meth:`Suite.score`) and stored in ``predictions.jsonl``; the headline
numbers come from :meth:`Suite.aggregate` over those rows, so a resumed run needs no regeneration.
"""
from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

# The filler sentence of the passkey test (Landmark Attention), also the noise of RULER's haystacks and the
# latency suite's default text.
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# A judge/generation callback a suite may use while scoring (LongGenBench's yes/no judge):
# generate(prompt_text, max_new_tokens) -> generated text.
GenerateFn = Callable[[str, int], str]


class DataError(ValueError):
    """A missing or malformed data file / row; the message names the file, the line and what was expected."""


class ConfigError(ValueError):
    """A mistake in the run's configuration (bad option, value or combination). Defined here, beside
    :class:`DataError`, so that :mod:`evals.threads` can raise it without importing :mod:`evals.config`;
    ``evals.config.ConfigError`` is the same class."""


@dataclass
class Sample:
    id: str  # stable across runs: a rerun skips ids already in predictions.jsonl
    task: str
    prompt_ids: list[int]
    max_new_tokens: int
    reference: Any  # answers, as the suite's metric expects them (JSON-serialisable)
    decode_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # latency runs force exactly max_new_tokens tokens
    stop_token_ids: list[int] = field(default_factory=list)  # end generation like EOS (LongBench samsum: "\n")
    min_new_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this many tokens
    eos_token_ids: list[int] | None = None  # replaces the model's EOS set (LongBench samsum: the tokenizer's EOS only)
    sampling: dict | None = None  # {"temperature", "top_p", "seed"}: nucleus sampling instead of greedy (LongGenBench)
    meta: dict = field(default_factory=dict)  # JSON-serialisable extras kept in the prediction row


@dataclass
class NoOptions:
    """A suite without options of its own."""


class Suite:
    """Base class. A suite's options are the fields of its ``Options`` dataclass (their defaults are the
    suite's defaults, and the run config's ``eval`` group is generated from them: :mod:`evals.config`);
    it is constructed with them as keyword arguments plus the common ones below, which :meth:`configure`
    checks. ``__init__`` must not load anything heavy beyond checking the data."""

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1  # written to metrics.json; bump when the suite's samples or scoring change
    needs_data: ClassVar[bool] = False
    Options: ClassVar[type] = NoOptions
    # run-config values of options that follow the model group (``${model.prompt...}`` interpolations)
    model_links: ClassVar[dict[str, str]] = {}

    def __init__(self, tokenizer, data_dir: str | Path | None = None, max_length: int = 8192,
                 seed: int = 0, limit: int | None = None, **options):
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 (samples per task), got {limit}")
        unknown = sorted(set(options) - {f.name for f in fields(self.Options)})
        if unknown:
            raise ValueError(f"eval '{self.name}' has no option(s) {unknown}")
        self.tokenizer = tokenizer
        self.data_dir = Path(data_dir) if data_dir else None
        self.max_length = max_length
        self.seed = seed
        self.limit = limit
        self.options = self.Options(**options)
        self.configure(**{f.name: getattr(self.options, f.name) for f in fields(self.Options)})

    def configure(self, **options) -> None:
        """Checks the options and derives the suite's settings from them (once, from ``__init__``)."""

    def samples(self) -> Iterator[Sample]:
        raise NotImplementedError

    def n_total(self) -> int | None:
        """The samples of the whole suite as configured, ``limit`` aside (what a limited run is part of),
        counted without building them; None for a suite that cannot count them."""
        return None

    def score(self, sample: Sample, prediction: str, generate: GenerateFn | None = None) -> dict[str, float]:
        """Per-sample metric values on a 0-1 (or 0-100, as the suite documents) scale."""
        raise NotImplementedError

    def judge(self, model, tokenizer, model_name: str, device: str) -> GenerateFn | None:
        """The callback :meth:`score` receives as ``generate`` (LongGenBench's yes/no judge), made once per run
        from the model under test (``model_name`` on ``device``); None, the default, for suites without one."""
        return None

    def needle_texts(self, sample: Sample) -> list[str]:
        """The needle strings of a needle-in-a-haystack sample (the pass key, RULER's niah values), whose
        prompt tokens the ``diagnostics=recall`` probe follows; ``[]`` (the default) for other samples."""
        return []

    def needle_positions(self, sample: Sample) -> list[int]:
        """Prompt positions of the tokens that spell each occurrence of :meth:`needle_texts` in
        ``sample.prompt_ids`` (found on the decoded text, so it does not depend on how the tokenizer splits
        the needle); ``[]`` when the sample has no needle."""
        texts = [t for t in self.needle_texts(sample) if t]
        if not texts:
            return []
        pieces = [self.tokenizer.decode([i]) for i in sample.prompt_ids]
        ends = list(itertools.accumulate(len(p) for p in pieces))  # end offset of each token's text
        text = "".join(pieces)
        positions = set()
        for needle in texts:
            found = text.find(needle)
            while found >= 0:  # the tokens whose text overlaps [found, found + len(needle))
                first, last = bisect.bisect_right(ends, found), bisect.bisect_left(ends, found + len(needle))
                positions.update(range(first, last + 1))
                found = text.find(needle, found + 1)
        return sorted(positions)

    def aggregate(self, rows: list[dict]) -> dict:
        """Headline metrics from prediction rows: ``{"score": 0-100, "tasks": {task: 0-100}, ...}``.
        Default: the mean of each row's ``scores["score"]`` per task, then the mean over tasks."""
        per_task: dict[str, list[float]] = {}
        for row in rows:
            per_task.setdefault(row["task"], []).append(float(row["scores"]["score"]))
        tasks = {t: 100.0 * sum(v) / len(v) for t, v in sorted(per_task.items())}
        score = sum(tasks.values()) / len(tasks) if tasks else 0.0
        return {"score": score, "tasks": tasks, "n_samples": len(rows)}

    def require_file(self, relative: str) -> Path:
        """The path of a data file under ``data_dir``, or a :class:`DataError` saying where to get it."""
        if self.data_dir is None or not self.data_dir.is_dir():
            raise DataError(f"eval '{self.name}' needs data_dir (got {self.data_dir}); pass data_dir=/path "
                            f"to the data folder (see docs/data.md)")
        path = self.data_dir / relative
        if not path.exists():
            raise DataError(f"eval '{self.name}': {path} not found; see docs/data.md for how to get it")
        return path


def resolve_budget(budget, n_prompt_tokens: int, multiple: int = 16, minimum: int = 64) -> int | None:
    """Token budget for one sample. A float in (0, 1) is that fraction of the prompt's tokens, rounded
    down to a multiple of ``multiple`` and at least ``minimum`` (PQCache's ``compress_ratio``; IceCache's
    "10% budget"; the harness passes :func:`evals.registry.budget_multiple`, whole pages for a paged method); a
    whole number >= 1 is a budget in tokens; ``None`` means no budget."""
    if budget is None:
        return None
    value = float(budget)
    if 0 < value < 1:
        return max(minimum, int(value * n_prompt_tokens) // multiple * multiple)
    if value >= 1 and value == int(value):
        return int(value)
    raise ValueError(f"budget must be a fraction in (0, 1) of the prompt or a whole number of tokens, got {budget}")


def spread(n_items: int, count: int | None) -> list[int]:
    """Indices of ``count`` of ``n_items`` items spread evenly over them, each the middle of its share
    (``(2 i + 1) * n_items // (2 count)``), in order, distinct; every index when ``count`` is None or at least
    ``n_items``. One item is the middle one (never the first of several)."""
    if count is None or count >= n_items:
        return list(range(n_items))
    return [(2 * i + 1) * n_items // (2 * count) for i in range(count)]


def count_jsonl(path: Path) -> int:
    """The non-blank lines of a JSON-lines file (its rows), counted without parsing them."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def read_jsonl(path: Path, limit: int | None = None) -> Iterator[tuple[int, int, dict]]:
    """``(index, line number, row)`` for the first ``limit`` non-blank lines of a JSON-lines file; a line
    that is not valid JSON is a :class:`DataError` naming the file and the line."""
    index = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and index >= limit:
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}, line {lineno}: not UTF-8 text (byte {err.start}: {err.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {lineno}: not valid JSON ({err})") from None
            yield index, lineno, row
            index += 1


def chat_text(tokenizer, user: str, system: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The tokenizer's chat template rendered as text for one user turn (after an optional system turn),
    generation prompt added; ``chat_template_kwargs`` (e.g. ``enable_thinking=False``) reach the template."""
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **dict(chat_template_kwargs or {}))
