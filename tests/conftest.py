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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (fp32 on CPU) and its tokenizer, loaded once per test session."""
    from icecache.models import ModelUnavailableError, load_model, load_tokenizer

    try:
        return load_model("smollm2-135m", dtype="float32"), load_tokenizer("smollm2-135m")
    except ModelUnavailableError as err:
        pytest.skip(f"embedded model unavailable: {err}")


@pytest.fixture(scope="session")
def qwen_coder():
    """The optional Qwen2.5-Coder-0.5B-Instruct (fp32 on CPU; `make model-qwen2.5-coder`) and its tokenizer."""
    from icecache.models import ModelUnavailableError, load_model, load_tokenizer

    try:
        return load_model("qwen2.5-coder-0.5b", dtype="float32"), load_tokenizer("qwen2.5-coder-0.5b")
    except ModelUnavailableError as err:
        pytest.skip(f"optional model not installed: {err}")
