"""LongBench suite: official metrics on hand-computed values, prompt building on the real sample rows,
middle truncation, chat rules, samsum, data errors, subsets and limits (THUDM/LongBench pred.py, metrics.py)."""
from __future__ import annotations

import json
import shutil

import pytest
from helpers import DATA_DIR, build_byte_tokenizer

from evals.tasks.longbench import metrics as m
from evals.task import DataError
from evals.tasks.longbench import CHINESE_TASKS, ENGLISH_TASKS, LongBench

SAMPLE_TASKS = ["qasper", "multifieldqa_en", "2wikimqa", "trec", "lcc", "multi_news"]
needs_data = pytest.mark.skipif(not (DATA_DIR / "longbench_sample").is_dir(),
                                reason=f"shared LongBench sample data not found at {DATA_DIR} (set ICECACHE_DATA_DIR)")
needs_config = pytest.mark.skipif(not (DATA_DIR / "longbench_config").is_dir(),
                                  reason=f"official LongBench config not found at {DATA_DIR}/longbench_config")


# ------------------------------------------------------------------ metrics (hand-computed values)
def test_normalize_answer_official_steps():
    assert m.normalize_answer("The  Eiffel-Tower, in an Apple!") == "eiffeltower in apple"
    assert m.normalize_answer("Theatre a") == "theatre"  # articles only as whole words


def test_qa_f1():
    # normalized: "eiffel tower in paris" vs "eiffel tower": P = 2/4, R = 2/2 -> F1 = 2/3
    assert m.qa_f1_score("The Eiffel Tower, in Paris!", "eiffel tower") == pytest.approx(2 / 3)
    assert m.qa_f1_score("a cat", "the dog") == 0.0
    # multiset: pred "yes yes" vs "yes": P = 1/2, R = 1 -> 2/3
    assert m.qa_f1_score("yes yes", "Yes.") == pytest.approx(2 / 3)


def test_qa_f1_zh():
    # jieba: 北京 / 是 / 首都 vs 北京 -> P = 1/3, R = 1 -> F1 = 1/2; punctuation dropped
    assert m.qa_f1_zh_score("北京是首都。", "北京") == pytest.approx(0.5)


def test_rouge_l_is_rouge_1_0_1():
    # rouge 1.0.1 counts *distinct* words: m = n = 5, LCS words {the, cat, on, mat} = 4 -> F = 0.8
    # (Google's rouge-score: LCS 5 of 6 tokens -> 5/6)
    assert m.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    assert m.rouge_score("the cat the", "the cat") == pytest.approx(1.0, abs=1e-6)  # rouge-score: 0.8
    # LCS "a b": R = 2/4, P = 2/3 -> F = 2PR/(P+R) = 4/7
    assert m.rouge_score("a b c", "a b d e") == pytest.approx(4 / 7, abs=1e-6)
    assert m.rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-6)  # case-sensitive
    assert m.rouge_score("", "the cat") == 0.0  # the library raises on empty text; official code scores 0


def test_rouge_zh_joins_jieba_tokens():
    assert m.rouge_zh_score("北京是首都", "北京是首都") == pytest.approx(1.0, abs=1e-6)
    assert m.rouge_zh_score("北京", "上海") == 0.0


def test_code_sim():
    # first line without `, # or //; "x = foo(1)" vs "x = foo(2)": indel distance 2 over 20 chars -> 90
    assert m.code_sim_score("\n// comment\n# note\nx = foo(1)\nmore", "x = foo(2)") == pytest.approx(0.9)
    assert m.code_sim_score("# only comments\n`code`", "x = 1") == 0.0
    assert m.code_sim_score("x = 1", "x = 1") == 1.0


def test_count_and_retrieval():
    assert m.count_score("There are 3 unique paragraphs, not 4 or 3", "3") == pytest.approx(2 / 3)
    assert m.count_score("no digits", "3") == 0.0
    assert m.retrieval_score("Paragraph 12 and paragraph 1", "Paragraph 12") == pytest.approx(0.5)
    assert m.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert m.retrieval_zh_score("段落3", "段落3") == 1.0


def test_classification_keeps_the_official_list_removal_quirk():
    classes = ["Human", "Human being", "Location"]
    assert m.classification_score("Human being", "Human being", all_classes=classes) == 1.0
    assert m.classification_score("Location", "Human being", all_classes=classes) == 0.0
    # matches [a, ab, abc]; removing "a" while iterating skips "ab", so 1/len([ab, abc]) = 0.5
    assert m.classification_score("abc", "abc", all_classes=["a", "ab", "abc"]) == 0.5


