#!/usr/bin/env bash
# Install check for a CUDA machine (docs/gpu.md): (1) the CUDA tests (`pytest -m cuda`), (2) one cell of the
# decode benchmark: IceCache on llama-8b-random (Llama-3.1-8B's shape, random weights, built on the GPU) at
# 8k tokens, budget 256, 32 new tokens, in bf16. Exit status 0 when both pass.
#
#   scripts/gpu_check.sh [OUTDIR] [--cpu]
#
# OUTDIR (default gpu_check_out/) receives pytest.txt, decode.json and gpu_check.log (the whole output).
# --cpu runs the same two steps on the CPU: the device-independent CUDA tests in bf16
# (ICECACHE_CUDA_TESTS_DEVICE=cpu; the CUDA-only ones skip) and the cell on tiny-llama at 1k tokens.
# PY picks the interpreter (default: .venv's python when there is one, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
outdir="" cpu=0
for arg in "$@"; do
    case "$arg" in
        --cpu) cpu=1 ;;
        -*) echo "usage: scripts/gpu_check.sh [OUTDIR] [--cpu]" >&2; exit 2 ;;
        *) if [ -z "$outdir" ]; then outdir=$arg; else echo "one OUTDIR only" >&2; exit 2; fi ;;
    esac
done
outdir=${outdir:-gpu_check_out}
mkdir -p "$outdir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $cpu -eq 1 ]; then
    export ICECACHE_CUDA_TESTS_DEVICE=cpu
    cell=(--model tiny-llama --device cpu --lengths 1024 --new-tokens 8)
else
    cell=(--model llama-8b-random --device cuda --lengths 8192 --new-tokens 32)
fi

{
    echo "== (1) CUDA tests"
    "$PY" -m pytest tests/test_cuda.py -m cuda -rfEs -p no:cacheprovider 2>&1 | tee "$outdir/pytest.txt"
    tests_rc=${PIPESTATUS[0]}
    echo "== (2) decode benchmark, one cell"
    "$PY" -m evals.bench.decode --in-process --methods icecache --budget 256 "${cell[@]}" \
        --out "$outdir/decode.json" 2>&1
    bench_rc=$?
    echo "== CUDA tests: $([ "$tests_rc" -eq 0 ] && echo ok || echo "FAILED (exit $tests_rc)");" \
        "decode cell: $([ "$bench_rc" -eq 0 ] && echo ok || echo "FAILED (exit $bench_rc)")"
    [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
} 2>&1 | tee "$outdir/gpu_check.log"
exit "${PIPESTATUS[0]}"
