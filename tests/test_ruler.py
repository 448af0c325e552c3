"""RULER suite (evals/tasks/ruler/; NVIDIA/RULER scripts/data/synthetic): generation fidelity, length fitting, metrics."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from helpers import DATA_DIR
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from evals.task import DataError, Sample
from evals.tasks.ruler import (
    TASKS,
    TEMPLATES,
    AdjNounWords,
    Ruler,
    _wonderwords,
    postprocess,
    string_match_all,
    string_match_part,
)

needs_data = pytest.mark.skipif(not (DATA_DIR / "pg_essays").is_dir(), reason=f"shared data not at {DATA_DIR}")
CHAT = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# incremental haystack units of each generator at >= 4096 tokens (the official step sizes)
INCREMENTAL = {"essay": 500, "noise": 25, "needle": 25, "variable_tracking": 10, "common_words_extraction": 10,
               "qa": 10}
NOISE_TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in-process on RULER's words, with a minimal chat template."""
    corpus = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
              "One of the special magic numbers for key is: 1234567. Answer the question. Document VAR"] * 20
    corpus += [" ".join(_wonderwords(f)) for f in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=3000, special_tokens=["<eos>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def all_samples(tokenizer):
    """Every available task at 4096 tokens, two samples each (the shared data provides essays and SQuAD)."""
    if not (DATA_DIR / "pg_essays").is_dir():
        pytest.skip(f"shared data not at {DATA_DIR}")
    suite = Ruler(tokenizer, data_dir=DATA_DIR, lengths=[4096], num_samples=2, max_length=8192, seed=42)
    return suite, list(suite.samples())


def _text(tokenizer, sample) -> str:
    return tokenizer.decode(sample.prompt_ids)


# ----------------------------------------------------------------------------------------- generation
def test_every_sample_fits_its_length(all_samples):
    suite, samples = all_samples
    assert {s.task for s in samples} == set(TASKS) - {"qa_2"}
    for s in samples:
        generator, args = TASKS[s.task]
        total = len(s.prompt_ids) + s.max_new_tokens
        assert s.max_new_tokens == TEMPLATES[generator]["tokens_to_generate"]
        assert total <= 4096, s.id
        # the official fit: the haystack is the largest that fits, less at most one incremental step
        units = s.meta["haystack_units"]
        step = (4046 // 32 if generator == "freq_words_extraction"
                else INCREMENTAL.get(args.get("type_haystack"), INCREMENTAL.get(generator)))
        assert 4096 - total < 1.25 * step * len(s.prompt_ids) / units + 64, (s.id, total, units)
        assert s.meta["n_tokens"] == len(s.prompt_ids) and s.meta["length"] == 4096


def test_chat_wrapper_then_answer_prefix(all_samples, tokenizer):
    suite, samples = all_samples
    assert suite.model_template == "chat"
    s = next(s for s in samples if s.task == "niah_single_1")
    text = _text(tokenizer, s)
    query = re.search(r"What is the special magic number for (.+?) mentioned in the provided text\?", text).group(1)
    assert text.startswith("<|user|>\nA special magic number is hidden within the following text.")
    assert text.endswith("mentioned in the provided text?<|end|>\n<|assistant|>\n The special magic number for "
                         f"{query} mentioned in the provided text is")
    assert s.meta["answer_prefix"] == f" The special magic number for {query} mentioned in the provided text is"
    assert suite.encode(text) == s.prompt_ids


def _niah_ok(text: str, sample) -> bool:
    question = r"What (?:are all|is) the special magic \w+ for (.+?) mentioned in the provided text\?"
    keys = re.split(r", and |, ", re.findall(question, text)[-1])
    values = [v for k in keys
              for v in re.findall(rf"One of the special magic \w+ for {re.escape(k)} is: (\S+)\.", text)]
    return sorted(values) == sorted(sample.reference) and len(sample.reference) == len(keys) * (
        4 if sample.task == "niah_multivalue" else 1)


def _vt_ok(text: str, sample) -> bool:
    value = re.findall(r"assigned the value (\d+) in the text above", text)[-1]
    edges = dict(re.findall(r"\bVAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d+)", text))

    def root(var):
        while var in edges:
            var = edges[var]
        return var
    return sorted(v for v in edges if root(v) == value) == sorted(sample.reference)


def _cwe_ok(text: str, sample) -> bool:
    listing = text.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion:")[0]
    counts = Counter(re.split(r"(?:^| )\d+\. ", listing)[1:]).most_common()
    return {w for w, _ in counts[:10]} == set(sample.reference) and counts[9][1] > counts[10][1]


def _fwe_ok(text: str, sample) -> bool:
    coded = text.split("Find the three most frequently appeared coded words. ")[1].split("\nQuestion:")[0]
    counts = Counter(w for w in coded.split(" ") if w != "...").most_common()
    return [w for w, _ in counts[:3]] == sample.reference and counts[2][1] > counts[3][1]


def _qa_ok(text: str, sample) -> bool:
    return any(answer in text for answer in sample.reference) and "Document 1:\n" in text


def test_needles_present_and_answers_correct_by_construction(all_samples, tokenizer):
    suite, samples = all_samples
    check = {"niah": _niah_ok, "variable_tracking": _vt_ok, "common_words_extraction": _cwe_ok,
             "freq_words_extraction": _fwe_ok, "qa": _qa_ok}
    for s in samples:
        assert check[TASKS[s.task][0]](_text(tokenizer, s), s), s.id
    vt = _text(tokenizer, next(s for s in samples if s.task == "vt"))
    assert len(re.findall(r"\bVAR [A-Z]{3} = ", vt)) == 5  # the in-context example, 3-letter names
    cwe = _text(tokenizer, next(s for s in samples if s.task == "cwe"))
    assert cwe.count("<|user|>") == 2  # upstream: the few-shot example is a whole wrapped turn


def test_determinism_and_seed(tokenizer):
    def run(seed):
        suite = Ruler(tokenizer, lengths=[2048], num_samples=2, tasks=NOISE_TASKS, max_length=4096, seed=seed)
        return [(s.id, s.prompt_ids, s.reference) for s in suite.samples()]
    first = run(0)
    assert first == run(0)
    other = run(1)
    assert [x[0] for x in other] == [x[0] for x in first]
    assert all(a[1] != b[1] and a[2] != b[2] for a, b in zip(first, other))


def test_tasks_lengths_and_limit(tokenizer):
    suite = Ruler(tokenizer, lengths=[1024, 2048], num_samples=5, limit=2, tasks=["niah_single_1", "fwe"],
                  max_length=4096, model_template="base")
    ids = [s.id for s in suite.samples()]
    assert ids == [f"{t}-{n}-{i}" for n in (1024, 2048) for t in ("niah_single_1", "fwe") for i in range(2)]
    base = next(Ruler(tokenizer, lengths=[1024], num_samples=1, tasks=["niah_single_1"], max_length=4096,
                      model_template="base").samples())
    assert tokenizer.decode(base.prompt_ids).startswith("A special magic number is hidden")
    with pytest.raises(ValueError, match="unknown RULER task"):
        Ruler(tokenizer, tasks=["niah_single_9"], max_length=4096)
    with pytest.raises(ValueError, match="at most the model's maximum"):
        Ruler(tokenizer, lengths=[8192], tasks=["vt"], max_length=4096)


# ---------------------------------------------------------------------------------------------- data
@needs_data
def test_qa_1_reads_squad(tokenizer):
    data = json.loads((DATA_DIR / "squad" / "dev-v2.0.json").read_text())
    answerable = [q for d in data["data"] for p in d["paragraphs"] for q in p["qas"] if not q["is_impossible"]]
    suite = Ruler(tokenizer, data_dir=DATA_DIR, lengths=[4096], num_samples=3, tasks=["qa_1"], max_length=8192)
    samples = list(suite.samples())
    for i, s in enumerate(samples):
        assert s.reference == [a["text"] for a in answerable[i]["answers"]]
        assert f"Question: {answerable[i]['question']}<|end|>" in tokenizer.decode(s.prompt_ids)


def test_qa_2_skipped_without_hotpotqa_and_read_when_present(tokenizer, tmp_path, caplog):
    suite = Ruler(tokenizer, data_dir=tmp_path, tasks=["niah_single_1", "qa_2"], lengths=[1024], num_samples=1,
                  max_length=4096)
    expected = tmp_path / "hotpotqa" / "hotpot_dev_distractor_v1.json"
    assert str(expected) in suite.skipped["qa_2"] and "qa_2 skipped" in caplog.text
    assert [s.task for s in suite.samples()] == ["niah_single_1"]
    assert suite.aggregate([])["skipped"] == suite.skipped
    items = [{"question": f"Who wrote book {i}?", "answer": f"Author {i}",
              "context": [[f"Book {i}", [f"Book {i} was written by Author {i}.", " It sold well."]],
                          [f"Other {i}", [f"Other {i} is a place."]]]} for i in range(30)]
    expected.parent.mkdir()
    expected.write_text(json.dumps(items))
    samples = list(Ruler(tokenizer, data_dir=tmp_path, tasks=["qa_2"], lengths=[1024], num_samples=2,
                         max_length=4096).samples())
    assert [s.reference for s in samples] == [["Author 0"], ["Author 1"]]
    text = tokenizer.decode(samples[1].prompt_ids)
    assert "Book 1\nBook 1 was written by Author 1. It sold well." in text and "Question: Who wrote book 1?" in text


def test_missing_data_files_name_the_path(tokenizer, tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "pg_essays" / "PaulGrahamEssays.json"))):
        Ruler(tokenizer, data_dir=tmp_path, tasks=["niah_single_2"], max_length=4096)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "squad" / "dev-v2.0.json"))):
        Ruler(tokenizer, data_dir=tmp_path, tasks=["qa_1"], max_length=4096)
    with pytest.raises(DataError, match="needs data_dir"):
        Ruler(tokenizer, tasks=["qa_1"], max_length=4096)


