"""Shared fixtures: tiny random models built in-process (milliseconds) and the full-attention oracle."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.registry import make_cache
from icecache.models import tiny_config

DATA_DIR = Path(os.environ.get("ICECACHE_DATA_DIR", Path(__file__).resolve().parents[1].parent / "shared" / "data"))

# (name, H_kv, H_q): MQA (H_kv = 1), GQA (1 < H_kv < H_q), MHA (H_kv = H_q, like LongChat), Qwen3 q/k-norm
TINY_SHAPES = [("tiny-llama", 1, 4), ("tiny-llama", 2, 4), ("tiny-llama", 4, 4), ("tiny-qwen3", 2, 4)]


def build_tiny(name: str = "tiny-llama", n_kv_heads: int = 2, n_heads: int = 4, n_layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, n_kv_heads=n_kv_heads, n_heads=n_heads,
                                                         n_layers=n_layers), dtype=torch.float32)
    return model.eval()


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


def generate_reference(model, ids: torch.Tensor, new_tokens: int):
    """Plain transformers greedy generation with its default cache and sdpa attention."""
    model.set_attn_implementation("sdpa")
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


def generate_with(model, ids: torch.Tensor, new_tokens: int, method: str, budget=None, **hp):
    cache = make_cache(method, model, budget=budget, **hp)
    try:
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              past_key_values=cache, output_logits=True, return_dict_in_generate=True), cache
    finally:
        cache.close()


def assert_matches_full(model, method: str, budget=None, prompt_len: int = 48, new_tokens: int = 8,
                        atol: float = 1e-4, seed: int = 0, **hp):
    """A method whose budget covers the whole context must equal full attention: same greedy tokens,
    logits within ``atol``."""
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    ref = generate_reference(model, ids, new_tokens)
    out, cache = generate_with(model, ids, new_tokens, method, budget, **hp)
    assert torch.equal(ref.sequences, out.sequences), f"{method}: greedy tokens differ from full attention"
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst <= atol, f"{method}: logits differ from full attention by {worst}"
    return cache


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_byte_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level tokenizer built in-process (one token per UTF-8 byte, exact round trip, BOS ``<s>``
    added, EOS ``</s>``) with a simple chat template; for eval-suite tests that need no real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=chat_template, model_max_length=1 << 30)


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


def natural_prompt_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """About ``n_tokens`` of natural text (Paul Graham essays when the data is present)."""
    import json

    essays = DATA_DIR / "pg_essays" / "PaulGrahamEssays.json"
    text = json.loads(essays.read_text())["text"] if essays.exists() else (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 400)
    return torch.tensor([tokenizer(text)["input_ids"][:n_tokens]])
