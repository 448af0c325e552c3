"""Prefill once, evaluate every configuration (evals/prefill_cache.py): a prefill replayed from disk decodes
exactly like a live one for every method that can replay, files are verified and refused when corrupt or
mismatched, the directory is size-bounded, and a second run reuses the first run's files."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import BUDGET_64_HP, METHOD_CASES, build_tiny, natural_prompt_ids, skip_without_requirement

from evals import prefill_cache
from evals.config import ConfigError
from evals.harness import run_eval
from evals.prefill_cache import Prefill, PrefillCacheError, PrefillStore, from_config, replay_refusal
from evals.registry import METHODS, make_method, method_class
from evals.runner import generate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()
LIVE = {"h2o", "snapkv", "snapkv_pinned", "kvpress"}  # statistics of every prompt query, or model hooks
REPLAYED = {"full", "streaming_llm", "quest", "topk", "page_oracle", "pqcache", "omnikv", "icecache",
            "icecache_reuse", "magicpig", "arkvale"}  # exact attention + store, or a prefill reading only the last query


def tiny_cfg(tmp_path, cache="streaming_llm", **over) -> dict:
    """A passkey run of three ~160-token prompts on the tiny random model (test_harness.py's)."""
    cfg = {"model": {"name": "tiny-llama", "path": None, "dtype": "float32", "max_length": 4096},
           "cache": {"name": cache}, "eval": {"name": "passkey", "lengths": [160], "depths": 3,
                                              "question_via_decode": True, "max_new_tokens": 4},
           "budget": 32, "limit": None, "seed": 0, "results_dir": str(tmp_path / "results"), "data_dir": None,
           "device": "cpu", "debug": True, "progress": False}
    return {**cfg, **over}


def read_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


class AttendedSets:
    """A probe (the ``diagnostics=recall`` hook) recording, per decode step and layer, the original positions
    each method attended (its own ``attended_positions``, read between attention and ``observe``)."""

    def __init__(self):
        self.sets = []

    def keep(self, layer, k, v):
        pass

    def reset(self):
        self.sets.clear()

    def measure(self, method, st, q, selection, out):
        self.sets.append((st.layer_idx, method.attended_positions(st, selection).clone()))

    def summary(self):
        return None


def small_options(name: str) -> dict:
    """A tiny-model configuration that compresses a 300-token prompt (helpers.METHOD_CASES' ``small``)."""
    case = next((c for c in METHOD_CASES if c.name == name), None)
    if case is not None and case.small:
        return dict(case.small)
    return {"budget": None if not method_class(name).needs_budget else 64, **BUDGET_64_HP.get(name, {})}


def run(model, name: str, prefilled=None, new_tokens: int = 16):
    probe = AttendedSets()
    gen = generate(model, None, make_method(name, **small_options(name)), PROMPT, new_tokens, ignore_eos=True,
                   prefilled=prefilled, probe=probe)
    return gen, probe.sets


def test_methods_are_classified_as_replayed_or_live():
    for name in METHODS:
        assert (replay_refusal(method_class(name)) is None) == (name not in LIVE), name
    assert REPLAYED <= set(METHODS)
    assert "column sums" in replay_refusal(method_class("h2o"))
    assert replay_refusal(method_class("snapkv")).endswith("during prefill attention (observation-window votes: "
                                                            "its last window_size queries over every prompt key): "
                                                            "run it live")


def test_a_method_that_times_the_live_prefill_runs_live_in_that_setting():
    adaptive = replay_refusal(make_method("pqcache", budget=64, kmeans_iters=0))
    assert adaptive == ("pqcache sizes its k-means by each layer's measured prefill time (kmeans_iters=0): run it "
                        "live (or set cache.kmeans_iters to a fixed bound)")
    assert replay_refusal(make_method("pqcache", budget=64, kmeans_iters=10)) is None


def test_replay_from_disk_equals_live_for_every_replayable_method(tmp_path):
    model = build_tiny("tiny-llama", 2, 4)
    store = PrefillStore(tmp_path, model_id="tiny-llama")
    replayed_names = []
    for name in METHODS:
        if name in LIVE:
            continue
        skip_without_requirement(name)
        if replay_refusal(make_method(name, **small_options(name))) is not None:  # a setting that must run live
            assert run(model, name, prefilled=store, new_tokens=2)[0].prefill == "live"
            continue
        replayed_names.append(name)
        live, live_sets = run(model, name)
        replayed, replayed_sets = run(model, name, prefilled=store)
        assert (live.prefill, replayed.prefill) == ("live", "replayed")
        assert replayed.token_ids == live.token_ids, name
        assert replayed.effective_tokens == pytest.approx(live.effective_tokens), name
        assert replayed.max_resident_tokens == live.max_resident_tokens, name
        assert replayed.method_stats == live.method_stats, name  # e.g. MagicPIG's K, from the last query
        assert len(replayed_sets) == len(live_sets) > 0, name
        for (layer_a, a), (layer_b, b) in zip(replayed_sets, live_sets):
            assert layer_a == layer_b and torch.equal(a, b), f"{name}: layer {layer_a} attended another set"
    assert (store.captures, len(list(tmp_path.glob("*.safetensors")))) == (1, 1)
    assert store.loads == len(replayed_names) - 1 and {"full", "icecache", "magicpig", "arkvale"} <= set(replayed_names)


def test_a_live_method_runs_live_with_one_notice(tmp_path, capsys):
    model = build_tiny("tiny-llama", 2, 4)
    store = PrefillStore(tmp_path)
    first, _ = run(model, "h2o", prefilled=store, new_tokens=4)
    second, _ = run(model, "h2o", prefilled=store, new_tokens=4)
    assert first.prefill == second.prefill == "live" and store.captures == 0
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == [f"note: h2o computes statistics during prefill attention (the attention column sums of every "
                     f"prompt query): run it live (prefill_cache={tmp_path})"]
    with pytest.raises(ValueError, match="statistics during prefill attention"):  # an explicit Prefill refuses
        generate(model, None, make_method("snapkv", budget=40), PROMPT, 4, prefilled=Prefill.capture(model, PROMPT))


def captured(tmp_path, prompt=PROMPT):
    model = build_tiny("tiny-llama", 2, 4)
    store = PrefillStore(tmp_path, model_id="tiny-llama")
    store.prefill_for(model, make_method("full"), prompt)
    return model, store, store.path_for(store.key(model, prompt))


def refusal(store, model, prompt=PROMPT) -> str:
    with pytest.raises(PrefillCacheError) as err:
        store.prefill_for(model, make_method("full"), prompt)
    message = str(err.value)
    assert "\n" not in message and "delete the file" in message
    return message


@pytest.mark.parametrize("where", ["tensors", "header"])
def test_a_corrupt_file_is_refused_in_one_line(tmp_path, where):
    model, store, path = captured(tmp_path)
    data = bytearray(path.read_bytes())
    at = len(data) - 100 if where == "tensors" else 20  # inside the last tensor, or the JSON header
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))
    message = refusal(store, model)
    assert str(path) in message
    assert ("sha256 checksum" in message) if where == "tensors" else ("unreadable" in message)
    path.write_bytes(bytes(data[: len(data) // 2]))  # a torn file
    assert "unreadable" in refusal(store, model)


def test_a_file_holding_another_prompt_is_refused(tmp_path):
    model, store, path = captured(tmp_path)
    other = PROMPT[:-1] + [PROMPT[-1] + 1]
    shutil.copy(path, store.path_for(store.key(model, other)))
    assert "its key differs from the prompt's (fields prompt_sha256)" in refusal(store, model, other)
    assert store.prefill_for(model, make_method("full"), PROMPT).prompt_ids == PROMPT  # the original still serves


def test_a_killed_capture_leaves_nothing_that_is_read(tmp_path):
    model = build_tiny("tiny-llama", 2, 4)
    store = PrefillStore(tmp_path)
    path = store.path_for(store.key(model, PROMPT))
    (tmp_path / f".{path.stem}.killed.tmp").write_bytes(b"half a file")  # what a SIGKILL mid-write leaves
    store.prefill_for(model, make_method("full"), PROMPT)
    assert store.captures == 1 and path.exists() and store.used_bytes() == path.stat().st_size + 11


def test_the_size_bound_fails_before_writing(tmp_path):
    model = build_tiny("tiny-llama", 2, 4)
    store = PrefillStore(tmp_path / "prefill", max_gb=1e-6)
    with pytest.raises(PrefillCacheError) as err:
        store.prefill_for(model, make_method("full"), PROMPT)
    message = str(err.value)
    assert "\n" not in message and "would bring it over prefill_cache_max_gb=1e-06" in message
    assert "raise the bound (prefill_cache_max_gb=...) or delete files from" in message
    assert not (tmp_path / "prefill").exists() or not any((tmp_path / "prefill").iterdir())


def count_captures(monkeypatch) -> list:
    calls = []
    original = Prefill.capture.__func__

    def counting(cls, model, prompt_ids):
        calls.append(len(prompt_ids))
        return original(cls, model, prompt_ids)
    monkeypatch.setattr(Prefill, "capture", classmethod(counting))
    return calls


def test_two_runs_share_the_files_and_record_replay(tmp_path, monkeypatch, capsys):
    calls = count_captures(monkeypatch)
    prefill = str(tmp_path / "prefill")
    first = run_eval(tiny_cfg(tmp_path / "a", cache="full", prefill_cache=prefill))
    assert len(calls) == 3 and len(list((tmp_path / "prefill").glob("*.safetensors"))) == 3
    second = run_eval(tiny_cfg(tmp_path / "a", prefill_cache=prefill, prefill_cache_max_gb=1))  # streaming_llm
    assert len(calls) == 3  # every prompt read back, none captured again
    live = run_eval(tiny_cfg(tmp_path / "b"))
    assert second.relative_to(tmp_path / "a") == live.relative_to(tmp_path / "b")  # not part of the identity
    assert [r["prediction"] for r in read_rows(second)] == [r["prediction"] for r in read_rows(live)]
    assert all(r["timing"]["prefill"] == "replayed" for r in read_rows(first) + read_rows(second))
    assert json.loads((second / "timing.json").read_text())["prefill"] == {"replayed": 3, "live": 0}
    h2o = run_eval(tiny_cfg(tmp_path / "a", cache="h2o", prefill_cache=prefill))
    assert json.loads((h2o / "timing.json").read_text())["prefill"] == {"replayed": 0, "live": 3}
    assert capsys.readouterr().err.count("h2o computes statistics during prefill attention") == 1
    assert "prefill_cache" not in (second / "config.yaml").read_text()


def test_the_size_bound_keeps_the_samples_already_written(tmp_path):
    one = PrefillStore(tmp_path / "probe")
    model = build_tiny("tiny-llama", 2, 4)
    one.write(tmp_path / "probe" / "x.safetensors", {}, Prefill.capture(model, list(range(160))))
    size = one.used_bytes()
    cfg = tiny_cfg(tmp_path, cache="full", prefill_cache=str(tmp_path / "prefill"),
                   prefill_cache_max_gb=1.5 * size / 1e9)
    with pytest.raises(PrefillCacheError, match="prefill_cache_max_gb"):
        run_eval(cfg)
    rows = read_rows(next((tmp_path / "results").rglob("predictions.jsonl")).parent)
    assert len(rows) == 1 and rows[0]["timing"]["prefill"] == "replayed"


def test_config_keys_are_checked_and_left_out_of_the_run_identity(tmp_path):
    cfg, store = from_config({"model": {"name": "m"}, "prefill_cache": str(tmp_path), "prefill_cache_max_gb": 2})
    assert "prefill_cache" not in cfg and "prefill_cache_max_gb" not in cfg
    assert (store.directory, store.max_gb, store.model_id) == (tmp_path, 2.0, "m")
    assert from_config({"prefill_cache": None})[1] is None
    for bad in (0, -1, "big", True):
        with pytest.raises(ConfigError, match="prefill_cache_max_gb must be a positive number"):
            from_config({"prefill_cache_max_gb": bad})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        from_config({"prefill_cache": str(tmp_path / "file" / "sub")})
    assert prefill_cache.prefill_counts([{"timing": {}}, {}]) == {"replayed": 0, "live": 2}


@pytest.mark.slow
def test_smollm2_replay_from_disk_equals_live(smollm2, tmp_path):
    """~1k natural-text tokens on the embedded SmolLM2: the file read back decodes what the live prefill does,
    for the full cache and for IceCache at a budget that compresses."""
    model, tokenizer = smollm2
    ids = natural_prompt_ids(tokenizer, 1000)[0].tolist()
    store = PrefillStore(tmp_path)
    for name, options in (("full", {}), ("icecache", {"budget": 128})):
        live = generate(model, tokenizer, make_method(name, **options), ids, 16, ignore_eos=True)
        replayed = generate(model, tokenizer, make_method(name, **options), ids, 16, ignore_eos=True, prefilled=store)
        assert replayed.prefill == "replayed" and replayed.token_ids == live.token_ids, name
        assert replayed.effective_tokens == pytest.approx(live.effective_tokens), name
    assert (store.captures, store.loads) == (1, 1)
