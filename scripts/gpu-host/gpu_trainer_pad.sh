#!/usr/bin/env bash
# The trainer's update on one GPU against the engine before this change (.base, `old:` paths): bench/
# trainer.py's long-tail updates at the Qwen2-0.5B shape with micro-batches of 16k and 32k tokens and at
# the 1.5B shape, steady state (2 warm-up updates: compilation, and cuBLAS's first use of each matmul
# shape), then one profiled update of today's engine at 0.5B read by bench/trace_summary.py.
#
# Run from the repository root on the GPU host (the device tool, carry [".base"] made by
#     rm -rf .base && mkdir .base && git archive <rev> areal_bus bench | tar -x -C .base
# ; about 7 minutes):  bash scripts/gpu-host/gpu_trainer_pad.sh
# Knobs (environment): OUT (gpu_logs), PYTEST (1: the CUDA tests of tests/test_train_model.py first),
# RUNS ("0.5b:16384 0.5b:32768 1.5b:16384"), TRACE_MICRO (32768).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="--old-tree .base --warmup 2 --steps 3"
P="old:compute_copy+compile,engine:compute_copy+compile"
{
    if [ "${PYTEST:-1}" = 1 ]; then  # the trainer policy's CUDA tests (no conftest on this host)
        timeout 200 python3 -m pytest -q --noconftest -p no:cacheprovider -rs -m gpu tests/test_train_model.py 2>&1 | tail -n 5
    fi
    for run in ${RUNS:-0.5b:16384 0.5b:32768 1.5b:16384}; do
        echo "# ${run%%:*}, micro-batches of ${run#*:} tokens"
        timeout 300 python3 bench/trainer.py $B --shapes "${run%%:*}" --micro-tokens "${run#*:}" --paths "$P" 2>&1 \
            | grep -E "^# bench|^[0-9.]+b |RESULT|rror"
    done
    echo "# one profiled update of engine:compute_copy+compile, 0.5b, micro-batches of ${TRACE_MICRO:=32768}"
    timeout 200 python3 bench/trainer.py $B --shapes 0.5b --steps 1 --micro-tokens "$TRACE_MICRO" \
        --paths engine:compute_copy+compile --profile --trace /tmp/trace.json > "$OUT/profile.log" 2>&1
    gzip -c /tmp/trace.json > "$OUT/trace.json.gz"
    python3 bench/trace_summary.py /tmp/trace.json
} 2>&1 | tee "$OUT/trainer_pad.log"
