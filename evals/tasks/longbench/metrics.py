"""LongBench v1 metrics, computed exactly as the official ``metrics.py`` / ``eval.py`` compute them
(THUDM/LongBench ``metrics.py``).

Libraries are the ones the official code uses: ``rouge==1.0.1`` (pltrdy, not Google's rouge-score:
case-sensitive, sentences split on ".", summary-level union LCS over *distinct* words, any exception
scores 0), ``fuzzywuzzy`` ``fuzz.ratio`` (backed by python-Levenshtein) and ``jieba`` for the Chinese
variants. Quirks are kept on purpose: ``classification_score`` removes items from the list it iterates
over, and signs, case and punctuation are handled as the originals handle them.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

# Tasks whose prediction is cut to its first line before scoring (eval.py).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

_CN_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
                   "–—‘’‛“”„‟…‧﹏.")
_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ALL_PUNCTUATION).split())


def f1_score(prediction: list[str], ground_truth: list[str]) -> float:
    """Token-multiset F1 (Counter intersection); 0 when nothing overlaps."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_cut(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


@lru_cache(maxsize=1)
def _jieba():
    import jieba

    jieba.setLogLevel(60)  # its dictionary-loading banner goes to stderr otherwise
    return jieba


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    def tokens(text):
        return [t for t in (normalize_zh_answer(w) for w in _jieba_cut(text)) if t]
    return f1_score(tokens(prediction), tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F from ``rouge==1.0.1``; 0.0 on any exception (empty text, recursion on long sentences)."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 - the official code uses a bare except here
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: list[str], **_) -> float:
    """1/len(matches) if the ground truth is among the class names found in the prediction.

    Matches that are strict substrings of the ground truth are dropped *while iterating over the same
    list*, so an element right after a removed one is skipped — exactly as the official code does."""
    matches = [c for c in all_classes if c in prediction]
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """``fuzz.ratio`` of the first line without a backtick, ``#`` or ``//`` (blank lines count) and the
    ground truth, divided by 100."""
    from fuzzywuzzy import fuzz

    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz.ratio(line, ground_truth) / 100


DATASET2METRIC = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def scored_text(task: str, prediction: str) -> str:
    """The part of a prediction the task's metric reads (``eval.py``): its first line for :data:`FIRST_LINE_TASKS`
    (leading newlines dropped), the whole text otherwise."""
    return prediction.lstrip("\n").split("\n")[0] if task in FIRST_LINE_TASKS else prediction


def score_prediction(task: str, prediction: str, answers: list[str], all_classes: list[str] | None) -> float:
    """Per-sample score (0-1): the first-line rule, then the max of the task's metric over the answers."""
    prediction = scored_text(task, prediction)
    metric = DATASET2METRIC[task]
    return max((metric(prediction, gt, all_classes=all_classes) for gt in answers), default=0.0)
