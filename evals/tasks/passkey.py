"""Passkey retrieval: the Landmark-Attention generator as IceCache's ``IceCache/benchmark/passkey_pred.py``
(the ArkVale script) and Quest's ``evaluation/passkey/passkey.py`` use it, seeded.

Prompt: the task description, a garbage prefix, the pass-key line and a garbage suffix, joined by newlines,
then ``question_separator`` and the final question. The garbage is one sentence repeated; prefix and suffix
are cut from its start (``n_prefix = int(n_garbage * depth)`` characters). ``question_separator``:

- ``""`` (default): ``prompt += prompt_postfix`` in IceCache's ``passkey_pred.py``: the question follows the
  suffix directly ("...back again. The grWhat is the pass key? The pass key is").
- ``"\\n"``: the question is the fifth newline-joined line (Landmark, Quest). This was this harness's layout
  before the IceCache one became the default; pass ``eval.question_separator='\\n'`` to reproduce it (on the
  command line the two characters backslash-n are read as a newline).

Lengths (``length_unit``): ``tokens`` = token targets (the garbage is sized with the model's tokenizer so the
prompt has about that many tokens); ``chars`` = ``n_garbage`` in characters, as both official scripts count it
(IceCache: 38000/76000/114000, about 10k/20k/30k tokens: ``eval=passkey_icecache``).

Depths: a list of relative positions, or a number ``n`` of them on ``depth_grid``: ``linear`` = ``i / n`` for
i = 0..n-1 (IceCache ``loc = i / num_tests``), ``quest`` = ``100 // n * (k + 1)`` percent for k = 0..n-1 (Quest's
``depth_ratio``; ``n_prefix = int(n_garbage * depth_ratio / 100)``). ``limit`` keeps that many depths per length,
spread over the depths (the middle one for ``limit=1``).

Where the final question goes (``question_via_decode``):
- ``False`` (default): appended to the prompt and prefilled, as IceCache's ``passkey_pred.py`` does (its
  ``--use-3-stages-gen`` flag is off by default). Only the answer tokens are decoded under the budget.
- ``True``: the prompt's last ``len(tokenize(question))`` tokens are fed token by token through the decode
  path (ArkVale/IceCache ``--use-3-stages-gen``, which tokenizes the question on its own with the tokenizer's
  BOS in front; here prefill + decode ids are exactly the whole prompt's ids).
- ``"quest"``: Quest's ``test_model`` exactly: the last 400 *characters* of the prompt are cut off, the rest
  is prefilled (``tokenizer(text)``), and ``tokenizer(prompt[-400:])`` without its first token (Quest drops
  index 0, the BOS of its Llama/Mistral tokenizers; here it is dropped only when it is the BOS) is decoded
  token by token: the end of the haystack goes through the decode path as well as the question.
  Feeding the question through the decode path makes the task far harsher at small budgets while the full
  cache is unaffected (README.md, "Choices made where the papers or official code are silent").

Pass key (``key_rng``): ``per_sample`` = ``random.Random(seed + 1000 * length_idx + depth_idx).randint(1, 50000)``;
``icecache`` = IceCache's ``numpy.random.randint(1, 50000)`` after ``seed_everything(seed)``, drawn in order
over lengths then depths (``seed=42`` reproduces the script's keys).

Score: the first integer of the output equals the pass key, compared as integers (Quest:
``int(re.search(r"\\d+", response).group()) == pass_key``, so "007" answers 7). IceCache's script instead
compares the last ``len(answer_ids)`` generated tokens with the answer's tokens.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..task import GARBAGE, Sample, Suite, spread

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
QUESTION = "What is the pass key? The pass key is"
QUEST_TAIL_CHARS = 400  # Quest test_model: q_length = 400
DEPTH_GRIDS = ("linear", "quest")
LENGTH_UNITS = ("tokens", "chars")
KEY_RNGS = ("per_sample", "icecache")


def depth_grid(n: int, grid: str = "linear") -> list[tuple[float, int | None]]:
    """``n`` depths as (fraction, Quest percent or None): IceCache's ``i / n`` or Quest's ``100 // n * (k+1)``."""
    if grid == "quest":
        return [((100 // n * (k + 1)) / 100, 100 // n * (k + 1)) for k in range(n)]
    return [(i / n, None) for i in range(n)]


def prefix_chars(n_garbage: int, depth: float, percent: int | None = None) -> int:
    """Characters of garbage before the key: ``int(n_garbage * loc)`` (IceCache) or
    ``int(n_garbage * depth_ratio / 100)`` (Quest, integer percent)."""
    return int(n_garbage * percent / 100) if percent is not None else int(n_garbage * depth)


def passkey_text(n_garbage: int, n_prefix: int, pass_key: int, separator: str = "") -> str:
    """``generate_prompt_landmark``: task, prefix, key line, suffix joined by newlines, then ``separator``
    and the final question (IceCache ``passkey_pred.py``: ``"\\n".join(lines) + final_question``)."""
    garbage = " ".join([GARBAGE] * (n_garbage // len(GARBAGE) + 2))
    info = f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
    body = "\n".join([TASK, garbage[:n_prefix], info, garbage[: n_garbage - n_prefix]])
    return body + separator + QUESTION


@dataclass
class PasskeyOptions:
    """Passkey options (see the module docstring)."""

    lengths: list[int] = field(default_factory=lambda: [2048, 4096])  # target prompt lengths (length_unit)
    depths: int | list[float] = 10  # number of depths (depth_grid), or a list of depths in [0, 1]
    depth_grid: str = "linear"  # linear: i/n (IceCache loc = i/num_tests) | quest: 100//n*(k+1) percent (Quest)
    length_unit: str = "tokens"  # tokens: sized with the tokenizer | chars: n_garbage characters (official)
    question_separator: str = ""  # "": right after the garbage (IceCache) | "\n": on its own line (Quest)
    question_via_decode: bool | str = False  # false: prefilled | true: through the decode path | quest: last 400 chars
    key_rng: str = "per_sample"  # per_sample: Random(seed + 1000*length_idx + depth_idx) | icecache: RandomState(seed)
    max_new_tokens: int = 10


class Passkey(Suite):
    name = "passkey"
    Options = PasskeyOptions

    def configure(self, lengths, depths, depth_grid, length_unit, question_separator, question_via_decode, key_rng,
                  max_new_tokens) -> None:
        tokenizer = self.tokenizer
        _check_choice("depth_grid", depth_grid, DEPTH_GRIDS)
        _check_choice("length_unit", length_unit, LENGTH_UNITS)
        _check_choice("key_rng", key_rng, KEY_RNGS)
        if question_via_decode not in (False, True, "quest"):
            raise ValueError(f"passkey question_via_decode must be false, true or quest, got {question_via_decode!r}")
        self.lengths = [int(n) for n in lengths]
        self.depths = (_grid(depths, depth_grid) if isinstance(depths, int)
                       else [(float(d), None) for d in depths])
        if not self.lengths or min(self.lengths) < 64 or not self.depths:
            raise ValueError("passkey needs lengths >= 64 and at least one depth")
        if any(not 0.0 <= d <= 1.0 for d, _ in self.depths):
            raise ValueError(f"passkey depths must lie in [0, 1], got {[d for d, _ in self.depths]}")
        self.length_unit, self.key_rng = length_unit, key_rng
        # A command-line override cannot carry a newline: the two characters backslash-n stand for one.
        self.question_separator = str(question_separator).replace("\\n", "\n")
        self.question_via_decode = question_via_decode
        self.max_new_tokens = max_new_tokens
        self._chars_per_token = len(GARBAGE) / len(tokenizer(GARBAGE, add_special_tokens=False)["input_ids"])
        for n in self.lengths:
            tokens = n if length_unit == "tokens" else int(n / self._chars_per_token)
            if tokens > self.max_length:
                raise ValueError(f"passkey length {n} {length_unit} (about {tokens} tokens) exceeds the model's "
                                 f"maximum of {self.max_length} tokens; use eval.lengths=[...] within it")

    def build_prompt(self, n_garbage: int, depth: float, pass_key: int, percent: int | None = None) -> str:
        return passkey_text(n_garbage, prefix_chars(n_garbage, depth, percent), pass_key, self.question_separator)

    def fit(self, target: int, depth: float, pass_key: int, percent: int | None = None) -> tuple[str, list[int]]:
        """The prompt text whose token count is closest to ``target`` (garbage sized in characters), and its ids."""
        n_garbage = int(target * self._chars_per_token)
        for _ in range(4):
            text = self.build_prompt(n_garbage, depth, pass_key, percent)
            ids = self.tokenizer(text)["input_ids"]
            if abs(len(ids) - target) <= 8:
                break
            n_garbage = max(0, n_garbage + int((target - len(ids)) * self._chars_per_token))
        return text, ids

    def split(self, text: str, ids: list[int]) -> tuple[list[int], list[int]]:
        """(prefilled ids, ids fed through the decode path) for ``question_via_decode``."""
        if self.question_via_decode is False:
            return ids, []
        if self.question_via_decode == "quest":
            head, tail = text[:-QUEST_TAIL_CHARS], text[-QUEST_TAIL_CHARS:]
            return self.tokenizer(head)["input_ids"], _drop_bos(self.tokenizer, self.tokenizer(tail)["input_ids"])
        n_question = len(self.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
        return ids[: len(ids) - n_question], ids[len(ids) - n_question:]

    def pass_keys(self) -> list[list[int]]:
        """Pass key per (length, depth), drawn as ``key_rng`` says."""
        if self.key_rng == "icecache":
            rng = np.random.RandomState(self.seed)
            return [[int(rng.randint(1, 50000)) for _ in self.depths] for _ in self.lengths]
        return [[random.Random(self.seed + 1000 * li + di).randint(1, 50000) for di in range(len(self.depths))]
                for li in range(len(self.lengths))]

    def n_total(self) -> int:
        return len(self.lengths) * len(self.depths)

    def samples(self) -> Iterator[Sample]:
        """One sample per (length, depth); with ``limit``, that many depths per length spread over the grid
        (:func:`~evals.task.spread`: ``limit=1`` is the middle depth, never depth 0, where the key sits among
        the attention sinks every method keeps)."""
        keys = self.pass_keys()
        for li, length in enumerate(self.lengths):
            for di in spread(len(self.depths), self.limit):
                (depth, percent), pass_key = self.depths[di], keys[li][di]
                if self.length_unit == "tokens":
                    text, ids = self.fit(length, depth, pass_key, percent)
                else:
                    text = self.build_prompt(length, depth, pass_key, percent)
                    ids = self.tokenizer(text)["input_ids"]
                prompt_ids, decode_ids = self.split(text, ids)
                yield Sample(id=f"passkey-{length}-{depth:.3f}", task=f"passkey_{length}", prompt_ids=prompt_ids,
                             decode_ids=decode_ids, max_new_tokens=self.max_new_tokens, reference=str(pass_key),
                             meta={"length": length, "length_unit": self.length_unit, "depth": depth,
                                   "n_tokens": len(prompt_ids) + len(decode_ids),
                                   "question_separator": self.question_separator,
                                   "question_via_decode": self.question_via_decode})

    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        return {"score": float(passkey_correct(prediction, sample.reference))}

    def needle_texts(self, sample: Sample) -> list[str]:
        return [sample.reference]  # the pass key, written twice in the needle sentence


def passkey_correct(prediction: str, pass_key) -> bool:
    """Quest's check: the first ``\\d+`` of the output, as an integer, equals the pass key."""
    found = re.search(r"\d+", prediction)
    return found is not None and int(found.group(0)) == int(pass_key)


def _grid(n: int, grid: str) -> list[tuple[float, int | None]]:
    if n < 1:
        raise ValueError(f"passkey depths must be >= 1, got {n}")
    return depth_grid(n, grid)


def _drop_bos(tokenizer, ids: list[int]) -> list[int]:
    return ids[1:] if ids and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id else ids


def _check_choice(option: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"passkey {option} must be one of {', '.join(choices)}, got {value!r}")
