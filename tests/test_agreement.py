"""Agreement with the full cache (evals/output/agreement.py): answer match, tokens to divergence and ROUGE-L of a
run against the full cache run of the same samples, checked against direct computations on crafted outputs; their
per-run means in the summary and the tables; the runner's ``output_ids`` on the tiny model."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from rouge import Rouge

from evals.output import agreement, results, summary, tables
from evals.tasks.longbench.metrics import normalize_answer

DRAWS = 300


def gsm8k_row(sid: str, prediction: str, ids: list[int] | None, protocol: str = "pqcache") -> dict:
    row = {"id": sid, "task": "gsm8k", "prediction": prediction, "reference": "#### 18", "scores": {"score": 1.0},
           "meta": {"protocol": protocol}}
    return row if ids is None else {**row, "output_ids": ids}


# ---------------------------------------------------------------- per sample, against direct computations
def test_identical_outputs_agree_everywhere_and_diverge_at_their_length():
    ids = [5, 8, 13, 21, 34]
    full = gsm8k_row("gsm8k-0", "3 + 15 = 18. The answer is 18.", ids)
    out = agreement.agreement_row("gsm8k", dict(full), full)
    assert out == {"id": "gsm8k-0", "task": "gsm8k", "answer_match": True, "tokens_to_divergence": len(ids),
                   "rouge_l": 1.0}


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_outputs_diverging_at_token_k_diverge_at_k(k):
    full = list(range(100, 107))
    run = full[:k] + [1] + full[k + 1:]  # the k-th token (0-based) differs, the rest is equal again
    assert agreement.tokens_to_divergence(run, full) == k
    assert agreement.tokens_to_divergence(full, run) == k


def test_a_prefix_diverges_at_its_length_and_missing_ids_are_none():
    full = [7, 7, 9, 4]
    assert agreement.tokens_to_divergence(full[:2], full) == agreement.tokens_to_divergence(full, full[:2]) == 2
    assert agreement.tokens_to_divergence([], full) == agreement.tokens_to_divergence([], []) == 0
    assert agreement.tokens_to_divergence(None, full) is None and agreement.tokens_to_divergence(full, None) is None
    old = gsm8k_row("gsm8k-0", "18", None)  # a row written before output_ids
    assert agreement.agreement_row("gsm8k", old, gsm8k_row("gsm8k-0", "18", [1]))["tokens_to_divergence"] is None


def test_rouge_l_is_the_packages_f1_with_the_empty_text_conventions():
    method, full = "The cat sat on the mat. It was warm.", "The cat lay on a mat. It was cold."
    direct = Rouge().get_scores([method], [full], avg=True)["rouge-l"]["f"]
    assert agreement.rouge_l(method, full) == pytest.approx(direct, abs=1e-12) and 0 < direct < 1
    assert agreement.rouge_l("", "") == agreement.rouge_l("  \n", "") == 1.0  # both empty: they agree
    assert agreement.rouge_l("", full) == agreement.rouge_l(method, " ") == 0.0  # one empty: they do not
    assert agreement.rouge_l(full, full) == 1.0  # identical: exactly 1 (the package gives 1 - 5e-9)


def test_rouge_l_on_long_texts_one_sentence_and_over_the_word_cap():
    words = [f"w{i % 97}" for i in range(1500)]
    method, full = " ".join(words[:700]), " ".join(words[:690] + ["x"] * 10)  # one 700-word sentence each
    value = agreement.rouge_l(method, full)  # the package's recursion would fail at the default limit
    assert value is not None and 0.9 < value < 1
    long = " ".join(words[: agreement.ROUGE_MAX_WORDS + 1])
    assert agreement.rouge_l(long, full) is None and agreement.rouge_l(long, long) == 1.0


# ---------------------------------------------------------------- final answers
def test_gsm8k_final_answer_is_the_protocols_extraction():
    pq = gsm8k_row("gsm8k-1", "She pays 1,200 + 34 = 1,234 dollars.\nQuestion: How many is 99?", [1])
    assert agreement.final_answer("gsm8k", pq) == 1234.0  # last number before "\nQuestion: ", commas dropped
    assert agreement.final_answer("gsm8k", gsm8k_row("gsm8k-1", "no number here", [1])) is None
    lm = gsm8k_row("gsm8k-1", "2 + 3 = 5. The answer is 1,234. Then 7.", [1], protocol="lm_eval")
    assert agreement.final_answer("gsm8k", lm) == "1234"  # strict match, exact_match's normalisation
    # the same answer in other words matches; another number does not; two answerless outputs match
    assert agreement.answer_match("gsm8k", gsm8k_row("gsm8k-1", "so 1234", [2]), pq) is True
    assert agreement.answer_match("gsm8k", gsm8k_row("gsm8k-1", "so 1235", [2]), pq) is False
    assert agreement.answer_match("gsm8k", gsm8k_row("a", "none", [2]), gsm8k_row("a", "nothing", [3])) is True


def test_longbench_short_answer_is_the_normalised_scored_text():
    def lb(task: str, prediction: str) -> dict:
        return {"id": f"{task}-0", "task": task, "prediction": prediction, "scores": {"score": 0.0}, "meta": {}}

    trivia = lb("triviaqa", "\nThe Eiffel Tower!\nQuestion: and Paris?")  # triviaqa: first line rule
    assert agreement.final_answer("longbench", trivia) == normalize_answer("The Eiffel Tower!") == "eiffel tower"
    assert agreement.answer_match("longbench", lb("triviaqa", "eiffel tower"), trivia) is True
    hotpot = lb("hotpotqa", "Paris.\nIt is in France.")  # no first-line rule: the whole text
    assert agreement.final_answer("longbench", hotpot) == "paris it is in france"
    assert agreement.answer_match("longbench", lb("hotpotqa", "Paris."), hotpot) is False
    assert agreement.final_answer("longbench", lb("lsht", "体育新闻。\n其他")) == "体育新闻"  # Chinese normaliser
    for task in ("gov_report", "samsum", "lcc", "dureader"):  # summaries, code, long answers: not defined
        assert agreement.final_answer("longbench", lb(task, "text")) is None
        assert agreement.answer_match("longbench", lb(task, "a"), lb(task, "a")) is None
    assert agreement.answer_match("passkey", lb("passkey_1024", "1"), lb("passkey_1024", "1")) is None


# ---------------------------------------------------------------- per run
def test_pairs_on_common_ids_and_the_means_with_their_bootstrap_interval():
    full = [gsm8k_row(f"gsm8k-{i}", f"The answer is {i}.", [1, 2, 3, 4, i]) for i in range(6)]
    run = [gsm8k_row("gsm8k-0", "The answer is 0.", [1, 2, 3, 4, 0]),  # identical
           gsm8k_row("gsm8k-1", "The answer is 9.", [1, 2, 3, 4, 9]),  # diverges at 4, another answer
           gsm8k_row("gsm8k-2", "The answer is 2.", [1, 5, 3, 4, 2]),  # diverges at 1, same text
           gsm8k_row("gsm8k-9", "The answer is 9.", [1])]  # not in full's samples: not paired
    pairs = agreement.paired_agreement("gsm8k", run, full)
    assert [p["id"] for p in pairs] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert [p["answer_match"] for p in pairs] == [True, False, True]
    assert [p["tokens_to_divergence"] for p in pairs] == [5, 4, 1]
    out = agreement.agreement_summary(pairs, draws=DRAWS, seed=0)
    assert set(out) == set(agreement.AGREEMENT_COLUMNS) and out["n_agreement"] == 3
    assert out["answer_match"] == pytest.approx(200 / 3) and out["tokens_to_divergence"] == pytest.approx(10 / 3)
    rouge = [p["rouge_l"] for p in pairs]
    assert out["rouge_l"] == pytest.approx(100 * sum(rouge) / 3)
    replicates = np.random.default_rng(0).integers(0, 3, (DRAWS, 3))  # the resample a plain loop draws
    means = [np.mean([[5, 4, 1][j] for j in draw]) for draw in replicates]
    assert (out["tokens_to_divergence_ci_low"], out["tokens_to_divergence_ci_high"]) == pytest.approx(
        tuple(np.percentile(means, [2.5, 97.5])))
    none = agreement.agreement_summary([{**p, "answer_match": None} for p in pairs], draws=DRAWS)
    assert none["answer_match"] is None and none["answer_match_ci_low"] is None  # not defined: empty, not 0


def write_run(root: Path, cache: str, budget: int, rows: list[dict], limit: int | None = None) -> Path:
    cfg = {"eval": {"name": "gsm8k", "protocol": "pqcache"}, "model": {"name": "tiny-llama"},
           "cache": {"name": cache}, "budget": budget, "limit": limit, "seed": 0, "results_dir": str(root)}
    run_dir = results.run_dir_for(cfg)
    run = results.RunDir(run_dir, cfg, yaml.safe_dump(cfg))
    for r in rows:
        run.append(r)
    score = 100 * sum(r["scores"]["score"] for r in rows) / len(rows)
    results.write_json(run_dir / "metrics.json", {"score": score, "tasks": {"gsm8k": score},
                                                  "n_samples": len(rows), "limit": limit, "n_total": 4})
    results.write_json(run_dir / "timing.json", {"ttft_s": 0.5, "tt2t_s": 0.6, "tpot_s": 0.01})
    return run_dir


def test_summary_and_tables_report_the_agreement_beside_the_score(tmp_path):
    root = tmp_path / "results"
    full = [gsm8k_row(f"gsm8k-{i}", f"So {i}.", [9, 9, i]) for i in range(4)]
    write_run(root, "full", 64, full)
    same_answer = [gsm8k_row(f"gsm8k-{i}", f"so {i}.", [9, 8, i]) for i in range(4)]  # diverge at 1, same answer
    write_run(root, "streaming_llm", 64, same_answer)
    write_run(root, "h2o", 64, [gsm8k_row("gsm8k-0", "So 7.", [9, 9, 7]), gsm8k_row("gsm8k-1", "So 1.", [9, 9, 1])],
              limit=2)
    collected = summary.collect(root, draws=DRAWS)
    frame, columns = collected.set_index("cache"), list(collected.columns)
    assert columns.index("n_paired") < columns.index("answer_match") < columns.index("n_agreement")
    stream = frame.loc["streaming_llm"]
    assert (stream["answer_match"], stream["tokens_to_divergence"], stream["n_agreement"]) == (100, 1, 4)
    expected_rouge = 100 * np.mean([agreement.rouge_l(a["prediction"], b["prediction"])
                                    for a, b in zip(same_answer, full)])
    assert stream["rouge_l"] == pytest.approx(expected_rouge)
    limited = frame.loc["h2o"]  # limit=2: paired on its 2 samples
    assert limited["n_agreement"] == 2 and limited["answer_match"] == pytest.approx(50)  # 7 != 0, 1 == 1
    assert limited["tokens_to_divergence"] == pytest.approx((2 + 3) / 2)
    own = frame.loc["full"]  # paired with itself: 100, its mean output length, 100
    assert (own["answer_match"], own["tokens_to_divergence"], own["rouge_l"]) == (100, 3, 100)
    text = tables.render(root, draws=DRAWS)
    lines = text.splitlines()
    start = lines.index(tables.AGREEMENT_TITLE)
    table = lines[start + 2: start + 6]  # the tables show complete runs (the limited one is in the summary only)
    assert table[0] == "| method | budget | score | answer match (%) | tokens to divergence | ROUGE-L | n |"
    assert table[2] == "| full | 64 | 100 | 100 [100, 100] | 3.0 [3.0, 3.0] | 100 [100, 100] | 4 |"
    assert table[3] == "| streaming_llm | 64 | 100 | 100 [100, 100] | 1.0 [1.0, 1.0] | 50 [50, 50] | 4 |"
    assert expected_rouge == pytest.approx(50)  # "so N." against "So N.": one of two words in common
    alone = tmp_path / "alone"  # without a full cache run: no agreement, no table
    write_run(alone, "streaming_llm", 64, same_answer)
    assert math.isnan(summary.collect(alone, draws=DRAWS).iloc[0].get("answer_match", float("nan")))
    assert tables.AGREEMENT_TITLE not in tables.render(alone, draws=DRAWS)


# ---------------------------------------------------------------- the runner stores the generated ids
def test_runner_writes_output_ids_equal_to_the_generated_ids(tmp_path, monkeypatch):
    from evals import harness
    from evals.models import load_tokenizer

    generated = {}
    real = harness.generate

    def recording(model, tokenizer, method, prompt_ids, *args, **kwargs):
        gen = real(model, tokenizer, method, prompt_ids, *args, **kwargs)
        generated[tuple(prompt_ids)] = list(gen.token_ids)
        return gen

    monkeypatch.setattr(harness, "generate", recording)
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": "streaming_llm"}, "eval": {"name": "passkey", "lengths": [160], "depths": 2,
                                                        "max_new_tokens": 6},
           "budget": 32, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "debug": True, "progress": False}
    run_dir = harness.run_eval(cfg)
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == len(generated) == 2
    assert sorted(tuple(r["output_ids"]) for r in rows) == sorted(tuple(v) for v in generated.values())
    tok = load_tokenizer("tiny-llama")
    for r in rows:
        assert r["output_ids"] and all(isinstance(i, int) for i in r["output_ids"])
        assert tok.decode(r["output_ids"], skip_special_tokens=True) == r["prediction"]
