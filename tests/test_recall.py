"""diagnostics=recall: the live attention-mass recall probe (icecache/kv/recall.py) against explicit references,
for every method (predictions unchanged, full recall at a covering budget), and through a run (recall.json,
summary columns, figures)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import METHOD_CASES, build_byte_tokenizer, build_tiny, skip_without_requirement
from test_harness import read_rows, tiny_cfg

from evals.task import Sample, Suite
from evals.harness import ConfigError, run_eval
from evals.output.plots import make_all
from evals.registry import make_method
from evals.runner import generate
from evals.output.summary import collect
from icecache.kv import KVCache, ModelSpec
from icecache.kv.recall import RecallProbe, exact_attention, pool_recall, positions_mask, step_metrics

CASES = {c.name: c for c in METHOD_CASES}


def test_positions_mask_matches_a_loop():
    torch.manual_seed(0)
    n, n_q = 30, 8
    for heads in (1, 2, 8):
        positions = torch.randint(-1, n, (heads, 12))
        mask = positions_mask(positions, n, n_q)
        for h in range(n_q):
            expected = {int(p) for p in positions[h // (n_q // heads)] if p >= 0}
            assert set(torch.nonzero(mask[h]).flatten().tolist()) == expected
    shared = positions_mask(torch.tensor([3, 5, -1]), n, n_q)
    assert shared.sum(-1).tolist() == [2] * n_q
    with pytest.raises(ValueError, match="beyond"):
        positions_mask(torch.tensor([n]), n, n_q)


def test_exact_attention_and_step_metrics_match_explicit_softmax():
    torch.manual_seed(1)
    h_kv, group, n, d, scaling = 2, 3, 20, 8, 0.3
    q, keys, values = torch.randn(h_kv * group, d), torch.randn(h_kv, n, d), torch.randn(h_kv, n, d)
    probs, out = exact_attention(q, keys, values, scaling)
    for h in range(h_kv * group):
        logits = [float(q[h] @ keys[h // group, j]) * scaling for j in range(n)]
        p = np.exp(np.array(logits) - max(logits))
        p /= p.sum()
        assert np.allclose(probs[h].numpy(), p)
        assert np.allclose(out[h].numpy(), p @ values[h // group].double().numpy())
    mask = torch.zeros(h_kv * group, n, dtype=torch.bool)
    mask[:, :10] = True
    needle = torch.tensor([2, 15])
    approx = out + 0.1
    got = step_metrics(probs, out, approx, mask, needle)
    for h in range(h_kv * group):
        p = probs[h].numpy()
        assert got["recall"][h] == pytest.approx(p[:10].sum())
        assert got["error"][h] == pytest.approx(float(np.linalg.norm(0.1 * np.ones(d)) / np.linalg.norm(out[h])))
        assert got["needle_share"][h] == pytest.approx(p[2] / (p[2] + p[15]))
        assert got["needle_top"][h] == (1.0 if p[2] >= p[15] else 0.0)


def test_topk_live_recall_is_the_exact_top_mass():
    """The top-k oracle attends each query head's top-B past tokens and the current one: the probe must report
    exactly their share of the exact softmax (computed here by hand)."""
    torch.manual_seed(2)
    h_kv, h_q, d, n, budget = 2, 4, 8, 40, 10
    spec = ModelSpec(n_layers=1, n_q_heads=h_q, n_kv_heads=h_kv, head_dim=d, scaling=d ** -0.5, max_position=1024)
    method = make_method("topk", budget=budget)
    probe = RecallProbe()
    cache = KVCache(method, spec, probe=probe)
    k, v = torch.randn(h_kv, n, d), torch.randn(h_kv, n, d)
    cache.begin_prefill()
    cache.run_attention(0, torch.randn(h_q, n, d), k, v)
    q1, k1, v1 = torch.randn(h_q, 1, d), torch.randn(h_kv, 1, d), torch.randn(h_kv, 1, d)
    cache.begin_step()
    cache.run_attention(0, q1, k1, v1)
    keys = torch.cat([k, k1], dim=1).repeat_interleave(h_q // h_kv, 0).double()
    probs = (torch.einsum("hd,hnd->hn", q1[:, 0].double(), keys) * spec.scaling).softmax(-1)
    expected = probs[:, :-1].topk(budget, dim=-1).values.sum(-1) + probs[:, -1]
    assert torch.allclose(probe.values[0]["recall"][0].double(), expected, atol=1e-6)


def run_case(name: str, hp: dict, probe: RecallProbe | None, prompt_len: int, new_tokens: int = 6):
    model = build_tiny()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    method = make_method(name, **hp)
    return generate(model, None, method, ids, new_tokens, ignore_eos=True, probe=probe)


@pytest.mark.parametrize("name", [c.name for c in METHOD_CASES if c.small])
def test_probe_leaves_predictions_unchanged(name):
    skip_without_requirement(name)
    case = CASES[name]
    plain = run_case(name, case.small, None, case.prompt_len)
    probed = run_case(name, case.small, RecallProbe(needle=[5, 6, 7]), case.prompt_len)
    assert probed.token_ids == plain.token_ids, f"{name}: the probe changed the generated tokens"
    rec = probed.recall
    assert rec is not None and rec["layers"], f"{name}: nothing measured"
    assert 0.0 <= rec["recall_mean"] <= 1.0 + 1e-9 and 0.0 <= rec["needle_share_mean"] <= 1.0 + 1e-9
    assert 0.0 <= rec["needle_top_mean"] <= 1.0 and rec["error_mean"] >= 0.0
    assert rec["recall_mean"] < 1.0 - 1e-6, f"{name}: a small budget should lose some attention mass"
    assert rec["common_layers"] == [2, 3] and 0.0 <= rec["recall_common_mean"] <= 1.0 + 1e-9, name
    assert set(rec["layers"]) == set(rec["own_layers"]) | {2, 3}, name


@pytest.mark.parametrize("name", [c.name for c in METHOD_CASES if c.name != "full"])
def test_covering_budget_keeps_all_the_attention(name):
    skip_without_requirement(name)
    case = CASES[name]
    gen = run_case(name, case.covering, RecallProbe(every=2), case.prompt_len, case.new_tokens)
    rec = gen.recall
    assert rec is not None, f"{name}: no budgeted layer measured"
    assert rec["recall_mean"] == pytest.approx(1.0, abs=1e-9), name
    assert rec["recall_common_mean"] == pytest.approx(1.0, abs=1e-9), name
    assert rec["error_mean"] < 1e-4, name
    measured_steps = -(-(case.new_tokens - 1) // 2)  # every 2nd of the new_tokens - 1 decode steps
    assert rec["per_layer"]["recall"]["n"] == [measured_steps * 4] * len(rec["layers"])  # x 4 query heads


def test_common_layers_are_the_same_for_every_method():
    """recall_common pools layers 2 .. L-1 whatever the method budgets: a layer of that set the method exempts
    is measured (it attends everything: recall 1) and counted there, not in the method's own pool."""
    own_all = run_case("topk", dict(budget=16), RecallProbe(), 48).recall
    dense3 = run_case("topk", dict(budget=16, n_dense_layers=3), RecallProbe(), 48).recall
    assert (own_all["own_layers"], own_all["common_layers"]) == ([0, 1, 2, 3], [2, 3])
    assert (dense3["layers"], dense3["own_layers"], dense3["common_layers"]) == ([2, 3], [3], [2, 3])
    per_layer = dense3["per_layer"]["recall"]
    assert per_layer["mean"][0] == pytest.approx(1.0, abs=1e-9)
    assert dense3["recall_mean"] == pytest.approx(per_layer["mean"][1])
    (n2, n3), (m2, m3) = per_layer["n"], per_layer["mean"]
    assert dense3["recall_common_mean"] == pytest.approx((m2 * n2 + m3 * n3) / (n2 + n3))
    assert RecallProbe(common_from=3).common_from == 3
    with pytest.raises(ValueError, match="common_from"):
        RecallProbe(common_from=-1)


