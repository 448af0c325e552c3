"""LongGenBench (Wu et al., "LongGenBench: Benchmarking Long-Form Generation in Long Context LLMs",
arXiv 2409.02076; mozhu621/LongGenBench at ``62c0e86``): the model writes one long structured document
(a 52-week diary, a 100-floor building, ...) that must mention given events in given units.

Generation (``Evalution/inference.py``): the item's raw ``prompt`` without a chat template (it ends with
``"*** started ***\\n" + prefix``), stop string ``"*** finished"``, at most 16,000 (short) / 32,000 (long)
new tokens; the harness caps that at ``max_length - prompt tokens`` and records both numbers in the
sample's meta. ``max_new_tokens`` (default ``null`` = the official budget) caps generation further for smoke
runs on slow hardware; the cap is recorded in each sample's meta and in ``metrics.json``, and a capped run
scores only the units written before the cap (lower completion rate, fewer judged checks), so its numbers
are not comparable with the paper's. ``decoding``: ``official`` (default, for paper reproduction) samples as
``inference.py``'s ``SamplingParams(temperature=0.95, top_p=0.95, seed=6211027)`` does (nucleus sampling in
:func:`evals.runner.sample_token`, seeded per item with ``sampling_seed``; vLLM's random stream is not
reproduced bit for bit), ``greedy`` decodes greedily.

Scoring (``Evalution/eval.py``): ``output = prefix + generated text`` is split on ``"#*#"``; the first block
matching ``"{type} (\\d+)"`` is unit ``\\d+``'s block. For every check (``checks_once``, ``checks_range``,
``checks_periodic``: ``{"<unit>": "<event>"}``) whose unit has a block, the judge gets
``"Context: " + block + "### Instruction: Does this context include the {event}? Please answer with 'yes'
or 'no' only."`` (raw prompt, 50 new tokens) and the verdict is yes iff ``'yes' in reply.strip().lower()``.
Checks without a block are left out. Accuracy per kind = yes / judged, pooled over all items (0 when none
was judged); Completion Rate = mean over items of ``100 * |units found in 1..number| / number``; Average
Accuracy = mean of the three accuracies. The judge is the ``generate`` callable given to :meth:`score`;
``judge_model`` names it: by default the official judge ``llama-3.1-8b-instruct`` (``eval.py``'s
meta-llama/Meta-Llama-3.1-8B-Instruct), checked when the suite is built, with an error saying how to provide
it when its weights are not available; ``null`` = the model under test (not comparable with the paper). The
harness's judge decodes greedily (``eval.py`` samples it with temperature 0.95, top-p 0.95, seed 42).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterator

from ..models import (MODELS, ModelUnavailableError, load_model, load_tokenizer, qwen_coder_checkpoint,
                      smollm2_gguf_path)
from ..registry import make_method
from ..runner import generate
from ..task import DataError, GenerateFn, Sample, Suite

MAX_NEW_TOKENS = {"short": 16000, "long": 32000}
OFFICIAL_JUDGE = "llama-3.1-8b-instruct"  # Evalution/eval.py: meta-llama/Meta-Llama-3.1-8B-Instruct
OFFICIAL_SAMPLING = {"temperature": 0.95, "top_p": 0.95}  # Evalution/inference.py SamplingParams
OFFICIAL_SEED = 6211027
DECODINGS = ("official", "greedy")
KINDS = ("once", "range", "periodic")
STOP = "*** finished"
JUDGE_MAX_NEW_TOKENS = 50
FIELDS = {"prompt": str, "prefix": str, "type": str, "number": int,
          "checks_once": dict, "checks_range": dict, "checks_periodic": dict}


def parse_blocks(output: str, unit_type: str) -> dict[int, str]:
    """``parse_blocks`` on ``output.split('#*#')``: unit number -> its first block."""
    found: dict[int, str] = {}
    for block in output.split("#*#"):
        match = re.search(rf"{re.escape(unit_type)} (\d+)", block)
        if match:
            found.setdefault(int(match.group(1)), block)
    return found


def judge_prompts(checks: dict[str, str], blocks: dict[int, str]) -> list[tuple[int, str]]:
    """``create_prompts``: (unit, judge prompt) for every check whose unit has a block."""
    return [(int(unit), "Context: " + blocks[int(unit)] + f"### Instruction: Does this context include the "
             f"{event}? Please answer with 'yes' or 'no' only.")
            for unit, event in checks.items() if int(unit) in blocks]


def completion_rate(blocks: dict[int, str], number: int) -> float:
    """``calculate_completion_rate``: percentage of units 1..number that have a block."""
    return 100.0 * len(set(blocks) & set(range(1, number + 1))) / number


def task_name(unit_type: str) -> str:
    return unit_type.lower().replace(" ", "_")


@dataclass
class LongGenBenchOptions:
    subset: str = "short"  # short (Dataset_short.json, 16k new tokens) | long (Dataset_long.json, 32k)
    types: list[str] | None = None  # e.g. [Week, Floor]; None = all four types of the subset
    judge_model: str | None = OFFICIAL_JUDGE  # None: the model under test judges
    max_new_tokens: int | None = None  # cap below the official 16k/32k new tokens (smoke runs); None = official
    decoding: str = "official"  # official: temperature 0.95, top-p 0.95, seeded | greedy
    sampling_seed: int = OFFICIAL_SEED  # the official SamplingParams seed; item i uses sampling_seed + i


class LongGenBench(Suite):
    """LongGenBench (Wu et al.). Options: ``subset`` (short = Dataset_short.json, 16K; long =
    Dataset_long.json, 32K), ``types`` (a subset of the item types, e.g. ``[Week, Floor]``; default all),
    ``judge_model`` (a registered model; default the official judge; ``null`` = the model under test),
    ``max_new_tokens`` (a cap below the official generation budget for smoke runs; ``null`` = official),
    ``decoding`` (``official`` sampling | ``greedy``) and ``sampling_seed``.
    ``limit`` caps the items per type. Sample ids: ``<subset>-<item index in the file>``."""

    name = "longgenbench"
    needs_data = True
    Options = LongGenBenchOptions

    def configure(self, subset, types, judge_model, max_new_tokens, decoding, sampling_seed) -> None:
        if subset not in MAX_NEW_TOKENS:
            raise ValueError(f"longgenbench subset must be one of {sorted(MAX_NEW_TOKENS)}, got {subset!r}")
        if max_new_tokens is not None and not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"longgenbench max_new_tokens must be a positive integer or null (the official "
                             f"{MAX_NEW_TOKENS[subset]}), got {max_new_tokens!r}")
        if decoding not in DECODINGS:
            raise ValueError(f"longgenbench decoding must be one of {DECODINGS}, got {decoding!r}")
        self.subset = subset
        self.decoding, self.sampling_seed = decoding, int(sampling_seed)
        self.max_new_tokens_cap = max_new_tokens
        self.types = list(types) if types else None
        self.judge_model = judge_model
        self.path = self.require_file(f"longgenbench/Dataset_{subset}.json")
        if judge_model:
            check_judge(judge_model)

    def judge(self, model, tokenizer, model_name: str, device: str) -> GenerateFn:
        return make_judge(model, tokenizer, self.judge_model, model_name, device)

    def items(self) -> list[dict]:
        """The dataset's items, checked field by field."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as err:
            raise DataError(f"{self.path}: not valid JSON ({err})") from None
        if not isinstance(data, list):
            raise DataError(f"{self.path}: expected a JSON list of items")
        for i, item in enumerate(data):
            for key, kind in FIELDS.items():
                if not isinstance(item.get(key) if isinstance(item, dict) else None, kind):
                    raise DataError(f"{self.path}: item {i} needs field '{key}' of type {kind.__name__}")
            if not item["prompt"].endswith(item["prefix"]):
                raise DataError(f"{self.path}: item {i}'s prompt does not end with its prefix")
        present = {item["type"] for item in data}
        if self.types and set(self.types) - present:
            raise ValueError(f"longgenbench types {sorted(set(self.types) - present)} not in {self.path}; "
                             f"valid: {sorted(present)}")
        return data

    def n_total(self) -> int:
        """The items of the selected types (``limit`` aside)."""
        return sum(1 for item in self.items() if not self.types or item["type"] in self.types)

    def samples(self) -> Iterator[Sample]:
        taken: dict[str, int] = {}
        for index, item in enumerate(self.items()):
            kind = item["type"]
            if (self.types and kind not in self.types) or (self.limit and taken.get(kind, 0) >= self.limit):
                continue
            taken[kind] = taken.get(kind, 0) + 1
            ids = self.tokenizer(item["prompt"])["input_ids"]
            room = self.max_length - len(ids)
            if room < 1:
                raise ValueError(f"longgenbench item {index}: the prompt has {len(ids)} tokens, no room to "
                                 f"generate within max_length={self.max_length}")
            yield Sample(id=f"{self.subset}-{index}", task=task_name(kind), prompt_ids=ids,
                         max_new_tokens=min(self.generation_budget(), room), stop=[STOP],
                         sampling=self.sampling(index),
                         reference={key: item[key] for key in FIELDS if key != "prompt"},
                         meta={"subset": self.subset, "type": kind, "number": item["number"],
                               "official_max_new_tokens": MAX_NEW_TOKENS[self.subset],
                               "max_new_tokens_cap": self.max_new_tokens_cap,
                               "judge_model": self.judge_model or "model under test", "decoding": self.decoding})

    def sampling(self, index: int) -> dict | None:
        """The official ``SamplingParams`` (seed ``sampling_seed + item index``), or ``None`` for greedy."""
        if self.decoding == "greedy":
            return None
        return {**OFFICIAL_SAMPLING, "seed": self.sampling_seed + index}

    def generation_budget(self) -> int:
        """The official new-token budget of the subset, or the smaller ``max_new_tokens`` cap when given."""
        official = MAX_NEW_TOKENS[self.subset]
        return official if self.max_new_tokens_cap is None else min(official, self.max_new_tokens_cap)

    def score(self, sample: Sample, prediction: str, generate: GenerateFn | None = None) -> dict[str, float]:
        """Judged checks of one item: ``<kind>_yes`` / ``<kind>_judged`` counts, its completion rate (0-100),
        the output's word count and ``score`` = this item's mean of the three accuracies (0-1)."""
        if generate is None:
            raise ValueError("longgenbench scoring needs a judge: pass generate(prompt, max_new_tokens) -> text")
        ref = sample.reference
        output = ref["prefix"] + prediction
        blocks = parse_blocks(output, ref["type"])
        scores: dict[str, float] = {"completion_rate": completion_rate(blocks, ref["number"]),
                                    "word_count": float(len(output.split()))}
        for kind in KINDS:
            prompts = judge_prompts(ref[f"checks_{kind}"], blocks)
            yes = sum("yes" in generate(p, JUDGE_MAX_NEW_TOKENS).strip().lower() for _, p in prompts)
            scores[f"{kind}_yes"], scores[f"{kind}_judged"] = float(yes), float(len(prompts))
        scores["score"] = sum(_accuracy([scores], k) for k in KINDS) / len(KINDS)
        return scores

    def aggregate(self, rows: list[dict]) -> dict:
        """Pooled (micro) accuracies as ``eval.py`` computes them; ``score`` = 100 x Average Accuracy."""
        scores = [row["scores"] for row in rows]
        acc = {k: _accuracy(scores, k) for k in KINDS}
        average = sum(acc.values()) / len(KINDS)
        per_task: dict[str, list[dict]] = {}
        for row in rows:
            per_task.setdefault(row["task"], []).append(row["scores"])
        tasks = {t: 100 * sum(_accuracy(s, k) for k in KINDS) / len(KINDS) for t, s in sorted(per_task.items())}
        return {"score": 100 * average, "average_accuracy": average,
                "completion_rate": sum(s["completion_rate"] for s in scores) / len(scores) if scores else 0.0,
                "accuracy_once": acc["once"], "accuracy_range": acc["range"], "accuracy_periodic": acc["periodic"],
                "tasks": tasks, "subset": self.subset, "judge_model": self.judge_model or "model under test",
                "decoding": self.decoding,
                "max_new_tokens": self.generation_budget(), "official_max_new_tokens": MAX_NEW_TOKENS[self.subset],
                "n_samples": len(rows)}


