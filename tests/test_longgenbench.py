"""LongGenBench (Wu et al.) suite (evals/tasks/longgenbench.py; mozhu621/LongGenBench): parsing, check
extraction, judged scoring with a deterministic fake judge, pooled aggregation."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from helpers import DATA_DIR

from evals.task import DataError, Sample
from evals.tasks.longgenbench import (
    LongGenBench,
    completion_rate,
    judge_prompts,
    parse_blocks,
)
from evals.models import tiny_tokenizer

needs_data = pytest.mark.skipif(not (DATA_DIR / "longgenbench").is_dir(), reason=f"shared data not at {DATA_DIR}")
QUESTION = "? Please answer with 'yes' or 'no' only."


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def suite(tokenizer, tmp_path):
    """A suite over a one-item hand-written dataset (scoring needs no real data)."""
    (tmp_path / "longgenbench").mkdir()
    (tmp_path / "longgenbench" / "Dataset_short.json").write_text(json.dumps([{
        "prompt": "Write a diary. *** started ***\n#*# Week 1:", "prefix": "#*# Week 1:", "type": "Week",
        "number": 2, "checks_once": {"1": "x"}, "checks_range": {}, "checks_periodic": {}}]))
    return LongGenBench(tokenizer, data_dir=tmp_path, judge_model="tiny-qwen3")


def fake_judge(calls: list):
    """Says yes iff the block mentions the event's first word (case-insensitive); records every prompt."""
    def judge(prompt: str, max_new_tokens: int) -> str:
        calls.append((prompt, max_new_tokens))
        block, event = re.fullmatch(r"Context: (.*)### Instruction: Does this context include the (.*)"
                                    + re.escape(QUESTION), prompt, re.S).groups()
        return " Yes, it does." if event.split()[0].lower() in block.lower() else "No."
    return judge


def item(**over) -> Sample:
    ref = {"prefix": "#*# Week 1 (January 1st - January 7th):", "type": "Week", "number": 4,
           "checks_once": {"1": "birthday party", "3": "dentist visit", "4": "wedding anniversary"},
           "checks_range": {"2": "trip to Paris", "3": "trip to Paris"},
           "checks_periodic": {"1": "yoga class", "3": "yoga class"}}
    ref.update(over)
    return Sample("short-0", "week", [1, 2], 100, ref)


# Week 1 and 2 written; "Week 2" appears twice (the first block wins); Week 3 is written last; Week 4 missing.
OUTPUT = (" Birthday party with friends, then yoga.\n"
          "#*# Week 2 (January 8th - January 14th): Trip to Paris, museums.\n"
          "#*# Week 2 again: nothing here.\n"
          "#*# Week 3 (January 15th - January 21st): dentist, no exercise this week.\n*** finished")


def test_block_parsing_and_check_extraction():
    blocks = parse_blocks("#*# Week 1 (January 1st - January 7th):" + OUTPUT, "Week")
    assert sorted(blocks) == [1, 2, 3]
    assert blocks[2] == " Week 2 (January 8th - January 14th): Trip to Paris, museums.\n"
    assert parse_blocks("#*# Menu Week 3: soup #*# Week 5: x", "Menu Week") == {3: " Menu Week 3: soup "}
    prompts = judge_prompts({"2": "trip to Paris", "4": "wedding"}, blocks)
    assert prompts == [(2, "Context:  Week 2 (January 8th - January 14th): Trip to Paris, museums.\n### Instruction: "
                           "Does this context include the trip to Paris? Please answer with 'yes' or 'no' only.")]
    assert completion_rate(blocks, 4) == 75.0 and completion_rate({1: "", 9: ""}, 4) == 25.0