def test_full_attention_has_no_budgeted_layer():
    assert run_case("full", {}, RecallProbe(), 48).recall is None


class NeedleSuite(Suite):
    name = "needle-test"

    def needle_texts(self, sample):
        return [sample.reference]


def test_needle_positions_are_the_tokens_spelling_each_occurrence():
    tok = build_byte_tokenizer()
    text = "abc 4242 xyz 4242."
    ids = tok(text)["input_ids"]  # BOS, then one token per byte
    sample = Sample(id="s", task="t", prompt_ids=ids, max_new_tokens=1, reference="4242")
    suite = NeedleSuite(tok)
    assert suite.needle_positions(sample) == [1 + i for i in (4, 5, 6, 7, 13, 14, 15, 16)]

    class NoNeedle(Suite):
        name = "no-needle-test"

    assert NoNeedle(tok).needle_positions(sample) == []


def test_pool_recall_weights_cases_and_keeps_per_layer_spread():
    rows = [{"id": "a", "recall": {"every": 1, "layers": [2, 3], "recall_mean": 0.5, "per_layer": {
                "recall": {"mean": [0.4, 0.6], "median": [0.4, 0.6], "p10": [0.1, 0.2], "n": [10, 10]}}}},
            {"id": "b", "recall": {"every": 1, "layers": [2, 3], "recall_mean": 0.9, "per_layer": {
                "recall": {"mean": [0.8, 1.0], "median": [0.8, 1.0], "p10": [0.7, 0.9], "n": [30, 30]}}}},
            {"id": "c"}]
    pooled = pool_recall(rows)
    assert pooled["n_samples"] == 2 and pooled["layers"] == [2, 3]
    assert pooled["recall_mean"] == pytest.approx((0.4 * 10 + 0.6 * 10 + 0.8 * 30 + 1.0 * 30) / 80)
    assert pooled["per_layer"]["recall"]["mean"] == pytest.approx([0.7, 0.9])
    assert pooled["per_layer"]["recall"]["median"] == pytest.approx([0.6, 0.8])
    assert pool_recall([{"id": "x"}]) is None
    assert "recall_common_mean" not in pooled and pooled["own_layers"] == [2, 3]  # rows from before the common set


