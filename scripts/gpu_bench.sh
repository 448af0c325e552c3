#!/usr/bin/env bash
# GPU latency check (one command): a Llama-3.1-8B-shaped model with random weights at 32k context,
# full vs icecache vs icecache_reuse vs pqcache; TT2T, TPOT and breakdown -> bench_decode_gpu.json.
# flash-attn is used for prefill when installed (pip install .[gpu]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m evals.bench.decode --model llama-8b-random --device cuda --lengths ${LENGTHS:-32768} \
    --methods full icecache icecache_reuse pqcache --budget ${BUDGET:-256} --new-tokens ${NEW_TOKENS:-32} \
    --out bench_decode_gpu.json