def test_score_with_fake_judge_hand_computed(suite):
    calls: list = []
    scores = suite.score(item(), OUTPUT, fake_judge(calls))
    # once: weeks 1 (birthday: yes), 3 (dentist: yes); week 4 has no block -> not judged
    # range: week 2 (trip: yes), week 3 (trip: no); periodic: week 1 (yoga: yes), week 3 (yoga: no)
    assert scores == {"completion_rate": 75.0, "word_count": float(len(("#*# Week 1 (January 1st - January 7th):"
                                                                          + OUTPUT).split())),
                      "once_yes": 2.0, "once_judged": 2.0, "range_yes": 1.0, "range_judged": 2.0,
                      "periodic_yes": 1.0, "periodic_judged": 2.0, "score": pytest.approx((1 + 0.5 + 0.5) / 3)}
    assert len(calls) == 6 and all(n == 50 for _, n in calls)
    with pytest.raises(ValueError, match="needs a judge"):
        suite.score(item(), OUTPUT)


def test_aggregate_pools_checks_across_items(suite):
    judge = fake_judge([])
    rows = [{"task": "week", "scores": suite.score(item(), OUTPUT, judge)},
            # only the prefix's unit written: Week 1 judged (birthday: no, yoga: no), completion 25%
            {"task": "week", "scores": suite.score(item(), " nothing", judge)},
            {"task": "floor", "scores": suite.score(
                item(type="Floor", prefix="#*# Floor 1:", number=2, checks_once={"1": "lobby"}, checks_range={},
                     checks_periodic={"2": "gym"}), " The lobby.\n#*# Floor 2: offices.", judge)}]
    out = suite.aggregate(rows)
    # pooled over items (not a mean of per-item accuracies): once 3/4 (2/2 + 0/1 + lobby 1/1),
    # range 1/2 (1/2 + none judged + none), periodic 1/4 (1/2 + 0/1 + gym 0/1)
    assert (out["accuracy_once"], out["accuracy_range"], out["accuracy_periodic"]) == (0.75, 0.5, 0.25)
    assert out["average_accuracy"] == 0.5 and out["score"] == 50.0
    assert out["completion_rate"] == pytest.approx((75 + 25 + 100) / 3)
    assert out["tasks"] == {"floor": pytest.approx(100 / 3), "week": pytest.approx(100 * (2 / 3 + 1 / 2 + 1 / 3) / 3)}
    assert out["judge_model"] == "tiny-qwen3" and out["n_samples"] == 3
    assert out["max_new_tokens"] == out["official_max_new_tokens"] == 16000


@needs_data
def test_real_files_parse_into_samples(tokenizer):
    for subset, types, total in (("short", {"Week": 52, "Floor": 100, "Menu Week": 52, "Block": 100}, 400),
                                 ("long", {"Day": 365, "Floor": 300, "Menu Day": 365, "Block": 361}, 400)):
        suite = LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, subset=subset, limit=2, max_length=32768)
        items = suite.items()
        assert len(items) == total and {i["type"]: i["number"] for i in items} == types
        samples = list(suite.samples())
        assert Counter(s.meta["type"] for s in samples) == {t: 2 for t in types}
        raw = json.loads((DATA_DIR / "longgenbench" / f"Dataset_{subset}.json").read_text())
        for s in samples:
            src = raw[int(s.id.split("-")[1])]
            assert s.id.startswith(f"{subset}-") and s.stop == ["*** finished"]
            assert tokenizer.decode(s.prompt_ids) == src["prompt"]
            assert s.reference["checks_periodic"] == src["checks_periodic"]
            assert s.max_new_tokens == min({"short": 16000, "long": 32000}[subset], 32768 - len(s.prompt_ids))
            assert src["prompt"].endswith("*** started ***\n" + src["prefix"])


