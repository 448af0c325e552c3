"""RULER's constants: task templates, the task table and the needle/noise strings (NVIDIA/RULER ``c3f5e3b``,
``scripts/data/synthetic/constants.py`` and ``scripts/synthetic.yaml``)."""
from __future__ import annotations

import numpy as np

# scripts/data/synthetic/constants.py (exact)
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
# The columns IceCache reports (its RULER table): means of the variants.
GROUPS = {"niah_single": ["niah_single_1", "niah_single_2", "niah_single_3"],
          "niah_multikey": ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"],
          "qa": ["qa_1", "qa_2"]}
DATA_FILES = {"essay": "pg_essays/PaulGrahamEssays.json", "squad": "squad/dev-v2.0.json",
              "hotpotqa": "hotpotqa/hotpot_dev_distractor_v1.json", "english_words": "ruler/english_words.json"}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
DOCUMENT_PROMPT = "Document {i}:\n{document}"
