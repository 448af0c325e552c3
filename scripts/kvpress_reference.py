"""kvpress' own kept token sets, for tests/test_kvpress.py (tests/fixtures/kvpress_sets.json).

Runs kvpress natively -- ``with press(model): model(input_ids, past_key_values=DynamicCache())``, its forward hook
compressing each layer's cache (``kvpress/presses/base_press.py`` ``BasePress.forward_hook``) -- so it needs an
environment where kvpress' declared dependencies hold (transformers < 5.3), not the project's venv::

    python3.11 -m venv /tmp/kvp-venv && /tmp/kvp-venv/bin/pip install torch==2.13.0 kvpress==0.5.5
    /tmp/kvp-venv/bin/python scripts/kvpress_reference.py --checkpoint ~/.cache/icecache/smollm2-135m-instruct-bf16

Imports only torch, transformers and kvpress. The kept set of a layer and KV head is recovered by matching each
compressed key row to the uncompressed prefill's keys (exact equality: compression happens after a layer's
attention, so the prefill itself, and every layer's keys, are those of the uncompressed run). Sets are written as
hex bitmasks over the prompt positions (one per layer and KV head) with the prompt's token ids, the model dtype
and the kvpress / transformers versions.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvpress
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

PRESSES = ("SnapKVPress", "ExpectedAttentionPress", "TOVAPress", "KnormPress", "StreamingLLMPress")
ROOT = Path(__file__).resolve().parents[1]


def prompt_ids(tokenizer, text_path: Path, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of the Paul Graham essays (the RULER haystack; docs/data.md)."""
    text = json.loads(text_path.read_text())["text"]
    return torch.tensor([tokenizer(text)["input_ids"][:n_tokens]])


def layer_keys(model, ids: torch.Tensor, press=None) -> list[torch.Tensor]:
    """``[H_kv, n, d]`` keys per layer after one prefill of ``ids`` (under ``press`` when given)."""
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model(ids, past_key_values=cache)
        else:
            with press(model):
                model(ids, past_key_values=cache)
    return [layer.keys[0] for layer in cache.layers]


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> list[list[int]]:
    """Per KV head, the prompt positions whose keys ``kept`` holds (each matched exactly, once)."""
    out = []
    for h in range(full.shape[0]):
        match = (kept[h][:, None, :] == full[h][None, :, :]).all(-1)  # [n_kept, n]
        if not bool((match.sum(-1) == 1).all()):
            raise AssertionError(f"head {h}: a kept key matches no (or several) prompt keys")
        out.append(sorted(match.float().argmax(-1).tolist()))
    return out


def bitmask(positions: list[int], n: int) -> str:
    value = sum(1 << p for p in positions)
    return format(value, f"0{(n + 3) // 4}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "pg_essays" /
                        "PaulGrahamEssays.json")
    parser.add_argument("--n-tokens", type=int, default=400)
    parser.add_argument("--kept", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "kvpress_sets.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    ids = prompt_ids(tokenizer, args.text, args.n_tokens)
    n = ids.shape[1]
    ratio = 1.0 - (args.kept + 0.5) / n  # kvpress' n_kept = int(n * (1 - ratio)) = kept
    full = layer_keys(model, ids)
    sets = {}
    for name in PRESSES:
        press = getattr(kvpress, name)(compression_ratio=ratio)
        compressed = layer_keys(model, ids, press)
        assert all(k.shape[1] == args.kept for k in compressed), f"{name}: n_kept is not {args.kept}"
        sets[name] = [[bitmask(p, n) for p in kept_positions(f, k)] for f, k in zip(full, compressed)]
        print(f"{name}: {len(compressed)} layers x {compressed[0].shape[0]} KV heads, {args.kept} of {n} kept")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": "smollm2-135m-instruct", "dtype": "float32", "attn_implementation": "sdpa",
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "kept": args.kept, "input_ids": ids[0].tolist(), "sets": sets}, indent=0) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
