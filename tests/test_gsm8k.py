"""GSM8K suite: the PQCache 10-shot prompt and answer extraction, the lm-eval gsm8k_cot protocol
(strict and flexible match), data errors, limit, and the fractional budget."""
from __future__ import annotations

import json

import pytest
from helpers import DATA_DIR

from evals.task import DataError, resolve_budget
from evals.tasks.gsm8k import (
    GSM8K,
    LM_EVAL_EXEMPLARS,
    lm_eval_exact_match,
    lm_eval_extract,
    pqcache_correct,
)

needs_data = pytest.mark.skipif(not (DATA_DIR / "gsm8k" / "test.jsonl").is_file(),
                                reason=f"shared GSM8K data not found at {DATA_DIR}/gsm8k (set ICECACHE_DATA_DIR)")
GOLD = "She has 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 1,018"


# ------------------------------------------------------------------ PQCache protocol
@pytest.mark.parametrize("generation, correct", [
    ("9 eggs, 9 * 2 = 1018 dollars.\nThe answer is 1018", True),
    ("The answer is 1,018.\nQuestion: John has 5 apples and 99 pears", True),   # cut at "\nQuestion: "
    ("The answer is 1018\nQuestion: 7", True),
    ("The answer is 1018.0", True),                                             # compared as floats
    ("The answer is -1018", True),                                              # the regex ignores signs
    ("The answer is 1017", False),
    ("I cannot tell.", False),                                                  # no number: wrong
    ("1018 first, but the answer is 12", False),                                # the last number counts
    ("The answer is 1018 Question: 5", False),                                  # only "\nQuestion: " cuts
])
def test_pqcache_answer_extraction(generation, correct):
    assert pqcache_correct(generation, GOLD) is correct


@needs_data
def test_pqcache_prompt_is_the_10_shot_file_plus_question(byte_tokenizer):
    suite = GSM8K(byte_tokenizer, data_dir=DATA_DIR, limit=3, max_length=1 << 16)  # bytes: ~11k tokens
    samples = list(suite.samples())
    cot = (DATA_DIR / "gsm8k" / "cot_prompt_10shot.txt").read_text(encoding="utf-8")
    assert cot.count("Let's think step by step\n") == 10 and cot.count("Question: ") == 10
    assert not cot.endswith("\n")
    rows = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    for i, (s, row) in enumerate(zip(samples, rows)):
        assert byte_tokenizer.decode(s.prompt_ids) == "<s>" + cot + "\nQuestion: " + row["question"] + "\n"
        assert s.id == f"gsm8k-{i}" and s.task == "gsm8k" and s.reference == row["answer"]
        assert s.max_new_tokens == 256 and s.stop == [] and s.decode_ids == []
    assert [s.id for s in samples] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    # the gold answer of the first problem (Janet's ducks, 18) against crafted generations
    assert suite.score(samples[0], "She sells 9 eggs for $2 each.\nThe answer is 18")["score"] == 1.0
    assert suite.score(samples[0], "The answer is 16\nQuestion: The answer is 18")["score"] == 0.0


# ------------------------------------------------------------------ lm-eval protocol
@pytest.mark.parametrize("generation, strict, flexible", [
    ("Olivia had 23 dollars. 23 - 15 is 8. The answer is 8.", "8", "8."),
    ("So 5 + 4 = 9. The answer is 1,234.", "1,234", "1,234."),
    ("So 5 + 4 = 9. The answer is $1,234.", "[invalid]", "$1,234."),          # strict allows no "$"
    ("We get 12 apples and then 30 pears", "[invalid]", "30"),
    ("No numbers here", "[invalid]", "[invalid]"),
    ("The answer is -3.5 The answer is 7.", "-3.5", "7."),
])
def test_lm_eval_filters(generation, strict, flexible):
    assert lm_eval_extract(generation) == {"strict_match": strict, "flexible_extract": flexible}


def test_lm_eval_exact_match_normalisation():
    assert lm_eval_exact_match("$1,234", "1234")
    assert lm_eval_exact_match("8.", "8")
    assert lm_eval_exact_match("#### 8", "8")
    assert not lm_eval_exact_match("8.0", "8")
    assert not lm_eval_exact_match("[invalid]", "8")


def _write_gsm8k(root, lines: str, cot: str = "Question: 1+1?\nLet's think step by step\n1+1=2\nThe answer is 2"):
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(lines)
    (root / "gsm8k" / "cot_prompt_10shot.txt").write_text(cot)


