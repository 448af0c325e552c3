"""Capture real post-RoPE keys and decode queries of SmolLM2 for the index benchmark (docs/benchmarks.md,
"Index benchmark").

Usage::

    python -m evals.bench.capture --out keys.pt [--data-dir ../shared/data] [--tokens 8000]

The prompt is ~``--tokens`` tokens of Paul Graham essays (``<data_dir>/pg_essays/PaulGrahamEssays.json``)
with a pass-key sentence at 40% depth and a question at the end (docs/benchmarks.md, "Index benchmark"). The model
(``smollm2-135m``, bf16, CPU) runs the prefill and ``--steps`` greedy decode steps with a
:class:`CaptureCache` (a ``FullCache`` that records the keys of the prompt and the decode queries).

Output (``torch.save``), the format ``evals.bench.index --keys`` reads:

- ``"keys"``: per budgeted layer ``[H_kv, n, d]`` bf16 post-RoPE keys of the prompt,
- ``"queries"``: per budgeted layer ``[steps, H_q, d]`` bf16 post-RoPE decode queries,
- ``"layers"``: the model layer ids of these entries (2 .. L-1: IceCache exempts the first 2, official
  ``n_unlimited_layers``; the layers the live probe's ``recall_common`` pools, docs/diagnostics.md),
- ``"meta"``: model, ``--tokens``, prompt length, pass key, its token depth, steps, generated text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from baselines.full import FullCache
from evals.registry import make_cache

ESSAYS = "pg_essays/PaulGrahamEssays.json"
N_DENSE_LAYERS = 2  # n_unlimited_layers of IceCache: layers 0, 1 are never budgeted
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class CaptureCache(FullCache):
    """Full attention that records in each layer's state the prompt keys (``st.captured_keys``) and every decode
    step's queries (``st.captured_queries``)."""

    def prefill(self, st, q, k, v):
        st.captured_keys, st.captured_queries = k.detach().to(torch.bfloat16).clone(), []
        return super().prefill(st, q, k, v)

    def decode(self, st, q, k, v, timer):
        st.captured_queries.append(q[:, -1].detach().to(torch.bfloat16).clone())
        return super().decode(st, q, k, v, timer)


def build_prompt(tokenizer, data_dir: Path, n_tokens: int, depth: float = 0.4, seed: int = 0) -> tuple[str, int]:
    """Essay text of ~``n_tokens`` tokens with the pass-key sentence inserted at ``depth`` (by tokens)."""
    text = json.loads((data_dir / ESSAYS).read_text())["text"]
    key = random.Random(seed).randrange(1, 50000)
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    budget = n_tokens - len(tokenizer(needle + QUESTION).input_ids)
    ids = tokenizer(text[: budget * 8]).input_ids[:budget]
    cut = int(len(ids) * depth)
    prompt = tokenizer.decode(ids[:cut]) + needle + tokenizer.decode(ids[cut:]) + QUESTION
    return prompt, key


def capture(model_name: str, data_dir: Path, n_tokens: int, steps: int, threads: int) -> dict:
    from evals.models import load_model, load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_name)
    prompt, key = build_prompt(tokenizer, data_dir, n_tokens)
    model = load_model(model_name)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cache = make_cache(CaptureCache(), model)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                             do_sample=False)
    states = [st for st in cache.states if st.layer_idx >= N_DENSE_LAYERS]
    generated = tokenizer.decode(out[0, ids.shape[1]:])
    return {
        "keys": [st.captured_keys for st in states],
        "queries": [torch.stack(st.captured_queries[:steps]) for st in states],
        "layers": [st.layer_idx for st in states],
        "meta": {"model": model_name, "tokens": n_tokens, "prompt_tokens": int(ids.shape[1]), "pass_key": key,
                 "depth": 0.4, "steps": steps, "generated": generated},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default=os.environ.get("ICECACHE_DATA_DIR", "../shared/data"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    data = capture(args.model, Path(args.data_dir), args.tokens, args.steps, args.threads)
    torch.save(data, args.out)
    k, q = data["keys"][0], data["queries"][0]
    print(f"wrote {args.out}: {len(data['layers'])} layers, keys {list(k.shape)}, queries {list(q.shape)}; "
          f"generated {data['meta']['generated']!r} (pass key {data['meta']['pass_key']})")
    return data


if __name__ == "__main__":
    main()
