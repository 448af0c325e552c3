"""Agreement with the full cache: a judge-free, paired score of how well a run preserves the full cache's own
output on the same samples (same eval, model and settings; rows matched by sample ``id``, on the ids both runs
hold, so a run limited to fewer samples is paired on its own).

Per paired sample (:func:`agreement_row`):

- ``answer_match``: the final answer equals the full cache's (True/False), where a final answer is defined, else
  None. GSM8K: the number the protocol's ``score`` reads (:func:`evals.tasks.gsm8k.final_answer`: ``pqcache``, the
  last number of the text cut at ``"\\nQuestion: "``; ``lm_eval``, the normalised strict-match answer); two
  generations without an answer (no number, ``[invalid]``) match. LongBench: the text the task's metric reads
  (``scored_text``: the first line for trec, triviaqa, lsht) normalised as LongBench's ``metrics.py`` does
  (``normalize_answer``; ``normalize_zh_answer`` for the Chinese tasks), on the short-answer tasks of
  :data:`LONGBENCH_SHORT_ANSWER` (single- and multi-document QA, few-shot QA and classification, the synthetic
  tasks). Not defined for the summarisation tasks (gov_report, qmsum, multi_news, vcsum, samsum), whose answer is
  the whole text, DuReader (long free-form answers, scored by ROUGE), the code tasks (lcc, repobench-p) and the other
  suites.
- ``tokens_to_divergence``: the generated tokens identical to the full cache's before the first that differs (the
  length of the common prefix of both ``output_ids``: the whole length when one output is a prefix of the other or
  both are identical). The runner stores the generated ids in every row as ``output_ids`` (the final EOS dropped,
  as in the text). Rows written before that have no ids and get None: re-tokenising the stored text does not give
  the generated ids back (BPE merges across token boundaries, special tokens skipped in the decoded text, the text
  cut at stop strings), so a divergence counted on it would be wrong where it matters.
- ``rouge_l``: ROUGE-L F1 (0-1) of the run's prediction text against the full cache's, with the function
  LongBench's metric uses (``rouge_score``: ``rouge==1.0.1``, summary-level union LCS). Conventions: both texts
  empty (or whitespace only) = 1.0, one empty = 0.0, identical texts = 1.0 without calling the package (it gives
  1 - 5e-9 for a text against itself); the recursion limit is raised around the call, as the package recovers an
  LCS one word per call frame and would score 0 a sentence over ~1,000 words; texts over
  :data:`ROUGE_MAX_WORDS` words get None (its union LCS is a pure-Python O(n m) table, whose time grows with the
  square of the length, prohibitive at LongGenBench's 16k tokens; docs/benchmarks.md, "Columns"). LongBench's
  Chinese tasks are cut into words by jieba first,
  as its ``rouge_zh_score`` does.

Per run (:func:`agreement_summary`, the summary's columns :data:`AGREEMENT_COLUMNS`): ``answer_match`` (% of the
pairs where it is defined), ``tokens_to_divergence`` (mean tokens), ``rouge_l`` (100 x mean F1), each over the
pairs where it is defined, with a 95% percentile bootstrap interval (``*_ci_low``/``*_ci_high``,
:func:`evals.output.pairing.resample_means` over the pairs, seed 0) and ``n_agreement`` (the pairs). The full
cache run paired with itself shows 100, its mean output length and 100.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from ..tasks import gsm8k
from ..tasks.longbench import CHINESE_TASKS
from ..tasks.longbench.metrics import _jieba_cut, normalize_answer, normalize_zh_answer, rouge_score, scored_text
from .results import prediction_key, run_predictions
from .pairing import DRAWS, LEVEL, SEED, full_reference, percentile_interval, resample_means

ROUGE_MAX_WORDS = 1024  # longer texts get rouge_l None (GSM8K's 256 and LongBench's <= 512 new tokens are shorter)
# LongBench tasks whose answer is short enough to be compared whole, and the normaliser of their metric
LONGBENCH_SHORT_ANSWER: dict[str, Callable[[str], str]] = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa",
                     "trec", "passage_count", "passage_retrieval_en"), normalize_answer),
    **dict.fromkeys(("multifieldqa_zh", "lsht", "passage_retrieval_zh"), normalize_zh_answer),
}
AGREEMENT_MEANS = ("answer_match", "tokens_to_divergence", "rouge_l")  # the per-run columns, then their intervals
AGREEMENT_COLUMNS = (*(c for m in AGREEMENT_MEANS for c in (m, f"{m}_ci_low", f"{m}_ci_high")), "n_agreement")
SCALE = {"answer_match": 100.0, "tokens_to_divergence": 1.0, "rouge_l": 100.0}  # per-run means: %, tokens, 0-100


def answer_extractor(eval_name: str, row: dict) -> Callable[[str], object] | None:
    """The function that reads the final answer from a prediction text of ``row``'s sample (module docstring), or
    None where no final answer is defined (other suites, LongBench's long-answer and code tasks)."""
    if eval_name == "gsm8k":
        protocol = (row.get("meta") or {}).get("protocol", "pqcache")
        return lambda text: gsm8k.final_answer(text, protocol)
    if eval_name == "longbench" and row.get("task") in LONGBENCH_SHORT_ANSWER:
        task = row["task"]
        return lambda text: LONGBENCH_SHORT_ANSWER[task](scored_text(task, text))
    return None


def final_answer(eval_name: str, row: dict):
    """The final answer of a prediction row (a float or a string; None for a GSM8K text without a number), or
    None where it is not defined; :func:`answer_extractor` tells the two Nones apart."""
    extract = answer_extractor(eval_name, row)
    return None if extract is None else extract(row["prediction"])


def answer_match(eval_name: str, row: dict, full_row: dict) -> bool | None:
    """Whether ``row``'s final answer equals ``full_row``'s (same sample); None where it is not defined."""
    extract = answer_extractor(eval_name, full_row)
    return None if extract is None else extract(row["prediction"]) == extract(full_row["prediction"])


def tokens_to_divergence(output_ids: list[int] | None, full_ids: list[int] | None) -> int | None:
    """The length of the common prefix of two generated id lists; None when either is missing."""
    if output_ids is None or full_ids is None:
        return None
    n = min(len(output_ids), len(full_ids))
    return next((k for k in range(n) if output_ids[k] != full_ids[k]), n)


def rouge_l(prediction: str, reference: str, chinese: bool = False) -> float | None:
    """ROUGE-L F1 (0-1) of ``prediction`` against ``reference`` with LongBench's ``rouge_score`` and the
    conventions of the module docstring (empty, identical and over-long texts); ``chinese``: on the texts cut into
    words by jieba, as LongBench's ``rouge_zh_score`` does."""
    empty = (not prediction.strip(), not reference.strip())
    if any(empty):
        return float(all(empty))
    if prediction == reference:
        return 1.0
    if chinese:
        prediction, reference = " ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(reference))
    words = (len(prediction.split()), len(reference.split()))
    if max(words) > ROUGE_MAX_WORDS:
        return None
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, sum(words) + 1000))  # the package recovers each LCS recursively, a word a frame
    try:
        return rouge_score(prediction, reference)
    finally:
        sys.setrecursionlimit(limit)