def test_score_prediction_first_line_and_max_over_answers():
    assert m.score_prediction("triviaqa", "\n\nParis\nLondon", ["London", "Paris"], None) == 1.0
    assert m.score_prediction("qasper", "Paris\nLondon", ["London"], None) == pytest.approx(2 / 3)
    assert m.score_prediction("samsum", "\nthe cat sat.\nDialogue: junk", ["the cat sat."], None) \
        == pytest.approx(1.0, abs=1e-6)
    assert m.score_prediction("qasper", "anything", [], None) == 0.0


# ------------------------------------------------------------------ prompts on the real sample rows
@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def rows_of(task):
    with open(DATA_DIR / "longbench_sample" / f"{task}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def official_prompt(task, row):
    template = json.loads((DATA_DIR / "longbench_config" / "dataset2prompt.json").read_text())[task]
    return template.format(**row)


@needs_data
def test_prompts_match_the_official_templates_without_truncation(tok):
    suite = LongBench(tok, data_dir=DATA_DIR, tasks=SAMPLE_TASKS, max_length=1 << 20, limit=1)
    samples = {s.task: s for s in suite.samples()}
    assert set(samples) == set(SAMPLE_TASKS)
    maxlen = json.loads((DATA_DIR / "longbench_config" / "dataset2maxlen.json").read_text())
    for task, s in samples.items():
        row = rows_of(task)[0]
        text = official_prompt(task, row)
        expected = "<s>" + text if task in ("trec", "lcc") else \
            f"<s><|system|>You are a helpful assistant.\n<|user|>{text}\n<|assistant|>"
        assert tok.decode(s.prompt_ids) == expected, task
        assert s.max_new_tokens == maxlen[task]
        assert s.id == f"{task}-{row['_id']}"
        assert s.reference["answers"] == row["answers"] and s.meta["data"] == "longbench_sample"
        assert not s.meta["truncated"] and s.decode_ids == [] and s.stop == []
    assert samples["trec"].reference["all_classes"] == rows_of("trec")[0]["all_classes"]
    assert rows_of("trec")[0]["input"].endswith("Type:")  # the suffix is in the data


@needs_data
@pytest.mark.parametrize("task", ["trec", "lcc", "qasper"])
def test_middle_truncation_keeps_head_and_tail(tok, task):
    max_length = 1000
    suite = LongBench(tok, data_dir=DATA_DIR, tasks=[task], max_length=max_length, chat_format="none", limit=2)
    for s, row in zip(suite.samples(), rows_of(task)):
        full = tok(official_prompt(task, row))["input_ids"]
        assert s.meta["truncated"] and s.meta["n_tokens_untruncated"] == len(full) > max_length
        assert len(s.prompt_ids) <= max_length
        half = max_length // 2
        assert s.prompt_ids[: half] == full[: half]  # BOS + head (the decoded BOS is re-added on encoding)
        assert s.prompt_ids[-(half - 1):] == full[-(half - 1):]  # the tail
        text = tok.decode(s.prompt_ids, skip_special_tokens=True)
        assert text.endswith(tok.decode(full[-half:], skip_special_tokens=True))


@needs_data
def test_chat_wrapper_is_applied_after_truncation(tok):
    max_length = 600
    suite = LongBench(tok, data_dir=DATA_DIR, tasks=["qasper"], max_length=max_length, limit=1, system_prompt=None)
    s = next(suite.samples())
    text = tok.decode(s.prompt_ids)
    assert text.startswith("<s><|user|>") and text.endswith("\n<|assistant|>")
    user = text[len("<s><|user|>"): -len("\n<|assistant|>")]
    assert len(tok(user, add_special_tokens=False)["input_ids"]) == max_length - 1  # halves minus the BOS
    assert len(s.prompt_ids) > max_length  # template tokens come on top, as in pred.py


@needs_data
def test_chat_rules_per_task_and_format(tok):
    tasks = ["qasper", "trec", "lcc", "multi_news"]
    for fmt, start in [("template", "<s><|system|>"), ("inst", "<s>[INST]"), ("none", "<s>")]:
        suite = LongBench(tok, data_dir=DATA_DIR, tasks=tasks, max_length=1 << 20, limit=1, chat_format=fmt)
        for s in suite.samples():
            text = tok.decode(s.prompt_ids)
            wrapped = s.task in ("qasper", "multi_news") and fmt != "none"
            assert s.meta["chat"] == wrapped
            if wrapped:
                assert text.startswith(start), (fmt, s.task)
                assert text.endswith("[/INST]" if fmt == "inst" else "<|assistant|>")
            else:
                assert text == "<s>" + official_prompt(s.task, rows_of(s.task)[0])
    # the double BOS of PQCache's Llama-3 wrapper is optional
    suite = LongBench(tok, data_dir=DATA_DIR, tasks=["qasper"], max_length=1 << 20, limit=1,
                      chat_add_special_tokens=False)
    assert tok.decode(next(suite.samples()).prompt_ids).startswith("<|system|>")


def test_template_format_needs_a_chat_template(tmp_path):
    _write_data(tmp_path, {"qasper": [_row()], "trec": [_row(all_classes=["A"])]})
    plain = build_byte_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        LongBench(plain, data_dir=tmp_path, tasks=["qasper"])
    assert len(list(LongBench(plain, data_dir=tmp_path, tasks=["trec"]).samples())) == 1  # trec never wraps


# ------------------------------------------------------------------ handcrafted data folders
def _row(**over):
    row = {"input": "What is it?", "context": "Some {braces} context.", "answers": ["an answer"], "length": 3,
           "dataset": "x", "language": "en", "all_classes": None, "_id": None}
    row.update(over)
    return row


def _write_data(root, tasks: dict, folder="longbench", lines: dict | None = None):
    shutil.copytree(DATA_DIR / "longbench_config", root / "longbench_config") if (DATA_DIR / "longbench_config").is_dir() \
        else pytest.skip(f"official LongBench config not found at {DATA_DIR}/longbench_config")
    (root / folder).mkdir()
    for task, rows in tasks.items():
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        (root / folder / f"{task}.jsonl").write_text((lines or {}).get(task, text))


@needs_config
def test_samsum_stops_at_the_newline_token_after_one_token(tmp_path, tok):
    _write_data(tmp_path, {"samsum": [_row(input="Dialogue: A: hi\nSummary:", answers=["A says hi."])]})
    s = next(LongBench(tok, data_dir=tmp_path, tasks=["samsum"]).samples())
    assert s.stop_token_ids == [tok.encode("\n", add_special_tokens=False)[-1]] and s.min_new_tokens == 1
    assert s.eos_token_ids == [tok.eos_token_id]  # pred.py: eos_token_id=[tokenizer.eos_token_id, newline]
    assert not s.meta["chat"] and s.max_new_tokens == 128
    suite = LongBench(tok, data_dir=tmp_path, tasks=["samsum"])
    assert suite.score(s, "\nA says hi.\nDialogue: more")["score"] == pytest.approx(1.0, abs=1e-6)
    assert suite.score(s, "Nothing.\nA says hi.")["score"] == 0.0


@needs_config
def test_ids_limit_and_task_subset(tmp_path, tok):
    _write_data(tmp_path, {"qasper": [_row(_id="q0"), _row(_id="q1"), _row(_id="q2")],
                           "hotpotqa": [_row(), _row(), _row()], "narrativeqa": [_row()]})
    suite = LongBench(tok, data_dir=tmp_path, tasks=["qasper", "hotpotqa"], limit=2)
    assert [s.id for s in suite.samples()] == ["qasper-q0", "qasper-q1", "hotpotqa-0", "hotpotqa-1"]
    # braces inside the context are data, not format fields
    assert "Some {braces} context." in tok.decode(next(suite.samples()).prompt_ids)
    with pytest.raises(ValueError, match="unknown"):
        LongBench(tok, data_dir=tmp_path, tasks=["qasper", "nope"])


@needs_config
def test_default_tasks_and_chinese_option(tmp_path, tok):
    _write_data(tmp_path, {})
    with pytest.raises(DataError, match="narrativeqa.jsonl not found"):
        LongBench(tok, data_dir=tmp_path)  # the 16 English tasks are the default
    with pytest.raises(DataError, match="multifieldqa_zh.jsonl not found"):
        _write_data_rows(tmp_path, {t: [_row()] for t in ENGLISH_TASKS})
        LongBench(tok, data_dir=tmp_path, chinese=True)
    assert LongBench(tok, data_dir=tmp_path).tasks == list(ENGLISH_TASKS)


def _write_data_rows(root, tasks):
    for task, rows in tasks.items():
        (root / "longbench" / f"{task}.jsonl").write_text(
            "\n".join(json.dumps(r if task not in ("trec", "lsht") else {**r, "all_classes": ["A"]}) for r in rows))


@needs_config
def test_missing_file_names_the_path_and_how_to_get_it(tmp_path, tok):
    _write_data(tmp_path, {"qasper": [_row()]})
    with pytest.raises(DataError) as err:
        LongBench(tok, data_dir=tmp_path, tasks=["qasper", "musique"])
    assert str(tmp_path / "longbench" / "musique.jsonl") in str(err.value)
    assert "THUDM/LongBench" in str(err.value)
    with pytest.raises(DataError, match="data_dir"):
        LongBench(tok, data_dir=None, tasks=["qasper"])


@needs_config
@pytest.mark.parametrize("line, problem", [('{"input": "q", "answers": ["a"]}', "missing field 'context'"),
                                           ('{"input": "q", "context": "c", "answers": "a"}', "must be a list"),
                                           ('{"input": "q", "context": ', "not valid JSON")])
def test_malformed_row_names_file_line_and_field(tmp_path, tok, line, problem):
    good = json.dumps(_row())
    _write_data(tmp_path, {"qasper": []}, lines={"qasper": f"{good}\n\n{line}\n{good}\n"})
    suite = LongBench(tok, data_dir=tmp_path, tasks=["qasper"])
    with pytest.raises(DataError) as err:
        list(suite.samples())
    assert f"{tmp_path / 'longbench' / 'qasper.jsonl'}, line 3" in str(err.value) and problem in str(err.value)
    assert len(list(LongBench(tok, data_dir=tmp_path, tasks=["qasper"], limit=1).samples())) == 1


@needs_config
def test_classification_rows_need_all_classes(tmp_path, tok):
    _write_data(tmp_path, {"trec": [_row()]})
    with pytest.raises(DataError, match="line 1: missing field 'all_classes'"):
        list(LongBench(tok, data_dir=tmp_path, tasks=["trec"]).samples())


@needs_config
def test_config_is_read_from_data_dir(tmp_path, tok):
    _write_data(tmp_path, {"qasper": [_row()]})
    maxlen = json.loads((tmp_path / "longbench_config" / "dataset2maxlen.json").read_text())
    (tmp_path / "longbench_config" / "dataset2maxlen.json").write_text(json.dumps({**maxlen, "qasper": 7}))
    assert next(LongBench(tok, data_dir=tmp_path, tasks=["qasper"]).samples()).max_new_tokens == 7


@needs_config
def test_hub_dataset_only_when_asked_and_file_missing(tmp_path, tok, monkeypatch):
    import datasets

    _write_data(tmp_path, {"qasper": [_row(_id="local")]})
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return [_row(_id="hub0"), _row(_id="hub1")]
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    suite = LongBench(tok, data_dir=tmp_path, tasks=["qasper", "musique"], hf_dataset="THUDM/LongBench", limit=1)
    samples = list(suite.samples())
    assert [s.id for s in samples] == ["qasper-local", "musique-hub0"]
    assert calls == [("THUDM/LongBench", "musique", "test")]
    assert [s.meta["data"] for s in samples] == ["longbench", "hf:THUDM/LongBench"]


@needs_data
def test_sample_fallback_is_reported_and_explicit_dir_is_not_replaced(tok):
    suite = LongBench(tok, data_dir=DATA_DIR, tasks=["trec"], limit=2, max_length=4096)
    rows = [{"task": s.task, "scores": suite.score(s, s.reference["answers"][0]), "meta": s.meta}
            for s in suite.samples()]
    assert [r["scores"]["score"] for r in rows] == [1.0, 1.0]  # the gold label scores 1 on the real trec rows
    assert suite.aggregate(rows)["data"] == ["longbench_sample"]
    with pytest.raises(DataError, match="elsewhere/trec.jsonl not found"):
        LongBench(tok, data_dir=DATA_DIR, tasks=["trec"], longbench_dir="elsewhere")


# ------------------------------------------------------------------ aggregate
def test_aggregate_rounds_per_task_and_averages_english_tasks(tmp_path):
    def rows(task, scores):
        return [{"task": task, "scores": {"score": s}, "meta": {"data": "longbench"}} for s in scores]
    all_rows = rows("qasper", [1.0, 0.0, 0.0]) + rows("trec", [1.0]) + rows("lsht", [0.5])
    out = LongBench.aggregate(object.__new__(LongBench), all_rows)
    assert out["tasks"] == {"qasper": 33.33, "trec": 100.0, "lsht": 50.0}
    assert out["score"] == pytest.approx((33.33 + 100.0) / 2) and out["score_zh"] == 50.0
    assert out["n_english_tasks"] == 2 and out["n_samples"] == 5 and out["data"] == ["longbench"]
    assert len(ENGLISH_TASKS) == 16 and len(CHINESE_TASKS) == 5


def test_samsum_eos_list_replaces_the_generation_configs():
    """pred.py passes eos_token_id=[tokenizer.eos, newline] for samsum: the generation config's other EOS ids
    (Llama-3.1's <|end_of_text|>) no longer end generation; every other task keeps them."""
    from baselines.full import FullCache
    from evals.runner import generate
    from evals.models import load_model, load_tokenizer

    model, tok = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    prompt = tok("Dialogue: A: hi")["input_ids"]
    first = generate(model, tok, FullCache(), prompt, 6, ignore_eos=True).token_ids
    assert first[2] not in first[:2]
    model.generation_config.eos_token_id = [first[2]]  # a second EOS id of the generation config
    assert generate(model, tok, FullCache(), prompt, 6).token_ids == first[:2]
    kept = generate(model, tok, FullCache(), prompt, 6, eos_token_ids=[tok.eos_token_id]).token_ids
    assert kept[:3] == first[:3] and len(kept) > 2
