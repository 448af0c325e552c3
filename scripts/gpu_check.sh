#!/usr/bin/env bash
# GPU check in one command, for any CUDA machine (docs/gpu.md): (a) install the wheels in gpu_wheels/ (if
# any; `make gpu-wheels` fills it for a machine without a package registry), (b) the CUDA tests, (c) the
# decode benchmark of llama-8b-random (Llama-3.1-8B-shaped, random weights) at 8k/32k/128k for full,
# icecache, icecache_reuse, quest, omnikv, pqcache and magicpig at budget 256 with 64 new tokens
# (breakdown, TT2T, peak GPU memory), (d) one JSON and one markdown table -- all within --deadline S
# seconds (default 1200), elapsed time printed per part.
#
#   scripts/gpu_check.sh [OUTDIR] [--cpu | --dry-run] [--deadline S] [--skip-tests] [--methods ...] [--lengths ...]
#
# OUTDIR defaults to gpu_check_out/. --cpu / --dry-run runs the same steps at tiny sizes on the CPU
# (tiny-llama, 512-2048 tokens). PY picks the interpreter (default: .venv's python when there is one, else
# python3, e.g. the one holding PyTorch in a CUDA container image).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=${GPU_WHEELS:-gpu_wheels}
outdir="" cpu=0 deadline=1200 args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu|--dry-run) cpu=1; args+=("$1") ;;
        --deadline) deadline=$2; shift ;;
        --deadline=*) deadline=${1#--deadline=} ;;
        --*) args+=("$1") ;;
        *) if [ -z "$outdir" ] && [ ${#args[@]} -eq 0 ]; then outdir=$1; else args+=("$1"); fi ;;
    esac
    shift
done
outdir=${outdir:-gpu_check_out}
mkdir -p "$outdir"
exec > >(tee "$outdir/gpu_check.log") 2>&1  # the whole output, part (a) included, also lands in the log
tee_pid=$!
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1

# (a) wheels: on a machine without a package registry the missing packages come as wheels
echo "== (a) wheels from $WHEELS/"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "   none carried (the CUDA tests and the benchmark need only torch, transformers, numba, numpy)"
elif [ $cpu -eq 1 ]; then
    # the wheels are for the target machine's Python (GPU_PYTHON, default 3.12, as in the Makefile): check
    # that every one installs there (pip's resolver for that CPython / manylinux_2_28 x86_64), and really
    # install the pure-Python ones into a temporary folder that is not put on the path (this environment
    # has its own copies)
    target_py=${GPU_PYTHON:-3.12}
    scratch=$(mktemp -d)
    "$PY" -m pip install --dry-run -q --no-index --no-deps --only-binary=:all: --python-version "$target_py" \
        --implementation cp --platform manylinux_2_28_x86_64 --target "$scratch/target" "${wheels[@]}" \
        && echo "   all ${#wheels[@]} wheels install on CPython $target_py / manylinux_2_28 x86_64"
    pure=("$WHEELS"/*-py3-none-any.whl "$WHEELS"/*-py2.py3-none-any.whl)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" "${pure[@]}" \
        && echo "   dry run: the ${#pure[@]} pure-Python wheels installed into a temporary folder (not used here)"
    rm -rf "$scratch"
else
    site=${GPU_SITE:-/tmp/gpu_site}
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}"; then
        export PYTHONPATH="$PYTHONPATH:$site"  # only packages the machine lacks (Makefile gpu-wheels)
        echo "   installed ${#wheels[@]} wheels into $site"
    else
        echo "   wheel install FAILED: continuing without them (run.py needs hydra; the check does not)"
    fi
fi
wheels_s=$(( $(date +%s) - start ))
echo "== (a) wheels: ${wheels_s} s"

left=$(( ${deadline%.*} - wheels_s ))
GPU_CHECK_WHEELS_S=$wheels_s "$PY" scripts/gpu_check.py "$outdir" --deadline "$left" "${args[@]}"
rc=$?
echo "== total: $(( $(date +%s) - start )) s (exit $rc)"
exec 1>&- 2>&-
wait "$tee_pid" 2>/dev/null  # the log is complete before the caller collects it
exit "$rc"