def test_adj_noun_words_equal_sorted_set():
    adjs = ["high", "high-pitched", "ad hoc", "Early", "x-rated", "x", "blue", "blue-eyed", "blue-eyed-ish", "ad"]
    nouns = ["pitched-tone", "tone", "ATM", "e-mail", "contact lens", "eyed", "eyed-ish", "rated", "zebra"]
    brute = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    words = AdjNounWords(adjs, nouns)
    assert len(words) == len(brute) and [words[k] for k in range(len(words))] == brute


# ------------------------------------------------------------------------------------------- metrics
def test_metrics_hand_computed():
    assert postprocess("  \x00 1234567\tand 7654321 \n") == "1234567\nand 7654321"
    assert string_match_all("The numbers are 1234567 and 2345678.", ["1234567", "2345678", "3456789"]) == 2 / 3
    assert string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert string_match_part("It was in FRANCE.", ["Paris", "France"]) == 1.0
    assert string_match_part("no idea", ["Paris", "France"]) == 0.0


def test_score_and_aggregate(tokenizer):
    suite = Ruler(tokenizer, tasks=["niah_single_1"], max_length=4096)
    mv = Sample("niah_multivalue-4096-0", "niah_multivalue", [1], 128, ["1111111", "2222222", "3333333", "4444444"])
    qa = Sample("qa_1-4096-0", "qa_1", [1], 32, ["Paris", "France"])
    assert suite.score(mv, " 1111111, 2222222 and 9999999") == {"score": 0.5, "null": 0.0}
    assert suite.score(qa, " france\x01") == {"score": 1.0, "null": 0.0}
    assert suite.score(qa, " \n ") == {"score": 0.0, "null": 1.0}

    def row(task, length, score):
        return {"task": task, "meta": {"length": length}, "scores": {"score": score, "null": 0.0}}
    rows = [row("niah_single_1", 4096, 1.0), row("niah_single_1", 4096, 0.0), row("niah_single_2", 4096, 1 / 3),
            row("qa_1", 4096, 1.0), row("niah_single_1", 8192, 0.0)]
    out = suite.aggregate(rows)
    assert out["lengths"]["4096"]["tasks"] == {"niah_single_1": 50.0, "niah_single_2": 33.33, "qa_1": 100.0}
    assert out["lengths"]["4096"]["score"] == pytest.approx((50 + 33.33 + 100) / 3)
    assert out["tasks"] == {"niah_single_1": 25.0, "niah_single_2": 33.33, "qa_1": 100.0}
    assert out["groups"] == {"niah_single": pytest.approx((25 + 33.33) / 2), "qa": 100.0}
    assert out["score"] == pytest.approx((25 + 33.33 + 100) / 3) and out["n_samples"] == 5


@pytest.mark.slow
@needs_data
def test_smollm2_tokenizer_chat_prompts():
    from transformers import AutoTokenizer

    from evals.models import ModelUnavailableError, smollm2_checkpoint
    try:
        tok = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    except ModelUnavailableError as err:
        pytest.skip(str(err))
    suite = Ruler(tok, data_dir=DATA_DIR, lengths=[4096], num_samples=1, max_length=8192,
                  tasks=["niah_single_2", "niah_multikey_1", "cwe", "qa_1"])
    for s in suite.samples():
        text = tok.decode(s.prompt_ids)
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n Answer" in text \
            or "<|im_start|>assistant\n The special magic" in text
        assert 4096 - 1000 < len(s.prompt_ids) + s.max_new_tokens <= 4096, s.id
        check = {"niah": _niah_ok, "common_words_extraction": _cwe_ok, "qa": _qa_ok}[TASKS[s.task][0]]
        assert check(text, s), s.id
