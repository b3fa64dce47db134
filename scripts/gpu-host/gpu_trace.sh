#!/usr/bin/env bash
# Where the trainer's update spends its time on one GPU: for each bench/trainer.py path in PATHS (today's
# engine, compiled, by default) and each micro-batch size in MICRO, the timed tokens/s of STEPS updates,
# then one profiled update whose chrome trace bench/trace_summary.py reads (device busy share, per-phase
# host and device time, queue delays, the longest idle gaps, runtime calls, top kernels).
#
# Run from the repository root on the GPU host (the device tool; ~1 minute per path and size):
#     bash scripts/gpu-host/gpu_trace.sh
# Knobs (environment): OUT (gpu_logs), SHAPE (0.5b), PATHS ("engine:compute_copy+compile"),
# MICRO ("16384"), STEPS (3), BENCH_ARGS (more bench/trainer.py arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for path in ${PATHS:-engine:compute_copy+compile}; do
    for micro in ${MICRO:-16384}; do
        tag=$(echo "$path-$micro" | tr ':+' '__')
        echo "# $path, micro-batches of $micro tokens"
        timeout 240 python3 bench/trainer.py --shapes "${SHAPE:-0.5b}" --paths "$path" --micro-tokens "$micro" \
            --steps "${STEPS:-3}" ${BENCH_ARGS:-} 2>&1 | grep -E "^[0-9.]+b |error|Error" | tail -n 3
        timeout 240 python3 bench/trainer.py --shapes "${SHAPE:-0.5b}" --paths "$path" --micro-tokens "$micro" \
            --steps 1 --profile --trace "/tmp/trace-$tag.json" ${BENCH_ARGS:-} > "$OUT/profile-$tag.log" 2>&1
        gzip -c "/tmp/trace-$tag.json" > "$OUT/trace-$tag.json.gz"
        python3 bench/trace_summary.py "/tmp/trace-$tag.json" 2>&1 | tee "$OUT/trace-$tag.txt"
    done
done
