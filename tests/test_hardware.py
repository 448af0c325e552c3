"""The CPU dtype decision (icecache/hardware.py)."""
import torch

from icecache import hardware

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f {extra}

processor\t: 1
model name\t: other
flags\t\t: fpu
"""


def test_bf16_only_with_native_bf16_arithmetic(tmp_path):
    for extra, want in (("avx512_vnni", torch.float32), ("avx512_bf16", torch.bfloat16),
                        ("amx_bf16 amx_tile", torch.bfloat16)):
        path = tmp_path / "cpuinfo"
        path.write_text(CPUINFO.format(extra=extra))
        model, flags = hardware.cpu_info(path)
        assert model == "Intel(R) Xeon(R) Platinum 8480+" and "avx2" in flags
        assert hardware.preferred_cpu_dtype(flags) is want


def test_missing_cpuinfo_falls_back_to_fp32(tmp_path):
    model, flags = hardware.cpu_info(tmp_path / "absent")
    assert model and flags == frozenset() and hardware.preferred_cpu_dtype(flags) is torch.float32
    choice = hardware.dtype_choice(frozenset({"amx_bf16"}))
    assert choice["dtype"] == "bfloat16" and choice["bf16_flags"] == ["amx_bf16"]
