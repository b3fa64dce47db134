#!/usr/bin/env bash
# The head's kept logit gradients (trainer_engine.logit_grad_keep_gib) against recomputing them
# (`+nokeep`: the engine as it was), same call, same updates, each path in a process of its own; and
# packed attention's kernels (bench/attn_varlen.py: FlashAttention-2 varlen vs cuDNN's ragged kernels).
#
# Run from the repository root on the GPU host (the device tool; no carry; ~8 minutes):
#     bash scripts/gpu-host/gpu_trainer_keep.sh
# Knobs (environment): OUT (gpu_logs), PYTEST (1: the CUDA tests of tests/test_train_model.py first),
# ATTN (1: bench/attn_varlen.py), RUNS ("0.5b:16384 0.5b:32768 1.5b:16384"), PATHS (per run),
# EXTRA (more bench/trainer.py runs as "shape:micro:paths", space-separated), WARMUP (2), STEPS (3), OLD (a tree for old:
# paths, e.g. .base from `git archive <rev> areal_bus bench`, carried). Each path's line comes with its
# graph breaks and recompilations (torch.compile's counters).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="--warmup ${WARMUP:-2} --steps ${STEPS:-3}${OLD:+ --old-tree $OLD}"
P=${PATHS:-engine:compute_copy+compile+nokeep,engine:compute_copy+compile}
{
    if [ "${PYTEST:-1}" = 1 ]; then  # the trainer policy's CUDA tests (no conftest on this host)
        timeout 200 python3 -m pytest -q --noconftest -p no:cacheprovider -rs -m gpu tests/test_train_model.py 2>&1 | tail -n 3
    fi
    if [ "${ATTN:-1}" = 1 ]; then
        timeout 120 python3 bench/attn_varlen.py 2>&1 | tail -n 20
    fi
    for run in ${RUNS:-0.5b:16384 0.5b:32768 1.5b:16384}; do
        echo "# ${run%%:*}, micro-batches of ${run#*:} tokens"
        timeout 240 python3 bench/trainer.py $B --shapes "${run%%:*}" --micro-tokens "${run#*:}" --paths "$P" 2>&1 \
            | grep -E "^# bench|^[0-9.]+b |RESULT|rror|graph breaks"
    done
    for run in ${EXTRA:-}; do
        IFS=: read -r shape micro paths <<< "$run"
        echo "# $shape, micro-batches of $micro tokens: $paths"
        timeout 240 python3 bench/trainer.py $B --shapes "$shape" --micro-tokens "$micro" --paths "$paths" 2>&1 \
            | grep -E "^# bench|^[0-9.]+b |RESULT|rror|graph breaks"
    done
} 2>&1 | tee "$OUT/trainer_keep.log"
