"""Shared fixtures (the helpers they use are in ``tests/helpers.py``)."""
from __future__ import annotations

import pytest
import torch
from helpers import TINY_SHAPES, build_byte_tokenizer, build_tiny


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and contend on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=TINY_SHAPES, ids=lambda p: f"{p[0]}-kv{p[1]}-q{p[2]}")
def tiny_model(request):
    name, n_kv, n_q = request.param
    return build_tiny(name, n_kv, n_q)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()


def _real_model(name: str, missing: str):
    """A real model (fp32 on CPU) and its tokenizer, or the test skipped with ``missing`` and the reason."""
    from evals.models import ModelUnavailableError, load_model, load_tokenizer

    try:
        return load_model(name, dtype="float32"), load_tokenizer(name)
    except ModelUnavailableError as err:
        pytest.skip(f"{missing}: {err}")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (fp32 on CPU) and its tokenizer, loaded once per test session."""
    return _real_model("smollm2-135m", "embedded model unavailable")


@pytest.fixture(scope="session")
def qwen_coder():
    """The optional Qwen2.5-Coder-0.5B-Instruct (fp32 on CPU; `make model-qwen2.5-coder`) and its tokenizer."""
    return _real_model("qwen2.5-coder-0.5b", "optional model not installed")