def agreement_row(eval_name: str, row: dict, full_row: dict) -> dict:
    """The three per-sample agreement values of ``row`` with the full cache's row of the same sample."""
    return {"id": row["id"], "task": row.get("task"),
            "answer_match": answer_match(eval_name, row, full_row),
            "tokens_to_divergence": tokens_to_divergence(row.get("output_ids"), full_row.get("output_ids")),
            "rouge_l": rouge_l(row.get("prediction") or "", full_row.get("prediction") or "",
                               chinese=eval_name == "longbench" and row.get("task") in CHINESE_TASKS)}


def paired_agreement(eval_name: str, rows: list[dict], full_rows: list[dict]) -> list[dict]:
    """:func:`agreement_row` of every row of ``rows`` whose sample ``full_rows`` also holds (matched by ``id``)."""
    by_id = {r["id"]: r for r in full_rows}
    return [agreement_row(eval_name, r, by_id[r["id"]]) for r in rows if r["id"] in by_id]


def mean_interval(values: list[float], scale: float = 1.0, draws: int = DRAWS, seed: int = SEED,
                  level: float = LEVEL) -> tuple[float | None, float | None, float | None]:
    """``scale`` x the mean of ``values`` and its ``level`` percentile bootstrap interval (``draws`` resamples of
    the values, :func:`~evals.output.pairing.resample_means`); Nones for no values, no interval for ``draws=0``."""
    if not values:
        return None, None, None
    x = scale * np.asarray(values, dtype=float)
    if draws <= 0:
        return float(x.mean()), None, None
    low, high = percentile_interval(resample_means([x], draws, np.random.default_rng(seed))[0], level)
    return float(x.mean()), low, high


def agreement_summary(pairs: list[dict], draws: int = DRAWS, seed: int = SEED, level: float = LEVEL) -> dict:
    """The per-run columns :data:`AGREEMENT_COLUMNS` of :func:`paired_agreement`'s pairs: each metric's mean over
    the pairs where it is defined (answer match in %, ROUGE-L x 100) with its bootstrap interval."""
    out: dict = {"n_agreement": len(pairs)}
    for metric in AGREEMENT_MEANS:
        values = [float(p[metric]) for p in pairs if p[metric] is not None]
        mean, low, high = mean_interval(values, SCALE[metric], draws, seed, level)
        out.update({metric: mean, f"{metric}_ci_low": low, f"{metric}_ci_high": high})
    return out


def add_agreement(rows: list[dict], flat: list[dict], draws: int = DRAWS, seed: int = SEED,
                  cache: dict | None = None) -> None:
    """Fills :data:`AGREEMENT_COLUMNS` of every finished run of the summary's ``rows`` (``flat``: their settings)
    that has a full cache run to pair with (:func:`evals.output.pairing.full_reference`, the full cache run of
    ``diff_to_full``), whatever its suite; ``cache``: predictions already read, by run directory."""
    cache = {} if cache is None else cache
    loaded = {i: cache.get(prediction_key(row)) or run_predictions(row)
              for i, row in enumerate(rows) if row.get("status", "incomplete") != "incomplete"}
    for i, preds in loaded.items():
        ref = full_reference(i, rows, flat, loaded)
        if ref is None:
            continue
        try:
            pairs = paired_agreement(rows[i]["eval"], preds, loaded[ref])
        except (KeyError, TypeError, ValueError) as err:
            print(f"warning: {rows[i]['run_dir']}: no agreement with the full cache (a row without {err})",
                  file=sys.stderr)
            continue
        rows[i].update(agreement_summary(pairs, draws, seed))
