#!/usr/bin/env bash
# The kvpress side-by-side table of docs/kvpress.md: five kvpress presses next to our methods on passkey
# (2k + 4k x 3 depths) and RULER 4k niah (5 tasks x LIMIT samples, default 1) at budgets 64/128/256, one thread, no probe
# (so TPOT is the method's own). Rows land in $OUT (results_dir); `python -m evals.output.summary $OUT` tabulates them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/kvpress_side}
LIMIT=${LIMIT:-1}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-1}
PRESSES=SnapKVPress,ExpectedAttentionPress,TOVAPress,KnormPress,StreamingLLMPress
OURS=streaming_llm,snapkv,icecache
NIAH='eval.tasks=[niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue]'
common=(results_dir=$OUT progress=false)
$PY run.py eval=passkey cache=full eval.depths=3 "${common[@]}"
$PY run.py eval=ruler cache=full "$NIAH" limit=$LIMIT "${common[@]}"
$PY run.py -m eval=passkey cache=kvpress cache.press=$PRESSES budget=64,128,256 eval.depths=3 "${common[@]}"
$PY run.py -m eval=passkey cache=$OURS budget=64,128,256 eval.depths=3 "${common[@]}"
$PY run.py -m eval=ruler cache=kvpress cache.press=$PRESSES budget=64,128,256 "$NIAH" limit=$LIMIT "${common[@]}"
$PY run.py -m eval=ruler cache=$OURS budget=64,128,256 "$NIAH" limit=$LIMIT "${common[@]}"