@needs_data
def test_types_limit_and_capped_generation(tokenizer):
    suite = LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, types=["Floor"], limit=3, max_length=8192)
    samples = list(suite.samples())
    assert [s.task for s in samples] == ["floor"] * 3
    assert [s.id for s in samples] == [s.id for s in suite.samples()]  # stable
    assert all(s.max_new_tokens == 8192 - len(s.prompt_ids) for s in samples)
    capped = list(LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, types=["Floor"], limit=3,
                               max_length=8192,
                               max_new_tokens=300).samples())
    assert [s.max_new_tokens for s in capped] == [300] * 3
    assert capped[0].meta["max_new_tokens_cap"] == 300 and capped[0].meta["official_max_new_tokens"] == 16000
    assert samples[0].meta["max_new_tokens_cap"] is None
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, max_new_tokens=0)
    with pytest.raises(ValueError, match="not in"):
        list(LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, types=["Day"]).samples())
    with pytest.raises(ValueError, match="subset"):
        LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, subset="medium")


def test_missing_or_malformed_data(tokenizer, tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "longgenbench" / "Dataset_long.json"))):
        LongGenBench(tokenizer, data_dir=tmp_path, judge_model=None, subset="long")
    (tmp_path / "longgenbench").mkdir()
    bad = tmp_path / "longgenbench" / "Dataset_short.json"
    bad.write_text(json.dumps([{"prompt": "p #*# Week 1:", "prefix": "#*# Week 1:", "type": "Week", "number": 2,
                                "checks_once": {}, "checks_range": {}}]))
    with pytest.raises(DataError, match=r"Dataset_short.json: item 0 needs field 'checks_periodic'"):
        list(LongGenBench(tokenizer, data_dir=tmp_path, judge_model=None).samples())


# ------------------------------------------------------------------ official decoding and judge
@pytest.mark.skipif(not (DATA_DIR / "longgenbench").is_dir(), reason=f"shared data not at {DATA_DIR}")
def test_official_sampling_by_default_greedy_as_an_option(tokenizer):
    official = list(LongGenBench(tokenizer, data_dir=DATA_DIR, types=["Week"], limit=2, max_length=32768,
                                 judge_model=None).samples())
    index = int(official[1].id.split("-")[1])
    assert official[1].sampling == {"temperature": 0.95, "top_p": 0.95, "seed": 6211027 + index}  # inference.py
    assert official[1].meta["decoding"] == "official"
    greedy = LongGenBench(tokenizer, data_dir=DATA_DIR, types=["Week"], limit=2, max_length=32768, judge_model=None,
                          decoding="greedy")
    assert all(s.sampling is None for s in greedy.samples())
    with pytest.raises(ValueError, match="decoding"):
        LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model=None, decoding="beam")


@pytest.mark.skipif(not (DATA_DIR / "longgenbench").is_dir(), reason=f"shared data not at {DATA_DIR}")
def test_official_judge_is_the_default_and_its_absence_is_a_clear_error(tokenizer, monkeypatch):
    import huggingface_hub

    from evals.models import ModelUnavailableError

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, filename: None)
    with pytest.raises(ModelUnavailableError, match="Llama-3.1-8B-Instruct.*judge_model=null"):
        LongGenBench(tokenizer, data_dir=DATA_DIR)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, filename: f"/cache/{repo}/{filename}")
    assert LongGenBench(tokenizer, data_dir=DATA_DIR).judge_model == "llama-3.1-8b-instruct"
    with pytest.raises(ValueError, match="not a registered model"):
        LongGenBench(tokenizer, data_dir=DATA_DIR, judge_model="gpt-judge")


def test_nucleus_sampling_keeps_the_top_p_mass_and_is_seeded():
    import torch

    from evals.runner import sample_token

    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = [sample_token(scores, 1.0, 0.75, torch.Generator().manual_seed(s)) for s in range(300)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reaches 0.75: tokens 2 and 3 are cut
    assert 0.5 < draws.count(0) / 300 < 0.75  # renormalised 0.625
    assert {sample_token(scores, 1.0, 0.4, torch.Generator().manual_seed(s)) for s in range(50)} == {0}
    assert sample_token(scores, 0.0, 0.95, torch.Generator()) == 0  # temperature 0 = greedy
    same = [sample_token(scores, 0.95, 0.95, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert len(set(same)) == 1
