#!/usr/bin/env bash
# One script that proves the GPU path on a lent machine in under 8 minutes, and writes
# $OUT/gpu_check.json and $OUT/gpu_check.md (plus one JSON and one log per stage).
#
#   OUT=/some/dir benchmarks/gpu_check.sh            # on a GPU machine
#   OUT=/some/dir benchmarks/gpu_check.sh --dry-run  # the same stages on a CPU, in about a minute
#   benchmarks/gpu_check.sh --fetch-wheels           # on a connected machine, before going offline
#
# The lent machine has torch, transformers, Triton and cuda-bindings but no internet and not every
# dependency vmkv imports (msgspec, pyzmq, ...): --fetch-wheels downloads those as Python 3.12
# manylinux wheels into build/gpu-wheels (ignored by git; carry it), and the install stage
# installs them from there, offline, when vmkv's engine does not import.
#
# Stages, each under its own time limit (the sum stays under 8 minutes): install (vmkv with
# --no-deps, only if it does not import), versions, the GPU tests, a driver probe (view before
# map, map from a thread with no current context, write/read back, aliasing, unmap right after an
# async kernel, raw call times), the kernel-compatibility matrix on both layouts, and an A/B of
# vattention (with and without the background mapper) against paged on the default model's shape
# and on a random-weight 1B-shape Llama. A failing stage is recorded and the next one runs.
# Worst case, every stage at its limit: 40 + 30 + 20 + 90 + 30 + 60 + 170 s plus 3 s of grace
# each, about 7 min 40 s; the A/B writes its JSON after every row, so a cut-off run keeps them.
set -u
cd "$(dirname "$0")/.."
DRY=""
WHEELS=build/gpu-wheels
WHEEL_PACKAGES="msgspec pyzmq psutil accelerate pytest pluggy iniconfig"
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    exec "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$WHEELS" $WHEEL_PACKAGES
fi
OUT="${OUT:-gpu-check-out}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
mkdir -p "$OUT"
STAGES="$OUT/stages.jsonl"
: > "$STAGES"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log it, record its exit status and time
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=3 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >> "$STAGES"
    tail -n 3 "$OUT/$name.log"
}

if ! "$PY" -c "import vmkv" 2>/dev/null; then
    stage install 40 "$PY" -m pip install --quiet -e . --no-deps --no-build-isolation
fi
missing_wheels() {  # the carried wheels whose module does not import here (never replace one that does)
    local pair
    for pair in msgspec:msgspec zmq:pyzmq psutil:psutil accelerate:accelerate pytest:pytest \
        pluggy:pluggy iniconfig:iniconfig; do
        "$PY" -c "import ${pair%%:*}" 2>/dev/null || ls "$WHEELS/${pair#*:}"-*.whl 2>/dev/null
    done
}
if [ -d "$WHEELS" ] && [ -n "$(missing_wheels)" ]; then
    stage install-wheels 30 "$PY" -m pip install --quiet --no-index --no-deps $(missing_wheels)
fi
stage versions 20 "$PY" benchmarks/gpu_driver_check.py versions --out "$OUT" $DRY
# The tests that exercise the GPU path (on a CPU they run their fake-driver and interpreter halves).
stage tests 90 env ${DRY:+TRITON_INTERPRET=1} "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_cuda_driver.py tests/test_flash_support.py tests/test_triton_attention.py \
    tests/test_vattention_attention.py tests/test_paged_attention.py
stage probe 30 "$PY" benchmarks/gpu_driver_check.py probe --out "$OUT" $DRY
stage matrix 60 "$PY" benchmarks/gpu_driver_check.py matrix --out "$OUT" $DRY
stage ab 170 "$PY" benchmarks/gpu_driver_check.py ab --out "$OUT" $DRY
"$PY" - "$STAGES" "$OUT/stages.json" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
json.dump({"stages": rows}, open(sys.argv[2], "w"), indent=2)
PYEOF
"$PY" benchmarks/gpu_driver_check.py report --out "$OUT"
rm -rf "$OUT/models"  # checkpoints built for the A/B: gigabytes, not results
echo "total ${SECONDS}s"
