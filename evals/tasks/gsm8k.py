"""GSM8K chain-of-thought (Cobbe et al., 2021, test set of 1,319 problems) under two protocols
; the score is exact-match accuracy, 0-100.

``protocol: pqcache`` (default): PQCache's ``GSM8k/evaluation_gsm8k.py``,
which IceCache's ``gsm8k_pred.py`` derives from. Prompt = the 10-exemplar CoT file
``<data_dir>/gsm8k/cot_prompt_10shot.txt`` (exemplars ``Question: ...\\nLet's think step by step\\n...The
answer is N``) + ``"\\nQuestion: " + question + "\\n"``, no chat template, tokenized with special tokens.
Greedy, 256 new tokens, no stop strings (it runs to 256 or EOS, which matters for timing). Scoring:
cut the generation at the first ``"\\nQuestion: "``, drop commas, and compare the last ``\\d*\\.?\\d+``
of the prediction and of the gold answer as floats (signs are ignored by that regex; no number = wrong).

``protocol: lm_eval``: lm-evaluation-harness ``lm_eval/tasks/gsm8k/gsm8k-cot.yaml`` (``gsm8k_cot``), 8 fixed exemplars rendered
``"Q: {question}\\nA: {target}"`` joined by blank lines, then ``"Q: {question}\\nA:"``; stop at ``Q:``,
``</s>`` or ``<|im_end|>``; 256 new tokens. ``strict_match`` takes the first ``The answer is (...)``,
``flexible_extract`` the last number-like match; both are compared after lm-eval's ``exact_match``
normalisation (drop ``,``, ``$``, ``.*#### ``, a final ``.``; case-insensitive). ``score`` is strict-match;
``flexible_extract`` is reported beside it.

Budgets for this suite are fractions of the prompt (the paper's "10% budget", PQCache
``compress_ratio=0.1``): :func:`resolve_budget`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from ..task import DataError, Sample, Suite, count_jsonl, read_jsonl

PROTOCOLS = ("pqcache", "lm_eval")
PQCACHE_SPLIT = "\nQuestion: "
PQCACHE_NUMBER = re.compile(r"\d*\.?\d+")

LM_EVAL_EXEMPLARS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
)
LM_EVAL_STOP = ["Q:", "</s>", "<|im_end|>"]
LM_EVAL_STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+).")
LM_EVAL_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
LM_EVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
INVALID = "[invalid]"


def pqcache_answer(generation: str) -> float | None:
    """The number PQCache's scoring reads from a generation: the last ``\\d*\\.?\\d+`` of the text before the first
    ``"\\nQuestion: "``, commas dropped, as a float; None when it has no number."""
    found = PQCACHE_NUMBER.findall(generation.split(PQCACHE_SPLIT)[0].replace(",", ""))
    return float(found[-1]) if found else None


def pqcache_correct(generation: str, answer: str) -> bool:
    """PQCache ``evaluate_pred_answer`` on ``generation.split("\\nQuestion: ")[0]``."""
    pred = pqcache_answer(generation)
    gold = PQCACHE_NUMBER.findall(answer.replace(",", ""))
    return pred is not None and pred == float(gold[-1])


def lm_eval_extract(generation: str) -> dict[str, str]:
    """The strict-match and flexible-extract filters of ``gsm8k_cot`` (RegexFilter + take_first)."""
    strict = LM_EVAL_STRICT.findall(generation)
    flexible = LM_EVAL_FLEXIBLE.findall(generation)
    return {"strict_match": strict[0].strip() if strict else INVALID,
            "flexible_extract": next(g for g in flexible[-1] if g).strip() if flexible else INVALID}


def lm_eval_normalise(text: str) -> str:
    """lm-eval ``exact_match``'s normalisation as ``gsm8k_cot`` sets it: ``regexes_to_ignore`` removed, lowercased."""
    for pattern in LM_EVAL_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def lm_eval_exact_match(prediction: str, target: str) -> bool:
    """lm-eval ``exact_match`` with ``regexes_to_ignore`` and ``ignore_case`` as ``gsm8k_cot`` sets them."""
    return lm_eval_normalise(prediction) == lm_eval_normalise(target)


def lm_eval_answer(generation: str) -> str:
    """The strict-match answer ``score`` compares under ``protocol: lm_eval``: the first ``The answer is ...`` of
    the generation cut at the stop strings, normalised as ``exact_match`` compares it (``[invalid]`` when none)."""
    return lm_eval_normalise(lm_eval_extract(cut_at_stop(generation, LM_EVAL_STOP))["strict_match"])