def test_pool_recall_pools_own_and_common_layers_separately():
    stats = {"mean": [0.2, 1.0, 0.6], "median": [0.2, 1.0, 0.6], "p10": [0.1, 1.0, 0.5], "n": [10, 10, 30]}
    rows = [{"id": "a", "recall": {"every": 1, "layers": [1, 2, 3], "own_layers": [1, 3], "common_layers": [2, 3],
                                   "per_layer": {"recall": stats}}}]
    pooled = pool_recall(rows)
    assert (pooled["own_layers"], pooled["common_layers"]) == ([1, 3], [2, 3])
    assert pooled["recall_mean"] == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)
    assert pooled["recall_common_mean"] == pytest.approx((1.0 * 10 + 0.6 * 30) / 40)


def test_a_recall_run_writes_recall_json_summary_columns_and_figures(tmp_path):
    diag = {"name": "recall", "every": 1}
    plain_dir = run_eval(tiny_cfg(tmp_path, cache="h2o", budget=32))
    run_dir = run_eval(tiny_cfg(tmp_path, cache="h2o", budget=32, diagnostics=diag))
    assert run_dir != plain_dir  # a diagnostics run never shares a directory with a plain one
    rows, plain_rows = read_rows(run_dir), read_rows(plain_dir)
    assert [r["prediction"] for r in rows] == [r["prediction"] for r in plain_rows]
    assert all(r["recall"]["needle_tokens"] > 0 for r in rows)  # passkey names its needle
    pooled = json.loads((run_dir / "recall.json").read_text())
    assert pooled["n_samples"] == len(rows) and 0 < pooled["recall_mean"] <= 1
    assert "needle_share_mean" in pooled and len(pooled["per_layer"]["recall"]["mean"]) == len(pooled["layers"])
    frame = collect(tmp_path / "results")
    with_recall = frame[frame["run_dir"] == str(run_dir)]
    assert float(with_recall["recall_mean"].iloc[0]) == pytest.approx(pooled["recall_mean"])
    assert float(with_recall["recall_common_mean"].iloc[0]) == pytest.approx(pooled["recall_common_mean"])
    names = {p.name for p in make_all(tmp_path / "results")}
    assert {"recall_vs_layer_passkey_tiny-llama.png", "recall_vs_accuracy_passkey_tiny-llama.png"} <= names


def test_bad_diagnostics_settings_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="diagnostics must be recall"):
        run_eval(tiny_cfg(tmp_path, diagnostics={"name": "attention"}))
    with pytest.raises(ConfigError, match="diagnostics.every"):
        run_eval(tiny_cfg(tmp_path, diagnostics={"name": "recall", "every": 0}))