def test_lm_eval_prompt_stop_and_scores(tmp_path, byte_tokenizer):
    _write_gsm8k(tmp_path, json.dumps({"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"}) + "\n")
    suite = GSM8K(byte_tokenizer, data_dir=tmp_path, protocol="lm_eval")
    s = next(suite.samples())
    shots = "\n\n".join(f"Q: {q}\nA: {t}" for q, t in LM_EVAL_EXEMPLARS)
    assert byte_tokenizer.decode(s.prompt_ids) == "<s>" + shots + "\n\nQ: What is 2+3?\nA:"
    assert len(LM_EVAL_EXEMPLARS) == 8 and s.stop == ["Q:", "</s>", "<|im_end|>"] and s.max_new_tokens == 256
    assert suite.score(s, " 2 + 3 = 5. The answer is 5.\n\nQ: next The answer is 6.") == \
        {"score": 1.0, "strict_match": 1.0, "flexible_extract": 1.0}
    # text after a stop string is ignored even if the runner did not cut it
    assert suite.score(s, " 2 + 3 = 5 apples\n\nQ: 7 The answer is 7.") == \
        {"score": 0.0, "strict_match": 0.0, "flexible_extract": 1.0}
    rows = [{"task": "gsm8k", "scores": suite.score(s, g)} for g in ("The answer is 5.", "so 5", "The answer is 4.")]
    out = suite.aggregate(rows)
    assert out["score"] == pytest.approx(100 / 3) and out["strict_match"] == pytest.approx(100 / 3)
    assert out["flexible_extract"] == pytest.approx(200 / 3) and out["tasks"] == {"gsm8k": out["score"]}
    assert out["n_samples"] == 3 and out["protocol"] == "lm_eval"
    bare = GSM8K(byte_tokenizer, data_dir=tmp_path, protocol="lm_eval", add_special_tokens=False)
    assert byte_tokenizer.decode(next(bare.samples()).prompt_ids).startswith("Q: There are 15 trees")


# ------------------------------------------------------------------ data handling
@pytest.mark.parametrize("bad, problem", [('{"question": "q"}', "missing field 'answer'"),
                                          ('{"question": "q", "answer": "no number"}', "no final number"),
                                          ('{"question": ', "not valid JSON")])
def test_malformed_row_names_file_and_line(tmp_path, byte_tokenizer, bad, problem):
    good = json.dumps({"question": "q", "answer": "#### 3"})
    _write_gsm8k(tmp_path, f"{good}\n{good}\n{bad}\n")
    suite = GSM8K(byte_tokenizer, data_dir=tmp_path)
    with pytest.raises(DataError) as err:
        list(suite.samples())
    assert f"{tmp_path / 'gsm8k' / 'test.jsonl'}, line 3" in str(err.value) and problem in str(err.value)
    assert [s.id for s in GSM8K(byte_tokenizer, data_dir=tmp_path, limit=2).samples()] == ["gsm8k-0", "gsm8k-1"]


def test_missing_data_and_bad_options(tmp_path, byte_tokenizer):
    with pytest.raises(DataError, match="gsm8k/test.jsonl not found"):
        GSM8K(byte_tokenizer, data_dir=tmp_path)
    with pytest.raises(ValueError, match="protocol"):
        GSM8K(byte_tokenizer, data_dir=tmp_path, protocol="zero_shot")
    _write_gsm8k(tmp_path, json.dumps({"question": "q", "answer": "#### 3"}))
    with pytest.raises(ValueError, match="more than the model's maximum"):
        list(GSM8K(byte_tokenizer, data_dir=tmp_path, max_length=16).samples())
    with pytest.raises(ValueError, match="limit"):
        GSM8K(byte_tokenizer, data_dir=tmp_path, limit=0)


# ------------------------------------------------------------------ budget as a fraction of the prompt
def test_resolve_budget():
    assert resolve_budget(0.1, 3000) == 288          # 300 rounded down to a multiple of 16
    assert resolve_budget(0.1, 500) == 64            # at least 64
    assert resolve_budget(0.5, 1000, multiple=8, minimum=16) == 496 // 8 * 8
    assert resolve_budget(256, 3000) == 256 and resolve_budget(256.0, 10) == 256
    assert resolve_budget(None, 3000) is None
    for bad in (0, -0.1, 1.5, -64):
        with pytest.raises(ValueError):
            resolve_budget(bad, 3000)
