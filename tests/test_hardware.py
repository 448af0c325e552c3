"""The CPU dtype decision (icecache/hardware.py)."""
import pytest
import torch

from icecache import hardware

CPUINFO = """processor\t: 0
cpu family\t: 6
model\t\t: 143
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
        assert hardware.cpu_signature(path) == "family 6 model 143"


def test_missing_cpuinfo_falls_back_to_fp32(tmp_path):
    model, flags = hardware.cpu_info(tmp_path / "absent")
    assert hardware.cpu_signature(tmp_path / "absent") == ""
    assert model and flags == frozenset() and hardware.preferred_cpu_dtype(flags) is torch.float32
    choice = hardware.dtype_choice(frozenset({"amx_bf16"}))
    assert choice["dtype"] == "bfloat16" and choice["bf16_flags"] == ["amx_bf16"]


def test_model_dtype_auto_is_bf16_on_cuda_and_the_cpu_rule_elsewhere(monkeypatch):
    from evals import models

    assert models.resolve_dtype("auto", "cuda") is torch.bfloat16
    assert models.resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert models.resolve_dtype("float32", "cuda") is torch.float32
    assert models.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    for flags, want in ((frozenset({"avx2"}), torch.float32), (frozenset({"amx_bf16"}), torch.bfloat16)):
        monkeypatch.setattr(hardware, "cpu_info", lambda path="/proc/cpuinfo", f=flags: ("test cpu", f))
        assert models.resolve_dtype("auto", "cpu") is want
        record = models.dtype_record("auto", "cpu")
        assert record["dtype"] == str(want).removeprefix("torch.") and record["dtype_requested"] == "auto"
        assert record["cpu_model"] == "test cpu" and record["cpu_bf16_flags"] == sorted(flags & {"amx_bf16"})
    assert models.dtype_record("auto", "cuda") == {"dtype": "bfloat16", "dtype_requested": "auto",
                                                   "dtype_rule": "cuda: bfloat16"}
    assert models.dtype_record("float32", "cpu")["dtype_rule"] == "explicit"


def test_default_model_config_resolves_to_this_cpus_rule():
    """conf/model/smollm2-135m.yaml says ``dtype: auto``: fp32 on a CPU without native bf16 (so the CPU
    accuracy tables, measured in fp32, are unchanged there)."""
    from pathlib import Path

    import yaml

    from evals import models

    conf = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "model" / "smollm2-135m.yaml").read_text())
    assert conf["dtype"] == "auto"
    want = torch.bfloat16 if hardware.native_bf16_flags() else torch.float32
    assert models.resolve_dtype(conf["dtype"], "cpu") is want


def test_llama_8b_random_has_the_llama_3_1_8b_shape():
    from evals import models

    cfg = models.llama_8b_config()
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (32, 32, 8, 128, 4096, 14336, 128256)
    assert models.model_entry("llama-8b-random").source == "random"
    assert len(models.load_tokenizer("llama-8b-random")("abc")["input_ids"]) == 3  # the byte tokenizer, no hub
    with torch.device("meta"):  # the loader builds on the target device (meta here: no memory)
        model = models.load_model("llama-8b-random", dtype="auto", device="meta", progress=False)
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(8.03e9, rel=0.01)