def make_judge(model, tokenizer, judge_model: str | None, model_name: str, device: str) -> GenerateFn:
    """The judge: by default the model under test (``model_name``), else the registered model ``judge_model``
    (loaded on first use); always greedy with the full cache."""
    loaded = {}

    def judge(text: str, max_new_tokens: int) -> str:
        if judge_model and judge_model != model_name:
            if not loaded:
                loaded["model"] = load_model(judge_model, device=device)
                loaded["tokenizer"] = load_tokenizer(judge_model)
            m, tok = loaded["model"], loaded["tokenizer"]
        else:
            m, tok = model, tokenizer
        return generate(m, tok, make_method("full"), tok(text)["input_ids"], max_new_tokens).text
    return judge


def check_judge(name: str) -> None:
    """Fails early, with what to do, when the judge model is unknown or its weights are not on this machine
    (a hub model must be in the local Hugging Face cache: the judge is loaded by name, without a path)."""
    from huggingface_hub import try_to_load_from_cache

    if name not in MODELS:
        raise ValueError(f"longgenbench judge_model '{name}' is not a registered model; valid: {', '.join(MODELS)}")
    entry = MODELS[name]
    if entry.source == "smollm2":
        smollm2_gguf_path()  # raises ModelUnavailableError saying how to install it
    elif entry.source == "qwen-coder":
        qwen_coder_checkpoint()  # raises ModelUnavailableError naming its make target
    elif entry.source == "hub" and not isinstance(try_to_load_from_cache(entry.repo_id, "config.json"), str):
        raise ModelUnavailableError(
            f"longgenbench: the judge '{name}' ({entry.repo_id}) is not in the local Hugging Face cache. The official "
            f"judge is Llama-3.1-8B-Instruct (mozhu621/LongGenBench Evalution/eval.py): download it first "
            f"(huggingface-cli download {entry.repo_id}), or set eval.judge_model=null to judge with the model "
            f"under test (not comparable with the paper)")


def _accuracy(scores: list[dict], kind: str) -> float:
    judged = sum(s[f"{kind}_judged"] for s in scores)
    return sum(s[f"{kind}_yes"] for s in scores) / judged if judged else 0.0
