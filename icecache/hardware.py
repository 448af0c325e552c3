"""What the CPU can do, for choosing the compute dtype of a CPU run (``model.dtype=auto``).

bf16 matmuls are only faster than fp32 on a CPU with native bf16 arithmetic: AMX tiles (``amx_bf16``,
Intel Sapphire Rapids and later) or AVX512-BF16 dot products (``avx512_bf16``, Cooper Lake, Zen 4 and
later), which oneDNN and PyTorch's CPU kernels use. Without them bf16 is converted to fp32 per element
and runs slower than fp32 (``python -m evals.bench.cpu_dtype`` compares the two; docs/benchmarks.md, "CPU dtype"). The
flags are read from ``/proc/cpuinfo`` (Linux), i.e. what the kernel, and a hypervisor, expose: a VM on
a CPU with AMX that hides the flags gets fp32, which is also what its kernels can use.
"""
from __future__ import annotations

import platform
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_info(path: str | Path = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first CPU in ``path``; ``(platform.processor(), {})`` without it."""
    try:
        text = Path(path).read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model or platform.machine(), flags


def cpu_signature(path: str | Path = "/proc/cpuinfo") -> str:
    """``"family F model M"`` of the first CPU in ``path`` (x86 ``cpu family`` and ``model``), which tells apart the
    CPUs a VM names alike (e.g. every "AMD EPYC"); ``""`` when ``path`` has no such fields."""
    try:
        text = Path(path).read_text()
    except OSError:
        return ""
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def native_bf16_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The native-bf16 instruction sets among ``flags`` (default: this machine's)."""
    flags = cpu_info()[1] if flags is None else flags
    return [f for f in BF16_FLAGS if f in flags]


def preferred_cpu_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 when the CPU has native bf16 arithmetic (AMX or AVX512-BF16), else float32."""
    return torch.bfloat16 if native_bf16_flags(flags) else torch.float32


def dtype_choice(flags: frozenset[str] | None = None) -> dict:
    """The choice and its reason, for ``timing.json``: ``{"dtype", "cpu_model", "bf16_flags"}``."""
    model, own = cpu_info()
    flags = own if flags is None else flags
    return {"dtype": str(preferred_cpu_dtype(flags)).removeprefix("torch."), "cpu_model": model,
            "bf16_flags": native_bf16_flags(flags)}