def final_answer(generation: str, protocol: str = "pqcache") -> float | str | None:
    """The final answer a protocol's ``score`` reads from a generation: :func:`pqcache_answer` (a float, None
    without a number) or :func:`lm_eval_answer` (a normalised string, ``[invalid]`` without a match)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"gsm8k protocol must be one of {PROTOCOLS}, got '{protocol}'")
    return pqcache_answer(generation) if protocol == "pqcache" else lm_eval_answer(generation)


def cut_at_stop(text: str, stop: list[str]) -> str:
    for s in stop:
        text = text.split(s)[0]
    return text


@dataclass
class GSM8KOptions:
    protocol: str = "pqcache"  # pqcache: 10-shot CoT file, PQCache/IceCache scoring | lm_eval: 8-shot, strict/flexible
    max_new_tokens: int = 256
    add_special_tokens: bool = True  # tokenize the prompt with the tokenizer's special tokens (BOS)


class GSM8K(Suite):
    name = "gsm8k"
    needs_data = True
    Options = GSM8KOptions

    def configure(self, protocol, max_new_tokens, add_special_tokens) -> None:
        tokenizer = self.tokenizer
        if protocol not in PROTOCOLS:
            raise ValueError(f"gsm8k protocol must be one of {PROTOCOLS}, got '{protocol}'")
        if tokenizer is None:
            raise ValueError("eval 'gsm8k' needs the model's tokenizer")
        self.protocol = protocol
        self.max_new_tokens = max_new_tokens
        self.add_special_tokens = add_special_tokens
        self.test_path = self.require_file("gsm8k/test.jsonl")
        self.cot_prompt = (self.require_file("gsm8k/cot_prompt_10shot.txt").read_text(encoding="utf-8")
                           if protocol == "pqcache" else None)

    def n_total(self) -> int:
        return count_jsonl(self.test_path)

    def problems(self) -> Iterator[tuple[int, dict]]:
        """``(index, row)`` for the first ``limit`` problems, validated."""
        for index, lineno, row in read_jsonl(self.test_path, self.limit):
            for field in ("question", "answer"):
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise DataError(f"{self.test_path}, line {lineno}: missing field '{field}' "
                                    "(a GSM8K row needs 'question' and 'answer' ending in '#### N')")
            if not PQCACHE_NUMBER.search(row["answer"].split("####")[-1]):
                raise DataError(f"{self.test_path}, line {lineno}: field 'answer' has no final number")
            yield index, row

    def prompt_text(self, question: str) -> str:
        if self.protocol == "pqcache":
            return self.cot_prompt + PQCACHE_SPLIT + question + "\n"
        shots = [f"Q: {q}\nA: {t}" for q, t in LM_EVAL_EXEMPLARS]
        return "\n\n".join(shots + [f"Q: {question}\nA:"])

    def samples(self) -> Iterator[Sample]:
        for index, row in self.problems():
            ids = self.tokenizer(self.prompt_text(row["question"]),
                                 add_special_tokens=self.add_special_tokens)["input_ids"]
            if len(ids) > self.max_length:
                raise ValueError(f"gsm8k-{index}: the {self.protocol} prompt has {len(ids)} tokens, more than "
                                 f"the model's maximum of {self.max_length}")
            yield Sample(id=f"gsm8k-{index}", task="gsm8k", prompt_ids=ids, max_new_tokens=self.max_new_tokens,
                         reference=row["answer"], stop=list(LM_EVAL_STOP) if self.protocol == "lm_eval" else [],
                         meta={"protocol": self.protocol, "n_prompt_tokens": len(ids)})

    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        if self.protocol == "pqcache":
            return {"score": float(pqcache_correct(prediction, sample.reference))}
        target = sample.reference.split("####")[-1].strip()
        found = lm_eval_extract(cut_at_stop(prediction, LM_EVAL_STOP))
        strict = float(lm_eval_exact_match(found["strict_match"], target))
        flexible = float(lm_eval_exact_match(found["flexible_extract"], target))
        return {"score": strict, "strict_match": strict, "flexible_extract": flexible}

    def aggregate(self, rows: list[dict]) -> dict:
        """Accuracy (0-100) of every per-sample score key; ``score`` is the protocol's headline number."""
        keys = rows[0]["scores"].keys() if rows else ["score"]
        out = {k: 100 * sum(float(r["scores"][k]) for r in rows) / len(rows) if rows else 0.0 for k in keys}
        return {**out, "tasks": {"gsm8k": out["score"]}, "n_samples": len(rows), "protocol": self.protocol}
